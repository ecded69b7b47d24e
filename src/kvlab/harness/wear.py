"""Wear, counted: what each setup's tier wrote to drives in each scenario.

The runner samples at every scenario's start and end (`open`, `close`), and around each engine
restart inside a scenario (a `close` before the engine stops, an `open` once it serves again):
the engine's counters and its processes' I/O counters start again with every process, so only
samples of one engine life are subtracted. A sample holds what every way of counting sees, and
the setup's `drive_tier` (kvlab.setups.registry) says which one is its tier's:
- `kvlab`: kvlab's connector counters (`kvlab_written_bytes`, `kvlab_read_bytes`,
  `kvlab_drive_written_bytes{drive}`) from its metrics port;
- `files`: `/proc/PID/io` of the engine's and the cache server's process trees
  (write_bytes - cancelled_write_bytes: what reached, or will reach, the block layer);
- `none`: no drive tier (recompute, DRAM): it writes 0 bytes to drives, by definition.
Restored bytes: kvlab's own bytes read where it counts them, else vLLM's external prefix-cache
hit tokens x the model's KV bytes per token.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from kvlab.wear import Drives, bytes_per_day, wear

Sink = Callable[[dict[str, Any]], None]
DRIVE_WRITTEN = "kvlab_drive_written_bytes"
_DRIVE_LABEL = re.compile(r'drive="((?:[^"\\]|\\.)*)"')


# ---- sampling -----------------------------------------------------------------------------
def proc_io(pid: int, proc: Path = Path("/proc")) -> dict[str, int]:
    """A process's I/O counters (`/proc/PID/io`): read_bytes, write_bytes, cancelled_write_bytes, …"""
    out = {}
    for line in (proc / str(pid) / "io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def tree_io(pid: int) -> dict[str, dict[str, int]]:
    """/proc/PID/io of a process and every descendant, by PID (as a JSON key); a descendant
    that ended while it was read is left out. OSError where the tree cannot be read."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error as e:
        raise OSError(f"process tree of {pid}: {type(e).__name__}") from e
    out = {}
    for p in procs:
        try:
            io = proc_io(p.pid)
        except FileNotFoundError:
            continue
        out[str(p.pid)] = {k: io.get(k, 0) for k in ("read_bytes", "write_bytes", "cancelled_write_bytes")}
    return out


def drive_written(connector_metrics: dict[str, float]) -> dict[str, float]:
    """kvlab_drive_written_bytes by drive path, from the connector's parsed Prometheus text."""
    out = {}
    for key, value in connector_metrics.items():
        if key.startswith((DRIVE_WRITTEN + "{", DRIVE_WRITTEN + "_total{")):
            m = _DRIVE_LABEL.search(key)
            if m:
                out[m[1]] = value
    return out


@dataclass
class WearSampler:
    """Writes `wear_sample` records for one setup's engine: `open(scenario)` and `close()`
    around each scenario; `pause()` before the engine stops and `resume()` once it serves
    again (both do nothing outside a scenario)."""

    setup: str
    drive_tier: str
    kv_bytes_per_token: int | None
    pids: Callable[[], dict[str, int | None]]  # role (engine, cache_server) -> PID
    counters: Callable[[], dict[str, float]]  # scenarios.Target.counters
    connector_metrics: Callable[[], dict[str, float]]
    sink: Sink
    _open: dict[str, Any] | None = field(default=None, init=False)
    _running: bool = field(default=False, init=False)

    def open(self, scenario: str, **labels: Any) -> None:
        self._open = {"scenario": scenario, **labels}
        self._sample("open")
        self._running = True

    def close(self) -> None:
        if self._open is not None and self._running:
            self._sample("close")
        self._open, self._running = None, False

    def pause(self) -> None:
        if self._open is not None and self._running:
            self._sample("close")
            self._running = False

    def resume(self) -> None:
        if self._open is not None and not self._running:
            self._sample("open", after_start=True)
            self._running = True

    def _sample(self, mark: str, after_start: bool = False) -> None:
        assert self._open is not None
        c = self.counters()
        rec: dict[str, Any] = {
            "kind": "wear_sample",
            "setup": self.setup,
            **self._open,
            "mark": mark,
            "t": time.time(),
            "drive_tier": self.drive_tier,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "counters": {
                k: c.get(k) for k in ("connector_written_bytes", "connector_read_bytes", "external_hits")
            },
            "drive_written_bytes": drive_written(self.connector_metrics())
            if self.drive_tier == "kvlab"
            else {},
            "io": {},
            **({"after_start": True} if after_start else {}),
        }
        errors = []
        for role, pid in self.pids().items():
            if pid is None:
                continue
            try:
                rec["io"][role] = tree_io(pid)
            except OSError as e:  # another user's process (a systemd unit): not readable here
                errors.append(f"{role} {pid}: {type(e).__name__}: {e}")
        if errors:
            rec["io_error"] = "; ".join(errors)[:500]
        self.sink(rec)


# ---- counting -----------------------------------------------------------------------------
def scenario_key(rec: dict[str, Any]) -> str:
    """A scenario as the summary keys it: `restore`, `sweep`, `agents:N`."""
    return f"agents:{rec['concurrency']}" if rec.get("concurrency") is not None else rec["scenario"]


def _grew(after: float | None, before: float | None) -> float | None:
    """A counter's change; a counter that went back (its process restarted) counts from zero."""
    if after is None or before is None:
        return None
    return after - before if after >= before else after


def _io_written(io: dict[str, int]) -> int:
    return io.get("write_bytes", 0) - io.get("cancelled_write_bytes", 0)


def io_delta(
    after: dict[str, dict[str, dict[str, int]]], before: dict[str, dict[str, dict[str, int]]], key: str
) -> float:
    """Bytes the processes of the trees gained in `key` (write: written less cancelled) between
    two samples. A process born in between counts from zero; one that ended in between had its
    counts added to its parent's when it was reaped (the kernel does), so what it had at the
    first sample is taken off again."""

    def of(io: dict[str, int]) -> int:
        return _io_written(io) if key == "write" else io.get(key, 0)

    total = 0.0
    for role, procs in after.items():
        was = before.get(role, {})
        for pid, io in procs.items():
            total += _grew(of(io), of(was[pid]) if pid in was else 0) or 0
        total -= sum(of(io) for pid, io in was.items() if pid not in procs)
    return total


@dataclass
class Counted:
    """One scenario's counts, summed over its segments (open..close within one engine life)."""

    tier: str
    segments: int = 0
    first_t: float | None = None
    last_t: float | None = None
    kvlab_written: float | None = 0.0
    kvlab_read: float | None = 0.0
    external_hits: float | None = 0.0
    process_written: float | None = 0.0
    drive_written: dict[str, float] = field(default_factory=dict)
    kv_bytes_per_token: int | None = None

    def add(self, a: dict[str, Any], b: dict[str, Any]) -> None:
        self.segments += 1
        self.first_t = a["t"] if self.first_t is None else min(self.first_t, a["t"])
        self.last_t = b["t"] if self.last_t is None else max(self.last_t, b["t"])
        self.kv_bytes_per_token = b.get("kv_bytes_per_token")
        ca, cb = dict(a.get("counters") or {}), b.get("counters") or {}
        if a.get("after_start"):  # a fresh engine's counters are 0, served yet or not
            ca = {k: 0.0 if v is None else v for k, v in ca.items()}
        for attr, key in (
            ("kvlab_written", "connector_written_bytes"),
            ("kvlab_read", "connector_read_bytes"),
            ("external_hits", "external_hits"),
        ):
            d, have = _grew(cb.get(key), ca.get(key)), getattr(self, attr)
            setattr(self, attr, None if d is None or have is None else have + d)
        if "io_error" in a or "io_error" in b or not b.get("io"):
            self.process_written = None
        elif self.process_written is not None:
            self.process_written += io_delta(b["io"], a.get("io") or {}, "write")
        for drive, v in (b.get("drive_written_bytes") or {}).items():
            self.drive_written[drive] = self.drive_written.get(drive, 0.0) + (
                _grew(v, (a.get("drive_written_bytes") or {}).get(drive, 0.0)) or 0.0
            )

    @property
    def wall_s(self) -> float | None:
        return self.last_t - self.first_t if self.first_t is not None and self.last_t is not None else None

    @property
    def written(self) -> float | None:
        if self.tier == "none":
            return 0.0
        return self.kvlab_written if self.tier == "kvlab" else self.process_written

    @property
    def restored(self) -> float | None:
        if self.tier == "kvlab":
            return self.kvlab_read
        if self.external_hits is None or self.kv_bytes_per_token is None:
            return None
        return self.external_hits * self.kv_bytes_per_token


def count(records: list[dict[str, Any]]) -> dict[str, Counted]:
    """One setup's `wear_sample` records, in order, as counts per scenario key; a segment
    without its close (the engine died) is not counted."""
    out: dict[str, Counted] = {}
    opened: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") != "wear_sample":
            continue
        key = scenario_key(r)
        if r["mark"] == "open":
            opened[key] = r
        elif key in opened:
            out.setdefault(key, Counted(r.get("drive_tier", "none"))).add(opened.pop(key), r)
    return out


def figures(c: Counted, drives: Drives | None) -> dict[str, Any]:
    """What the summary shows of one scenario's counts (summary.WearPoint's fields)."""
    written, restored, wall = c.written, c.restored, c.wall_s
    out: dict[str, Any] = {
        "tier": c.tier,
        "written_bytes": written,
        "restored_bytes": restored,
        "written_over_restored": written / restored if written is not None and restored else None,
        "wall_s": wall,
        "write_bytes_per_s": written / wall if written is not None and wall else None,
        "drive_written_bytes": dict(c.drive_written) if c.tier == "kvlab" else None,
        "process_written_bytes": c.process_written,
        "segments": c.segments,
        "drive_writes_per_day": None,
        "rated_life_years": None,
    }
    per_day = bytes_per_day(written, wall) if written is not None and wall else None
    if drives is not None and per_day is not None:
        w = wear(per_day, drives)
        out["drive_writes_per_day"], out["rated_life_years"] = w.drive_writes_per_day, w.rated_life_years
    return out


def total(counts: dict[str, Counted]) -> Counted | None:
    """The setup's scenarios together (`all`): sums, over the sum of their wall times."""
    if not counts:
        return None
    cs = list(counts.values())
    t = Counted(cs[0].tier, kv_bytes_per_token=cs[0].kv_bytes_per_token)
    for attr in ("kvlab_written", "kvlab_read", "external_hits", "process_written"):
        vals = [getattr(c, attr) for c in cs]
        setattr(t, attr, None if None in vals else sum(vals))
    t.segments = sum(c.segments for c in cs)
    t.first_t, t.last_t = 0.0, sum(c.wall_s or 0.0 for c in cs)
    for c in cs:
        for d, v in c.drive_written.items():
            t.drive_written[d] = t.drive_written.get(d, 0.0) + v
    return t


def drives_record(drives: Drives | None) -> dict[str, Any] | None:
    """The campaign's drive declaration as a record (kind `drives`), once per run."""
    if drives is None:
        return None
    return {
        "kind": "drives",
        "model": drives.model,
        "count": drives.count,
        "capacity_tb": drives.capacity_tb,
        "dwpd": drives.dwpd,
        "tbw": drives.tbw,
        "warranty_years": drives.warranty_years,
    }


def drives_of(records: list[dict[str, Any]]) -> Drives | None:
    rec = next((r for r in records if r.get("kind") == "drives"), None)
    if rec is None:
        return None
    return Drives(
        count=rec["count"],
        capacity_tb=rec["capacity_tb"],
        dwpd=rec.get("dwpd"),
        tbw=rec.get("tbw"),
        warranty_years=rec.get("warranty_years", 5.0),
        model=rec.get("model"),
    )
