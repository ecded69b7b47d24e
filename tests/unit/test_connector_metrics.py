"""The connector's Prometheus registry is published whole, and the store's accounting can
never leave an I/O unresolved (a cache server's reads hung on both, together)."""

from __future__ import annotations

from pathlib import Path

import prometheus_client
import pytest

from kvlab_connector import metrics
from kvlab_connector.ring import StagingRing
from kvlab_connector.store import ObjectShape, Store
from kvlab_connector.store.stats import Recorder

NS = "ef" * 16
SHAPE = ObjectShape(n_sections=2, section_bytes=8192)


class _Fake:
    seen: list[object] = []

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        # What another thread's lock-free metrics() call would return right now.
        _Fake.seen.append(metrics._metrics)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return lambda *a, **k: self


def test_the_registry_is_published_only_once_it_is_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # metrics() published the counters, then added io_latency to the same dict in place: an
    # I/O thread's observe_io in between raised KeyError 'io_latency'.
    for name in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(prometheus_client, name, _Fake)
    monkeypatch.setattr(metrics, "_metrics", None)
    _Fake.seen = []
    m = metrics.metrics()
    assert m is not None and {"io_latency", "read_request_bytes", "bytes_read"} <= set(m)
    assert _Fake.seen and all(s is None for s in _Fake.seen), "a partial registry was visible while it was built"


def test_a_read_and_a_write_resolve_even_when_their_accounting_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store([str(tmp_path / "d0")], capacity_bytes=1 << 30)
    ring = StagingRing(4 * SHAPE.stride, SHAPE.stride)

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyError("io_latency")

    monkeypatch.setattr(Recorder, "note_write", broken)
    monkeypatch.setattr(Recorder, "note_read", broken)
    w = store.begin_write(NS, "01" * 16, SHAPE, num_tokens=16)
    released = []
    for s in range(SHAPE.n_sections):
        slot = ring.acquire(timeout_s=10)
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: (released.append(ok), ring.release(slot)))
    assert w.done.result(timeout=10) is True  # the bytes went out; only their counting failed
    assert released == [True, True] and ring.in_use == 0
    fds = store.open_object(NS, "01" * 16, SHAPE)
    assert fds is not None
    slot = ring.acquire(timeout_s=10)
    assert store.submit_read_section(fds, NS, "01" * 16, SHAPE, 0, ring.buffer(slot)).result(timeout=10) is True
    store.close()
