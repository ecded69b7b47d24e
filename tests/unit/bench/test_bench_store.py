"""`kvlab bench store` end to end, small: real fio beside the real store, repeat by repeat."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from kvlab.bench.connector import bench_store
from kvlab.bench.fio import fio_available


@pytest.mark.skipif(not fio_available(), reason="fio is not installed (scripts/system-deps installs it)")
def test_ratios_pair_the_store_with_fios_best_job_of_the_same_repeat(tmp_path: Path) -> None:
    res = bench_store(tmp_path, repeats=3, size_mib=32, small_objects=500)
    raw = res["raw"]
    fio = raw["fio_gbps"]
    assert set(fio) == {"write-1M", "write-4M", "read-1M", "read-4M"}
    assert all(len(v) == 3 for v in fio.values())
    jobs = res["fio_limit_jobs"]
    for rw in ("write", "read"):
        best = max((k for k in fio if k.startswith(rw)), key=lambda k: statistics.median(fio[k]))
        assert jobs[rw] == best, "the limit is the job with the best median"
        assert res[f"fio_{rw}_limit_gbps"] == statistics.median(fio[best])
        store = raw[f"store_{rw}_gbps"]
        assert raw[f"{rw}_ratio"] == [s / f for s, f in zip(store, fio[best], strict=True)]
        assert res[f"{rw}_ratio"] == statistics.median(raw[f"{rw}_ratio"]) > 0
    assert res["index_rebuild_objects"] == 500 and res["index_rebuild_s_100k"] > 0
    # Every repeat runs every job, each in another order: no job always follows the same one.
    assert all(sorted(order) == ["fio-1M", "fio-4M", "store"] for order in raw["order"])
    assert len({tuple(order) for order in raw["order"]}) == 3
    prov = res["provenance"]
    assert prov["git"]["commit"] and prov["versions"]["kvlab-connector"] and prov["host"]["cpu_count"]
    assert prov["filesystem"]["fstype"], "the filesystem measured on is named"
    assert res["fio_jobs"]["write-4M"]["direct"] == 1 and res["fio_jobs"]["read-1M"]["iodepth"] == 32


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "lots"])
def test_a_size_that_is_no_size_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str,
) -> None:
    from kvlab.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "store", "--size-mib", value, "--workdir", str(tmp_path / "w")])
    assert e.value.code == 2
    assert f"argument --size-mib: must be a positive integer, got {value!r}" in capsys.readouterr().err
    assert not (tmp_path / "w").exists(), "nothing ran"


def test_a_size_the_workdir_cannot_hold_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    import shutil

    from kvlab.cli import main

    absurd = (shutil.disk_usage(tmp_path).free >> 20) + (1 << 20)  # a TiB more than is free
    assert main(["bench", "store", "--size-mib", str(absurd), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvlab: --size-mib {absurd}: {tmp_path} has ") and "\n" not in err
    assert not (tmp_path / "w").exists(), "nothing ran"


def test_a_workdir_that_does_not_exist_yet_is_made(tmp_path: Path) -> None:
    """The default workdir (~/.cache/kvlab/state/bench-store) is absent on a fresh machine: the
    bench makes its own folder (the store never makes a drive path's parents, by design)."""
    work = tmp_path / "state" / "bench-store"
    res = bench_store(work, repeats=1, size_mib=8, small_objects=50)
    assert res["store_write_gbps"] > 0 and work.is_dir()
