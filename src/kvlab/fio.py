"""The drive limit: fio's O_DIRECT sequential read and write on the store's filesystem.

The limit is fio's best over a small matrix (io_uring, 1 MiB and 4 MiB blocks, queue
depth 32); every job is recorded so that a reader can rerun it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

BLOCK_SIZES = ("1M", "4M")


@dataclass(frozen=True)
class FioResult:
    rw: str  # read | write
    bs: str
    gbps: float  # GB/s (1e9 bytes)
    job: dict

    def to_dict(self) -> dict:
        return asdict(self)


def fio_available() -> bool:
    return shutil.which("fio") is not None


def run_fio(directory: Path, rw: str, bs: str, size_mib: int = 1024, runtime_s: int = 4) -> FioResult:
    if not fio_available():
        raise RuntimeError("fio is not installed: run scripts/system-deps (apt-get install fio)")
    directory.mkdir(parents=True, exist_ok=True)
    job = {
        "name": f"kvlab-limit-{rw}-{bs}",
        "directory": str(directory),
        "filename": "kvlab-fio.dat",
        "rw": rw,
        "bs": bs,
        "size": f"{size_mib}M",
        "ioengine": "io_uring",
        "iodepth": 32,
        "direct": 1,
        "runtime": runtime_s,
        "time_based": 1,
        "numjobs": 1,
        "group_reporting": 1,
    }
    args = ["fio", "--output-format=json"] + [f"--{k}={v}" for k, v in job.items()]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=runtime_s * 10 + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    side = data["jobs"][0]["read" if rw == "read" else "write"]
    return FioResult(rw=rw, bs=bs, gbps=side["bw_bytes"] / 1e9, job=job)


def fio_limit(directory: Path, rw: str, size_mib: int = 1024, runtime_s: int = 4) -> tuple[float, list[FioResult]]:
    """fio's best GB/s over the matrix, and every job's result."""
    results = [run_fio(directory, rw, bs, size_mib, runtime_s) for bs in BLOCK_SIZES]
    return max(r.gbps for r in results), results


def cleanup(directory: Path) -> None:
    (directory / "kvlab-fio.dat").unlink(missing_ok=True)
