"""kvlab's connector on the real vLLM CPU engine: byte-exact restores, restarts, chunked
prefill, corruption, tenant and model isolation.

Each engine life runs in its own process (tests/engine/probe.py); the paged KV blocks of
every saved and every loaded chunk are snapshot from the engine's KV cache, so restores
are compared byte for byte, not through a random model's repetitive outputs alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from probing import ProbeRun, answer_problem, run_probe

from kvlab.model import ensure_tiny

# 2 full chunks of 512 tokens, a tail object of 2 blocks of 128 and 20 tokens past it;
# prefill in steps of 512 tokens (chunked prefill).
PROMPT = ["--tokens", "1300", "--max-batched", "512"]
# Not a chunk multiple: 7 chunks, a tail object of 3 blocks, 32 tokens past it.
LONG = ["--tokens", "4000", "--max-batched", "1024"]
LONG_HIT = 7 * 512 + 3 * 128


def same_kv(saved: np.ndarray, restored: np.ndarray) -> bool:
    return saved.shape == restored.shape and np.array_equal(saved, restored)


def swap_k_and_v(blocks: np.ndarray) -> np.ndarray:
    half = blocks.shape[-1] // 2
    return np.concatenate([blocks[..., half:], blocks[..., :half]], axis=-1)


def shift_blocks(blocks: np.ndarray) -> np.ndarray:
    return np.roll(blocks, 1, axis=1)


@pytest.fixture(scope="module")
def first_life(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[ProbeRun, Path]:
    """Round 0 computes and saves; round 1 restores after a prefix-cache reset."""
    d = tmp_path_factory.mktemp("life1")
    return run_probe(d / "probe", tiny_model, d / "store", *PROMPT, "--rounds", "2"), d / "store"


@pytest.fixture(scope="module")
def recompute(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ProbeRun:
    d = tmp_path_factory.mktemp("baseline")
    return run_probe(d / "probe", tiny_model, d / "unused", *PROMPT, "--no-connector")


def test_chunked_prefill_saves_every_chunk(first_life: tuple[ProbeRun, Path]) -> None:
    run, _ = first_life
    assert run.round(0)["saved_blocks"] == [4, 4, 2], "both full chunks and the tail, not only the first step's"
    assert run.result["stats"]["objects_written"] == 3
    assert run.result["stats"]["saves_dropped"] == 0


def test_warm_restore_is_byte_exact(first_life: tuple[ProbeRun, Path]) -> None:
    run, _ = first_life
    r0, r1 = run.round(0), run.round(1)
    assert r1["loaded"] == r0["saved"]
    assert r1["num_cached_tokens"] >= 1024 + 256
    for key in r0["saved"]:
        assert same_kv(run.saved(0, key), run.loaded(1, key)), f"chunk {key} differs after the restore"


def test_the_byte_check_catches_a_mutated_restore(first_life: tuple[ProbeRun, Path]) -> None:
    run, _ = first_life
    key = run.round(0)["saved"][0]
    saved, restored = run.saved(0, key), run.loaded(1, key)
    assert same_kv(saved, restored)
    assert not same_kv(saved, swap_k_and_v(restored)), "K and V swapped must fail the check"
    assert not same_kv(saved, shift_blocks(restored)), "blocks shifted by one must fail the check"


def test_restore_after_engine_restart(first_life: tuple[ProbeRun, Path], tiny_model: Path,
                                      recompute: ProbeRun, tmp_path: Path) -> None:
    first, store = first_life
    # Every section lands 50 ms late: vLLM's forward pass must wait for each restored layer,
    # and in a poisoned cache a layer read before it landed cannot give recompute's answer.
    second = run_probe(tmp_path / "probe", tiny_model, store, *PROMPT, "--slow-copy-ms", "50")
    assert second.result["forward_waited_s"] > 0.1, "the forward pass must have waited for late layers"
    r = second.round(0)
    assert r["loaded"] == first.round(0)["saved"], "a new engine must find the chunks on the drives"
    for key in r["loaded"]:
        assert same_kv(first.saved(0, key), second.loaded(0, key))
    assert (p := answer_problem(r, recompute.round(0))) is None, "greedy output must equal recompute: " + p
    assert (p := answer_problem(first.round(1), recompute.round(0))) is None, p


def test_corrupted_object_is_recomputed(first_life: tuple[ProbeRun, Path], tiny_model: Path,
                                        recompute: ProbeRun, tmp_path: Path) -> None:
    _, store = first_life
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    fragments = sorted(p for p in copy.rglob("*.0-1.*") if p.is_file())
    assert len(fragments) == 3
    victim = fragments[0]
    data = bytearray(victim.read_bytes())
    data[3 * (1 << 20) + 3 * 4096 + 123] ^= 0xFF  # inside a section's payload
    victim.write_bytes(bytes(data))
    run = run_probe(tmp_path / "probe", tiny_model, copy, *PROMPT)
    assert run.result["stats"]["checksum_failures"] >= 1
    assert (p := answer_problem(run.round(0), recompute.round(0))) is None, "a corrupt object must end in a correct answer: " + p


def test_cache_salts_never_share_a_hit(tiny_model: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    a = run_probe(tmp_path / "a", tiny_model, store, *PROMPT, "--salt", "tenant-a", "--rounds", "2")
    assert a.round(1)["loaded"], "the same tenant must hit its own objects"
    b = run_probe(tmp_path / "b", tiny_model, store, *PROMPT, "--salt", "tenant-b")
    assert b.round(0)["loaded"] == [] and b.round(0)["num_cached_tokens"] == 0
    assert set(b.round(0)["saved"]).isdisjoint(a.round(0)["saved"])


def test_reseeded_model_at_the_same_path_never_hits(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(ensure_tiny(seed=0), model)
    store = tmp_path / "store"
    old = run_probe(tmp_path / "old", model, store, *PROMPT)
    assert len(old.round(0)["saved"]) == 3
    shutil.rmtree(model)
    shutil.copytree(ensure_tiny(seed=1), model)
    new = run_probe(tmp_path / "new", model, store, *PROMPT)
    assert new.round(0)["loaded"] == [] and new.round(0)["num_cached_tokens"] == 0


# ---- block-granular restores, the next turn, repair ----------------------------------
@pytest.fixture(scope="module")
def long_life(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[ProbeRun, Path]:
    d = tmp_path_factory.mktemp("long")
    return run_probe(d / "probe", tiny_model, d / "store", *LONG, "--rounds", "2"), d / "store"


def test_a_prompt_past_its_last_chunk_is_restored_with_its_tail(long_life: tuple[ProbeRun, Path]) -> None:
    run, _ = long_life
    r0, r1 = run.round(0), run.round(1)
    assert r0["saved_blocks"] == [4] * 7 + [3], "7 chunks and a tail object of the 3 whole blocks past them"
    assert r1["loaded"] == r0["saved"]
    assert r1["num_cached_tokens"] == LONG_HIT, "every whole block but the one vLLM must compute"
    for key in r0["saved"]:
        assert same_kv(run.saved(0, key), run.loaded(1, key)), f"object {key} differs after the restore"
    assert (p := answer_problem(r1, r0)) is None, p


def test_the_byte_check_catches_a_mutated_tail(long_life: tuple[ProbeRun, Path]) -> None:
    run, _ = long_life
    tail = run.round(0)["saved"][-1]
    saved, restored = run.saved(0, tail), run.loaded(1, tail)
    assert saved.shape[1] == 3 and same_kv(saved, restored)
    assert not same_kv(saved, swap_k_and_v(restored)), "K and V swapped must fail the check"
    assert not same_kv(saved, shift_blocks(restored)), "blocks shifted by one must fail the check"
    swapped = restored.copy()
    swapped[:, [0, 1]] = restored[:, [1, 0]]
    assert not same_kv(saved, swapped), "two blocks swapped must fail the check"


def test_a_long_prompt_is_restored_with_its_tail_after_a_restart(long_life: tuple[ProbeRun, Path],
                                                                 tiny_model: Path, tmp_path: Path) -> None:
    first, store = long_life
    second = run_probe(tmp_path / "probe", tiny_model, store, *LONG)
    r = second.round(0)
    assert r["loaded"] == first.round(0)["saved"] and r["num_cached_tokens"] == LONG_HIT
    for key in r["loaded"]:
        assert same_kv(first.saved(0, key), second.loaded(0, key))
    assert (p := answer_problem(r, first.round(0))) is None, p


def test_the_next_turn_restores_through_the_first_answer(tiny_model: Path, tmp_path: Path) -> None:
    """A first turn of 3700 tokens (7 chunks and 116 tokens) answers 16: the answer
    completes block 28, saved when the request finishes; the second turn (the first, its
    answer and 50 new tokens, after a prefix-cache reset) restores through it."""
    run = run_probe(tmp_path / "probe", tiny_model, tmp_path / "store", "--tokens", "3700", "--max-batched", "1024",
                    "--max-tokens", "16", "--next-turn", "50")
    first, turn = run.round(0), run.round(1)
    assert len(first["output"]) == 16
    assert first["finish_saved"] and first["saved_blocks"][-1] == 1, "the answer's whole block, at the finish"
    assert turn["prompt_tokens"] == 3700 + 16 + 50
    assert turn["loaded"] == first["saved"]
    assert turn["num_cached_tokens"] == 7 * 512 + 128, "through the answer's tokens"
    for key in first["saved"]:
        assert same_kv(run.saved(0, key), run.loaded(1, key))


def test_a_corrupt_object_is_recomputed_once_then_restored_from_its_replacement(
        long_life: tuple[ProbeRun, Path], tiny_model: Path, tmp_path: Path) -> None:
    first, store = long_life
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    victim_key = first.round(0)["saved"][3]
    (victim,) = [p for p in copy.rglob(f"{victim_key}.0-1.*") if p.is_file()]
    data = bytearray(victim.read_bytes())
    data[2 * (1 << 20) + 2 * 4096 + 123] ^= 0xFF  # inside a section's payload
    victim.write_bytes(bytes(data))
    run = run_probe(tmp_path / "probe", tiny_model, copy, *LONG, "--rounds", "2")
    r0, r1 = run.round(0), run.round(1)
    assert run.result["stats"]["checksum_failures"] == 1, "a failed load once, then never again"
    assert victim_key in r0["loaded"] and victim_key in r0["saved"], "recomputed and saved again"
    assert [k for k in r0["saved"] if k != victim_key] == [], "objects that verified are not written again"
    assert r1["loaded"] == first.round(0)["saved"] and r1["num_cached_tokens"] == LONG_HIT
    assert same_kv(run.saved(0, victim_key), run.loaded(1, victim_key))
    assert (p := answer_problem(r0, first.round(0))) is None, p
    assert (p := answer_problem(r1, first.round(0))) is None, p
