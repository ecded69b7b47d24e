"""Prometheus metrics of the connector, one registry per process.

Served on `metrics_port` (scheduler and rank-0 worker share a process on a single-GPU or
CPU engine; other ranks add their rank to the port). Without prometheus-client the
counters still exist in the store's stats and in vLLM's connector stats.
"""

from __future__ import annotations

import threading
from typing import Any

from kvlab_connector.counters import COUNTERS, PER_DRIVE

READ_REQUEST_BUCKETS = tuple(float(1 << k) for k in range(12, 29))  # 4 KiB .. 256 MiB
_lock = threading.Lock()
_metrics: dict[str, Any] | None = None
_served_ports: set[int] = set()


def metrics() -> dict[str, Any] | None:
    global _metrics
    if _metrics is not None:  # every I/O lands here: no lock once the registry exists
        return _metrics
    with _lock:
        if _metrics is not None:
            return _metrics
        try:
            from prometheus_client import Counter, Gauge, Histogram
        except ImportError:
            return None
        # Built whole, then published: the I/O threads read _metrics without the lock.
        registry = {c.name: Counter(c.prometheus, c.help) for c in COUNTERS if c.prometheus}
        registry |= {c.name: Counter(c.prometheus, c.help, ["drive"]) for c in PER_DRIVE if c.prometheus}
        registry |= {
            "io_latency": Histogram(
                "kvlab_io_latency_seconds", "latency of one section's I/O",
                buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
            ),
            # One read request's bytes (a run of adjacent sections, one preadv; one section
            # through GDS): powers of two, so that "the median request is >= 1 MiB" is exact.
            "read_request_bytes": Histogram(
                "kvlab_read_request_bytes", "bytes of one read request to the drives",
                buckets=READ_REQUEST_BUCKETS,
            ),
            "io_mode": Gauge("kvlab_io_mode_info", "I/O mode in use", ["mode"]),
            "ring_in_use": Gauge("kvlab_ring_slots_in_use", "staging ring slots in use"),
        }
        _metrics = registry
        return _metrics


def serve(port: int) -> None:
    if metrics() is None:
        return
    with _lock:
        if port in _served_ports:
            return
        from prometheus_client import start_http_server

        start_http_server(port, addr="127.0.0.1")
        _served_ports.add(port)


def inc(name: str, value: float = 1) -> None:
    m = metrics()
    if m is not None and value:
        m[name].inc(value)


def observe_io(seconds: float, read_bytes: int = 0, written_bytes: int = 0, drive: str | None = None) -> None:
    """One I/O request over; `drive` (its path) counts written bytes against that drive."""
    m = metrics()
    if m is None:
        return
    m["io_latency"].observe(seconds)
    if read_bytes:
        m["bytes_read"].inc(read_bytes)
        m["read_request_bytes"].observe(read_bytes)
    if written_bytes:
        m["bytes_written"].inc(written_bytes)
        if drive is not None:
            m["drive_bytes_written"].labels(drive=drive).inc(written_bytes)
