"""The host's cache limit (bench/cachebw.py), measured for real: sysfs's cache sizes and the
read rates of a buffer inside and far beyond the last-level cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.bench import cachebw


def test_the_record_holds_sane_figures() -> None:
    rec = cachebw.cache_limit(repeats=3)
    assert rec["kind"] == "cache_limit"
    assert "error" not in rec
    levels = cachebw.caches()
    if levels:
        assert rec["llc_bytes"] == levels[max(levels)]
    assert rec["llc_bytes"] >= 1 << 20
    sizes = [s for s, _ in rec["curve"]]
    assert sizes == sorted(sizes) and sizes[-1] == 8 * rec["llc_bytes"]
    for _, gbps in rec["curve"]:
        assert 0.1 < gbps < 10_000  # a memory read rate, in GB/s
    assert rec["dram_gbps"] == rec["curve"][-1][1]
    assert rec["effective_llc_bytes"] in sizes and rec["effective_llc_bytes"] <= 2 * rec["llc_bytes"]


def test_a_read_is_timed_on_the_thread() -> None:
    assert cachebw.read_gbps(1 << 20, repeats=3) > 0.1


@pytest.mark.parametrize(
    ("text", "want"), [("32K", 32 << 10), ("1024K", 1 << 20), ("32M", 32 << 20), ("512", 512)]
)
def test_sysfs_sizes(text: str, want: int) -> None:
    assert cachebw._size(text + "\n") == want


def test_caches_read_sysfs_and_skip_instruction_caches(tmp_path: Path) -> None:
    for i, (level, kind, size) in enumerate(
        [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"), (3, "Unified", "32768K")]
    ):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert cachebw.caches(tmp_path) == {1: 32 << 10, 2: 1 << 20, 3: 32 << 20}
