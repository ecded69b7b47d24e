"""How long a plan's steps take: an estimate that sizes a run, nothing more.

Estimates come from the restore planner's arithmetic (kvlab.planner: prefill FLOPs of the
campaign's model, a restore through a tier) with constants per device measured where they
were: on the embedded CPU default (2 cores) the embedded-sweep run's curve, engines starting
in 25-40 s; on the lab's GPUs the first seed's 196K-token prefill (47.7 s) and restore (~2 s).
Each estimate takes a step of the plan (kvlab.harness.plan) and its specs, never the campaign.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.harness.plan import AgentsSpec, RestoreSpec, Step, SweepSpec
from kvlab.harness.sessions import (
    GeneratorSpec,
    WorkloadSpec,
    agent_max_prompt_tokens,
)
from kvlab.planner.geometry import Geometry
from kvlab.planner.node import PRESETS as node_presets
from kvlab.planner.recompute import PrefillCurve
from kvlab.planner.restore import restore as restore_tier


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

    def extend(self, start: int, n: int) -> float:
        """Computing tokens start..n on top of a context of `start` tokens already in the cache."""
        assert self.geometry is not None
        return self.curve.time(self.geometry, n, start)

    def restore(self, n: int, kv_bytes_per_token: int) -> float:
        g = self.geometry
        assert g is not None
        r = restore_tier(
            self.tier,
            node_presets[self.node],
            n * kv_bytes_per_token,
            1,
            1.0,
            self.curve.compute_s(g, n, max(0, n - 1)),
            g.layers,
            self.restore_fixed_s,
            transfer_gbps=self.restore_gbps,
        )
        return r.total_s


# CPU (the embedded default, two cores): fitted on embedded-sweep's recomputes (100 to 100K
# tokens of the light tiny model) and kvlab's hits; `make demo`'s 4K-token prefill of the
# KV-heavy model comes out at ~1.1 s (measured 0.887 s; the curve before this was 4.85 s).
# CUDA: the first seed's GLM-5.3 on 8x H200, the FLOPs rate set so that its 196K-token
# prefill is the seed's 47.7 s, and its ~2 s restore.
COST = {
    "cpu": CostModel(
        engine_start_s=40,
        node="cpu",
        tier="nvme-host",
        curve=PrefillCurve(100e9, 0.0, 0.07, "embedded-sweep, two cores"),
        restore_gbps=0.35,
        restore_fixed_s=0.05,
        decode_s_per_token=0.03,
    ),
    "cuda": CostModel(
        engine_start_s=300,
        node="h200",
        tier="nvme-gds",
        curve=PrefillCurve(5.0e14, 0.0, 0.1, "the first seed: 196K tokens in 47.7 s"),
        restore_gbps=5.0,
        restore_fixed_s=0.2,
        decode_s_per_token=0.04,
    ),
}


ENGINE_STOP_S = 5.0


def _agents(cm: CostModel, wl: WorkloadSpec, kv_bytes_per_token: int, cached: bool) -> float:
    """Prefill serializes on the one engine; decode and think time overlap between agents.
    A generated agent's first turn is computed in every setup; each returning turn then computes
    its new tokens (a tool's output, the previous answer) on top of its context, restored
    (`cached`) or computed again. Checked against measured cells in tests/unit/test_harness_campaign.py."""
    n = wl.agents
    if isinstance(wl.source, GeneratorSpec):
        g = wl.source
        reply = g.output_tokens if g.answers == "engine" else g.assistant_tokens
        new = (sum(g.tool_output_tokens) + sum(reply)) / 2
        context = g.system_tokens + g.first_user_tokens
        per_agent = cm.prefill(context)
        for _turn in range(1, g.turns):
            grown = int(context + new)
            if cached:
                per_agent += cm.extend(int(context), grown) + cm.restore(int(context), kv_bytes_per_token)
            else:
                per_agent += cm.prefill(grown)
            context += new
        out = sum(g.output_tokens) / 2
        think = sum(g.think_time_s) / 2
        return n * per_agent + g.turns * (out * cm.decode_s_per_token + think)
    m = wl.source
    top = agent_max_prompt_tokens(m)
    return m.limit * (
        cm.prefill(top // 2) * (0.5 if cached else 1.0) + m.max_output_tokens * cm.decode_s_per_token / n
    )


def step_seconds(cm: CostModel, step: Step, kv_bytes_per_token: int, cached: bool) -> float:
    """A step's estimate; `cached`: the setup restores (every setup but baseline)."""
    spec = step.spec
    if step.kind == "engine-start":
        return cm.engine_start_s
    if step.kind == "engine-stop":
        return ENGINE_STOP_S
    if isinstance(spec, RestoreSpec):
        comp = cm.prefill(spec.tokens)
        again = cm.restore(spec.tokens, kv_bytes_per_token) if cached else comp
        warm_up = cm.prefill(spec.warmup_tokens)  # every engine life answers one first
        return {
            "restore-compute": warm_up + comp + spec.settle_s,
            "restore-recompute": spec.recompute_prompts * comp,
            "restore-warm": again,
            "restore-restart": cm.engine_start_s + warm_up + again + spec.settle_s,
        }[step.kind]
    if isinstance(spec, SweepSpec):
        assert step.arg is not None
        n = step.arg
        per = cm.prefill(n) + spec.output_tokens * cm.decode_s_per_token + spec.settle_s
        hit = (
            cm.restore(n, kv_bytes_per_token) + spec.output_tokens * cm.decode_s_per_token + spec.settle_s
            if cached
            else per
        )
        return per + (spec.rounds - 1) * hit
    assert isinstance(spec, AgentsSpec) and step.workload is not None
    return _agents(cm, step.workload, kv_bytes_per_token, cached)
