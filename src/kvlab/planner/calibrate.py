"""Calibration on a run: fit the planner's free constants on the run's records, predict per
setup and length.

Physical inputs come from the run, never from the fit: the model's geometry (provenance),
the drive's fio limit on the stores' filesystem (a `drive_limit` record), a CPU node's LLC and
its read rates (a `cache_limit` record: the prefill's KV reads beyond the LLC, recompute.py).
Free constants:
- the prefill curve (fixed cost, per-token cost, effective FLOP/s) on the recompute
  setup's requests (no cache: baseline) and the restore scenario's recompute reference;
- per setup and tier (the sweep's hits; the restore's warm and restart restores): a fixed
  cost and an effective transfer rate (GB/s of restored KV), with the tail past the
  restored prefix computed on the prefill curve.
Each fit weighs points by 1/t^2 (relative error: a 100-token point counts as much as a
100K one) on the per-length means of the averaged rounds, as the summary measures them;
intervals come from every request's residual.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvlab.planner.fit import nnls, relative_interval
from kvlab.planner.geometry import Geometry
from kvlab.planner.presets import tiny_geometry
from kvlab.planner.recompute import CacheLimit, PrefillCurve
from kvlab.planner.restore import overlap


class CalibrationError(ValueError):
    """A run the planner cannot calibrate on; the message says what is missing."""


@dataclass(frozen=True)
class Point:
    setup: str
    tier: str  # sweep | warm | restart | recompute
    tokens: int
    cached: int
    ttft_s: float
    t_start: float | None = None
    t_end: float | None = None


@dataclass
class TierFit:
    setup: str
    tier: str
    fixed_s: float
    gbps: float | None  # effective GB/s of restored KV (None: no restored bytes to fit on)
    granule: int  # the restored prefix: a multiple of this many tokens
    lag: int  # ... at most tokens - lag
    points: int
    interval: tuple[float, float] | None = None  # relative, 5-95% of the requests' residuals
    miss_s: float = 0.0  # what a request the tier cannot serve costs beyond its recompute (lookup)

    def cached(self, n: int) -> int:
        return max(0, (n - self.lag) // self.granule * self.granule) if self.granule else 0


@dataclass
class Calibration:
    run: str
    geometry: Geometry
    kv_bytes_per_token: int
    drive_read_gbps: float | None
    prefill: PrefillCurve
    prefill_interval: tuple[float, float] | None
    prefill_points: int
    recompute_setups: list[str]
    tiers: dict[tuple[str, str], TierFit] = field(default_factory=dict)
    measured: dict[tuple[str, str, int], float] = field(default_factory=dict)  # (setup, tier, n) -> mean TTFT
    # (setup, tier, n) -> the share of its requests' time a runnable task waited for a CPU (PSI)
    pressure: dict[tuple[str, str, int], float] = field(default_factory=dict)

    def predict(self, setup: str, tier: str, n: int) -> tuple[float, float | None, TierFit | None]:
        """Predicted TTFT, the restored share (None: a recompute) and the fit used."""
        fit = self.tiers.get((setup, tier))
        g, kvb = self.geometry, self.kv_bytes_per_token
        if fit is None or fit.cached(n) == 0:
            return self.prefill.time(g, n) + (fit.miss_s if fit else 0.0), None, fit
        c = fit.cached(n)
        tail = self.prefill.compute_s(g, n, c)
        transfer = c * kvb / (fit.gbps * 1e9) if fit.gbps else 0.0  # None: no length dependence seen
        return fit.fixed_s + overlap(transfer, tail, g.layers), c / n, fit

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "model": self.geometry.name,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "drive_read_gbps": self.drive_read_gbps,
            "prefill": {
                **self.prefill.to_dict(),
                "points": self.prefill_points,
                "setups": self.recompute_setups,
                "interval": self.prefill_interval,
            },
            "tiers": [
                {
                    "miss_s": f.miss_s,
                    "setup": f.setup,
                    "tier": f.tier,
                    "fixed_s": f.fixed_s,
                    "effective_gbps": f.gbps,
                    "granule_tokens": f.granule,
                    "points": f.points,
                    "interval": f.interval,
                }
                for f in self.tiers.values()
            ],
        }


def geometry_of(prov: dict[str, Any]) -> Geometry:
    """The run's model geometry from its provenance: the tiny model's fields (a run before they
    were recorded: the default tiny model's), or the model folder's config.json on this host."""
    from kvlab.model import TinyGeometry

    m = prov.get("model") or {}
    run_id = prov.get("run_id", "run")
    if m.get("kind") == "tiny":
        return tiny_geometry(f"tiny (run {run_id})", TinyGeometry(**(m.get("geometry") or {})))
    from kvlab.planner.modelconfig import from_config

    cfg = Path(m.get("path", "")) / "config.json"
    if cfg.is_file():
        return from_config(json.loads(cfg.read_text()), name=cfg.parent.name)
    raise CalibrationError(
        f"run {run_id}: its provenance names no model geometry and its model's config.json ({cfg}) is not on "
        "this host: calibrate where the model folder is"
    )


def _avg_rounds(run: Path) -> tuple[int, int] | None:
    try:
        c = yaml.safe_load((run / "campaign.yml").read_text()) or {}
        r = ((c.get("scenarios") or {}).get("sweep") or {}).get("average_rounds")
        return (int(r[0]), int(r[1])) if r else (2, 9)
    except (OSError, yaml.YAMLError):
        return None


def points(records: list[dict[str, Any]], avg: tuple[int, int] | None) -> list[Point]:
    out = []
    for r in records:
        if r.get("kind") != "request" or "error" in r or r.get("ttft_s") is None:
            continue
        n = int(r.get("prompt_tokens") or r.get("length") or r.get("tokens") or 0)
        if r.get("scenario") == "sweep":
            if avg and not avg[0] <= r.get("round", 0) <= avg[1]:
                continue
            tier = "sweep"
        elif r.get("scenario") == "restore" and r.get("phase") in ("warm", "restart", "recompute"):
            tier = r["phase"]
        else:
            continue
        cached = int(r.get("cached_tokens") or 0)
        out.append(Point(r["setup"], tier, n, cached, float(r["ttft_s"]), r.get("t_start"), r.get("t_end")))
    return out


CONTENDED = 0.25  # a cell whose requests saw runnable tasks wait for a CPU a quarter of the time


def cpu_pressure(records: list[dict[str, Any]], ps: list[Point]) -> float | None:
    """The share of the points' time during which a runnable task waited for a CPU: the growth
    of the kernel's CPU pressure (the memory samples' `cpu_pressure_some_us`) between the samples
    around each request, summed over the points; None where the run recorded none. A quiet host
    shows little; other work on the engine's cores shows as much as it delayed."""
    samples = sorted(
        (float(r["t"]), int(r["cpu_pressure_some_us"]))
        for r in records
        if r.get("kind") == "memory" and r.get("cpu_pressure_some_us") is not None and r.get("t")
    )
    ts = [t for t, _ in samples]
    waited = span = 0.0
    for p in ps:
        if p.t_start is None or p.t_end is None:
            continue
        i, j = bisect_right(ts, p.t_start) - 1, bisect_left(ts, p.t_end)
        if i < 0 or j >= len(ts) or ts[j] <= ts[i]:
            continue
        waited += (samples[j][1] - samples[i][1]) / 1e6
        span += ts[j] - ts[i]
    return waited / span if span else None


def _means(ps: list[Point]) -> list[tuple[int, int, float, list[float]]]:
    """Per length: tokens, the median restored prefix, the TTFT as the summary takes it (the
    sweep's mean of its rounds, the restore's median), every TTFT."""
    by: dict[int, list[Point]] = defaultdict(list)
    for p in ps:
        by[p.tokens].append(p)
    out = []
    for n in sorted(by):
        cs = sorted(p.cached for p in by[n])
        ts = [p.ttft_s for p in by[n]]
        if by[n][0].tier == "sweep":
            t = sum(ts) / len(ts)
        else:
            o = sorted(ts)
            t = (o[(len(o) - 1) // 2] + o[len(o) // 2]) / 2
        out.append((n, cs[len(cs) // 2], t, ts))
    return out


def cache_limit_of(records: list[dict[str, Any]]) -> CacheLimit | None:
    """The run's measured caches (None: no `cache_limit` record, or one that could not measure)."""
    r = next((r for r in records if r.get("kind") == "cache_limit"), None)
    if not r or r.get("error") or not r.get("llc_gbps") or not r.get("dram_gbps"):
        return None
    return CacheLimit(
        int(r.get("effective_llc_bytes") or r["llc_bytes"]),
        float(r["llc_gbps"]),
        float(r["dram_gbps"]),
        int(r.get("l2_bytes") or 1 << 20),
    )


def fit_prefill(
    g: Geometry, ps: list[Point], source: str, memory: CacheLimit | None = None
) -> tuple[PrefillCurve, tuple[float, float] | None]:
    """Fixed, per-token and FLOP/s on the recompute points; the DRAM reads beyond the LLC are
    physics (measured rates), taken off each point before the fit, never fitted."""
    means = _means(ps)
    if not means:
        raise CalibrationError(
            f"{source}: no recompute to fit the prefill on (a setup without a cache, "
            "e.g. baseline, in the sweep or the restore's recompute reference)"
        )
    rows = [[1.0, float(n), g.prefill_flops(n)] for n, _, _, _ in means]
    mem = memory.memory_s if memory else (lambda g, n, start=0: 0.0)
    y = [t - mem(g, n) for n, _, t, _ in means]
    fixed, per_token, inv_rate = nnls(rows, y, [1 / t**2 for *_, t, _ in means])
    # no attention measured (too few lengths): every second of work is per-token
    curve = PrefillCurve(
        1 / inv_rate if inv_rate > 0 else math.inf, per_token, fixed, f"fitted on {source}", memory
    )
    pred = [curve.time(g, p.tokens) for p in ps]
    return curve, relative_interval(pred, [p.ttft_s for p in ps])


def _granule(ps: list[Point]) -> tuple[int, int]:
    cached = [p.cached for p in ps if p.cached > 0]
    if not cached:
        return 0, 0
    gran = 0
    for c in cached:
        gran = math.gcd(gran, c)
    for lag in range(1, gran + 1):
        if all(p.cached == max(0, (p.tokens - lag) // gran * gran) for p in ps if p.cached > 0):
            return gran, lag
    return gran, 1


def fit_tier(cal: Calibration, setup: str, tier: str, ps: list[Point]) -> TierFit:
    gran, lag = _granule(ps)
    hits = [p for p in ps if p.cached > 0]
    g, kvb = cal.geometry, cal.kv_bytes_per_token
    over = sorted(p.ttft_s - cal.prefill.time(g, p.tokens) for p in ps if p.cached == 0)
    miss = max(0.0, over[len(over) // 2]) if over else 0.0
    if not hits:
        fit = TierFit(setup, tier, 0.0, None, 0, 0, len(ps), miss_s=miss)
        cal.tiers[(setup, tier)] = fit
        return fit
    means = _means(hits)
    # t = fixed + overlap(restored bytes / rate, tail), the tail's compute from the prefill
    # curve; the overlap's share beyond the transfer depends on the rate: iterate to a fixed point
    rows = [[1.0, c * kvb] for n, c, _, _ in means]
    tails = [cal.prefill.compute_s(g, n, c) for n, c, _, _ in means]
    fixed, inv = 0.0, 0.0
    for _ in range(50):
        extra = [
            overlap(c * kvb * inv, tail, g.layers) - c * kvb * inv if inv else tail
            for (_, c, _, _), tail in zip(means, tails, strict=True)
        ]
        y = [t - e for (*_, t, _), e in zip(means, extra, strict=True)]
        new = nnls(rows, y, [1 / t**2 for *_, t, _ in means])
        if new == [fixed, inv]:
            break
        fixed, inv = new
    fit = TierFit(setup, tier, fixed, 1 / (inv * 1e9) if inv > 0 else None, gran, lag, len(hits), miss_s=miss)
    cal.tiers[(setup, tier)] = fit
    pred = [cal.predict(setup, tier, p.tokens)[0] for p in hits]
    fit.interval = relative_interval(pred, [p.ttft_s for p in hits])
    return fit


def calibrate_records(
    records: list[dict[str, Any]], g: Geometry, run: str, avg: tuple[int, int] | None = (2, 9)
) -> Calibration:
    ps = points(records, avg)
    by_setup: dict[str, list[Point]] = defaultdict(list)
    for p in ps:
        by_setup[p.setup].append(p)
    recompute = sorted(s for s, xs in by_setup.items() if all(p.cached == 0 for p in xs))
    pre = [p for p in ps if p.setup in recompute or p.tier == "recompute"]
    if not pre:  # no setup without a cache: every full compute the run timed, first rounds too
        pre = [p for p in points(records, None) if p.cached == 0]
    curve, interval = fit_prefill(g, pre, run, cache_limit_of(records))
    drive = next((r.get("read_gbps") for r in records if r.get("kind") == "drive_limit"), None)
    cal = Calibration(run, g, g.kv_bytes_per_token(), drive, curve, interval, len(pre), recompute)
    groups: dict[tuple[str, str], list[Point]] = defaultdict(list)
    for p in ps:
        if p.setup not in recompute and p.tier != "recompute":
            groups[(p.setup, p.tier)].append(p)
    for (setup, tier), xs in groups.items():
        fit_tier(cal, setup, tier, xs)
    for (setup, tier), xs in [*groups.items(), *((("recompute", "recompute"), pre),)]:
        for n, _, t, _ in _means(xs):
            cal.measured[(setup, tier, n)] = t
    for s in recompute:
        for n, _, t, _ in _means(by_setup[s]):
            cal.measured[(s, "sweep", n)] = t
    cells_points: dict[tuple[str, str, int], list[Point]] = defaultdict(list)
    for p in ps:
        cells_points[(p.setup, "sweep" if p.setup in recompute else p.tier, p.tokens)].append(p)
    for key, xs in cells_points.items():
        share = cpu_pressure(records, xs)
        if share is not None:
            cal.pressure[key] = share
    return cal


def calibrate(run: Path) -> Calibration:
    from kvlab.harness.results import read_records

    run = Path(run)
    if not (run / "records.jsonl").is_file():
        raise CalibrationError(f"{run}: no records.jsonl: give a run folder (results/runs/<id>)")
    try:
        prov = json.loads((run / "provenance.json").read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{run}: no readable provenance.json ({e})") from None
    return calibrate_records(read_records(run), geometry_of(prov), str(run), _avg_rounds(run))


def cells(cal: Calibration, tokens: list[int] | None) -> list[dict[str, Any]]:
    """Per setup and length: predicted TTFT, and where the run measured that cell, the measured
    mean and the error (predicted / measured - 1). Lengths: the given ones, else the run's."""
    out = []
    setups = sorted({s for s, _ in cal.tiers} | set(cal.recompute_setups))
    for setup in setups:
        tiers = [t for s, t in cal.tiers if s == setup] or ["sweep"]
        for tier in tiers:
            lengths = tokens or sorted(n for s, t, n in cal.measured if s == setup and t == tier)
            for n in lengths:
                p, share, fit = cal.predict(setup, tier, n)
                cell: dict[str, Any] = {
                    "setup": setup,
                    "tier": tier,
                    "tokens": n,
                    "predicted_ttft_s": p,
                    "restored_share": share,
                }
                iv = fit.interval if fit and share else cal.prefill_interval
                if iv:
                    cell["interval_s"] = [p * (1 + iv[0]), p * (1 + iv[1])]
                m = cal.measured.get((setup, tier, n))
                if m is not None:
                    cell["measured_ttft_s"] = m
                    cell["error"] = p / m - 1
                    if (setup, tier, n) in cal.pressure:
                        cell["cpu_pressure"] = cal.pressure[(setup, tier, n)]
                out.append(cell)
    return out
