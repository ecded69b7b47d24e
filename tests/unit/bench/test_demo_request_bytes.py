"""`kvlab demo`'s read_request_bytes_p50: the median read request, from the connector's
kvlab_read_request_bytes histogram as Prometheus serves it."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvlab.bench.demo import REQUEST_BYTES, request_bytes_p50
from kvlab.engines.local import parse_prometheus
from kvlab_connector import metrics

MIB = 1 << 20


def served(sizes: list[int]) -> dict[str, float]:
    reg = CollectorRegistry()
    h = Histogram(REQUEST_BYTES, "bytes of one read request", buckets=metrics.READ_REQUEST_BUCKETS, registry=reg)
    for n in sizes:
        h.observe(n)
    return parse_prometheus(generate_latest(reg).decode())


def test_the_median_lies_in_its_bucket() -> None:
    est, lo, hi, n, mean = request_bytes_p50(served([4 * MIB + 4096] * 9 + [64 * 1024]))
    assert (lo, hi, n) == (4 * MIB, 8 * MIB, 10) and lo < est <= hi
    assert mean == pytest.approx((9 * (4 * MIB + 4096) + 64 * 1024) / 10)


def test_small_requests_give_a_small_median() -> None:
    est, lo, hi, _, _ = request_bytes_p50(served([128 * 1024] * 6 + [4 * MIB] * 4))
    assert hi == 128 * 1024 and est < MIB


def test_no_reads_no_median() -> None:
    assert request_bytes_p50(served([])) is None
    assert request_bytes_p50({}) is None


def test_the_connector_observes_each_read_request() -> None:
    m = metrics.metrics()
    assert m is not None
    before = m["read_request_bytes"]._sum.get()
    metrics.observe_io(0.001, read_bytes=3 * MIB)
    metrics.observe_io(0.001, written_bytes=5 * MIB)  # a write is not a read request
    assert m["read_request_bytes"]._sum.get() - before == pytest.approx(3 * MIB)
