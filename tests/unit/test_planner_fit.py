"""The calibration's fit on synthetic records made from known constants recovers them, and
predicts lengths it never saw; intervals come from the residuals."""

from __future__ import annotations

import random

import pytest

from kvlab.planner import presets
from kvlab.planner.calibrate import calibrate_records, cells
from kvlab.planner.recompute import PrefillCurve

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
