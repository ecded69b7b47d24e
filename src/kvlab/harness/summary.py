"""The summary of a run (`kvlab report RUN --summary-json`), derived from its raw records.

Schema `kvlab.summary/5`, documented in docs/results-schema.md and validated by the
pydantic models below. Times are medians (the sweep's: the mean of the chosen rounds,
as the second seed averages); every median has its sample count beside it; a value is
null where its scenario did not run for that setup.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvlab.harness import metrics
from kvlab.harness import wear as wear_count
from kvlab.harness.metrics import Turn
from kvlab.wear import Drives

SCHEMA = "kvlab.summary/5"


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SweepPoint(_M):
    ttft_s: float | None
    throughput_tok_s: float | None
    samples: int = Field(description="rounds averaged")
    ttft_improvement: float | None = Field(None, description="baseline TTFT / this setup's")
    throughput_improvement: float | None = Field(None, description="this setup's throughput / baseline's")
    rounds: int = Field(0, description="rounds averaged (as samples)")
    page_cache_dropped_rounds: int = Field(0, description="averaged rounds with the page cache dropped before them")
    cached_tokens: float | None = Field(None, description="median over the averaged rounds of vLLM's cached tokens")


class AgentsPoint(_M):
    decode_tok_s_per_agent: float | None
    returning_turn_hit_share: float | None
    returning_token_hit_share: float | None
    returning_reusable_hit_share: float | None = Field(
        None, description="tokens restored / reusable tokens rounded down to the engine's block size")
    returning_ttft_median_s: float | None
    returning_ttft_p90_s: float | None
    returning_ttft_p99_s: float | None
    frozen_answers: int | None
    wall_s: float | None
    samples: int = Field(description="returning turns sent once every agent was active (the TTFT figures' sample)")
    returning_turns: int | None = Field(None, description="every returning turn (the hit shares' sample)")
    ramp_s: float | None = Field(
        None, description="from the step's start until every agent's first turn was answered; null: sessions "
        "start at their own times (a trace), or a run from before it was recorded")
    ramp_turns: int = Field(0, description="returning turns sent before ramp_s, left out of the TTFT figures")
    answers: int
    errors: int
    external_hit_tokens: float | None = Field(None, description="vLLM's external prefix-cache hits over the step")
    working_set_tokens: int | None = Field(
        None, description="distinct prompt tokens of every agent's latest turn at the step's end (whole blocks "
        "keyed by their prefix: a shared system prompt counts once)")
    engine_cache_tokens: int | None = Field(
        None, description="what the engine's own KV cache holds: blocks × block size (num_gpu_blocks_override "
        "included)")
    working_set_over_engine_cache: float | None = Field(
        None, description="working_set_tokens / engine_cache_tokens: above 1, returning turns must come back "
        "from the tier")
    saves_dropped: float | None = Field(
        None, description="kvlab's saves dropped over the step (no ring slot in time); None: not a kvlab setup")


class LMCacheBreakdown(_M):
    """An LMCache MP setup's restores, phase by phase: medians over those that restored tokens.

    Each phase's median is taken on its own, so they need not add up to the TTFT median.
    """

    ttft_s: float | None = Field(description="client TTFT")
    lookup_s: float | None = Field(description="vLLM's lmcache_mp_lookup_duration_seconds: lookup submitted .. answered")
    server_prefetch_s: float | None = Field(
        description="cache server log: lookup to prefetch result (L1, and L2 loads), inside lookup_s")
    retrieve_s: float | None = Field(
        description="cache server log: prepare_retrieve answered .. commit_retrieve arrived "
        "(ZMQ transfer, unpickle, scatter into vLLM's paged KV, commit)")
    retrieved_tokens: float | None
    engine_queue_s: float | None = Field(description="vLLM WAITING phase (lookup, async KV load, waits)")
    engine_prefill_s: float | None = Field(description="vLLM PREFILL phase: compute of the tokens not restored")
    rest_s: float | None = Field(
        description="TTFT - lookup - retrieve - prefill: server gather + pickle, scheduler steps, HTTP")
    samples: int = Field(description="restores with an lmcache record and cached tokens")
    misses: int = Field(0, description="restores with an lmcache record and no cached token (recomputed)")


class PeakMemory(_M):
    engine: int | None
    cache_server: int | None


class MemorySource(_M):
    """Where the memory figures came from: cgroup, process_tree, or both joined by '+'."""

    engine: str | None = None
    cache_server: str | None = None


class WearPoint(_M):
    """What one scenario (or `all` of them) of a setup wrote to drives, and what that rate
    does to the campaign's declared drives."""

    tier: str = Field(description="how the tier's writes are counted: kvlab (its counters), files "
                      "(/proc/PID/io of the engine's and cache server's processes), none (no drive tier: 0)")
    written_bytes: float | None = Field(description="bytes the tier wrote to drives; null: not counted")
    restored_bytes: float | None = Field(
        description="bytes restored: kvlab's bytes read, else external prefix-cache hit tokens x KV bytes/token")
    written_over_restored: float | None = Field(description="written / restored; null where nothing was restored")
    wall_s: float | None = Field(description="the scenario's wall time, first sample to last")
    write_bytes_per_s: float | None
    drive_writes_per_day: float | None = Field(
        description="write_bytes_per_s x 86400 / the declared drives' capacity; null without drives")
    rated_life_years: float | None = Field(
        description="years the drives' rated writes last at this rate; null without drives or writes")
    drive_written_bytes: dict[str, float] | None = Field(None, description="kvlab: bytes written per drive path")
    process_written_bytes: float | None = Field(
        None, description="/proc/PID/io write_bytes - cancelled_write_bytes of the engine's and cache server's "
        "process trees, every setup (logs included)")
    segments: int = Field(0, description="open..close sample pairs counted (one more per engine restart)")


class DrivesDeclared(_M):
    """The campaign's `drives`: what the projection divides by."""

    model: str | None = None
    count: int
    capacity_tb: float
    dwpd: float | None = None
    tbw: float | None = None
    warranty_years: float
    rated_dwpd: float = Field(description="dwpd, or tbw / (capacity_tb x 365 x warranty_years)")

    def drives(self) -> Drives:
        """The drives this declares, as kvlab.wear computes with them (drives_declared's inverse)."""
        return Drives(count=self.count, capacity_tb=self.capacity_tb, dwpd=self.dwpd, tbw=self.tbw,
                      warranty_years=self.warranty_years, model=self.model)


class SetupSummary(_M):
    skipped: str | None = None
    errors: list[str] = Field(default_factory=list)
    io_mode: str | None
    recompute_ttft_s: float | None
    recompute_samples: int
    warm_restore_ttft_s: float | None
    warm_restore_samples: int
    restart_restore_ttft_s: float | None
    restart_restore_samples: int
    block_size: int | None = Field(None, description="the engine's KV block size, tokens (vLLM's cache config)")
    warm_over_recompute: float | None = Field(None, description="warm restore TTFT / the run's recompute reference")
    restart_over_recompute: float | None = Field(
        None, description="restart restore TTFT / the run's recompute reference")
    warm_restore_cached_tokens: float | None = None
    restart_restore_cached_tokens: float | None = None
    restore_read_bytes: float | None = Field(None, description="connector bytes read per restart restore (median)")
    lmcache_warm_restore: LMCacheBreakdown | None = None
    lmcache_restart_restore: LMCacheBreakdown | None = None
    sweep: dict[str, SweepPoint]
    agents: dict[str, AgentsPoint]
    peak_rss_bytes: PeakMemory
    peak_pinned_bytes: PeakMemory
    memory_samples: int
    memory_source: MemorySource | None = None
    wear: dict[str, WearPoint] = Field(
        default_factory=dict, description="per scenario (restore, sweep, agents:N) and `all`: bytes written")


class RecomputeReference(_M):
    """The recompute every setup's restores are set against: fresh prompts of the restore's
    length on one warm engine without a cache (restore.recompute_setup)."""

    setup: str
    ttft_s: float | None = Field(description="median TTFT")
    samples: int
    tokens: int | None


class PredictedFit(_M):
    setup: str
    tier: str = Field(description="sweep (its hits), warm or restart (the restore scenario's)")
    fixed_s: float = Field(description="fitted fixed cost per restore")
    effective_gbps: float | None = Field(description="fitted GB/s of restored KV (null: no length dependence)")
    granule_tokens: int = Field(description="the restored prefix is a multiple of this many tokens")
    points: int = Field(description="requests the fit saw")
    miss_s: float = Field(0.0, description="a request the tier cannot serve: its cost beyond the recompute (median)")


class PredictedCell(_M):
    setup: str
    tier: str
    tokens: int
    predicted_ttft_s: float
    measured_ttft_s: float | None = Field(None, description="as this summary measures it (sweep: mean; restore: median)")
    error: float | None = Field(None, description="predicted / measured - 1")
    interval_s: list[float] | None = Field(None, description="5-95% of the fit's residuals around the prediction")
    restored_share: float | None = Field(None, description="restored tokens / tokens (null: a recompute)")


class PredictedCheck(_M):
    """The restore planner fitted on this run itself: in-sample, so the table says how well the
    planner's shape (fixed cost + bytes over an effective rate + the tail's compute) describes
    the run, and how far the effective rate is from the drive's fio limit."""

    label: str = "in-sample: the planner fitted on this run's own records"
    model: str | None = None
    kv_bytes_per_token: int | None = None
    drive_read_gbps: float | None = Field(None, description="the run's fio read limit on the stores' filesystem")
    prefill: dict[str, Any] | None = Field(None, description="fitted flops_s, per_token_s, fixed_s, points")
    fits: list[PredictedFit] = Field(default_factory=list)
    cells: list[PredictedCell] = Field(default_factory=list)
    error: str | None = Field(None, description="why no fit (no recompute, no geometry)")


class Summary(_M):
    schema_: str = Field(SCHEMA, alias="schema")
    run_id: str | None = None
    campaign: str | None = None
    recompute_reference: RecomputeReference | None = None
    setups: dict[str, SetupSummary]
    predicted: PredictedCheck | None = Field(None, description="the restore planner, fitted on this run (in-sample)")
    drives: DrivesDeclared | None = Field(None, description="the campaign's drives (null: none declared)")


def _med(xs: list[float]) -> float | None:
    return metrics.median(xs)


def _restore(recs: list[dict], phase: str) -> list[dict]:
    return [r for r in recs if r.get("scenario") == "restore" and r.get("phase") == phase and "error" not in r]


def lmcache_breakdown(recs: list[dict]) -> LMCacheBreakdown | None:
    """Medians of the LMCache phases of restores that restored tokens; None without records."""
    with_lm = [r for r in recs if isinstance(r.get("lmcache"), dict)]
    if not with_lm:
        return None
    hits = [r for r in with_lm if (r.get("cached_tokens") or 0) > 0]

    def med(key: str) -> float | None:
        return _med([r["lmcache"][key] for r in hits if r["lmcache"].get(key) is not None])

    return LMCacheBreakdown(
        ttft_s=_med([r["ttft_s"] for r in hits]), lookup_s=med("lookup_s"),
        server_prefetch_s=med("server_prefetch_s"), retrieve_s=med("retrieve_s"),
        retrieved_tokens=med("retrieved_tokens"), engine_queue_s=med("engine_queue_s"),
        engine_prefill_s=med("engine_prefill_s"), rest_s=med("rest_s"),
        samples=len(hits), misses=len(with_lm) - len(hits),
    )


def recompute_reference(records: list[dict]) -> RecomputeReference | None:
    """The run's recompute reference from its `recompute` records; None where none ran."""
    recs = [r for r in records if r.get("kind") == "request" and r.get("scenario") == "restore"
            and r.get("phase") == "recompute"]
    if not recs:
        return None
    ok = [r for r in recs if "error" not in r]
    return RecomputeReference(setup=recs[0]["setup"], ttft_s=_med([r["ttft_s"] for r in ok]), samples=len(ok),
                              tokens=recs[0].get("tokens"))


def _over(value: float | None, ref: RecomputeReference | None) -> float | None:
    return value / ref.ttft_s if value is not None and ref and ref.ttft_s else None


def all_active(request: dict[str, Any], all_active_t: float | None) -> bool:
    """Whether an agents request was sent in the steady state, once every agent was active
    (its step's `all_active_t`; None: no ramp, as in a trace). Before, the agents' first turns
    (which no tier can save) queue in front of the earliest returning turns, whatever the tier."""
    return all_active_t is None or request["t_start"] >= all_active_t


def agents_load_fields(step: dict[str, Any]) -> dict[str, Any]:
    """An agents step's load: its working set against the engine's own cache, and the saves
    kvlab dropped."""
    ws, cache = step.get("working_set_tokens"), step.get("engine_cache_tokens")
    return {"working_set_tokens": ws, "engine_cache_tokens": cache,
            "working_set_over_engine_cache": ws / cache if ws is not None and cache else None,
            "saves_dropped": (step.get("counters") or {}).get("connector_saves_dropped")}


def wear_points(recs: list[dict], drives: Drives | None) -> dict[str, WearPoint]:
    """A setup's bytes written per scenario and over all of them, from its wear samples."""
    counts = wear_count.count(recs)
    out = {k: WearPoint(**wear_count.figures(c, drives)) for k, c in counts.items()}
    all_ = wear_count.total(counts)
    if all_ is not None:
        out["all"] = WearPoint(**wear_count.figures(all_, drives))
    return out


def drives_declared(d: Drives | None) -> DrivesDeclared | None:
    if d is None:
        return None
    return DrivesDeclared(model=d.model, count=d.count, capacity_tb=d.capacity_tb, dwpd=d.dwpd, tbw=d.tbw,
                          warranty_years=d.warranty_years, rated_dwpd=d.rated_dwpd)


def summarize_setup(name: str, recs: list[dict], baseline: SetupSummary | None,
                    avg_rounds: tuple[int, int] | None, reference: RecomputeReference | None = None,
                    drives: Drives | None = None) -> SetupSummary:
    skipped = next((r["reason"] for r in recs if r.get("kind") == "skip"), None)
    errors = [r["message"].splitlines()[0][:300] for r in recs if r.get("kind") == "error"]
    req = [r for r in recs if r.get("kind") == "request"]
    io = [r["io_mode"] for r in recs if r.get("kind") == "io_mode" and r.get("io_mode")]
    comp, warm, rest = _restore(req, "compute"), _restore(req, "warm"), _restore(req, "restart")

    # sweep: per length, the mean of the chosen rounds
    sweep: dict[str, SweepPoint] = {}
    by_len: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in req:
        if r.get("scenario") == "sweep" and "error" not in r:
            by_len[r["length"]][r["round"]] = r
    for length in sorted(by_len):
        rounds = by_len[length]
        n = max(rounds)
        first, last = avg_rounds or (1, n)
        last = min(last, n)
        chosen = [rounds[i] for i in range(first, last + 1) if i in rounds]
        if not chosen:
            sweep[str(length)] = SweepPoint(ttft_s=None, throughput_tok_s=None, samples=0)
            continue
        ttft = sum(r["ttft_s"] for r in chosen) / len(chosen)
        thr = sum(metrics.throughput(r["prompt_tokens"], r["output_tokens"], r["total_s"]) for r in chosen) / len(chosen)
        b = baseline.sweep.get(str(length)) if baseline else None
        sweep[str(length)] = SweepPoint(
            ttft_s=ttft, throughput_tok_s=thr, samples=len(chosen), rounds=len(chosen),
            page_cache_dropped_rounds=sum(1 for r in chosen if r.get("page_cache_dropped") is True),
            cached_tokens=_med([r.get("cached_tokens") or 0 for r in chosen]),
            ttft_improvement=metrics.improvement(b.ttft_s if b else None, ttft, higher_is_better=False),
            throughput_improvement=metrics.improvement(b.throughput_tok_s if b else None, thr, higher_is_better=True),
        )

    # agents: per concurrency
    agents: dict[str, AgentsPoint] = {}
    block = next((r["block_size"] for r in reversed(recs) if r.get("kind") == "engine_config" and r.get("block_size")),
                 None)
    steps = {r["concurrency"]: r for r in recs if r.get("kind") == "step" and r.get("scenario") == "agents"}
    turns_by_n: dict[int, list[dict]] = defaultdict(list)
    for r in req:
        if r.get("scenario") == "agents":
            turns_by_n[r["concurrency"]].append(r)
    for n in sorted(set(steps) | set(turns_by_n)):
        rs = turns_by_n.get(n, [])
        ok = [r for r in rs if "error" not in r]
        step = steps.get(n, {})
        threshold = step.get("frozen_threshold_s") or (rs[0].get("frozen_threshold_s") if rs else None)
        min_frac = step.get("hit_min_fraction", 0.5)
        turns = [Turn(r["prompt_tokens"], r.get("cached_tokens") or 0, r["reusable_tokens"]) for r in ok]
        returning = [r for r in ok if r["reusable_tokens"] > 0]
        active = step.get("all_active_t")
        ret_ttft = [r["ttft_s"] for r in returning if all_active(r, active)]
        per_agent: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
        for r in ok:
            per_agent[r["agent"]].append((r["output_tokens"], r["ttft_s"], r["total_s"]))
        agents[str(n)] = AgentsPoint(
            decode_tok_s_per_agent=metrics.decode_rate_per_agent(per_agent.values()),
            returning_turn_hit_share=metrics.turn_hit_share(turns, min_frac),
            returning_token_hit_share=metrics.token_hit_share(turns),
            returning_reusable_hit_share=metrics.reusable_hit_share(turns, block),
            returning_ttft_median_s=_med(ret_ttft),
            returning_ttft_p90_s=metrics.percentile(ret_ttft, 90) if ret_ttft else None,
            returning_ttft_p99_s=metrics.percentile(ret_ttft, 99) if ret_ttft else None,
            frozen_answers=metrics.frozen_answers((r["max_gap_s"] for r in ok), threshold) if threshold else None,
            wall_s=step.get("wall_s"),
            samples=len(ret_ttft), returning_turns=len(returning), answers=len(ok), errors=len(rs) - len(ok),
            ramp_s=active - step["t_start"] if active is not None and step.get("t_start") is not None else None,
            ramp_turns=len(returning) - len(ret_ttft),
            external_hit_tokens=(step.get("counters") or {}).get("external_hits"),
            **agents_load_fields(step),
        )

    mem = [r for r in recs if r.get("kind") == "memory"]

    def peak(*keys: str) -> int | None:
        vals = [r[k] for r in mem for k in keys if r.get(k) is not None]
        return max(vals) if vals else None

    def sources(prefix: str) -> str | None:
        # records written before the source was recorded measured the process tree
        found = {r.get(f"{prefix}_memory_source") or "process_tree" for r in mem
                 if r.get(f"{prefix}_rss_bytes") is not None}
        return "+".join(sorted(found)) or None

    read = [r["counters"]["connector_read_bytes"] for r in rest if "connector_read_bytes" in (r.get("counters") or {})]
    return SetupSummary(
        skipped=skipped, errors=errors, io_mode=io[-1] if io else None,
        recompute_ttft_s=_med([r["ttft_s"] for r in comp]), recompute_samples=len(comp),
        warm_restore_ttft_s=_med([r["ttft_s"] for r in warm]), warm_restore_samples=len(warm),
        restart_restore_ttft_s=_med([r["ttft_s"] for r in rest]), restart_restore_samples=len(rest),
        block_size=block,
        warm_over_recompute=_over(_med([r["ttft_s"] for r in warm]), reference),
        restart_over_recompute=_over(_med([r["ttft_s"] for r in rest]), reference),
        warm_restore_cached_tokens=_med([r.get("cached_tokens") or 0 for r in warm]),
        restart_restore_cached_tokens=_med([r.get("cached_tokens") or 0 for r in rest]),
        restore_read_bytes=_med(read),
        lmcache_warm_restore=lmcache_breakdown(warm), lmcache_restart_restore=lmcache_breakdown(rest),
        sweep=sweep, agents=agents,
        # a cgroup's memory.peak also holds what rose and fell between two samples
        peak_rss_bytes=PeakMemory(engine=peak("engine_rss_bytes", "engine_peak_bytes"),
                                  cache_server=peak("cache_server_rss_bytes", "cache_server_peak_bytes")),
        peak_pinned_bytes=PeakMemory(engine=peak("engine_pinned_bytes"), cache_server=peak("cache_server_pinned_bytes")),
        memory_samples=len(mem),
        memory_source=MemorySource(engine=sources("engine"), cache_server=sources("cache_server")) if mem else None,
        wear=wear_points(recs, drives),
    )


def predicted_check(records: list[dict], provenance: dict[str, Any], avg_rounds: tuple[int, int] | None
                    ) -> PredictedCheck:
    """The planner fitted on the run's restore and sweep cells; the reason where it cannot be."""
    from kvlab.planner.calibrate import CalibrationError, calibrate_records, cells, geometry_of

    try:
        cal = calibrate_records(records, geometry_of(provenance), provenance.get("run_id", "run"), avg_rounds)
    except CalibrationError as e:
        return PredictedCheck(error=str(e))
    d = cal.to_dict()
    fits = [PredictedFit(setup=t["setup"], tier=t["tier"], fixed_s=t["fixed_s"],
                         effective_gbps=t["effective_gbps"],
                         granule_tokens=t["granule_tokens"], points=t["points"], miss_s=t["miss_s"]) for t in d["tiers"]]
    keep = {"setup", "tier", "tokens", "predicted_ttft_s", "measured_ttft_s", "error", "interval_s", "restored_share"}
    return PredictedCheck(
        model=cal.geometry.name, kv_bytes_per_token=cal.kv_bytes_per_token, drive_read_gbps=cal.drive_read_gbps,
        prefill={k: d["prefill"][k] for k in ("flops_s", "per_token_s", "fixed_s", "points")}, fits=fits,
        cells=[PredictedCell(**{k: v for k, v in c.items() if k in keep}) for c in cells(cal, None)])


def summarize(records: list[dict], setup_order: list[str], run_id: str | None = None,
              campaign: str | None = None, avg_rounds: tuple[int, int] | None = None,
              provenance: dict[str, Any] | None = None) -> Summary:
    by_setup: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("setup"):
            by_setup[r["setup"]].append(r)
    names = [s for s in setup_order if s in by_setup] + [s for s in by_setup if s not in setup_order]
    out: dict[str, SetupSummary] = {}
    ref = recompute_reference(records)
    drives = wear_count.drives_of(records)
    # baseline first: the others' improvement factors divide by it
    if "baseline" in by_setup:
        out["baseline"] = summarize_setup("baseline", by_setup["baseline"], None, avg_rounds, ref, drives)
    for s in names:
        if s != "baseline":
            out[s] = summarize_setup(s, by_setup[s], out.get("baseline"), avg_rounds, ref, drives)
    ordered = {s: out[s] for s in names}
    predicted = predicted_check(records, provenance, avg_rounds) if provenance is not None else None
    return Summary(schema=SCHEMA, run_id=run_id, campaign=campaign, recompute_reference=ref, setups=ordered,
                   predicted=predicted, drives=drives_declared(drives))


def to_json_obj(s: Summary) -> dict[str, Any]:
    return s.model_dump(by_alias=True)


def validate(obj: dict[str, Any]) -> Summary:
    return Summary.model_validate(obj)
