"""The plan a campaign compiles to: what runs, in order, with nothing left to look up.

A plan is a list of setups; each runs in engine lives (one engine configuration each: the
engine's parameters), and each life is its steps in the order they run: engine start, the
scenarios' steps (each with its scenario's spec; an agents step with its workload and seed),
engine stop. The compiler (kvlab.harness.compiler) is the only reader of a campaign; the
runner executes a plan, `--dry-run` prints it, the progress bar counts its steps and the run
folder records it (`plan.json`, schema kvlab.plan/1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvlab.harness.sessions import GeneratorSpec, WorkloadSpec
from kvlab.wear import Drives

SCHEMA = "kvlab.plan/1"

StepKind = Literal[
    "engine-start",
    "restore-compute",
    "restore-recompute",
    "restore-warm",
    "restore-restart",
    "sweep",
    "agents",
    "engine-stop",
]


@dataclass(frozen=True)
class RestoreSpec:
    """One long prompt computed, then restored (the campaign's RestoreScenario says what each field is)."""

    tokens: int
    warmup_tokens: int
    recompute_prompts: int
    recompute_setup: str
    warm_repeats: int
    restart_repeats: int
    output_tokens: int
    drop_page_cache: bool
    settle_s: float
    prefix_caching: bool


@dataclass(frozen=True)
class SweepSpec:
    """Context lengths x rounds of the same input (the campaign's SweepScenario)."""

    lengths: tuple[int, ...]
    rounds: int
    average_rounds: tuple[int, int]
    output_tokens: int
    prefix_caching: bool
    settle_s: float
    drop_page_cache: bool


@dataclass(frozen=True)
class AgentsSpec:
    """N concurrent agents (the campaign's AgentsScenario); each N's workload is its step's."""

    concurrency: tuple[int, ...]
    frozen_threshold_s: float
    hit_min_fraction: float
    prefix_caching: bool
    answers: str | None  # the generator's answers (seeded, engine); None for a trace


ScenarioSpec = RestoreSpec | SweepSpec | AgentsSpec


@dataclass(frozen=True)
class Step:
    """One thing a life does, in order. `arg`: the repeat (restore), the length (sweep) or N
    (agents); `workload`: an agents step's turns, as a spec with its seed."""

    setup: str
    kind: StepKind
    what: str
    est_s: float = 0.0
    scenario: str | None = None
    spec: ScenarioSpec | None = None
    arg: int | None = None
    workload: WorkloadSpec | None = None


@dataclass(frozen=True)
class EngineSpec:
    """An engine life's configuration: kvlab.setups.EngineParams fields but those of the host
    it runs on (model path, ports, work folders), which the runner fills in."""

    device: str
    prefix_caching: bool
    values: Mapping[str, Any]


@dataclass(frozen=True)
class Life:
    setup: str
    index: int
    scenarios: tuple[str, ...]
    engine: EngineSpec
    steps: tuple[Step, ...]

    def spec(self, scenario: str) -> ScenarioSpec | None:
        return next((s.spec for s in self.steps if s.scenario == scenario), None)


@dataclass(frozen=True)
class SetupPlan:
    setup: str
    runs: bool
    reason: str | None
    lives: tuple[Life, ...]

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(s for life in self.lives for s in life.steps)


@dataclass(frozen=True)
class ModelPlan:
    """The model: the tiny one (its seed and TinyGeometry fields) or a folder on the engine host."""

    kind: Literal["tiny", "path"]
    served_name: str
    kv_bytes_per_token: int
    seed: int | None = None
    geometry: Mapping[str, Any] | None = None
    path: str | None = None


@dataclass(frozen=True)
class Plan:
    campaign: str
    device: str
    seed: int
    model: ModelPlan
    memory_interval_s: float
    files: tuple[Path, ...]  # every file the campaign refers to, resolved (their sha256 go in the provenance)
    variants: tuple[str, ...]
    cost_model: str
    setups: tuple[SetupPlan, ...]
    drives: Drives | None = None  # the drives the tiers write to (the report's wear projection)
    description: str = ""  # the campaign's, for the report's heading

    @property
    def steps(self) -> tuple[Step, ...]:
        """Every step that runs, in order (what the progress bar counts)."""
        return tuple(s for p in self.setups if p.runs for s in p.steps)


def restore_steps(setup: str, r: RestoreSpec) -> list[Step]:
    out = [Step(setup, "restore-compute", f"restore: compute {r.tokens} tokens", scenario="restore", spec=r)]
    if setup == r.recompute_setup:
        out.append(
            Step(
                setup,
                "restore-recompute",
                f"restore: recompute reference x{r.recompute_prompts}",
                scenario="restore",
                spec=r,
            )
        )
    out += [
        Step(
            setup,
            "restore-warm",
            f"restore: warm {i + 1}/{r.warm_repeats}",
            scenario="restore",
            spec=r,
            arg=i,
        )
        for i in range(r.warm_repeats)
    ]
    out += [
        Step(
            setup,
            "restore-restart",
            f"restore: restart {i + 1}/{r.restart_repeats}",
            scenario="restore",
            spec=r,
            arg=i,
        )
        for i in range(r.restart_repeats)
    ]
    return out


def sweep_steps(setup: str, sw: SweepSpec) -> list[Step]:
    return [
        Step(setup, "sweep", f"sweep: {n} tokens x {sw.rounds} rounds", scenario="sweep", spec=sw, arg=n)
        for n in sw.lengths
    ]


def agents_steps(setup: str, a: AgentsSpec, workloads: Mapping[int, WorkloadSpec]) -> list[Step]:
    def what(n: int) -> str:
        source = workloads[n].source
        return f"agents: N={n}" + (f", {source.turns} turns each" if isinstance(source, GeneratorSpec) else "")

    return [
        Step(setup, "agents", what(n), scenario="agents", spec=a, arg=n, workload=workloads[n])
        for n in a.concurrency
    ]


def life_steps(setup: str, prefix_caching: bool, scenario_steps: list[Step]) -> tuple[Step, ...]:
    start = Step(setup, "engine-start", f"engine start (prefix caching {'on' if prefix_caching else 'off'})")
    return (start, *scenario_steps, Step(setup, "engine-stop", "engine stop"))


def fmt_s(s: float) -> str:
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def total_estimate(plan: Plan) -> float:
    """The whole run's estimate: every step that runs, once per variant."""
    return sum(s.est_s for s in plan.steps) * max(1, len(plan.variants))


def render_plan(plan: Plan) -> str:
    lines = [f"campaign {plan.campaign} ({plan.device}): {len(plan.setups)} setup(s), seed {plan.seed}"]
    for p in plan.setups:
        if not p.runs:
            lines.append(f"  {p.setup}: SKIPPED: {p.reason}")
            continue
        lives = " | ".join("+".join(life.scenarios) for life in p.lives)
        lines.append(f"  {p.setup}: ~{fmt_s(sum(s.est_s for s in p.steps))}  (engine lives: {lives})")
        for life in p.lives:
            lines.append(f"    life {life.index + 1}: {'+'.join(life.scenarios)}")
            for s in life.steps:
                seed = f"  (seed {s.workload.seed}, {s.workload.step})" if s.workload else ""
                lines.append(f"    - {s.what:40s} ~{fmt_s(s.est_s)}{seed}")
    if plan.variants:
        lines.append(
            f"  x {len(plan.variants)} variant(s): {', '.join(plan.variants)} "
            f"(lab inventory parameters; each repeats the plan above)"
        )
    d = plan.drives
    if d is None:
        lines.append("  wear: no drives declared (bytes written are counted, not projected)")
    else:
        lines.append(f"  wear projected onto {d.describe()}")
    lines.append(f"estimate: ~{fmt_s(total_estimate(plan))} ({plan.cost_model} cost model; see estimate.py)")
    return "\n".join(lines)


def _json(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _json(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, Mapping):
        return {str(k): _json(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_json(x) for x in v]
    return v


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as the run folder records it (plan.json): each life's scenario specs once,
    its steps in order without them."""

    def life(x: Life) -> dict[str, Any]:
        specs = {s.scenario: _json(s.spec) for s in x.steps if s.scenario}
        steps = [
            {k: v for k, v in _json(s).items() if k not in ("setup", "spec") and v is not None}
            for s in x.steps
        ]
        return {
            "index": x.index,
            "scenarios": list(x.scenarios),
            "engine": _json(x.engine),
            "specs": specs,
            "steps": steps,
        }

    return {
        "schema": SCHEMA,
        "campaign": plan.campaign,
        "description": plan.description,
        "device": plan.device,
        "seed": plan.seed,
        "model": _json(plan.model),
        "memory_interval_s": plan.memory_interval_s,
        "files": [str(f) for f in plan.files],
        "variants": list(plan.variants),
        "cost_model": plan.cost_model,
        "drives": _json(plan.drives),
        "estimate_s": total_estimate(plan),
        "setups": [
            {"setup": p.setup, "runs": p.runs, "reason": p.reason, "lives": [life(x) for x in p.lives]}
            for p in plan.setups
        ],
    }
