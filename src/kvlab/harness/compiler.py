"""The compiler: a campaign becomes the plan it runs (kvlab.harness.plan), in one place.

This is the only module that reads a campaign's fields on the way to a run: setups x scenarios
become engine lives in order, each with its engine parameters and its steps; the scenarios'
fields become specs, the agents' sources workload specs with their seeds, and every step gets
its estimate (kvlab.harness.estimate). The runner, the scenarios and the sessions take the plan.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from kvlab.harness.campaign import AgentsScenario, Campaign, RestoreScenario, SweepScenario
from kvlab.harness.estimate import COST, CostModel, step_seconds
from kvlab.harness.plan import (
    AgentsSpec,
    EngineSpec,
    Life,
    ModelPlan,
    Plan,
    RestoreSpec,
    SetupPlan,
    Step,
    SweepSpec,
    agents_steps,
    life_steps,
    restore_steps,
    sweep_steps,
)
from kvlab.harness.sessions import WorkloadSpec
from kvlab.planner import presets as planner_presets
from kvlab.planner.geometry import Geometry
from kvlab.planner.modelconfig import ModelError
from kvlab.planner.modelconfig import resolve as resolve_model
from kvlab.planner.presets import tiny_geometry
from kvlab.setups import registry as setups

# A scenario's own fields that are not its spec's: which setups run it is the plan's shape.
_NOT_SPEC = {"setups", "source"}


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
        return (
            False,
            f"setup {name!r} runs on {'/'.join(setup.devices)}, not on this campaign's device {device!r}",
        )
    return True, None


def kv_bytes_per_token(c: Campaign) -> int:
    if c.model.kv_bytes_per_token:
        return c.model.kv_bytes_per_token
    return c.model.tiny.tiny_geometry().kv_bytes_per_token if c.model.tiny else 0


def engine_values(c: Campaign, max_prompt: int) -> dict[str, Any]:
    """The EngineParams fields every life of every setup shares: sized for the longest prompt,
    then the campaign's `engine`."""
    kvb = kv_bytes_per_token(c)
    values: dict[str, Any] = {
        "max_model_len": int(math.ceil((max_prompt + 1024) / 1024) * 1024),
        "cpu_kv_cache_gib": max(2, math.ceil(max_prompt * kvb * 4 / (1 << 30))),
    }
    # A setup whose connector needs the whole prompt in one step (ExampleConnector) gets a
    # batch that holds it, and so does every other setup: the flags stay identical.
    if any(setups.get(s).needs_full_prompt_batch for s in c.setups):
        values["max_num_batched_tokens"] = max(values["max_model_len"], 8192)
    values.update(c.engine)
    return values


def model_plan(c: Campaign) -> ModelPlan:
    kvb = kv_bytes_per_token(c)
    if c.model.tiny is not None:
        return ModelPlan("tiny", "tiny", kvb, seed=c.model.tiny.seed, geometry=dict(c.model.tiny.geometry))
    return ModelPlan("path", c.model.served_name, kvb, path=c.model.path)


def restore_spec(sc: RestoreScenario) -> RestoreSpec:
    return RestoreSpec(**sc.model_dump(exclude=_NOT_SPEC))


def sweep_spec(sc: SweepScenario) -> SweepSpec:
    d = sc.model_dump(exclude=_NOT_SPEC)
    return SweepSpec(**{**d, "lengths": tuple(d["lengths"])})


def agents_spec(sc: AgentsScenario) -> AgentsSpec:
    d = sc.model_dump(exclude=_NOT_SPEC)
    return AgentsSpec(
        **{
            **d,
            "concurrency": tuple(d["concurrency"]),
            "answers": sc.source.generator.answers if sc.source.generator else None,
        }
    )


def scenario_steps(c: Campaign, setup: str, name: str, base: Path | None) -> list[Step]:
    """A scenario's steps on one setup, in the order they run."""
    sc = c.scenarios
    if name == "restore":
        assert sc.restore is not None
        return restore_steps(setup, restore_spec(sc.restore))
    if name == "sweep":
        assert sc.sweep is not None
        return sweep_steps(setup, sweep_spec(sc.sweep))
    assert name == "agents" and sc.agents is not None
    a = sc.agents
    return agents_steps(
        setup, agents_spec(a), {n: WorkloadSpec(a.source.spec(n, base), n, c.seed, f"agents-{n}") for n in a.concurrency}
    )


def compile_campaign(c: Campaign, base: Path | None = None) -> Plan:
    """The plan of a campaign; `base` is the campaign file's folder (files it names resolve there)."""
    cm = cost_model(c)
    kvb = kv_bytes_per_token(c)
    values = engine_values(c, c.max_prompt_tokens(base))
    out = []
    for name in c.setups:
        runs, reason = setup_runs_here(name, c.device)
        cached = name != "baseline"
        lives = []
        for i, (prefix_caching, names) in enumerate(lives_of(c, name)):
            steps = life_steps(
                name, prefix_caching, [s for sc in names for s in scenario_steps(c, name, sc, base)]
            )
            steps = tuple(dataclasses.replace(s, est_s=step_seconds(cm, s, kvb, cached)) for s in steps)
            lives.append(Life(name, i, tuple(names), EngineSpec(c.device, prefix_caching, values), steps))
        out.append(SetupPlan(name, runs, reason, tuple(lives)))
    return Plan(
        campaign=c.name,
        device=c.device,
        seed=c.seed,
        model=model_plan(c),
        memory_interval_s=c.memory.interval_s,
        files=tuple(f.path for f in c.files(base)),
        variants=tuple(v.name for v in c.variants),
        cost_model="CPU" if c.device == "cpu" else "GPU",
        setups=tuple(out),
        drives=c.drives.drives() if c.drives else None,
        description=c.description,
    )


def run_campaign(
    c: Campaign,
    campaign_path: Path,
    campaign_sha: str,
    runs_dir: Path,
    keep_stores: bool = False,
    engines: Any = None,
) -> Path:
    """Compile, then run: the campaign file's plan, executed (kvlab.harness.runner.run_plan)."""
    from kvlab.harness.runner import run_plan

    return run_plan(
        compile_campaign(c, campaign_path.parent),
        campaign_path,
        campaign_sha,
        runs_dir,
        keep_stores=keep_stores,
        engines=engines,
    )
