"""`kvlab campaign compare FILE --engines local,container`: one campaign under two engine controls.

The question it answers: does running the serving stack from the image (or any other engine
control) change what the engines restore or how fast? Timings on two shared cores drift over
minutes, so the two controls' runs are interleaved: repeat r runs A then B, repeat r+1 B then A,
and each repeat's restore TTFT medians are divided within the repeat (B over A), as
`kvlab bench overhead` does for baseline and kvlab. Every run is an ordinary campaign run
(results/runs/<run-id>, its own report and provenance: the image digest for a container run);
the comparison (compare.json, beside the side-by-side report of all of them) names them.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvlab.harness import metrics, results

SCHEMA = "kvlab.compare/1"
PHASES = ("warm", "restart")  # the restore phases that restore; compute and recompute do not


def order_of(repeat: int, controls: Sequence[str]) -> tuple[str, ...]:
    """Repeat 0 runs the controls in the order given, repeat 1 reversed, and so on."""
    return tuple(controls) if repeat % 2 == 0 else tuple(reversed(controls))


def run_interleaved(repeats: int, controls: Sequence[str], run_one: Callable[[str, int], Path],
                    progress: Callable[[str], None]) -> dict[str, list[Path]]:
    """Every repeat's runs in their interleaved order; the run folders by control."""
    lives = [(r, control) for r in range(repeats) for control in order_of(r, controls)]
    out: dict[str, list[Path]] = {control: [] for control in controls}
    t0 = time.monotonic()
    for i, (r, control) in enumerate(lives):
        elapsed = time.monotonic() - t0
        left = f" · ~{elapsed / i * (len(lives) - i):.0f} s left" if i else ""
        progress(f"[{i + 1}/{len(lives)} · {elapsed:.0f} s elapsed{left}] repeat {r + 1}/{repeats}: "
                 f"--engine {control}")
        out[control].append(run_one(control, r))
    return out


def restores(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's restore requests that restore (warm and after a restart), answered."""
    return [r for r in records if r.get("kind") == "request" and r.get("scenario") == "restore"
            and r.get("phase") in PHASES and "error" not in r and r.get("ttft_s") is not None]


def restored_tokens(records: list[dict[str, Any]]) -> dict[tuple[str, str, int], tuple[int, int]]:
    """(setup, phase, repeat) -> (cached tokens, output tokens): what two controls must agree on."""
    return {(r["setup"], r["phase"], r.get("repeat", 0)): (r.get("cached_tokens"), r.get("output_tokens"))
            for r in restores(records)}


def _ttft_medians(records: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    by: dict[tuple[str, str], list[float]] = {}
    for r in restores(records):
        by.setdefault((r["setup"], r["phase"]), []).append(r["ttft_s"])
    return {k: statistics.median(v) for k, v in by.items()}


def summarize(runs: dict[str, list[list[dict[str, Any]]]], run_ids: dict[str, list[str]],
              controls: Sequence[str]) -> dict[str, Any]:
    """B over A per repeat for every (setup, phase) both restored in; medians and quartiles over
    the repeats; and every (setup, phase, repeat) whose restored or answered tokens differ."""
    a, b = controls
    pairs = list(zip(runs[a], runs[b], strict=True))
    if not pairs:
        raise ValueError("no repeat in which both engine controls ran")
    ratios: dict[str, list[float]] = {}
    medians: dict[str, dict[str, list[float]]] = {}
    differ = []
    for ra, rb in pairs:
        ma, mb = _ttft_medians(ra), _ttft_medians(rb)
        for key in sorted(ma.keys() & mb.keys()):
            name = f"{key[0]}.{key[1]}"
            ratios.setdefault(name, []).append(mb[key] / ma[key])
            medians.setdefault(name, {a: [], b: []})
            medians[name][a].append(ma[key])
            medians[name][b].append(mb[key])
        ta, tb = restored_tokens(ra), restored_tokens(rb)
        differ += [{"request": list(k), a: ta.get(k), b: tb.get(k)} for k in sorted(ta.keys() | tb.keys())
                   if ta.get(k) != tb.get(k)]
    ttft = {}
    for name, rs in ratios.items():
        q1, q3 = metrics.quartiles(rs)
        ttft[name] = {f"{b}_over_{a}": statistics.median(rs), "q1": q1, "q3": q3, "repeats": len(rs),
                      **{f"{c}_ttft_s": statistics.median(medians[name][c]) for c in controls}}
    return {"schema": SCHEMA, "controls": list(controls), "repeats": len(pairs),
            "restore_ttft": ttft, "same_restored_tokens": not differ, "token_differences": differ,
            "runs": run_ids}


def compare(campaign_path: Path, controls: Sequence[str], repeats: int, runs_dir: Path,
            engines_for: Callable[[str], Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the campaign `repeats` times under each control, interleaved; the comparison with
    provenance and the side-by-side report's path."""
    from kvlab.harness import campaign as campaign_mod
    from kvlab.harness.compiler import compile_campaign
    from kvlab.harness.report import load_run, render
    from kvlab.harness.runner import run_plan

    c, sha = campaign_mod.load(campaign_path)
    plan = compile_campaign(c, campaign_path.parent)  # one plan, run under each control
    engines = {control: engines_for(control) for control in controls}  # an image builds once, first

    def run_one(control: str, repeat: int) -> Path:
        return run_plan(plan, campaign_path, sha, runs_dir, engines=engines[control])

    t0 = time.monotonic()
    dirs = run_interleaved(repeats, controls, run_one, progress)
    out = summarize({k: [results.read_records(d) for d in v] for k, v in dirs.items()},
                    {k: [d.name for d in v] for k, v in dirs.items()}, controls)
    md = render([load_run(d) for control in controls for d in dirs[control]],
                runs_dir.parent / "reports" / f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    out["report"] = str(md)
    out["provenance"] = {**results.provenance(), "campaign": str(campaign_path), "campaign_sha256": sha,
                         "engine_control": {k: e.describe() for k, e in engines.items()},
                         "wall_s": time.monotonic() - t0}
    (md.parent / "compare.json").write_text(json.dumps(out, indent=2))
    return out
