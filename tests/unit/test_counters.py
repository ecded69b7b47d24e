"""Each counter's name is declared once (kvlab_connector/counters.py) and read by every
exporter: the worker's counters() and stats(), vLLM's connector stats and Prometheus. The
worker counted Prometheus' `load_errors` under the one name and reported `load_error_blocks`
under the other; `missing`, `evicted_bytes` and `writes_aborted` were counted, never exported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab_connector.counters import BY_NAME, COUNTERS, PER_DRIVE, WORKER_REPORTED

SRC = Path(__file__).resolve().parents[2] / "connector" / "src" / "kvlab_connector"


def incremented_names() -> list[tuple[str, str]]:
    """(file, name) of every metrics.inc("name", ...) in the connector."""
    out = []
    for path in sorted(SRC.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "inc"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "metrics"
            ):
                arg = node.args[0]
                out.append((path.name, arg.value if isinstance(arg, ast.Constant) else ast.dump(arg)))
    return out


def test_each_name_is_declared_once() -> None:
    names = [c.name for c in (*COUNTERS, *PER_DRIVE)]
    assert len(names) == len(set(names))
    prom = [c.prometheus for c in (*COUNTERS, *PER_DRIVE) if c.prometheus]
    assert len(prom) == len(set(prom))


@pytest.mark.parametrize(("where", "name"), incremented_names())
def test_every_prometheus_increment_names_a_declared_counter(where: str, name: str) -> None:
    assert name in BY_NAME and BY_NAME[name].prometheus, f"{where}: metrics.inc({name!r}) declares nothing"


def test_prometheus_serves_every_declared_counter_by_its_name() -> None:
    from kvlab_connector import metrics

    m = metrics.metrics()
    assert m is not None
    for c in COUNTERS:
        if c.prometheus:
            assert m[c.name]._name == c.prometheus


def test_store_counters_are_the_stores_fields() -> None:
    import dataclasses

    from kvlab_connector.store.stats import StoreStats

    # Every counter field is declared (objects_read was a field that nothing counted or read).
    fields = {f.name for f in dataclasses.fields(StoreStats)} - {"io_latency_s"}
    assert {c.name for c in (*COUNTERS, *PER_DRIVE) if c.source == "store"} == fields


def test_bytes_written_are_counted_per_drive_in_the_stats_and_prometheus(tmp_path: Path) -> None:
    # Wear: a drive's endurance is rated in writes of its own capacity.
    from test_store import SHAPE, put

    from kvlab_connector import metrics
    from kvlab_connector.ring import StagingRing
    from kvlab_connector.store import Store

    m = metrics.metrics()
    assert m is not None
    drives = [tmp_path / "d0", tmp_path / "d1"]
    before = [m["drive_bytes_written"].labels(drive=str(d))._value.get() for d in drives]
    store = Store(drives, capacity_bytes=1 << 30)
    ring = StagingRing(8 * SHAPE.stride, SHAPE.stride)
    for i in range(3):
        assert put(store, ring, i)
    per_drive = store.stats.drive_bytes_written
    assert per_drive == [3 * SHAPE.object_bytes // 2] * 2  # four sections striped over two drives
    assert sum(per_drive) == store.stats.bytes_written
    served = [m["drive_bytes_written"].labels(drive=str(d))._value.get() - b for d, b in zip(drives, before, strict=True)]
    assert served == per_drive
    assert m["drive_bytes_written"]._name == "kvlab_drive_written_bytes"
    store.close()


def test_a_campaign_record_carries_every_counter_prometheus_serves() -> None:
    from kvlab.harness.scenarios import CONNECTOR_COUNTERS

    assert sorted(CONNECTOR_COUNTERS.values()) == sorted(c.prometheus for c in COUNTERS if c.prometheus)
    assert CONNECTOR_COUNTERS["read_bytes"] == "kvlab_read_bytes"  # the record's connector_read_bytes


def test_the_worker_reports_every_declared_counter(tmp_path: Path) -> None:
    from test_worker import worker

    w, _ = worker(tmp_path)
    try:
        assert tuple(w.counters()) == WORKER_REPORTED
        assert set(WORKER_REPORTED) <= set(w.stats())
        assert {"missing", "evicted_bytes", "writes_aborted", "load_error_blocks"} <= set(WORKER_REPORTED)
    finally:
        w.store.close()


def in_fresh_interpreter(code: str) -> None:
    """Run code that imports vLLM in a fresh interpreter: vLLM's import of torch._dynamo fails
    in a process where Ansible (other unit tests) has patched sys.intern."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_vllms_connector_stats_carry_every_reported_counter() -> None:
    code = (
        "from kvlab_connector.counters import WORKER_REPORTED\n"
        "from kvlab_connector.vllm_stats import COUNTERS, KvlabStats, delta\n"
        "assert tuple(COUNTERS) == WORKER_REPORTED, COUNTERS\n"
        "stats = KvlabStats(data=delta({'missing': 3, 'load_error_blocks': 2}, {}))\n"
        "r = stats.reduce()\n"
        "assert r['missing'] == 3 and r['load_error_blocks'] == 2, r\n"
    )
    in_fresh_interpreter(code)


def test_an_interval_in_which_nothing_moved_is_reported_once_then_not_at_all() -> None:
    """Each report travels worker -> scheduler -> API server every step: a decode with nothing to
    save or load reported an all-zero interval at each of its steps."""
    code = (
        "from kvlab_connector.vllm_stats import Intervals\n"
        "i = Intervals()\n"
        "a = i.next({'bytes_written': 10})\n"
        "assert a['bytes_written'] == 10, a\n"
        "b = i.next({'bytes_written': 10})\n"
        "assert b is not None and not any(b.values()), b  # zeros once: vLLM no longer shows 10\n"
        "assert i.next({'bytes_written': 10}) is None and i.next({'bytes_written': 10}) is None\n"
        "c = i.next({'bytes_written': 25, 'missing': 1})\n"
        "assert (c['bytes_written'], c['missing']) == (15, 1), c\n"
        "assert not any(i.next({'bytes_written': 25, 'missing': 1}).values())\n"
    )
    in_fresh_interpreter(code)
