"""The calibration's fit on synthetic records made from known constants recovers them, and
predicts lengths it never saw; intervals come from the residuals."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvlab.planner import presets
from kvlab.planner.calibrate import calibrate_records, cells
from kvlab.planner.recompute import CacheLimit, PrefillCurve

G = presets.get("tiny-sweep")
TRUE_CURVE = PrefillCurve(flops_s=70e9, per_token_s=8e-6, fixed_s=0.06, source="truth")
FIXED, GBPS, GRANULE = 0.05, 0.4, 128


def restored(n: int) -> int:
    return (n - 1) // GRANULE * GRANULE


def restore_ttft(n: int) -> float:
    c = restored(n)
    transfer = c * G.kv_bytes_per_token() / (GBPS * 1e9)
    tail = TRUE_CURVE.compute_s(G, n, c)
    return FIXED + max(transfer, tail) + min(transfer, tail) / G.layers


def records(lengths: list[int], noise: float = 0.0, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out: list[dict] = [{"kind": "drive_limit", "read_gbps": 1.5}]
    for n in lengths:
        for r in range(1, 11):
            for setup in ("baseline", "kvlab"):
                hit = setup == "kvlab" and r > 1 and restored(n) > 0
                t = restore_ttft(n) if hit else TRUE_CURVE.time(G, n)
                out.append(
                    {
                        "kind": "request",
                        "scenario": "sweep",
                        "setup": setup,
                        "length": n,
                        "round": r,
                        "prompt_tokens": n,
                        "cached_tokens": restored(n) if hit else 0,
                        "ttft_s": t * (1 + rng.uniform(-noise, noise)),
                        "output_tokens": 16,
                        "total_s": t + 0.1,
                    }
                )
    return out


def test_fit_recovers_the_constants() -> None:
    cal = calibrate_records(records([100, 1000, 10000, 50000]), G, "synthetic")
    assert cal.recompute_setups == ["baseline"]
    assert cal.prefill.fixed_s == pytest.approx(TRUE_CURVE.fixed_s, rel=1e-6)
    assert cal.prefill.per_token_s == pytest.approx(TRUE_CURVE.per_token_s, rel=1e-6)
    assert cal.prefill.flops_s == pytest.approx(TRUE_CURVE.flops_s, rel=1e-6)
    fit = cal.tiers[("kvlab", "sweep")]
    assert (fit.granule, fit.lag) == (GRANULE, 1)
    assert fit.fixed_s == pytest.approx(FIXED, rel=1e-6)
    assert fit.gbps == pytest.approx(GBPS, rel=1e-6)
    assert cal.drive_read_gbps == 1.5


def test_held_out_lengths_are_predicted() -> None:
    cal = calibrate_records(records([100, 1000, 10000]), G, "synthetic")
    got = {(c["setup"], c["tokens"]): c for c in cells(cal, [50000, 100000])}
    for n in (50000, 100000):
        assert got[("baseline", n)]["predicted_ttft_s"] == pytest.approx(TRUE_CURVE.time(G, n), rel=1e-6)
        assert got[("kvlab", n)]["predicted_ttft_s"] == pytest.approx(restore_ttft(n), rel=1e-6)
        assert "measured_ttft_s" not in got[("kvlab", n)]  # the run never measured it


def test_noisy_records_give_an_interval_that_holds_the_truth() -> None:
    cal = calibrate_records(records([100, 1000, 10000, 50000], noise=0.1, seed=3), G, "synthetic")
    fit = cal.tiers[("kvlab", "sweep")]
    assert fit.gbps == pytest.approx(GBPS, rel=0.15)
    lo, hi = fit.interval
    assert -0.11 < lo < 0 < hi < 0.11
    cell = next(c for c in cells(cal, None) if c["setup"] == "kvlab" and c["tokens"] == 50000)
    assert cell["interval_s"][0] < restore_ttft(50000) < cell["interval_s"][1]
    assert abs(cell["error"]) < 0.1


def test_averaged_rounds_only() -> None:
    """Round 1 (kvlab's compute) and round 10 stay out of the fit, as out of the summary."""
    recs = records([100, 1000, 10000])
    for r in recs:
        if r.get("round") in (1, 10):
            r["ttft_s"] = 1e3
    cal = calibrate_records(recs, G, "synthetic", avg=(2, 9))
    assert cal.tiers[("kvlab", "sweep")].gbps == pytest.approx(GBPS, rel=1e-6)


# ---- a CPU node's caches: the KV reads beyond the LLC (recompute.CacheLimit) ----------------
CACHES = CacheLimit(llc_bytes=8 << 20, llc_gbps=50.0, dram_gbps=10.0, l2_bytes=1 << 20)
CPU_CURVE = dataclasses.replace(TRUE_CURVE, memory=CACHES)


def cache_record() -> dict:
    return {
        "kind": "cache_limit",
        "llc_bytes": 32 << 20,
        "effective_llc_bytes": CACHES.llc_bytes,
        "l2_bytes": CACHES.l2_bytes,
        "llc_gbps": CACHES.llc_gbps,
        "dram_gbps": CACHES.dram_gbps,
    }


def test_the_query_tile_is_vllm_cpu_attns() -> None:
    # half of 1 MiB / (32 x (4 + 2x4 + 4) + 8 x 4) B per token = 963, rounded down to 8
    assert CACHES.q_tile_tokens(G) == 960
    assert dataclasses.replace(CACHES, l2_bytes=4 << 20).q_tile_tokens(G) == 1024  # at most 128 x 8


def test_kv_reads_beyond_the_llc_cost_the_dram_rate() -> None:
    head = G.layer_bytes("fp32") // G.kv_heads  # 256 B of K+V per token per KV head
    fits = CACHES.llc_bytes // head  # 32,768 tokens
    assert CACHES.beyond_llc_bytes(G, fits - 960) == 0.0  # every prefix fits
    # 100K tokens: the tiles ending past 32,768 tokens each read their prefix from DRAM
    t, n = 960, 100_000
    want = sum(min(n, s + t) * head for s in range(0, n, t) if min(n, s + t) > fits) * G.layers * G.kv_heads
    assert CACHES.beyond_llc_bytes(G, n) == pytest.approx(want)
    assert CACHES.memory_s(G, n) == pytest.approx(want * (1 / 10 - 1 / 50) / 1e9)
    # a restore's tail: one tile over the restored prefix
    assert CACHES.beyond_llc_bytes(G, n, n - 100) == pytest.approx(n * head * G.layers * G.kv_heads)


def test_a_gpu_curve_has_no_memory_term() -> None:
    assert TRUE_CURVE.memory_s(G, 100_000) == 0.0
    assert "arithmetic only" in TRUE_CURVE.regime()
    assert CPU_CURVE.time(G, 100_000) > TRUE_CURVE.time(G, 100_000)


def cpu_records(lengths: list[int]) -> list[dict]:
    """Baseline's sweep on a CPU node whose prefill pays the DRAM reads."""
    out: list[dict] = [{"kind": "drive_limit", "read_gbps": 1.5}, cache_record()]
    for n in lengths:
        for r in range(1, 11):
            t = CPU_CURVE.time(G, n)
            out.append(
                {"kind": "request", "scenario": "sweep", "setup": "baseline", "length": n, "round": r}
                | {"prompt_tokens": n, "cached_tokens": 0, "ttft_s": t, "output_tokens": 16, "total_s": t}
            )
    return out


def test_the_fit_on_short_prompts_predicts_long_ones_with_the_memory_term() -> None:
    cal = calibrate_records(cpu_records([100, 1000, 10000, 20000]), G, "synthetic")
    assert cal.prefill.memory == CACHES
    assert cal.prefill.flops_s == pytest.approx(TRUE_CURVE.flops_s, rel=1e-6)
    assert cal.prefill.per_token_s == pytest.approx(TRUE_CURVE.per_token_s, rel=1e-6)
    got = {c["tokens"]: c["predicted_ttft_s"] for c in cells(cal, [50000, 100000])}
    for n in (50000, 100000):
        assert got[n] == pytest.approx(CPU_CURVE.time(G, n), rel=1e-6)
        assert got[n] > TRUE_CURVE.time(G, n)  # the DRAM reads are in it


def test_a_run_without_the_record_keeps_the_arithmetic_model() -> None:
    recs = [r for r in cpu_records([100, 1000, 10000]) if r["kind"] != "cache_limit"]
    cal = calibrate_records(recs, G, "synthetic")
    assert cal.prefill.memory is None
    assert cal.to_dict()["prefill"]["cache_limit"] is None


def test_a_cell_measured_under_contention_says_how_much() -> None:
    """The memory samples' CPU pressure (PSI) between the samples around each request: here a
    neighbour makes runnable tasks wait 60% of the time during baseline's 10K rounds only."""
    reqs = [r for r in records([100, 1000, 10000]) if r["kind"] == "request"]
    samples, us = [], 0
    for i, r in enumerate(reqs):  # one request a second, a sample at each second
        r["t_start"], r["t_end"] = 1000.0 + i + 0.1, 1000.0 + i + 0.1 + r["ttft_s"]
        samples.append({"kind": "memory", "setup": r["setup"], "t": 1000.0 + i, "cpu_pressure_some_us": us})
        us += int((0.6 if (r["setup"], r["length"]) == ("baseline", 10000) else 0.02) * 1e6)
    samples.append({"kind": "memory", "setup": "kvlab", "t": 1000.0 + len(reqs), "cpu_pressure_some_us": us})
    cal = calibrate_records(reqs + samples, G, "synthetic")
    got = {(c["setup"], c["tokens"]): c for c in cells(cal, None)}
    assert got[("baseline", 10000)]["cpu_pressure"] == pytest.approx(0.6)
    assert got[("baseline", 1000)]["cpu_pressure"] == pytest.approx(0.02)
    assert got[("kvlab", 10000)]["cpu_pressure"] == pytest.approx(0.02)
    # a run without the samples: no figure
    assert "cpu_pressure" not in cells(calibrate_records(records([100, 1000]), G, "synthetic"), None)[0]
