"""`kvlab report`: the seeds' tables (Markdown) and plots (PNG), derived from raw records.

Everything here is regenerable: it reads records.jsonl, campaign.yml and provenance.json
of each run and rewrites report/ (summary.json, report.md, *.png). Several runs render
side by side, each setup labelled with its run.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvlab.harness import results
from kvlab.harness.summary import SetupSummary, Summary, all_active, summarize, to_json_obj


@dataclass(frozen=True)
class RunInputs:
    """What a run was asked to do, as far as the report needs it: read from the plan the runner
    executed (plan.json), or, for a run recorded before plans were, from its campaign.yml."""

    name: str | None
    description: str
    setups: list[str]
    specs: dict[str, dict[str, Any]]  # scenario -> its parameters (restore, sweep, agents)

    @classmethod
    def of_run(cls, run_dir: Path) -> RunInputs:
        plan_path = run_dir / results.PLAN
        if plan_path.exists():
            plan = json.loads(plan_path.read_text())
            specs: dict[str, dict[str, Any]] = {}
            for p in plan.get("setups", []):
                for life in p.get("lives", []):
                    for scenario, spec in (life.get("specs") or {}).items():
                        specs.setdefault(scenario, spec)
            return cls(plan.get("campaign"), plan.get("description", ""), [p["setup"] for p in plan.get("setups", [])],
                       specs)
        c_path = run_dir / results.CAMPAIGN
        c = (yaml.safe_load(c_path.read_text()) or {}) if c_path.exists() else {}
        specs = {k: dict(v) for k, v in (c.get("scenarios") or {}).items() if isinstance(v, dict)}
        if "agents" in specs:
            source = specs["agents"].get("source") or {}
            specs["agents"]["answers"] = (source.get("generator") or {}).get("answers", "seeded") if "generator" in source else None
        return cls(c.get("name"), c.get("description") or "", list(c.get("setups") or []), specs)

    @property
    def answers(self) -> str:
        """What the agents send back as the previous answer: engine, seeded, or (None) a trace's requests."""
        return str((self.specs.get("agents") or {}).get("answers") or "trace")


@dataclass
class RunData:
    dir: Path
    run_id: str
    inputs: RunInputs
    provenance: dict[str, Any]
    records: list[dict[str, Any]]
    summary: Summary


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    if not (run_dir / results.RECORDS).exists():
        raise FileNotFoundError(f"{run_dir}: not a campaign run (no {results.RECORDS}): give results/runs/<run-id>")
    resolved = run_dir.resolve()
    inputs = RunInputs.of_run(run_dir)
    prov_path = run_dir / results.PROVENANCE
    prov = json.loads(prov_path.read_text()) if prov_path.exists() else {}
    records = results.read_records(run_dir)
    sweep = inputs.specs.get("sweep") or {}
    avg = tuple(sweep.get("average_rounds", (2, 9))) if sweep else None
    if avg and sweep.get("rounds") and avg[1] > sweep["rounds"]:
        avg = None
    summary = summarize(records, inputs.setups, run_id=resolved.name,
                        campaign=inputs.name, avg_rounds=avg,  # type: ignore[arg-type]
                        provenance={"run_id": resolved.name, **prov})
    return RunData(run_dir, resolved.name, inputs, prov, records, summary)


# ---- formatting ------------------------------------------------------------------------
def f3(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


def mib(v: float | None) -> str:
    return "—" if v is None else f"{v / 2**20:.0f}"


def gib(v: float | None) -> str:
    return "—" if v is None else f"{v / 2**30:.2f}"


def columns(runs: list[RunData]) -> list[tuple[str, SetupSummary, RunData]]:
    multi = len(runs) > 1
    return [((f"{r.run_id}:{name}" if multi else name), s, r) for r in runs for name, s in r.summary.setups.items()]


def restore_table(cols: list[tuple[str, SetupSummary, RunData]]) -> list[str]:
    rows = ["| setup | I/O mode | compute s | warm restore s | after restart s | cached tokens warm / restart "
            "| read MiB per restart | restart ÷ recompute |", "|---|---|---|---|---|---|---|---|"]
    for label, s, _ in cols:
        if s.skipped:
            continue
        ratio = s.restart_over_recompute
        rows.append(
            f"| {label} | {s.io_mode or 'not reported'} | {f3(s.recompute_ttft_s)} (×{s.recompute_samples}) "
            f"| {f3(s.warm_restore_ttft_s)} (×{s.warm_restore_samples}) "
            f"| {f3(s.restart_restore_ttft_s)} (×{s.restart_restore_samples}) "
            f"| {f3(s.warm_restore_cached_tokens, 0)} / {f3(s.restart_restore_cached_tokens, 0)} "
            f"| {mib(s.restore_read_bytes)} | {f3(ratio)} |")
    return rows


LMCACHE_BREAKDOWN_NOTE = [
    "What vLLM and LMCache expose, each as its change over one request (nothing else runs); medians, each "
    "phase on its own, so they need not add up; restores that restored nothing (recomputes) are counted apart.",
    "",
    "- **lookup**: vLLM's `vllm:lmcache_mp_lookup_duration_seconds`, the scheduler's lookup from submitted to "
    "answered. **server prefetch**, part of it: the cache server's logged time to its prefetch result "
    "(L1 hits, and L2 loads after a restart).",
    "- **retrieve → commit**: the cache server's logged `Retrieved N tokens in X seconds`, from its answer to "
    "`prepare_retrieve` until the worker's `commit_retrieve` arrives: the transfer to the engine (chunks "
    "pickled over ZMQ, unpickled), the injection (scatter into vLLM's paged KV cache) and the commit. LMCache "
    "times these three only together on the CPU engine (engine-driven transfer): no metric of its cache "
    "server times them apart or counts their bytes (tokens are given).",
    "- **vLLM queue / prefill**: vLLM's own request timers, `request_queue_time_seconds` (WAITING: lookup and "
    "the asynchronous load run there) and `request_prefill_time_seconds` (compute of the tokens not restored).",
    "- **rest** = TTFT − lookup − retrieve − prefill, not measured apart: the cache server's gather and pickle "
    "of the chunks before its answer, the scheduler's steps between lookup, load and compute, and HTTP. Empty "
    "where vLLM's timers do not show those phases as disjoint.",
]


def reference_lines(runs: list[RunData]) -> list[str]:
    out = []
    for r in runs:
        ref = r.summary.recompute_reference
        where = f" ({r.run_id})" if len(runs) > 1 else ""
        if ref is None:
            out.append(f"No recompute reference{where}: restart ÷ recompute is not given.")
        else:
            out.append(f"Recompute reference{where}: {f3(ref.ttft_s)} s, the median of {ref.samples} fresh "
                       f"{ref.tokens}-token prompts on {ref.setup}'s warm engine; every setup's restart ÷ "
                       "recompute divides by it.")
    return out + [""]


def lmcache_breakdown_table(cols: list[tuple[str, SetupSummary, RunData]]) -> list[str]:
    rows = ["| setup | restore | TTFT s | lookup s | server prefetch s | retrieve → commit s | tokens retrieved "
            "| vLLM queue s | vLLM prefill s | rest s | restored · recomputed |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, s, _ in cols:
        for kind, b in (("warm", s.lmcache_warm_restore), ("after restart", s.lmcache_restart_restore)):
            if b is None:
                continue
            rows.append(
                f"| {label} | {kind} | {f3(b.ttft_s)} | {f3(b.lookup_s)} | {f3(b.server_prefetch_s)} "
                f"| {f3(b.retrieve_s)} | {f3(b.retrieved_tokens, 0)} | {f3(b.engine_queue_s)} "
                f"| {f3(b.engine_prefill_s)} | {f3(b.rest_s)} | {b.samples} · {b.misses} |")
    return rows if len(rows) > 2 else []


def ratio_line(cols: list[tuple[str, SetupSummary, RunData]]) -> list[str]:
    """kvlab's warm restore over lmcache-mp's, per run, with what lmcache-mp's is made of."""
    out = []
    runs = {id(r): r for _, _, r in cols}
    for run in runs.values():
        k, lm = run.summary.setups.get("kvlab"), run.summary.setups.get("lmcache-mp")
        if not (k and lm and k.warm_restore_ttft_s and lm.warm_restore_ttft_s):
            continue
        where = f" ({run.run_id})" if len(runs) > 1 else ""
        line = (f"kvlab ÷ lmcache-mp, warm restore TTFT{where}: {k.warm_restore_ttft_s:.3f} ÷ "
                f"{lm.warm_restore_ttft_s:.3f} = {k.warm_restore_ttft_s / lm.warm_restore_ttft_s:.2f}")
        b = lm.lmcache_warm_restore
        if b and b.samples:
            line += (f"; lmcache-mp's phase by phase (medians): lookup {f3(b.lookup_s)} s, retrieve → commit "
                     f"{f3(b.retrieve_s)} s, prefill {f3(b.engine_prefill_s)} s, rest {f3(b.rest_s)} s.")
        out.append(line)
    return out


def sweep_tables(cols: list[tuple[str, SetupSummary, RunData]]) -> list[str]:
    lengths = sorted({int(k) for _, s, _ in cols for k in s.sweep}, key=int)
    if not lengths:
        return ["No sweep ran."]
    live = [(label, s) for label, s, _ in cols if s.sweep]
    head = "| input tokens | " + " | ".join(label for label, _ in live) + " |"
    sep = "|---|" + "---|" * len(live)
    out = []
    for title, key, digits in (("Mean TTFT, s (lower is better)", "ttft_s", 3),
                               ("Total token throughput, tokens/s (higher is better)", "throughput_tok_s", 0),
                               ("TTFT improvement over baseline, × (baseline ÷ setup)", "ttft_improvement", 2),
                               ("Throughput improvement over baseline, × (setup ÷ baseline)",
                                "throughput_improvement", 2)):
        out += [f"**{title}**", "", head, sep]
        for n in lengths:
            cells = []
            for _, s in live:
                p = s.sweep.get(str(n))
                cells.append("—" if p is None else f3(getattr(p, key), digits))
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["**Prompt tokens found in the cache, median of the averaged rounds**", "", head, sep]
    for n in lengths:
        cells = []
        for _, s in live:
            p = s.sweep.get(str(n))
            cells.append("—" if p is None else f3(p.cached_tokens, 0))
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out.append("")
    samples = {p.samples for _, s in live for p in s.sweep.values()}
    out.append(f"Rounds averaged per cell: {', '.join(map(str, sorted(samples)))}. " + page_cache_line(live))
    return out


def page_cache_line(live: list[tuple[str, SetupSummary]]) -> str:
    """Whether each averaged round read its tier from the drive or possibly from host RAM."""
    cells = [p for _, s in live for p in s.sweep.values() if p.rounds]
    dropped = sum(p.page_cache_dropped_rounds for p in cells)
    rounds = sum(p.rounds for p in cells)
    if dropped == 0:
        return ("The page cache was not dropped between rounds: a file-backed tier may have been read from "
                "host RAM, not from its drive.")
    if dropped == rounds:
        return "The page cache was dropped before every averaged round: every file-backed tier read from its drive."
    short = [f"{label} {n}: {p.page_cache_dropped_rounds}/{p.rounds}" for label, s in live
             for n, p in s.sweep.items() if p.page_cache_dropped_rounds < p.rounds]
    return (f"The page cache was dropped before {dropped} of {rounds} averaged rounds (a drop can be refused: not "
            f"root, read-only /proc); not before every one in {', '.join(short)}: those may have read from RAM.")


def agents_table(cols: list[tuple[str, SetupSummary, RunData]]) -> list[str]:
    live = [(label, s, r) for label, s, r in cols if s.agents]
    if not live:
        return ["No agents step ran."]
    ns = sorted({int(n) for _, s, _ in live for n in s.agents})
    thr = {(r.inputs.specs.get("agents") or {}).get("frozen_threshold_s", 20.0) for _, _, r in live}
    threshold = "/".join(f"{t:g}" for t in sorted(thr))

    def cell(s: SetupSummary, fn: Any) -> str:
        return " / ".join(fn(s.agents[str(n)]) if str(n) in s.agents else "—" for n in ns)

    metrics_rows = [
        ("Decode rate per agent, tokens/s", lambda p: f3(p.decode_tok_s_per_agent, 1)),
        ("Returning turns found in the cache", lambda p: pct(p.returning_turn_hit_share)),
        ("Prompt tokens of returning turns from the cache", lambda p: pct(p.returning_token_hit_share)),
        ("Reusable tokens restored, of the block-aligned best", lambda p: pct(p.returning_reusable_hit_share)),
        ("First token of a returning turn, median, s (all agents active)", lambda p: f3(p.returning_ttft_median_s, 2)),
        ("First token of a returning turn, p90, s (all agents active)", lambda p: f3(p.returning_ttft_p90_s, 2)),
        ("First token of a returning turn, p99, s (all agents active)", lambda p: f3(p.returning_ttft_p99_s, 2)),
        (f"Answers frozen for more than {threshold} s", lambda p: "—" if p.frozen_answers is None else str(p.frozen_answers)),
        ("Wall time of the step, s", lambda p: f3(p.wall_s, 1)),
        ("Answers · returning · failed", lambda p: f"{p.answers}·{p.returning_turns if p.returning_turns is not None else p.samples}·{p.errors}"),
        ("Ramp, s · returning turns in it (not in the first-token rows)",
         lambda p: "—" if p.ramp_s is None else f"{p.ramp_s:.1f}·{p.ramp_turns}"),
        ("External prefix-cache hits, tokens", lambda p: f3(p.external_hit_tokens, 0)),
        *agents_load_rows(),
    ]
    blocks = sorted({s.block_size for _, s, _ in live if s.block_size})
    answers = sorted({r.inputs.answers for _, _, r in live})
    carried = {("engine",): "each next turn carries the tokens the engine generated for the previous one",
               ("seeded",): "each next turn carries a seeded reply, not the engine's answer",
               ("trace",): "requests replayed from a trace"}.get(tuple(answers), f"answers: {'/'.join(answers)}")
    out = [f"At N = {' / '.join(map(str, ns))} concurrent agents; {carried}. The block-aligned best is each "
           "returning turn's reusable tokens (those an earlier request computed) rounded down to the engine's "
           f"block size ({'/'.join(map(str, blocks)) or 'not reported'} tokens). The first-token rows and the "
           "CDF plot take the returning turns sent once every agent was active: in the ramp before, until "
           "every agent's first turn is answered, those first turns (nothing any tier can restore) queue in "
           "front of the earliest returning turns.", "",
           "| Metric | " + " | ".join(label for label, _, _ in live) + " |", "|---|" + "---|" * len(live)]
    for title, fn in metrics_rows:
        out.append(f"| {title} | " + " | ".join(cell(s, fn) for _, s, _ in live) + " |")
    return out


def agents_load_rows() -> list[tuple[str, Any]]:
    """The agents table's load rows: the working set against the engine's own KV cache, and
    the saves kvlab dropped (— where a setup does not count them)."""
    def ratio(p: Any) -> str:
        if p.working_set_over_engine_cache is None:
            return "—"
        return f"{p.working_set_tokens:,}/{p.engine_cache_tokens:,} = {p.working_set_over_engine_cache:.1f}×"

    return [
        ("Working set / engine's own KV cache, tokens", ratio),
        ("Saves dropped", lambda p: f3(p.saves_dropped, 0)),
    ]


def memory_table(cols: list[tuple[str, SetupSummary, RunData]]) -> list[str]:
    out = ["| setup | engine peak RSS GiB | cache server peak RSS GiB | engine pinned GiB | cache server pinned GiB | samples "
           "| source (engine / cache server) |",
           "|---|---|---|---|---|---|---|"]
    for label, s, _ in cols:
        if s.skipped:
            continue
        src = s.memory_source
        where = ("—" if src is None else src.engine if src.cache_server in (None, src.engine)
                 else f"{src.engine} / {src.cache_server}")
        out.append(f"| {label} | {gib(s.peak_rss_bytes.engine)} | {gib(s.peak_rss_bytes.cache_server)} | "
                   f"{gib(s.peak_pinned_bytes.engine)} | {gib(s.peak_pinned_bytes.cache_server)} | {s.memory_samples} "
                   f"| {where} |")
    return out


def drives_line(r: RunData) -> str:
    d = r.summary.drives
    if d is None:
        return (f"{r.run_id}: the campaign declares no `drives`, so no drive writes per day or rated life "
                "(docs/results-schema.md, *Campaign fields*).")
    return (f"{r.run_id}: drives of the run (the campaign's `drives`, or `campaign run --drives`): "
            f"{d.drives().describe()}; drive writes per day = bytes written per second of "
            f"the scenario × 86400 ÷ their {d.count * d.capacity_tb:g} TB.")


def years(v: float | None) -> str:
    return "—" if v is None else f"{v:.3g}" if v >= 1000 else f"{v:.2f}"


def wear_table(runs: list[RunData], cols: list[tuple[str, SetupSummary, RunData]]) -> list[str]:
    """Per setup and scenario: bytes its tier wrote to drives, against what was restored, and
    what that rate would do to the declared drives."""
    if not any(s.wear for _, s, _ in cols):
        return ["No wear samples (a run from before kvlab.summary/4)."]
    out = [drives_line(r) for r in runs]
    out += ["", "| setup | scenario | counted by | written MiB | restored MiB | written ÷ restored | wall s "
            "| written MB/s | drive writes/day | rated life, years |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, s, _ in cols:
        for key, w in s.wear.items():
            out.append(f"| {label} | {key} | {w.tier} | {mib(w.written_bytes)} | {mib(w.restored_bytes)} "
                       f"| {f3(w.written_over_restored, 2)} | {f3(w.wall_s, 1)} "
                       f"| {f3(None if w.write_bytes_per_s is None else w.write_bytes_per_s / 1e6, 2)} "
                       f"| {'—' if w.drive_writes_per_day is None else f'{w.drive_writes_per_day:.3g}'} "
                       f"| {years(w.rated_life_years)} |")
    out += ["", "Counted by: `kvlab`, the connector's own `kvlab_written_bytes`; `files`, `/proc/PID/io` "
            "write_bytes − cancelled_write_bytes of the engine's and cache server's processes (their logs "
            "included); `none`, no drive tier (0 by definition). Restored: kvlab's bytes read, else vLLM's "
            "external prefix-cache hit tokens × KV bytes per token. `all`: the setup's scenarios together."]
    return out


def predicted_tables(runs: list[RunData]) -> list[str]:
    """Per run: the planner fitted on the run's own restore and sweep cells (in-sample: it says
    how well fixed cost + bytes over an effective rate + the tail's compute describe the run,
    and how far the effective rate is from the drive's fio limit)."""
    out: list[str] = []
    for r in runs:
        p = r.summary.predicted
        head = f"{r.run_id}: " if len(runs) > 1 else ""
        if p is None or p.error:
            out += [f"{head}no fit: {p.error if p else 'no provenance'}", ""]
            continue
        pre = p.prefill or {}
        drive = f"; the drive's fio read limit {p.drive_read_gbps:.2f} GB/s" if p.drive_read_gbps else ""
        out += [f"{head}In-sample: fitted on this run's own records (`kvlab predict --calibrate RUN` predicts other "
                f"lengths). Model {p.model}, {p.kv_bytes_per_token:,} B/token{drive}. Prefill: fixed "
                f"{pre.get('fixed_s', 0):.3f} s + {pre.get('per_token_s', 0) * 1e6:.2f} µs/token + FLOPs at "
                f"{pre.get('flops_s', 0) / 1e9:.1f} GFLOP/s ({pre.get('points', 0)} requests).", ""]
        for f in p.fits:
            rate = f"{f.effective_gbps:.2f} GB/s" if f.effective_gbps else "no length dependence"
            out.append(f"- {f.setup} {f.tier}: fixed {f.fixed_s:.3f} s, effective {rate} of restored KV "
                       f"({f.points} requests)")
        out += ["", "| setup | tier | tokens | predicted TTFT s | 5-95% | measured s | error |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for c in p.cells:
            iv = f"{c.interval_s[0]:.3f}-{c.interval_s[1]:.3f}" if c.interval_s else "-"
            err = f"{c.error:+.0%}" if c.error is not None else "-"
            out.append(f"| {c.setup} | {c.tier} | {c.tokens} | {c.predicted_ttft_s:.3f} | {iv} | "
                       f"{f3(c.measured_ttft_s)} | {err} |")
        out.append("")
    return out


def provenance_lines(runs: list[RunData]) -> list[str]:
    out = []
    for r in runs:
        p = r.provenance
        g, v, h = p.get("git", {}), p.get("versions", {}), p.get("host", {})
        ctl = p.get("engine_control") or {}
        image = (ctl.get("image") or {}).get("digest")
        engines = f"engines {ctl.get('kind', 'local')}" + (f" from image `{image[:19]}…`" if image else "")
        out += [f"- **{r.run_id}**: {engines}; campaign `{p.get('campaign')}` sha256 `{str(p.get('campaign_sha256'))[:16]}…`, "
                f"seed {p.get('seed')}; commit `{str(g.get('commit'))[:12]}`{' (dirty)' if g.get('dirty') else ''}; "
                f"vLLM {v.get('vllm')}, torch {v.get('torch')}, LMCache {v.get('lmcache')}, kvlab {v.get('kvlab')}; "
                f"{h.get('cpu_model')} ×{h.get('cpu_count')}, GPUs {h.get('gpus') or 'none'}, kernel {h.get('kernel')}; "
                f"model {p.get('model', {}).get('kind')} `{str(p.get('model', {}).get('sha256', ''))[:16]}`; "
                f"traces {json.dumps({Path(k).name: str(x)[:16] for k, x in (p.get('trace_sha256') or {}).items()})}"]
    return out


# ---- plots -----------------------------------------------------------------------------
def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(cols: list[tuple[str, SetupSummary, RunData]], out: Path) -> list[str]:
    live = [(label, s) for label, s, _ in cols if s.sweep]
    if not live:
        return []
    plt = _plt()
    made = []
    for key, fname, ylabel, title in (
        ("ttft_s", "ttft_vs_length.png", "mean TTFT, s", "Mean TTFT vs input length (lower is better)"),
        ("throughput_tok_s", "throughput_vs_length.png", "total token throughput, tokens/s",
         "Total token throughput vs input length (higher is better)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, s in live:
            xs = sorted(int(k) for k in s.sweep)
            ys = [getattr(s.sweep[str(x)], key) for x in xs]
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("input length, tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        made.append(fname)
    imp = [(label, s) for label, s in live if any(p.throughput_improvement for p in s.sweep.values())]
    if imp:
        lengths = sorted({int(k) for _, s in imp for k in s.sweep})
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
        width = 0.8 / len(imp)
        for ax, key, title in ((axes[0], "ttft_improvement", "TTFT: baseline ÷ setup"),
                               (axes[1], "throughput_improvement", "Throughput: setup ÷ baseline")):
            for i, (label, s) in enumerate(imp):
                ys = [getattr(s.sweep.get(str(n)), key, None) or 0 for n in lengths]
                ax.bar([j + i * width for j in range(len(lengths))], ys, width, label=label)
            ax.set_xticks([j + width * (len(imp) - 1) / 2 for j in range(len(lengths))], [str(n) for n in lengths])
            ax.axhline(1, color="grey", lw=0.8)
            ax.set_xlabel("input length, tokens")
            ax.set_ylabel("improvement over baseline, ×")
            ax.set_title(title)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "improvement.png", dpi=110)
        plt.close(fig)
        made.append("improvement.png")
    return made


def plot_restore(cols: list[tuple[str, SetupSummary, RunData]], out: Path) -> list[str]:
    live = [(label, s) for label, s, _ in cols if s.recompute_samples]
    if not live:
        return []
    plt = _plt()
    # Horizontal bars: the setups' names (lmcache-mp+kvlab-detached, ...) are read along
    # the y axis, one line each, however many setups there are.
    kinds = (("compute (with its save)", "recompute_ttft_s"), ("warm restore", "warm_restore_ttft_s"),
             ("after restart", "restart_restore_ttft_s"))
    height = 0.8 / len(kinds)
    fig, ax = plt.subplots(figsize=(8, 2.0 + 0.75 * len(live)))
    for i, (name, key) in enumerate(kinds):
        xs = [getattr(s, key) or 0 for _, s in live]
        ax.barh([j + i * height for j in range(len(live))], xs, height, label=name)
    ax.set_yticks([j + height for j in range(len(live))], [label for label, _ in live])
    ax.invert_yaxis()  # the campaign's order, top to bottom
    refs = {id(r): r.summary.recompute_reference for _, _, r in cols}
    for ref in refs.values():
        if ref and ref.ttft_s:
            ax.axvline(ref.ttft_s, color="black", ls="--", lw=1,
                       label=f"recompute reference ({ref.setup}, median of {ref.samples})")
    ax.set_xlabel("TTFT at the client, s (median)")
    ax.set_title("One long prompt: compute, warm restore, restore after restart")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)  # below: no bar hidden
    fig.tight_layout()
    fig.savefig(out / "restore.png", dpi=110)
    plt.close(fig)
    return ["restore.png"]


def plot_cdf(runs: list[RunData], out: Path) -> list[str]:
    data: dict[tuple[str, int], list[float]] = defaultdict(list)
    multi = len(runs) > 1
    for r in runs:
        active = {(rec["setup"], rec["concurrency"]): rec.get("all_active_t") for rec in r.records
                  if rec.get("kind") == "step" and rec.get("scenario") == "agents"}
        for rec in r.records:
            if rec.get("kind") == "request" and rec.get("scenario") == "agents" and "error" not in rec \
                    and rec.get("reusable_tokens", 0) > 0 \
                    and all_active(rec, active.get((rec["setup"], rec["concurrency"]))):
                label = f"{r.run_id}:{rec['setup']}" if multi else rec["setup"]
                data[(label, rec["concurrency"])].append(rec["ttft_s"])
    if not data:
        return []
    plt = _plt()
    ns = sorted({n for _, n in data})
    fig, axes = plt.subplots(1, len(ns), figsize=(4.2 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns, strict=True):
        for (label, m), xs in sorted(data.items()):
            if m != n:
                continue
            xs = sorted(xs)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
        ax.set_title(f"N = {n} agents")
        ax.set_xlabel("first token of a returning turn, s")
        ax.set_ylabel("share of returning turns")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("CDF of returning-turn TTFT, all agents active")
    fig.tight_layout()
    fig.savefig(out / "returning_ttft_cdf.png", dpi=110)
    plt.close(fig)
    return ["returning_ttft_cdf.png"]


def plot_memory(runs: list[RunData], out: Path) -> list[str]:
    series: dict[str, list[tuple[float, float, float | None]]] = defaultdict(list)
    multi = len(runs) > 1
    for r in runs:
        for rec in r.records:
            if rec.get("kind") == "memory":
                label = f"{r.run_id}:{rec['setup']}" if multi else rec["setup"]
                series[label].append((rec["t"], rec["engine_rss_bytes"], rec.get("cache_server_rss_bytes")))
    if not series:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, pts in series.items():
        t0 = pts[0][0]
        ax.plot([t - t0 for t, _, _ in pts], [e / 2**30 for _, e, _ in pts], label=f"{label} engine")
        if any(c for _, _, c in pts):
            ax.plot([t - t0 for t, _, _ in pts], [(c or 0) / 2**30 for _, _, c in pts], ls="--",
                    label=f"{label} cache server")
    ax.set_xlabel("seconds since the setup's first engine start")
    ax.set_ylabel("GiB (process tree RSS, or a unit's cgroup memory.current)")
    ax.set_title("Memory over time: the bill")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)
    return ["memory.png"]


# ---- the report --------------------------------------------------------------------------
def render(runs: list[RunData], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cols = columns(runs)
    plots = plot_restore(cols, out) + plot_sweep(cols, out) + plot_cdf(runs, out) + plot_memory(runs, out)
    title = (runs[0].inputs.name or "campaign") if len(runs) == 1 else "runs side by side"
    lines = [f"# kvlab report: {title}", ""]
    if len(runs) == 1:
        desc = runs[0].inputs.description
        if desc:
            lines += [desc.strip(), ""]
    skipped = [(label, s) for label, s, _ in cols if s.skipped or s.errors]
    if skipped:
        lines += ["## Not run", ""]
        for label, s in skipped:
            if s.skipped:
                lines.append(f"- **{label}** skipped: {s.skipped}")
            for e in s.errors:
                lines.append(f"- **{label}** error: {e}")
        lines.append("")
    lines += ["## Restore: one long prompt", ""]
    tokens = {(r.inputs.specs.get("restore") or {}).get("tokens") for r in runs} - {None}
    if tokens:
        rs = [(r.inputs.specs.get("restore") or {}) for r in runs]
        warm = ("after a prefix-cache reset on the running engine" if all(x.get("prefix_caching", True) for x in rs)
                else "the prompt again on the running engine, whose own prefix caching is off (so it comes "
                "from the tier under test)")
        lines += [f"Prompt of {', '.join(map(str, sorted(tokens)))} tokens; TTFT at the client (median, ×samples). "
                  "Every engine life answers an unrelated warm-up request first. Compute: the prompt's first "
                  f"request on the setup (computed, and saved where the setup saves). Warm: {warm}. After restart: "
                  "the prompt's first request to a restarted engine (page cache dropped while it was down).", ""]
        lines += reference_lines(runs) + restore_table(cols)
        breakdown = lmcache_breakdown_table(cols)
        if breakdown:
            lines += ["", "### LMCache restore breakdown", "", *LMCACHE_BREAKDOWN_NOTE, ""] + breakdown
            ratio = ratio_line(cols)
            if ratio:
                lines += [""] + ratio
    else:
        lines.append("No restore ran.")
    lines += ["", "## Sweep: TTFT and throughput by input length", ""] + sweep_tables(cols)
    lines += ["", "## Agents: concurrent multi-turn sessions", ""] + agents_table(cols)
    lines += ["", "## Memory", ""] + memory_table(cols)
    lines += ["", "## Wear: bytes written to drives", ""] + wear_table(runs, cols)
    lines += ["", "## Predicted against measured (the restore planner, in-sample)", ""] + predicted_tables(runs)
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Provenance", ""] + provenance_lines(runs)
    lines += ["", "Definitions: docs/results-schema.md. Regenerate: `kvlab report RUN`."]
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n")
    if len(runs) == 1:
        (out / "summary.json").write_text(json.dumps(to_json_obj(runs[0].summary), indent=2) + "\n")
    return md


def report_dir(run: RunData) -> Path:
    return run.dir / results.REPORT


def render_run(run_dir: Path) -> tuple[RunData, Path]:
    run = load_run(run_dir)
    out = report_dir(run)
    tmp = out.with_name(f".report.{os.getpid()}")
    render([run], tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return run, out / "report.md"
