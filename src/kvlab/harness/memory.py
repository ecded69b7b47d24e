"""The memory scenario: RSS and pinned memory of the engine's process tree and, separately,
of the cache server's, sampled through every scenario by a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psutil


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


class MemorySampler:
    """Samples every interval_s until stopped; `phase` labels what runs now."""

    def __init__(self, pids: Callable[[], dict[str, int | None]], interval_s: float,
                 sink: Callable[[dict], None], setup: str):
        self.pids = pids
        self.interval_s = interval_s
        self.sink = sink
        self.setup = setup
        self.phase = "start"
        self.t0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"memory[{setup}]", daemon=True)

    def sample(self) -> dict:
        pids = self.pids()
        e_rss, e_pin = tree_usage(pids.get("engine"))
        c_rss, c_pin = tree_usage(pids.get("cache_server"))
        rec = {"kind": "memory", "setup": self.setup, "phase": self.phase, "t": time.time(),
               "engine_rss_bytes": e_rss, "engine_pinned_bytes": e_pin,
               "cache_server_rss_bytes": c_rss if pids.get("cache_server") else None,
               "cache_server_pinned_bytes": c_pin if pids.get("cache_server") else None}
        return rec

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.pids().get("engine") is not None:  # none between a stop and a restart
                self.sink(self.sample())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
