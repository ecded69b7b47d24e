"""kvlab's numbers in vLLM's own KV-connector stats (logged with the engine's stats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvlab_connector.counters import WORKER_REPORTED as COUNTERS


@dataclass
class KvlabStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KvlabStats:
        for k, v in other.data.items():
            if k in COUNTERS:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d.get(k, 0) for k in COUNTERS if not k.endswith("_s")}
        out["read_GBps"] = round(d.get("bytes_read", 0) / d["read_s"] / 1e9, 3) if d.get("read_s") else 0.0
        out["write_GBps"] = round(d.get("bytes_written", 0) / d["write_s"] / 1e9, 3) if d.get("write_s") else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS)


def delta(now: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    return {k: now.get(k, 0) - last.get(k, 0) for k in COUNTERS}


class Intervals:
    """The worker's counters as vLLM's stats, one interval a step. An interval in which nothing
    moved is reported once after one that moved (vLLM then shows zeros, not the last numbers),
    and after that not at all: every report travels worker -> scheduler -> API server and is
    logged there, each decode step, and the steps of a request with nothing to save or load
    are most steps."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}
        self._empty_reported = False

    def next(self, now: dict[str, Any]) -> dict[str, Any] | None:
        if self._empty_reported and now == self._last:
            return None  # most steps: one comparison, no interval built
        data = delta(now, self._last)
        self._last = now
        empty = not any(data.values())
        if empty and self._empty_reported:
            return None
        self._empty_reported = empty
        return data
