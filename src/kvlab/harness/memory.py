"""The memory scenario: memory and pinned memory of the engine and, separately, of the cache
server, sampled through every scenario by a background thread.

One place decides where a figure comes from. A local engine (a child of the harness) is
measured over its process tree: RSS summed over the process and its descendants. A systemd
unit (the lab path) is measured by its cgroup v2 files: `memory.current` and `memory.peak`
count the whole unit, children and page cache charged to it included, and the peak catches
what happens between two samples. Where the cgroup cannot be read, the process tree stands
in and the record says why.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

CGROUP = "cgroup"
PROCESS_TREE = "process_tree"


def _pinned_bytes(pid: int) -> int:
    """VmPin + VmLck from /proc (page-locked memory; what pinned DRAM tiers hold)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmPin:", "VmLck:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return total


def tree_usage(pid: int | None) -> tuple[int, int]:
    """(RSS, pinned) bytes summed over a process and all its descendants; (0, 0) if gone."""
    if pid is None:
        return 0, 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    rss = pinned = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
        except psutil.Error:
            continue
        pinned += _pinned_bytes(p.pid)
    return rss, pinned


@dataclass(frozen=True)
class Usage:
    """The memory of one engine or cache server at one instant, and where it was read."""

    current_bytes: int  # process tree: RSS; cgroup: memory.current
    pinned_bytes: int  # VmPin + VmLck over the tree, or over the cgroup's processes
    source: Literal["cgroup", "process_tree"] = PROCESS_TREE
    peak_bytes: int | None = None  # cgroup: memory.peak, the high-water mark since the unit started
    fallback: str | None = None  # why not (all of) the cgroup's figures, where they were sought

    def fields(self, prefix: str) -> dict[str, object]:
        """The record's fields for `prefix` (engine, cache_server)."""
        return {f"{prefix}_rss_bytes": self.current_bytes, f"{prefix}_pinned_bytes": self.pinned_bytes,
                f"{prefix}_peak_bytes": self.peak_bytes, f"{prefix}_memory_source": self.source,
                f"{prefix}_memory_fallback": self.fallback}


def process_tree(pid: int, fallback: str | None = None) -> Usage:
    rss, pinned = tree_usage(pid)
    return Usage(rss, pinned, PROCESS_TREE, None, fallback)


class CgroupUnreadable(Exception):
    """A unit's cgroup v2 memory files cannot be read; the message says why (for the record)."""


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def cgroup_procs(cg: Path) -> list[int]:
    """Every process in a cgroup and the cgroups below it."""
    pids: list[int] = []
    for dirpath, _, files in os.walk(cg):
        if "cgroup.procs" in files:
            try:
                pids += [int(p) for p in (Path(dirpath) / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                continue
    return pids


def cgroup_usage(cg: Path) -> Usage:
    """The unit's memory from its cgroup v2 folder (/sys/fs/cgroup/<ControlGroup>)."""
    current = cg / "memory.current"
    try:
        now = _read_int(current)
    except FileNotFoundError:
        if not cg.is_dir():
            raise CgroupUnreadable(f"no cgroup folder {cg}") from None
        if not (cg / "cgroup.controllers").exists():
            raise CgroupUnreadable(f"{cg} is not on a cgroup v2 (unified) hierarchy") from None
        raise CgroupUnreadable(f"no {current}: the memory controller is not enabled for this cgroup") from None
    except (OSError, ValueError, IndexError) as e:
        raise CgroupUnreadable(f"{current} unreadable: {e}") from None
    try:
        peak, why = _read_int(cg / "memory.peak"), None
    except FileNotFoundError:
        peak, why = None, "no memory.peak (kernel < 5.19): peaks are the sampled memory.current"
    except (OSError, ValueError, IndexError) as e:
        peak, why = None, f"memory.peak unreadable ({e}): peaks are the sampled memory.current"
    pinned = sum(_pinned_bytes(p) for p in cgroup_procs(cg))
    return Usage(now, pinned, CGROUP, peak, why)


MemoryOf = Callable[[], dict[str, Usage | None]]
CPU_PRESSURE = Path("/proc/pressure/cpu")


def cpu_pressure_us(path: Path = CPU_PRESSURE) -> int | None:
    """The kernel's CPU pressure (PSI): microseconds, since boot, during which at least one
    runnable task waited for a CPU. Its growth over a request is how much other work contended
    with the engine then; None where the kernel has no PSI."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                return int(dict(f.split("=") for f in line.split()[1:])["total"])
    except (OSError, ValueError, KeyError):
        pass
    return None


class MemorySampler:
    """Samples every interval_s until stopped; `phase` labels what runs now.

    `memory` is the server's `memory()`: each of engine and cache_server measured from its
    source, None where it does not run (nothing is recorded while the engine is down)."""

    def __init__(self, memory: MemoryOf, interval_s: float, sink: Callable[[dict], None], setup: str):
        self.memory = memory
        self.interval_s = interval_s
        self.sink = sink
        self.setup = setup
        self.phase = "start"
        self.t0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"memory[{setup}]", daemon=True)

    def record(self, usage: dict[str, Usage | None]) -> dict:
        rec: dict = {"kind": "memory", "setup": self.setup, "phase": self.phase, "t": time.time()}
        rec["cpu_pressure_some_us"] = cpu_pressure_us()  # the planner's contention check
        for prefix in ("engine", "cache_server"):
            u = usage.get(prefix)
            rec |= u.fields(prefix) if u else dict.fromkeys(Usage(0, 0).fields(prefix))  # all null
        return rec

    def sample(self) -> dict | None:
        usage = self.memory()
        return self.record(usage) if usage.get("engine") is not None else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            rec = self.sample()  # none between a stop and a restart
            if rec is not None:
                self.sink(rec)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
