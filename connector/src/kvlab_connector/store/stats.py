"""What one process's store did: counters and a bounded latency sample."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    io_latency_s: list[float] = field(default_factory=list)

    def note_latency(self, s: float) -> None:
        # A bounded sample keeps the histogram's memory constant.
        if len(self.io_latency_s) < 100_000:
            self.io_latency_s.append(s)
