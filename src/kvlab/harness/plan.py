"""The plan of a campaign run: engine lives and steps, each with a time estimate.

Estimates come from a cost model per device, calibrated on what was measured: on the
embedded CPU default (2 cores, the tiny fp32 model) prefill is ~O(n^2) (~15 s at 8K,
~200 s at 32K) and an engine starts in 25-40 s; on the lab's GPUs the first seed's
196K-token prefill took 47.7 s and its restore ~2 s. They size a run, nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvlab.harness.campaign import Campaign
from kvlab.harness.sessions import agent_max_prompt_tokens, generator_max_prompt_tokens
from kvlab.setups import registry as setups

TINY_KV_BYTES_PER_TOKEN = 16384


@dataclass(frozen=True)
class CostModel:
    engine_start_s: float
    prefill_quadratic: float  # s per token^2
    prefill_linear: float  # s per token
    restore_gbps: float
    restore_fixed_s: float
    decode_s_per_token: float

    def prefill(self, n: int) -> float:
        return self.prefill_quadratic * n * n + self.prefill_linear * n + 0.05

    def restore(self, n: int, kv_bytes_per_token: int) -> float:
        return self.restore_fixed_s + n * kv_bytes_per_token / (self.restore_gbps * 1e9)


COST = {
    "cpu": CostModel(engine_start_s=40, prefill_quadratic=2e-7, prefill_linear=4e-4, restore_gbps=1.0,
                     restore_fixed_s=0.1, decode_s_per_token=0.03),
    "cuda": CostModel(engine_start_s=300, prefill_quadratic=1.2e-9, prefill_linear=1e-5, restore_gbps=5.0,
                      restore_fixed_s=0.2, decode_s_per_token=0.04),
}


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
    return TINY_KV_BYTES_PER_TOKEN if c.model.tiny else 0


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
    cm = COST[c.device]
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
