"""The engine probe's answer comparison (probing.answer_problem), on the answers of a real
restore that parted from its recompute at a tie. No engine: these run in a moment."""

from __future__ import annotations

import copy

from probing import TIE, answer_problem

# A restored 1300-token prompt (1280 tokens loaded, byte-exact) and its recompute: the second
# token's two likeliest were tied in the recompute, and the restore took the other one.
RESTORED = {"output": [5180, 2621, 4917, 1659], "top2": [
    [[5180, -8.006973266601562], [4917, -8.030410766601562]],
    [[2621, -8.00551700592041], [1659, -8.01332950592041]],
    [[4917, -7.881789684295654], [1659, -7.944289684295654]],
    [[1659, -7.919174671173096], [7364, -7.997299671173096]]]}
RECOMPUTED = {"output": [5180, 1659, 4917, 1659], "top2": [
    [[5180, -8.007014274597168], [4917, -8.030451774597168]],
    [[1659, -8.005514144897461], [2621, -8.005514144897461]],
    [[4917, -7.974620342254639], [1659, -7.990245342254639]],
    [[1659, -7.919137477874756], [7364, -7.997262477874756]]]}


def test_answers_that_part_at_a_tie_are_the_same_answer() -> None:
    assert answer_problem(RESTORED, RECOMPUTED) is None
    assert answer_problem(RECOMPUTED, RECOMPUTED) is None


def test_answers_that_part_where_nothing_tied_differ() -> None:
    want = copy.deepcopy(RECOMPUTED)
    want["top2"][1][1][1] -= 4 * TIE  # the recompute's second token far behind its first
    assert "outputs part at position 1" in answer_problem(RESTORED, want)


def test_a_token_outside_the_tied_pair_differs() -> None:
    got = copy.deepcopy(RESTORED)
    got["output"][1] = got["top2"][1][0][0] = 7364
    assert "outputs part at position 1" in answer_problem(got, RECOMPUTED)


def test_the_same_tokens_with_moved_logprobs_differ() -> None:
    got = copy.deepcopy(RECOMPUTED)
    got["top2"][0][0][1] += 3 * TIE  # what KV read before its load landed does, and more
    assert "position 0: the same token 5180" in answer_problem(got, RECOMPUTED)
