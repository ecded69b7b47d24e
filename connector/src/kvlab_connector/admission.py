"""Admission: which objects the scheduler side saves, bounding what the drives absorb.

A KV cache writes every prompt it saves, and drives are rated for a number of their own
capacity's writes a day (counters.PER_DRIVE counts each drive's). Two bounds, each counted:

- `admission`: `always` (every object, the default) or `reused`: an object is saved the
  second time its key is planned within a window of the last `admission_window` keys, as
  vLLM's reuse filter (FilterReusedOffloadingManager, store_threshold 2) and CacheLib's
  admission policies do; a prompt that never returns is never written.
- `write_budget_bytes_per_day`: a token bucket that refills at that rate (holding at most
  one hour's worth); a save that does not fit is dropped until it does.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kvlab_connector import metrics

POLICIES = ("always", "reused")
BUDGET_BURST_S = 3600.0  # the bucket holds at most this long's budget


class Admission:
    def __init__(self, policy: str = "always", window: int = 100_000, budget_bytes_per_day: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"admission must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.window = window
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.rate = budget_bytes_per_day / 86400 if budget_bytes_per_day else None
        self.capacity = self.rate * BUDGET_BURST_S if self.rate else 0.0
        self._tokens = self.capacity
        self._t = time.monotonic()
        self.counts = {"admission_refused": 0, "over_write_budget": 0}  # objects not saved, by why

    def _reused(self, key: str) -> bool:
        if key in self._seen:
            self._seen.move_to_end(key)
            return True
        self._seen[key] = None
        if len(self._seen) > self.window:
            self._seen.popitem(last=False)
        return False

    def _within_budget(self, nbytes: int) -> bool:
        now = time.monotonic()
        self._tokens = min(self.capacity, self._tokens + (now - self._t) * self.rate)  # type: ignore[operator]
        self._t = now
        if nbytes > self._tokens:
            return False
        self._tokens -= nbytes
        return True

    def admit(self, key: str, nbytes: int) -> str | None:
        """None if the object of `key` (`nbytes` over every rank) is saved; else why not,
        the name of the counter that counts it."""
        if self.policy == "reused" and not self._reused(key):
            return self._count("admission_refused")
        if self.rate is not None and not self._within_budget(nbytes):
            return self._count("over_write_budget")
        return None

    def skip(self, key: str, reason: str) -> None:
        """An object not offered (an earlier one of its prompt was refused): its key is
        seen all the same, and it counts where the refusal did."""
        if self.policy == "reused":
            self._reused(key)
        self._count(reason)

    def _count(self, reason: str) -> str:
        self.counts[reason] += 1
        if reason == "admission_refused":  # each name spelled out: tests find every counter incremented
            metrics.inc("admission_refused")
        else:
            metrics.inc("over_write_budget")
        return reason
