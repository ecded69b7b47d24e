"""The plan of a campaign run: engine lives and steps, each with a time estimate.

Estimates come from the restore planner's arithmetic (kvlab.planner: prefill FLOPs of the
campaign's model, a restore through a tier) with constants per device measured where they
were: on the embedded CPU default (2 cores) the embedded-sweep run's curve, engines starting
in 25-40 s; on the lab's GPUs the first seed's 196K-token prefill (47.7 s) and restore (~2 s).
They size a run, nothing more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvlab.harness.campaign import Campaign
from kvlab.harness.sessions import agent_max_prompt_tokens, generator_max_prompt_tokens
from kvlab.planner import presets as planner_presets
from kvlab.planner.geometry import Geometry
from kvlab.planner.modelconfig import ModelError
from kvlab.planner.modelconfig import resolve as resolve_model
from kvlab.planner.node import PRESETS as node_presets
from kvlab.planner.presets import tiny_geometry
from kvlab.planner.recompute import PrefillCurve
from kvlab.planner.restore import restore as restore_tier
from kvlab.setups import registry as setups


@dataclass(frozen=True)
class CostModel:
    """The restore planner's arithmetic (kvlab.planner) with a device's constants: a prefill
    curve on the campaign model's FLOPs, a restore through the node's tier at an effective
    rate, engine starts and decode steps."""

    engine_start_s: float
    node: str  # kvlab.planner.node preset
    tier: str  # the restore's path on that node
    curve: PrefillCurve
    restore_gbps: float  # effective GB/s of restored KV
    restore_fixed_s: float
    decode_s_per_token: float
    geometry: Geometry | None = None  # the campaign's model (cost_model fills it in)

    def prefill(self, n: int) -> float:
        assert self.geometry is not None
        return self.curve.time(self.geometry, n)

    def restore(self, n: int, kv_bytes_per_token: int) -> float:
        g = self.geometry
        assert g is not None
        r = restore_tier(self.tier, node_presets[self.node], n * kv_bytes_per_token, 1, 1.0,
                         self.curve.compute_s(g, n, max(0, n - 1)), g.layers, self.restore_fixed_s,
                         transfer_gbps=self.restore_gbps)
        return r.total_s


# CPU (the embedded default, two cores): fitted on embedded-sweep's recomputes (100 to 100K
# tokens of the light tiny model) and kvlab's hits; `make demo`'s 4K-token prefill of the
# KV-heavy model comes out at ~1.1 s (measured 0.887 s; the curve before this was 4.85 s).
# CUDA: the first seed's GLM-5.3 on 8x H200, the FLOPs rate set so that its 196K-token
# prefill is the seed's 47.7 s, and its ~2 s restore.
COST = {
    "cpu": CostModel(engine_start_s=40, node="cpu", tier="nvme-host",
                     curve=PrefillCurve(100e9, 0.0, 0.07, "embedded-sweep, two cores"),
                     restore_gbps=0.35, restore_fixed_s=0.05, decode_s_per_token=0.03),
    "cuda": CostModel(engine_start_s=300, node="h200", tier="nvme-gds",
                      curve=PrefillCurve(5.0e14, 0.0, 0.1, "the first seed: 196K tokens in 47.7 s"),
                      restore_gbps=5.0, restore_fixed_s=0.2, decode_s_per_token=0.04),
}


def campaign_geometry(c: Campaign) -> Geometry:
    """The campaign model's geometry: the tiny model's fields, a model folder's config.json
    where this host has it, else the first seed's GLM-5.3 (the lab's model) scaled to the
    campaign's kv_bytes_per_token."""
    if c.model.tiny is not None:
        return tiny_geometry("tiny", c.model.tiny.tiny_geometry())
    try:
        return resolve_model(c.model.path or "")
    except ModelError:
        return planner_presets.get("glm-5.3")


def cost_model(c: Campaign) -> CostModel:
    return dataclasses.replace(COST[c.device], geometry=campaign_geometry(c))


@dataclass(frozen=True)
class Step:
    setup: str
    life: int  # engine life within the setup (a restart starts a new one inside restore)
    what: str
    est_s: float


@dataclass(frozen=True)
class SetupPlan:
    setup: str
    runs: bool
    reason: str | None
    lives: tuple[tuple[str, ...], ...]  # scenario names per engine life
    steps: tuple[Step, ...]


def lives_of(c: Campaign, setup: str) -> list[tuple[bool, list[str]]]:
    """A setup's scenarios grouped by the engine's prefix caching, restore first (it
    resets the cache)."""
    on: list[str] = []
    off: list[str] = []
    for name in c.scenarios_for(setup):
        (on if getattr(c.scenarios, name).prefix_caching else off).append(name)
    return [(flag, names) for flag, names in ((True, on), (False, off)) if names]


def setup_runs_here(name: str, device: str) -> tuple[bool, str | None]:
    setup = setups.get(name)
    if device not in setup.devices:
        return False, f"setup {name!r} runs on {'/'.join(setup.devices)}, not on this campaign's device {device!r}"
    return True, None


def kv_bytes_per_token(c: Campaign) -> int:
    if c.model.kv_bytes_per_token:
        return c.model.kv_bytes_per_token
    return c.model.tiny.tiny_geometry().kv_bytes_per_token if c.model.tiny else 0


def _agents_est(c: Campaign, n: int, cm: CostModel, cached: bool, base: Path | None) -> float:
    a = c.scenarios.agents
    assert a is not None
    if a.source.generator:
        g = a.source.generator
        top = generator_max_prompt_tokens(g)
        mean_new = (g.tool_output_tokens[0] + g.tool_output_tokens[1] + g.assistant_tokens[0] + g.assistant_tokens[1]) / 2
        per_turn_prefill = cm.prefill(int(mean_new)) if cached else cm.prefill(top // 2) * 1.0
        out = (g.output_tokens[0] + g.output_tokens[1]) / 2
        think = (g.think_time_s[0] + g.think_time_s[1]) / 2
        # prefill serializes on the one engine; decode and think time overlap between agents
        return n * g.turns * per_turn_prefill + g.turns * (out * cm.decode_s_per_token + think)
    m = a.source.mooncake
    assert m is not None
    top = agent_max_prompt_tokens(a.source, base)
    return m.limit * (cm.prefill(top // 2) * (0.5 if cached else 1.0) + m.max_output_tokens * cm.decode_s_per_token / n)


def plan(c: Campaign, base: Path | None = None) -> list[SetupPlan]:
    cm = cost_model(c)
    kvb = kv_bytes_per_token(c)
    out = []
    for name in c.setups:
        runs, reason = setup_runs_here(name, c.device)
        cached = name != "baseline"
        steps: list[Step] = []
        lives = lives_of(c, name)
        life = 0
        for _, names in lives:
            steps.append(Step(name, life, "engine start", cm.engine_start_s))
            for sc in names:
                if sc == "restore":
                    r = c.scenarios.restore
                    assert r is not None
                    comp = cm.prefill(r.tokens)
                    again = cm.restore(r.tokens, kvb) if cached else comp
                    warm_up = cm.prefill(r.warmup_tokens)  # every engine life answers one first
                    steps.append(Step(name, life, f"restore: compute {r.tokens} tokens",
                                      warm_up + comp + r.settle_s))
                    if name == r.recompute_setup:
                        steps.append(Step(name, life, f"restore: recompute reference x{r.recompute_prompts}",
                                          r.recompute_prompts * comp))
                    for i in range(r.warm_repeats):
                        steps.append(Step(name, life, f"restore: warm {i + 1}/{r.warm_repeats}", again))
                    for i in range(r.restart_repeats):
                        life += 1
                        steps.append(Step(name, life, f"restore: restart {i + 1}/{r.restart_repeats}",
                                          cm.engine_start_s + warm_up + again + r.settle_s))
                elif sc == "sweep":
                    sw = c.scenarios.sweep
                    assert sw is not None
                    for n in sw.lengths:
                        per = cm.prefill(n) + sw.output_tokens * cm.decode_s_per_token + sw.settle_s
                        hit = (cm.restore(n, kvb) + sw.output_tokens * cm.decode_s_per_token + sw.settle_s
                               if cached else per)
                        steps.append(Step(name, life, f"sweep: {n} tokens x {sw.rounds} rounds",
                                          per + (sw.rounds - 1) * hit))
                elif sc == "agents":
                    a = c.scenarios.agents
                    assert a is not None
                    for n in a.concurrency:
                        steps.append(Step(name, life, f"agents: N={n}", _agents_est(c, n, cm, cached, base)))
            steps.append(Step(name, life, "engine stop", 5))
            life += 1
        out.append(SetupPlan(name, runs, reason, tuple(tuple(n) for _, n in lives), tuple(steps)))
    return out


def fmt_s(s: float) -> str:
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def render_plan(c: Campaign, plans: list[SetupPlan]) -> str:
    lines = [f"campaign {c.name} ({c.device}): {len(c.setups)} setup(s), seed {c.seed}"]
    variants = c.variants or []
    total = 0.0
    for p in plans:
        if not p.runs:
            lines.append(f"  {p.setup}: SKIPPED: {p.reason}")
            continue
        est = sum(s.est_s for s in p.steps)
        total += est
        lives = " | ".join("+".join(n) for n in p.lives)
        lines.append(f"  {p.setup}: ~{fmt_s(est)}  (engine lives: {lives})")
        for s in p.steps:
            lines.append(f"    - {s.what:40s} ~{fmt_s(s.est_s)}")
    if variants:
        lines.append(f"  x {len(variants)} variant(s): {', '.join(v.name for v in variants)} "
                     f"(lab inventory parameters; each repeats the plan above)")
        total *= len(variants)
    lines.append(f"estimate: ~{fmt_s(total)} ({'CPU' if c.device == 'cpu' else 'GPU'} cost model; see plan.py)")
    return "\n".join(lines)
