"""What one process's store did: counters and a bounded latency sample, and the recorder
through which the store's parts count (one lock for all of them)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvlab_connector import metrics


@dataclass
class StoreStats:
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    objects_written: int = 0
    sections_failed: int = 0
    checksum_failures: int = 0
    missing: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    writes_aborted: int = 0
    out_of_space: int = 0  # times a drive was full below the capacity bound
    drive_bytes_written: list[int] = field(default_factory=list)  # per drive, in the store's order: wear
    io_latency_s: list[float] = field(default_factory=list)

    def note_latency(self, s: float) -> None:
        # A bounded sample keeps the histogram's memory constant.
        if len(self.io_latency_s) < 100_000:
            self.io_latency_s.append(s)


class Recorder:
    """The store's stats and the lock that guards them, handed to each part that counts
    (reader, writer, memory media, ledger); Prometheus gets the same counts (metrics.py)."""

    def __init__(self, drives: list[str] | None = None, lock: threading.Lock | None = None):
        self.drives = list(drives or [])  # each drive's path: the label of its wear counter
        self.stats = StoreStats(drive_bytes_written=[0] * len(self.drives))
        self.lock = lock if lock is not None else threading.Lock()

    def add(self, **counts: float) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def note_missing(self) -> None:
        self.add(missing=1)

    def checksum_matches(self, actual: int, expected: int) -> bool:
        if actual == expected:
            return True
        self.add(checksum_failures=1)
        metrics.inc("checksum_failures")
        return False

    def note_read(self, t0: float, oks: list[bool], stride: int) -> None:
        """A read request over: its sections that verified count as read bytes."""
        n_ok = sum(oks)
        with self.lock:
            dt = time.perf_counter() - t0
            self.stats.note_latency(dt)
            self.stats.bytes_read += n_ok * stride
            if n_ok == len(oks):
                self.stats.read_s += dt
            self.stats.sections_failed += len(oks) - n_ok
        metrics.observe_io(dt, read_bytes=n_ok * stride)

    def note_write(self, t0: float, nbytes: int, ok: bool, drive: int) -> None:
        """A write request to drive `drive` (its index) over: its bytes count as written,
        to the store and to that drive, if every one went out."""
        dt = time.perf_counter() - t0
        with self.lock:
            self.stats.note_latency(dt)
            if ok:
                self.stats.bytes_written += nbytes
                self.stats.write_s += dt
                self.stats.drive_bytes_written[drive] += nbytes
        metrics.observe_io(dt, written_bytes=nbytes if ok else 0, drive=self.drives[drive])
