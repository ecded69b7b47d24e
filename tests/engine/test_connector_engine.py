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
from probing import ProbeRun, run_probe

from kvlab.model import ensure_tiny

# 2 full chunks of 512 tokens and a tail; prefill in steps of 512 tokens (chunked prefill).
PROMPT = ["--tokens", "1300", "--max-batched", "512"]


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
    assert len(run.round(0)["saved"]) == 2, "both full chunks must be saved, not only the first prefill step"
    assert run.result["stats"]["objects_written"] == 2
    assert run.result["stats"]["saves_dropped"] == 0


def test_warm_restore_is_byte_exact(first_life: tuple[ProbeRun, Path]) -> None:
    run, _ = first_life
    r0, r1 = run.round(0), run.round(1)
    assert r1["loaded"] == r0["saved"]
    assert r1["num_cached_tokens"] >= 1024
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
    second = run_probe(tmp_path / "probe", tiny_model, store, *PROMPT)
    r = second.round(0)
    assert r["loaded"] == first.round(0)["saved"], "a new engine must find the chunks on the drives"
    for key in r["loaded"]:
        assert same_kv(first.saved(0, key), second.loaded(0, key))
    assert r["output"] == recompute.round(0)["output"], "greedy output must equal recompute"
    assert first.round(1)["output"] == recompute.round(0)["output"]


def test_corrupted_object_is_recomputed(first_life: tuple[ProbeRun, Path], tiny_model: Path,
                                        recompute: ProbeRun, tmp_path: Path) -> None:
    _, store = first_life
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    fragments = sorted(p for p in copy.rglob("*.0-1.*") if p.is_file())
    assert len(fragments) == 2
    victim = fragments[0]
    data = bytearray(victim.read_bytes())
    data[3 * (1 << 20) + 3 * 4096 + 123] ^= 0xFF  # inside a section's payload
    victim.write_bytes(bytes(data))
    run = run_probe(tmp_path / "probe", tiny_model, copy, *PROMPT)
    assert run.result["stats"]["checksum_failures"] >= 1
    assert run.round(0)["output"] == recompute.round(0)["output"], "a corrupt object must end in a correct answer"


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
    assert len(old.round(0)["saved"]) == 2
    shutil.rmtree(model)
    shutil.copytree(ensure_tiny(seed=1), model)
    new = run_probe(tmp_path / "new", model, store, *PROMPT)
    assert new.round(0)["loaded"] == [] and new.round(0)["num_cached_tokens"] == 0
