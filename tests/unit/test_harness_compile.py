"""Compile, then run: a campaign becomes one plan (engine lives, each with its steps, specs,
workloads and seeds, estimates) in the compiler alone; the dry run prints that plan, the
runner walks exactly its lives and steps, the progress bar counts them, and the run folder
records the plan. Nothing that runs a campaign imports the campaign's model."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvlab.client import Completion
from kvlab.harness import campaign, results, scenarios
from kvlab.harness.compiler import compile_campaign, lives_of
from kvlab.harness.plan import SCHEMA, Life, Plan, Step, plan_json, render_plan
from kvlab.harness.progress import Progress
from kvlab.harness.runner import run_life
from kvlab.setups import registry as setups

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "src" / "kvlab" / "harness"
CAMPAIGNS = sorted((ROOT / "campaigns").glob("*.yml"))
# What takes the plan: the runner, the scenarios and sessions it runs, the estimate, the
# progress bar, the report (a run's plan.json), and the plan's own types.
TAKE_THE_PLAN = ("runner", "scenarios", "sessions", "estimate", "progress", "report", "plan")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top, inside a function or under TYPE_CHECKING;
    `from P import x` counts as P.x too (x may be a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("module", TAKE_THE_PLAN)
def test_what_runs_a_campaign_imports_nothing_of_the_campaigns_model(module: str) -> None:
    reads = sorted(
        m
        for m in imported_modules(HARNESS / f"{module}.py")
        if m.startswith("kvlab.harness.campaign") or m in ("kvlab.harness.compiler", "kvlab.harness.cli")
    )
    assert reads == [], f"kvlab.harness.{module} imports {', '.join(reads)}: it must take the plan"


def test_the_report_reads_the_plan_the_run_recorded_not_its_campaign_file(tmp_path: Path) -> None:
    """The plan is what ran: where a run's campaign.yml says otherwise (edited after the run),
    the report follows plan.json."""
    from kvlab.harness.plan import plan_json
    from kvlab.harness.report import RunInputs

    path = ROOT / "campaigns/ci-small.yml"
    (tmp_path / "plan.json").write_text(json.dumps(plan_json(compiled(path))))
    edited = yaml.safe_load(path.read_text())
    edited.update(name="edited", setups=["kvlab"], description="edited")
    edited["scenarios"]["agents"]["frozen_threshold_s"] = 99
    (tmp_path / "campaign.yml").write_text(yaml.safe_dump(edited))
    inputs = RunInputs.of_run(tmp_path)
    assert (inputs.name, inputs.setups) == ("ci-small", ["baseline", "kvlab"])
    assert inputs.description.startswith("CI's small embedded campaign")
    assert inputs.specs["agents"]["frozen_threshold_s"] == 3 and inputs.answers == "engine"
    assert inputs.specs["restore"]["tokens"] == 2050 and inputs.specs["sweep"]["average_rounds"] == [2, 3]


def test_the_check_sees_an_import_of_the_campaign(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvlab.harness import campaign_base\n"
    )
    assert "kvlab.harness.campaign_base" in imported_modules(f)


def compiled(path: Path) -> Plan:
    c, _ = campaign.load(path)
    return compile_campaign(c, path.parent)


def printed_steps(text: str) -> dict[str, list[list[str]]]:
    """The dry run's lives and steps per setup, as printed."""
    out: dict[str, list[list[str]]] = {}
    setup = None
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and ": ~" in line:
            setup = line.split(":")[0].strip()
            out[setup] = []
        elif line.startswith("    life ") and setup:
            out[setup].append([])
        elif line.startswith("    - ") and setup:
            out[setup][-1].append(line[6:].split(" ~")[0].strip())
    return out


@pytest.mark.parametrize("path", CAMPAIGNS, ids=lambda p: p.name)
def test_the_dry_run_prints_the_compiled_plan(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab.cli import main

    plan = compiled(path)
    assert main(["campaign", "run", str(path), "--dry-run"]) == 0
    printed = printed_steps(capsys.readouterr().out)
    assert printed == {
        p.setup: [[s.what for s in life.steps] for life in p.lives] for p in plan.setups if p.runs
    }


@pytest.mark.parametrize("path", CAMPAIGNS, ids=lambda p: p.name)
def test_each_life_starts_its_engine_runs_its_scenarios_steps_in_order_and_stops_it(path: Path) -> None:
    c, _ = campaign.load(path)
    plan = compile_campaign(c, path.parent)
    assert [p.setup for p in plan.setups] == c.setups
    for p in plan.setups:
        assert [(life.engine.prefix_caching, list(life.scenarios)) for life in p.lives] == lives_of(
            c, p.setup
        )
        for life in p.lives:
            kinds = [s.kind for s in life.steps]
            assert kinds[0] == "engine-start" and kinds[-1] == "engine-stop"
            assert [s.scenario for s in life.steps[1:-1]] == sorted(
                (s.scenario for s in life.steps[1:-1]), key=list(life.scenarios).index
            )
            assert all(s.setup == p.setup and s.est_s > 0 for s in life.steps)
            for s in life.steps:
                if s.kind == "agents":  # a workload with the campaign's seed, one per N
                    assert s.workload is not None and s.workload.seed == c.seed and s.workload.agents == s.arg
    assert plan.steps == tuple(s for p in plan.setups if p.runs for s in p.steps)


def test_the_plan_is_recorded_as_json_with_its_own_schema() -> None:
    plan = compiled(ROOT / "campaigns/ci-small.yml")
    obj = json.loads(json.dumps(plan_json(plan)))
    assert obj["schema"] == SCHEMA == "kvlab.plan/1"
    assert obj["campaign"] == "ci-small" and obj["seed"] == 7
    [kvlab] = [p for p in obj["setups"] if p["setup"] == "kvlab"]
    [life] = kvlab["lives"]
    assert life["engine"]["prefix_caching"] is False and life["engine"]["values"]["cpu_kv_cache_gib"] == 1
    assert set(life["specs"]) == {"restore", "sweep", "agents"}
    assert [s["what"] for s in life["steps"]] == [s.what for s in plan.setups[1].lives[0].steps]
    agents = [s for s in life["steps"] if s["kind"] == "agents"]
    assert [a["workload"]["seed"] for a in agents] == [7, 7] and agents[0]["workload"]["step"] == "agents-1"
    assert obj["estimate_s"] == pytest.approx(sum(s.est_s for s in plan.steps))


# ---- the runner walks the plan ---------------------------------------------------------------
@dataclass
class FakeProc:
    def stop(self) -> None:
        pass


@dataclass
class FakeServer:
    """An engine's control surface, without an engine (the engine tier runs real ones)."""

    deployment: setups.Deployment
    base_url: str = "http://fake"
    engine: FakeProc = field(default_factory=FakeProc)
    companion: None = None
    starts: int = 0

    def start(self, progress: bool = False) -> float:
        self.starts += 1
        return 1.0

    def stop(self) -> None:
        pass

    def pids(self) -> dict[str, int | None]:
        return {"engine": None, "cache_server": None}

    def memory(self) -> dict[str, Any]:
        return {"engine": None}

    def reset_prefix_cache(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {'vllm:cache_config_info{block_size="128",num_gpu_blocks="64"}': 1.0}


class FakeEngines:
    def __init__(self) -> None:
        self.servers: list[FakeServer] = []

    def deployment(self, setup: str, params: setups.EngineParams) -> setups.Deployment:
        return setups.render(setup, params)

    def server(self, deployment: setups.Deployment, log_dir: Path) -> FakeServer:
        self.servers.append(FakeServer(deployment))
        return self.servers[-1]

    def describe(self) -> dict[str, Any]:
        return {"kind": "fake"}


class Walked(Progress):
    def __init__(self, steps: tuple[Step, ...]):
        super().__init__(steps)
        self.walked: list[Step] = []

    def advance(self, step: Step) -> None:
        self.walked.append(step)
        super().advance(step)


def complete(
    url: str, model: str, prompt: list[int], max_tokens: int, return_token_ids: bool = False
) -> Completion:
    ids = [9000 + i for i in range(max_tokens)]
    return Completion(
        ttft_s=0.01,
        total_s=0.02,
        output_tokens=max_tokens,
        prompt_tokens=len(prompt),
        cached_tokens=0,
        text="",
        token_ids=ids if return_token_ids else None,
    )


@pytest.mark.parametrize("setup", ["baseline", "kvlab"])
def test_the_runner_walks_exactly_the_plans_lives_and_steps(
    setup: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scenarios, "complete", complete)
    monkeypatch.setattr(scenarios.time, "sleep", lambda s: None)
    monkeypatch.setattr(scenarios, "drop_page_cache", lambda: None)
    plan = compiled(ROOT / "campaigns/ci-small.yml")
    [p] = [p for p in plan.setups if p.setup == setup]
    writer = results.RunWriter(tmp_path / "runs", "r")
    progress = Walked(plan.steps)
    engines = FakeEngines()
    for life in p.lives:
        assert run_life(plan, life, tmp_path / "model", "tiny", tmp_path / "work", writer, progress, engines)  # type: ignore[arg-type]
    writer.close()
    assert progress.walked == list(p.steps)
    records = results.read_records(writer.dir)
    life: Life = p.lives[0]
    restore = life.spec("restore")
    assert restore is not None
    assert sum(r.get("event") == "engine_start" for r in records) == 1 + restore.restart_repeats  # type: ignore[union-attr]
    seen = [r["scenario"] for r in records if r.get("kind") in ("request", "step")]
    assert [x for i, x in enumerate(seen) if i == 0 or seen[i - 1] != x] == list(life.scenarios)
    recompute = [r for r in records if r.get("phase") == "recompute"]
    assert len(recompute) == (restore.recompute_prompts if setup == "baseline" else 0)  # type: ignore[union-attr]
    sweep = [r["length"] for r in records if r.get("kind") == "request" and r.get("scenario") == "sweep"]
    assert sweep == [n for s in life.steps if s.kind == "sweep" for n in [s.arg] * s.spec.rounds]  # type: ignore[union-attr]
    assert [r["concurrency"] for r in records if r.get("kind") == "step"] == [1, 2]


def test_render_names_each_life_and_the_workloads_seed() -> None:
    text = render_plan(compiled(ROOT / "campaigns/ci-small.yml"))
    assert "    life 1: restore+sweep+agents" in text
    assert "agents: N=2" in text and "(seed 7, agents-2)" in text
