"""scripts/gpu-check.py checks itself without a GPU (--cpu-dry-run): the store's GDS save and
read paths run on CPU tensors with a POSIX stand-in for kvikio (io_gds.PosixFile), the
store's POSIX path reads the same objects, and the connector's worker saves and loads
chunks through both its device path and its host ring; every comparison must hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_restores_byte_for_byte(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/gpu-check.py"),
            "--cpu-dry-run",
            "--size-gib",
            "0.07",
            "--section-mib",
            "1",
            "--sections",
            "8",
            "--threads",
            "2",
            "--engine-rounds",
            "2",
            "--dir",
            str(store),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(ROOT / "connector" / "src")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["byte_for_byte"] is True and report["pinned_copy_byte_for_byte"] is True
    assert report["posix_sections_failed"] == 0 and report["gpu_sections_failed"] == 0
    assert report["verified_bytes"] == report["bytes"] == report["objects"] * 8 * (1 << 20) > 0
    assert report["io_mode"] == "posix (dry run)"
    engine = {e["io_engine"]: e for e in report["engine"]}
    assert engine["auto"]["io_mode"] == "posix (dry run)", "the worker's device path ran"
    assert engine["posix"]["io_mode"].startswith("posix-"), "the worker's host ring ran"
    for e in engine.values():
        assert e["byte_for_byte"] and e["load_errors"] == 0 and e["saves_dropped"] == 0
        assert e["objects_written"] > 0 and e["rounds"] == 2
        assert e["damaged_object_is_load_error"] is True
        overlap = e["overlap"]  # timings are reported, not judged; that they ran is
        assert overlap["matmuls_per_layer"] >= 1 and overlap["overlapped_s"] > 0 and overlap["save_slowdown"] > 0
    assert report["damaged_section"] == {"failed_sections": [1], "others_byte_for_byte": True}


def test_gpu_check_wheels_fit_in_64_mib() -> None:
    lock = (ROOT / "scripts/gpu-check.lock").read_text().splitlines()
    pins = [line.split()[0] for line in lock if line and not line.startswith("#")]
    assert all("==" in p for p in pins) and len(pins) == len({p.split("==")[0] for p in pins})
    assert all("--hash=sha256:" in line for line in lock if line and not line.startswith("#"))
    assert not any(p.startswith("cupy") for p in pins), "cupy is ~100 MiB: kvikio takes torch's CUDA tensors"
