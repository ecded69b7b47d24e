"""Each counter's name is declared once (kvlab_connector/counters.py) and read by every
exporter: the worker's counters() and stats(), vLLM's connector stats and Prometheus. The
worker counted Prometheus' `load_errors` under the one name and reported `load_error_blocks`
under the other; `missing`, `evicted_bytes` and `writes_aborted` were counted, never exported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvlab_connector.counters import BY_NAME, COUNTERS, WORKER_REPORTED

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
    names = [c.name for c in COUNTERS]
    assert len(names) == len(set(names))
    prom = [c.prometheus for c in COUNTERS if c.prometheus]
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

    from kvlab_connector.store_stats import StoreStats

    fields = {f.name for f in dataclasses.fields(StoreStats)}
    assert {c.name for c in COUNTERS if c.source == "store"} <= fields


def test_the_worker_and_vllms_stats_report_every_declared_counter(tmp_path: Path) -> None:
    from test_worker import worker

    from kvlab_connector.vllm_stats import COUNTERS as VLLM_COUNTERS
    from kvlab_connector.vllm_stats import KvlabStats, delta

    w, _ = worker(tmp_path)
    try:
        assert tuple(w.counters()) == WORKER_REPORTED == tuple(VLLM_COUNTERS)
        assert set(WORKER_REPORTED) <= set(w.stats())
        assert {"missing", "evicted_bytes", "writes_aborted", "load_error_blocks"} <= set(WORKER_REPORTED)
        w.store.stats.missing = 3
        stats = KvlabStats(data=delta(w.counters(), {}))
        assert stats.reduce()["missing"] == 3
    finally:
        w.store.close()
