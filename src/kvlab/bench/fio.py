"""The drive limit: fio's O_DIRECT sequential read and write on the store's filesystem.

The limit is fio's best over a small matrix (io_uring, 1 MiB and 4 MiB blocks, queue
depth 32); every job is recorded so that a reader can rerun it. Each job moves its
`size` once, as the store does: a write job writes a new, preallocated file (the store
writes new objects; rewriting blocks already allocated would measure something the
store never does) and a read job reads the file the writes left.
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


def run_fio(directory: Path, rw: str, bs: str, size_mib: int = 1024) -> FioResult:
    if not fio_available():
        raise RuntimeError("fio is not installed: run scripts/system-deps (apt-get install fio)")
    directory.mkdir(parents=True, exist_ok=True)
    if rw == "write":
        cleanup(directory)
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
        "fallocate": "native",
        "numjobs": 1,
        "group_reporting": 1,
    }
    args = ["fio", "--output-format=json"] + [f"--{k}={v}" for k, v in job.items()]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    side = data["jobs"][0]["read" if rw == "read" else "write"]
    return FioResult(rw=rw, bs=bs, gbps=side["bw_bytes"] / 1e9, job=job)


def fio_limit(directory: Path, rw: str, size_mib: int = 1024) -> tuple[float, list[FioResult]]:
    """fio's best GB/s over the matrix, and every job's result."""
    results = [run_fio(directory, rw, bs, size_mib) for bs in BLOCK_SIZES]
    return max(r.gbps for r in results), results


def cleanup(directory: Path) -> None:
    (directory / "kvlab-fio.dat").unlink(missing_ok=True)
