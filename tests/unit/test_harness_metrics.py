"""The seeds' metrics against hand-computed fixtures."""

from __future__ import annotations

import pytest

from kvlab.harness import metrics
from kvlab.harness.metrics import Turn


def test_frozen_answers_counts_gaps_strictly_above_the_threshold() -> None:
    # 20.0 is not above 20; 20.1 and 61 are.
    assert metrics.frozen_answers([0.5, 20.0, 20.1, 61.0, 5.7], threshold_s=20) == 2
    assert metrics.frozen_answers([], threshold_s=20) == 0


def test_rounds_two_to_nine_drop_the_cold_round_and_the_last() -> None:
    rounds = [10.0, 2, 4, 6, 8, 10, 12, 14, 16, 100]
    # (2+4+6+8+10+12+14+16) / 8 = 72 / 8
    assert metrics.mean_of_rounds(rounds, 2, 9) == 9.0
    assert metrics.mean_of_rounds(rounds, 1, 10) == pytest.approx(18.2)


def test_rounds_outside_the_measured_ones_are_refused() -> None:
    with pytest.raises(ValueError):
        metrics.mean_of_rounds([1.0, 2.0, 3.0], 2, 9)


@pytest.mark.parametrize(("values", "p", "expected"), [
    ([1, 2, 3, 4], 50, 2.5),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90, 9.1),   # rank 8.1 -> 9 + 0.1
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 99, 9.91),  # rank 8.91
    ([10, 1, 5], 0, 1),
    ([10, 1, 5], 100, 10),
    ([7], 99, 7),
])
def test_percentile_interpolates_between_closest_ranks(values: list[float], p: float, expected: float) -> None:
    assert metrics.percentile(values, p) == pytest.approx(expected)


TURNS = [
    Turn(prompt_tokens=1000, cached_tokens=512, reusable_tokens=900),   # 512 >= 450: hit
    Turn(prompt_tokens=1200, cached_tokens=0, reusable_tokens=1000),    # miss
    Turn(prompt_tokens=600, cached_tokens=0, reusable_tokens=0),        # first turn: not returning
    Turn(prompt_tokens=2000, cached_tokens=1024, reusable_tokens=1500),  # 1024 >= 750: hit
    Turn(prompt_tokens=2000, cached_tokens=512, reusable_tokens=1500),  # 512 < 750: miss
]


def test_turn_hit_share_counts_returning_turns_found_in_the_cache() -> None:
    assert metrics.turn_hit_share(TURNS, min_fraction=0.5) == 0.5  # 2 of 4 returning
    assert metrics.turn_hit_share(TURNS, min_fraction=0.3) == 0.75  # 512 >= 450 too
    assert metrics.turn_hit_share(TURNS[2:3], min_fraction=0.5) is None


def test_token_hit_share_weighs_by_prompt_tokens_of_returning_turns() -> None:
    # (512 + 0 + 1024 + 512) / (1000 + 1200 + 2000 + 2000)
    assert metrics.token_hit_share(TURNS) == pytest.approx(2048 / 6200)


@pytest.mark.parametrize(("baseline", "value", "higher", "expected"), [
    (10.0, 2.0, False, 5.0),        # TTFT: baseline / setup
    (100.0, 2400.0, True, 24.0),    # throughput: setup / baseline (the second seed's ~24x)
    (2.0, 4.0, False, 0.5),         # slower than baseline: below 1
    (None, 1.0, True, None),
    (1.0, 0.0, False, None),
])
def test_improvement_factors(baseline: float | None, value: float, higher: bool, expected: float | None) -> None:
    got = metrics.improvement(baseline, value, higher_is_better=higher)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_decode_rate_per_agent_is_the_mean_of_each_agents_rate() -> None:
    a = [(11, 1.0, 2.0), (5, 0.5, 1.5)]  # 10 + 4 tokens over 1 + 1 s: 7 tok/s
    b = [(21, 0.2, 1.2), (1, 0.1, 0.1)]  # 20 tokens over 1 s (the 1-token answer decodes nothing)
    assert metrics.decode_rate_per_agent([a, b]) == pytest.approx(13.5)


def test_throughput_counts_prompt_and_output_tokens_over_the_round() -> None:
    assert metrics.throughput(1000, 16, 2.0) == 508.0
