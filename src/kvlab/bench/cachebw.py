"""The host's cache limit: its caches' sizes (sysfs) and the single-thread read bandwidth of a
buffer that fits in the last-level cache against one that does not, once per run.

A CPU engine's prefill is attention, which reads the prefix's KV; whether those reads come
from the last-level cache or from DRAM is a physical input of the restore planner
(`kvlab predict --calibrate`), measured here the way `drive_limit` measures the drive. The
bandwidth is thread CPU time, not wall time: a neighbour that takes the core for a while
lengthens the wall clock, not what one read costs. Each size is read `repeats` times; the
median counts.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

CPU0_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
FALLBACK_LLC = 32 << 20  # where sysfs says nothing (not Linux): a common server LLC slice


def _size(text: str) -> int:
    text = text.strip().upper()
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * unit


def caches(root: Path = CPU0_CACHE) -> dict[int, int]:
    """Level -> bytes of cpu0's data or unified caches, from sysfs ({} where it has none)."""
    out: dict[int, int] = {}
    for d in sorted(root.glob("index*")):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            out[int((d / "level").read_text())] = _size((d / "size").read_text())
        except (OSError, ValueError):
            continue
    return out


def read_gbps(nbytes: int, repeats: int = 9) -> float:
    """GB/s one thread reads a resident buffer of `nbytes` (numpy's vectorised max: one pass)."""
    a = np.ones(max(1, nbytes // 4), dtype=np.float32)
    a.max()  # fault it in and warm the cache it fits in
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        a.max()
        times.append(time.thread_time() - t0)
    return a.nbytes / max(statistics.median(times), 1e-9) / 1e9


def cache_limit(repeats: int = 9) -> dict[str, Any]:
    """The `cache_limit` record: cache sizes, and the read bandwidth at a quarter of the LLC
    (`llc_gbps`), at eight times it (`dram_gbps`) and along the way (`curve`: bytes, GB/s);
    `effective_llc_bytes`: the largest size still read nearer the LLC's rate than DRAM's (the
    geometric mean between): what this host's LLC holds for one reader while its neighbours
    share it (a VM's slice of a shared L3 holds less than sysfs says)."""
    levels = caches()
    llc = levels[max(levels)] if levels else FALLBACK_LLC
    rec: dict[str, Any] = {
        "kind": "cache_limit",
        "llc_bytes": llc,
        "l2_bytes": levels.get(2),
        "caches": {str(k): v for k, v in sorted(levels.items())},
        "method": "numpy float32 max, one thread, thread CPU time, median of repeats",
        "repeats": repeats,
    }
    try:
        sizes = sorted({llc // 8, llc // 4, llc // 2, llc, 2 * llc, 8 * llc})
        curve = [(s, read_gbps(s, repeats)) for s in sizes]
    except (MemoryError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[-500:]
        return rec
    rec["curve"] = [[s, g] for s, g in curve]
    rec["llc_gbps"] = dict(curve)[llc // 4]
    rec["dram_gbps"] = curve[-1][1]
    mid = (rec["llc_gbps"] * rec["dram_gbps"]) ** 0.5
    held = curve[0][0]
    for s, g in curve:  # the sizes read at the LLC's rate, smallest first, up to the first that is not
        if g < mid:
            break
        held = s
    rec["effective_llc_bytes"] = held
    return rec
