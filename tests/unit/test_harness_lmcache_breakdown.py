"""LMCache MP restore phases: from scrapes and server log lines (taken from a real restore of
8192 tokens on the CPU engine) to the record, the summary and the report's breakdown table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvlab.engines.local import parse_prometheus
from kvlab.harness import metrics, results
from kvlab.harness.report import render_run
from kvlab.harness.summary import lmcache_breakdown, summarize, validate


def engine_text(n: int, lookup: float, ttft: float, queue: float, prefill: float) -> str:
    """vLLM's /metrics lines the breakdown reads, after n requests (values from the real scrapes)."""
    lines = ["# HELP vllm:lmcache_mp_lookup_duration_seconds LMCache MP lookup latency observed by vLLM.",
             "# TYPE vllm:lmcache_mp_lookup_duration_seconds histogram",
             f'vllm:lmcache_mp_lookup_duration_seconds_bucket{{engine="0",le="0.025",model_name="tiny"}} {n}.0']
    for name, total in (("lmcache_mp_lookup_duration_seconds", lookup), ("time_to_first_token_seconds", ttft),
                        ("request_queue_time_seconds", queue), ("request_prefill_time_seconds", prefill)):
        lines += [f'vllm:{name}_count{{engine="0",model_name="tiny"}} {n}.0',
                  f'vllm:{name}_sum{{engine="0",model_name="tiny"}} {total}']
    return "\n".join(lines) + "\n"


# After the compute (one request), then after the warm restore (two).
ENGINE_BEFORE = engine_text(1, 0.024762880999332992, 18.69192147254944, 0.02720585499992012, 18.56912206599918)
ENGINE_AFTER = engine_text(2, 0.04407634999915899, 22.764456748962402, 3.9160116790008033, 18.740139941999587)
M = 'cache_salt="",model_name="/models/tiny"'
SERVER_BEFORE = f"""\
lmcache_mp_lookup_requested_tokens_total{{{M}}} 8192.0
lmcache_mp_lookup_hit_tokens_total{{{M}}} 0.0
lmcache_mp_lookup_hit_l1_tokens_total{{{M}}} 0.0
lmcache_mp_lookup_hit_l2_tokens_total{{{M}}} 0.0
"""
SERVER_AFTER = SERVER_BEFORE.replace("8192.0", "16384.0").replace("hit_tokens_total{" + M + "} 0.0",
                                                                  "hit_tokens_total{" + M + "} 8192.0") \
    .replace("hit_l1_tokens_total{" + M + "} 0.0", "hit_l1_tokens_total{" + M + "} 8192.0")
# The cache server's own lines (ANSI colour codes as it writes them), and one of another kind.
LOG = (
    "\x1b[32;20m[2026-11-29 14:04:34,610] LMCache INFO:\x1b[0m Stored 2048 tokens in 0.427 seconds\n"
    "\x1b[32;20m[2026-11-29 14:04:40,406] LMCache INFO:\x1b[0m Prefetch request completed (L1+L2): 32/32 "
    "retained keys (32 L1, 0 L2) in 8.8 ms (external_request_id=cmpl-8e79-0-9a4b, prefetch_request_id=1) "
    "\x1b[3m(storage_manager.py:651:lmcache.v1.distributed.storage_manager)\x1b[0m\n"
    "\x1b[32;20m[2026-11-29 14:04:44,226] LMCache INFO:\x1b[0m Retrieved 8192 tokens in 2.273 seconds "
    "\x1b[3m(engine_driven_transfer.py:514:lmcache.v1.multiprocess.modules.engine_driven_transfer)\x1b[0m\n"
    'INFO:     127.0.0.1:34094 - "GET /metrics HTTP/1.1" 200 OK\n'
)


def test_histogram_delta_is_the_sum_and_count_gained() -> None:
    before, after = parse_prometheus(ENGINE_BEFORE), parse_prometheus(ENGINE_AFTER)
    s, n = metrics.histogram_delta(after, before, metrics.LOOKUP_HISTOGRAM)  # type: ignore[misc]
    assert n == 1 and s == pytest.approx(0.0193134690)
    assert metrics.histogram_delta(after, before, "vllm:absent_seconds") is None


def test_server_log_sums_retrieves_and_prefetches() -> None:
    log = metrics.parse_server_log(LOG + LOG.replace("2.273", "0.5").replace("32 L1, 0 L2", "0 L1, 32 L2"))
    assert (log.retrieves, log.retrieved_tokens, log.retrieve_s) == (2, 16384, pytest.approx(2.773))
    assert (log.prefetches, log.prefetch_l1_keys, log.prefetch_l2_keys) == (2, 32, 32)
    assert log.prefetch_s == pytest.approx(0.0176)
    assert metrics.parse_server_log("Stored 2048 tokens in 0.4 seconds\n").retrieves == 0


def test_breakdown_of_a_real_warm_restore() -> None:
    b = metrics.lmcache_breakdown(4.096, parse_prometheus(ENGINE_AFTER), parse_prometheus(ENGINE_BEFORE),
                                  parse_prometheus(SERVER_AFTER), parse_prometheus(SERVER_BEFORE),
                                  metrics.parse_server_log(LOG))
    assert b["lookup_s"] == pytest.approx(0.01931, abs=1e-5) and b["lookups"] == 1
    assert b["engine_ttft_s"] == pytest.approx(4.0725, abs=1e-4)
    assert b["engine_queue_s"] == pytest.approx(3.8888, abs=1e-4)
    assert b["engine_prefill_s"] == pytest.approx(0.1710, abs=1e-4)
    assert (b["retrieve_s"], b["retrieved_tokens"], b["retrieves"]) == (2.273, 8192, 1)
    assert (b["server_prefetch_s"], b["prefetch_l1_keys"], b["prefetch_l2_keys"]) == (pytest.approx(0.0088), 32, 0)
    assert (b["server_lookup_requested_tokens"], b["server_lookup_hit_tokens"]) == (8192, 8192)
    assert (b["server_lookup_hit_l1_tokens"], b["server_lookup_hit_l2_tokens"]) == (8192, 0)
    # 4.096 - 0.0193 - 2.273 - 0.1710
    assert b["rest_s"] == pytest.approx(1.6327, abs=1e-4)


def test_l2_counters_and_load_rate_after_a_restart() -> None:
    before = 'lmcache_mp_l2_prefetch_load_completed_chunks_total 0.0\n'
    after = ('lmcache_mp_l2_prefetch_load_completed_chunks_total 32.0\n'
             'lmcache_mp_l2_load_throughput_GB_per_second_count{l2_name="plugin"} 1.0\n'
             'lmcache_mp_l2_load_throughput_GB_per_second_sum{l2_name="plugin"} 0.06261062277764658\n')
    b = metrics.lmcache_breakdown(8.9, {}, {}, parse_prometheus(after), parse_prometheus(before), None)
    assert b["server_l2_load_chunks"] == 32 and b["server_l2_load_gb_s"] == pytest.approx(0.0626, abs=1e-4)
    assert "server_l1_read_chunks" not in b and b["lookup_s"] is None


def test_a_restore_without_server_log_lines_has_no_retrieve_time_rather_than_zero() -> None:
    b = metrics.lmcache_breakdown(4.096, parse_prometheus(ENGINE_AFTER), parse_prometheus(ENGINE_BEFORE), {}, {},
                                  metrics.parse_server_log("Stored 2048 tokens in 0.427 seconds\n"))
    assert (b["retrieves"], b["retrieve_s"], b["retrieved_tokens"], b["server_prefetch_s"]) == (0, None, None, None)
    assert b["rest_s"] is None


def test_breakdown_without_a_cache_server_log_or_metrics_leaves_those_phases_out() -> None:
    b = metrics.lmcache_breakdown(1.0, parse_prometheus(ENGINE_AFTER), parse_prometheus(ENGINE_BEFORE), {}, {}, None)
    assert "retrieve_s" not in b and "server_lookup_hit_tokens" not in b and b["rest_s"] is None
    assert b["lookup_s"] == pytest.approx(0.01931, abs=1e-5)


@pytest.mark.parametrize(("lookup", "retrieve", "queue", "prefill", "expected"), [
    (0.02, 2.0, 3.0, 0.2, 4.0 - 2.22),
    (0.02, 2.0, 1.0, 0.2, None),  # the load did not fit in the WAITING phase: phases overlap
    (None, 2.0, 3.0, 0.2, None),
    (0.02, None, 3.0, 0.2, None),
])
def test_rest_only_where_the_phases_are_disjoint(lookup: float | None, retrieve: float | None, queue: float,
                                                 prefill: float, expected: float | None) -> None:
    rest = metrics.lmcache_rest(4.0, lookup, retrieve, queue, prefill)
    assert rest == (None if expected is None else pytest.approx(expected))


def restore(phase: str, ttft: float, lm: dict | None, setup: str = "lmcache-mp", repeat: int = 0) -> dict:
    rec = {"kind": "request", "setup": setup, "scenario": "restore", "phase": phase, "repeat": repeat,
           "ttft_s": ttft, "total_s": ttft + 0.1, "prompt_tokens": 8194, "output_tokens": 4,
           "cached_tokens": 8192 if lm and lm.get("retrieved_tokens") else 0, "max_gap_s": 0.01}
    return rec | ({"lmcache": lm} if lm is not None else {})


def phases(retrieve: float, tokens: int = 8192, rest: float | None = 1.0) -> dict:
    return {"lookup_s": 0.02, "server_prefetch_s": 0.005, "retrieve_s": retrieve, "retrieved_tokens": tokens,
            "engine_queue_s": retrieve + 1.0, "engine_prefill_s": 0.2, "rest_s": rest}


def test_summary_medians_of_hits_and_misses_apart() -> None:
    warm = [restore("warm", t, phases(r), repeat=i) for i, (t, r) in enumerate(((3.0, 1.5), (4.0, 2.5), (2.0, 1.0)))]
    b = lmcache_breakdown(warm + [restore("warm", 9.0, phases(0.0, tokens=0), repeat=3)])
    assert b is not None
    assert (b.samples, b.misses, b.ttft_s, b.retrieve_s, b.retrieved_tokens) == (3, 1, 3.0, 1.5, 8192)
    assert (b.lookup_s, b.engine_prefill_s, b.engine_queue_s, b.rest_s) == (0.02, 0.2, 2.5, 1.0)
    # a record without the field (older runs, other setups) gives no breakdown
    assert lmcache_breakdown([restore("warm", 1.0, None)]) is None


def test_summary_of_an_old_record_format_still_validates() -> None:
    s = summarize([restore("warm", 1.0, None, setup="kvlab")], ["kvlab"])
    assert s.setups["kvlab"].lmcache_warm_restore is None and s.setups["kvlab"].warm_restore_ttft_s == 1.0


def test_summary_after_restart_of_a_setup_that_recomputes() -> None:
    recs = [restore("warm", 3.0, phases(2.0)), restore("restart", 9.0, phases(0.0, tokens=0, rest=None))]
    s = summarize(recs, ["lmcache-mp"]).setups["lmcache-mp"]
    assert s.lmcache_warm_restore and s.lmcache_warm_restore.samples == 1
    r = s.lmcache_restart_restore
    assert r and (r.samples, r.misses, r.ttft_s, r.retrieve_s) == (0, 1, None, None)


def test_report_shows_the_breakdown_beside_the_restore_table_and_the_ratio(tmp_path: Path) -> None:
    w = results.RunWriter(tmp_path / "runs", "r1")
    w.write_once(results.CAMPAIGN, yaml.safe_dump({"name": "t", "setups": ["kvlab", "lmcache-mp"],
                                                   "scenarios": {"restore": {"tokens": 8192}}}))
    for setup, ttft in (("kvlab", 0.5), ("lmcache-mp", 4.0)):
        w.append(restore("compute", 19.0, None, setup=setup))
        w.append(restore("warm", ttft, phases(2.25) if setup == "lmcache-mp" else None, setup=setup))
    w.append(restore("restart", 19.0, phases(0.0, tokens=0, rest=None)))
    w.close()
    _, md = render_run(tmp_path / "runs" / "r1")
    text = md.read_text()
    assert text.index("## Restore") < text.index("### LMCache restore breakdown") < text.index("## Sweep")
    assert "| lmcache-mp | warm | 4.000 | 0.020 | 0.005 | 2.250 | 8192 | 3.250 | 0.200 | 1.000 | 1 · 0 |" in text
    assert "| lmcache-mp | after restart | — | — | — | — | — | — | — | — | 0 · 1 |" in text
    assert "| kvlab | warm" not in text  # kvlab has no LMCache phases
    assert "kvlab ÷ lmcache-mp, warm restore TTFT: 0.500 ÷ 4.000 = 0.12" in text
    assert "transfer to the engine" in text and "injection" in text and "times them apart" in text
    validate(json.loads((md.parent / "summary.json").read_text()))


def test_report_without_lmcache_records_has_no_breakdown(tmp_path: Path) -> None:
    w = results.RunWriter(tmp_path / "runs", "r1")
    w.write_once(results.CAMPAIGN, yaml.safe_dump({"name": "t", "scenarios": {"restore": {"tokens": 8192}}}))
    w.append(restore("warm", 0.5, None, setup="kvlab"))
    w.close()
    _, md = render_run(tmp_path / "runs" / "r1")
    assert "LMCache restore breakdown" not in md.read_text()
