"""A fair campaign: the sweep's page-cache drops counted (and refusals recorded), agents that carry
the engine's real answers, the block-aligned reusable share, and one warm recompute reference
for every restore. Synthetic records and a fake engine; no vLLM."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvlab.client import Completion
from kvlab.harness import campaign, metrics, pagecache, scenarios
from kvlab.harness.campaign_sources import GeneratorSource
from kvlab.harness.compiler import agents_spec, restore_spec, sweep_spec
from kvlab.harness.metrics import Turn
from kvlab.harness.plan import Step, restore_steps, sweep_steps
from kvlab.harness.report import render_run
from kvlab.harness.sessions import coding_agent_sessions
from kvlab.harness.summary import summarize, validate

ROOT = Path(__file__).resolve().parents[2]


# ---- the block-aligned reusable share ------------------------------------------------------
def test_the_reusable_share_rounds_each_turns_bound_down_to_whole_blocks() -> None:
    turns = [Turn(prompt_tokens=1200, cached_tokens=896, reusable_tokens=1000),  # bound 896 = 7 x 128
             Turn(prompt_tokens=700, cached_tokens=512, reusable_tokens=600),  # bound 512
             Turn(prompt_tokens=600, cached_tokens=0, reusable_tokens=0)]  # not returning: left out
    assert metrics.reusable_hit_share(turns, 128) == 1.0
    assert metrics.reusable_hit_share(turns, 16) == pytest.approx((896 + 512) / (992 + 592))


def test_the_bound_leaves_the_prompts_last_token_to_be_computed() -> None:
    # a whole prompt reusable (a trace request sent twice): vLLM computes its last token anyway
    assert metrics.block_aligned_reusable(Turn(256, 128, 256), 128) == 128
    assert metrics.block_aligned_reusable(Turn(257, 256, 256), 128) == 256


def test_restored_tokens_count_at_most_the_bound_and_no_bound_gives_no_share() -> None:
    assert metrics.reusable_hit_share([Turn(1200, 1100, 1000)], 128) == 1.0
    assert metrics.reusable_hit_share([Turn(1200, 0, 100)], 128) is None  # under one block: no bound
    assert metrics.reusable_hit_share([Turn(1200, 512, 1000)], None) is None  # block size unknown


# ---- the summary from synthetic records ----------------------------------------------------
def req(setup: str, **kw: Any) -> dict:
    return {"kind": "request", "setup": setup, "t_start": 0.0, "t_end": 1.0, "output_tokens": 4,
            "max_gap_s": 0.1, "cached_tokens": 0, "total_s": 1.0, "prompt_tokens": 1000} | kw


def fair_records() -> list[dict]:
    recs: list[dict] = []
    for setup in ("baseline", "kvlab"):
        recs.append({"kind": "engine_config", "setup": setup, "block_size": 128})
        recs.append(req(setup, scenario="restore", phase="warmup", repeat=0, ttft_s=9.0, tokens=256))
        recs.append(req(setup, scenario="restore", phase="compute", ttft_s=5.0 if setup == "kvlab" else 3.0))
        recs.append(req(setup, scenario="restore", phase="warm", repeat=0, ttft_s=0.4 if setup == "kvlab" else 2.0))
        recs.append(req(setup, scenario="restore", phase="restart", repeat=0, ttft_s=0.5 if setup == "kvlab" else 2.0,
                        page_cache_dropped=True))
        for r in range(1, 6):
            # kvlab: the drop is refused before round 3; baseline: every drop succeeds
            refused = setup == "kvlab" and r == 3
            recs.append(req(setup, scenario="sweep", length=1000, round=r, ttft_s=0.1,
                            cached_tokens=(896 if r != 4 else 512) if setup == "kvlab" else 0,
                            **scenarios.page_cache_fields("cannot write 1 to x: Permission denied" if refused else None)))
        recs.append(req(setup, scenario="agents", concurrency=1, agent=0, session=0, turn=0, reusable_tokens=0,
                        ttft_s=1.0, prompt_tokens=600, cached_tokens=0))
        recs.append(req(setup, scenario="agents", concurrency=1, agent=0, session=0, turn=1, reusable_tokens=660,
                        carried_answer_tokens=61, ttft_s=0.3, prompt_tokens=1300,
                        cached_tokens=640 if setup == "kvlab" else 0))
    for i, t in enumerate((2.0, 2.2, 1.8)):  # the reference: baseline only
        recs.append(req("baseline", scenario="restore", phase="recompute", repeat=i, ttft_s=t, tokens=4098))
    return recs


def test_sweep_cells_count_rounds_drops_and_cached_tokens() -> None:
    s = summarize(fair_records(), ["baseline", "kvlab"], avg_rounds=(2, 4))
    k, b = s.setups["kvlab"].sweep["1000"], s.setups["baseline"].sweep["1000"]
    assert (k.rounds, k.page_cache_dropped_rounds, k.cached_tokens) == (3, 2, 896)  # rounds 2-4: 896, 896, 512
    assert (b.rounds, b.page_cache_dropped_rounds, b.cached_tokens) == (3, 3, 0)


def test_agents_cells_give_the_reusable_share_and_the_setup_its_block_size() -> None:
    s = summarize(fair_records(), ["baseline", "kvlab"])
    k = s.setups["kvlab"]
    assert k.block_size == 128
    assert k.agents["1"].returning_reusable_hit_share == 1.0  # 640 of 660 // 128 * 128 = 640
    assert s.setups["baseline"].agents["1"].returning_reusable_hit_share == 0.0


def test_every_restore_is_set_against_one_recompute_reference() -> None:
    s = summarize(fair_records(), ["baseline", "kvlab"])
    ref = s.recompute_reference
    assert ref is not None and (ref.setup, ref.ttft_s, ref.samples, ref.tokens) == ("baseline", 2.0, 3, 4098)
    k = s.setups["kvlab"]
    assert k.recompute_ttft_s == 5.0 and k.recompute_samples == 1  # its own compute, warm-up left out
    assert k.restart_over_recompute == pytest.approx(0.25) and k.warm_over_recompute == pytest.approx(0.2)
    assert s.setups["baseline"].restart_over_recompute == pytest.approx(1.0)
    assert summarize([r for r in fair_records() if r.get("phase") != "recompute"], ["kvlab"]).recompute_reference is None


def test_the_report_says_whether_the_page_cache_was_dropped(tmp_path: Path) -> None:
    from kvlab.harness import results

    runs = tmp_path / "runs"
    w = results.RunWriter(runs, "r1")
    w.write_once(results.CAMPAIGN, (ROOT / "campaigns/embedded.yml").read_bytes())
    w.write_once(results.PROVENANCE, "{}")
    for r in fair_records():
        w.append(r)
    w.close()
    run, md = render_run(runs / "r1")
    text = md.read_text()
    # embedded.yml averages rounds 2-9: of these 5 rounds, 2-5
    assert "dropped before 7 of 8 averaged rounds" in text and "kvlab 1000: 3/4" in text
    assert "Recompute reference: 2.000 s, the median of 3 fresh 4098-token prompts on baseline" in text
    assert "block size (128 tokens)" in text and "carries the tokens the engine generated" in text
    obj = json.loads((md.parent / "summary.json").read_text())
    assert obj["schema"] == "kvlab.summary/5"
    assert obj["setups"]["kvlab"]["sweep"]["1000"]["page_cache_dropped_rounds"] == 3
    validate(obj)


# ---- the page cache drop ---------------------------------------------------------------------
def test_a_refused_drop_says_why(tmp_path: Path) -> None:
    reason = pagecache.drop_page_cache(tmp_path / "no-such-dir" / "drop_caches")
    assert reason and "No such file" in reason and "drop_caches" in reason


def test_a_drop_writes_1_for_the_page_cache_only(tmp_path: Path) -> None:
    control = tmp_path / "drop_caches"
    assert pagecache.drop_page_cache(control) is None
    assert control.read_text() == "1\n"


# ---- scenarios against a fake engine ----------------------------------------------------------
@dataclass
class FakeEngineProc:
    stops: int = 0

    def stop(self) -> None:
        self.stops += 1


@dataclass
class FakeDeployment:
    kv_transfer_config: None = None
    serves_dev_routes: bool = True  # bound to loopback: /reset_prefix_cache is served


@dataclass
class FakeServer:
    base_url: str = "http://fake"
    engine: FakeEngineProc = field(default_factory=FakeEngineProc)
    companion: None = None
    deployment: FakeDeployment = field(default_factory=FakeDeployment)

    def reset_prefix_cache(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0"}': 1.0}


class FakeEngine:
    """complete(): answers `max_tokens` ids derived from the prompt's length; prompts kept."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def __call__(self, url: str, model: str, prompt: list[int], max_tokens: int,
                 return_token_ids: bool = False) -> Completion:
        self.prompts.append(list(prompt))
        ids = [9000 + len(prompt) + i for i in range(max_tokens)]
        return Completion(ttft_s=0.01, total_s=0.02, output_tokens=max_tokens, prompt_tokens=len(prompt),
                          cached_tokens=0, text="", token_ids=ids if return_token_ids else None)


def target(setup: str, recs: list[dict]) -> scenarios.Target:
    return scenarios.Target(setup, FakeServer(), "m", None, recs.append, lambda m: None,  # type: ignore[arg-type]
                            lambda ph: None)


def test_the_engines_block_size_comes_from_its_cache_config() -> None:
    assert target("kvlab", []).block_size() == 128
    assert scenarios.block_size_of({"vllm:num_requests_running": 0.0}) is None


def run_steps(t: scenarios.Target, steps: list[Step]) -> None:
    """A scenario's steps of the plan, in order, as the runner runs them."""
    for step in steps:
        scenarios.run_step(t, step, 1, lambda: 1.0)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    fake = FakeEngine()
    monkeypatch.setattr(scenarios, "complete", fake)
    monkeypatch.setattr(scenarios.time, "sleep", lambda s: None)
    return fake


def test_a_refused_drop_is_recorded_on_every_sweep_round(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scenarios, "drop_page_cache", lambda: "cannot write 1 to /proc/sys/vm/drop_caches: "
                                                              "Read-only file system")
    notes: list[str] = []
    recs: list[dict] = []
    t = scenarios.Target("kvlab", FakeServer(), "m", None, recs.append, notes.append, lambda ph: None)  # type: ignore[arg-type]
    sc = campaign.SweepScenario(lengths=[100], rounds=3, average_rounds=(1, 3), drop_page_cache=True)
    run_steps(t, sweep_steps("kvlab", sweep_spec(sc)))
    sweep = [r for r in recs if r.get("scenario") == "sweep"]
    assert [r["page_cache_dropped"] for r in sweep] == [False] * 3
    assert all("Read-only file system" in r["page_cache_drop_error"] for r in sweep)
    assert sum("page cache not dropped" in n for n in notes) == 1  # said once, recorded every time
    assert summarize(recs, ["kvlab"], avg_rounds=(1, 3)).setups["kvlab"].sweep["100"].page_cache_dropped_rounds == 0


def test_sweep_rounds_drop_before_each_round_only_when_asked(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    drops: list[int] = []
    monkeypatch.setattr(scenarios, "drop_page_cache", lambda: drops.append(1))
    recs: list[dict] = []
    sc = campaign.SweepScenario(lengths=[100], rounds=2, average_rounds=(1, 2), drop_page_cache=True)
    run_steps(target("kvlab", recs), sweep_steps("kvlab", sweep_spec(sc)))
    assert len(drops) == 2 and all(r["page_cache_dropped"] is True for r in recs)
    recs.clear()
    sc = campaign.SweepScenario(lengths=[100], rounds=2, average_rounds=(1, 2))
    run_steps(target("kvlab", recs), sweep_steps("kvlab", sweep_spec(sc)))
    assert len(drops) == 2 and all("page_cache_dropped" not in r for r in recs)


GEN = dict(turns=3, system_tokens=40, first_user_tokens=8, tool_output_tokens=(10, 20), assistant_tokens=(5, 9),
           output_tokens=(3, 6), think_time_s=(0.0, 0.0))


def test_engine_answers_draw_the_same_sessions_as_seeded_ones_less_the_replies() -> None:
    seeded = coding_agent_sessions(GeneratorSource(**GEN).spec(2), 2, seed=1, step="s")
    real = coding_agent_sessions(GeneratorSource(**GEN, answers="engine").spec(2), 2, seed=1, step="s")
    for sa, ra in zip(seeded.agents, real.agents, strict=True):
        assert ra[0] == sa[0]  # the first turn has no answer to carry
        for s, r in zip(sa[1:], ra[1:], strict=True):
            assert r.after_answer and (r.max_tokens, r.think_s) == (s.max_tokens, s.think_s)
            assert s.prompt[-len(r.prompt):] == r.prompt  # the same tool output closes the turn


def test_each_next_turn_carries_the_tokens_the_engine_generated(engine: FakeEngine) -> None:
    src = GeneratorSource(**GEN, answers="engine")
    sc = campaign.AgentsScenario(concurrency=[1], source={"generator": src.model_dump()})
    wl = coding_agent_sessions(src.spec(1), 1, seed=1, step="s")
    recs: list[dict] = []
    scenarios.agents(target("kvlab", recs), agents_spec(sc), 1, wl)
    turns = sorted((r for r in recs if r.get("scenario") == "agents" and r["kind"] == "request"),
                   key=lambda r: r["turn"])
    p = engine.prompts
    for k in (1, 2):
        answer = [9000 + len(p[k - 1]) + i for i in range(wl.agents[0][k - 1].max_tokens)]
        assert p[k] == p[k - 1] + answer + list(wl.agents[0][k].prompt)  # previous prompt, its answer, the tool
        assert turns[k]["carried_answer_tokens"] == len(answer)
        assert turns[k]["reusable_tokens"] == len(p[k - 1]) + len(answer) - 1  # the last answer token: no KV
    assert turns[0]["reusable_tokens"] == 0 and "carried_answer_tokens" not in turns[0]
    assert [r for r in recs if r["kind"] == "step"][0]["answers"] == "engine"


def test_a_turn_with_no_answer_to_carry_is_a_recorded_error(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail_first(url: str, model: str, prompt: list[int], max_tokens: int, return_token_ids: bool = False) -> Completion:
        if not engine.prompts:
            engine.prompts.append(prompt)
            raise ConnectionError("engine gone")
        return engine(url, model, prompt, max_tokens, return_token_ids)

    monkeypatch.setattr(scenarios, "complete", fail_first)
    src = GeneratorSource(**GEN, answers="engine")
    sc = campaign.AgentsScenario(concurrency=[1], source={"generator": src.model_dump()})
    recs: list[dict] = []
    scenarios.agents(target("kvlab", recs), agents_spec(sc), 1, coding_agent_sessions(src.spec(1), 1, seed=1, step="s"))
    errors = [r["error"] for r in recs if r["kind"] == "request"]
    assert errors[0].startswith("ConnectionError") and all("no answer to carry" in e for e in errors[1:])
    assert len(errors) == 3 and summarize(recs, ["kvlab"]).setups["kvlab"].agents["1"].errors == 3


def test_the_restore_warms_each_engine_and_times_the_reference_on_its_setup(engine: FakeEngine) -> None:
    sc = campaign.RestoreScenario(tokens=300, warm_repeats=1, restart_repeats=2, settle_s=0, recompute_prompts=3,
                                  drop_page_cache=False)
    phases = {}
    for setup in ("baseline", "kvlab"):
        recs: list[dict] = []
        run_steps(target(setup, recs), restore_steps(setup, restore_spec(sc)))
        phases[setup] = [r["phase"] for r in recs]
    assert phases["baseline"] == ["warmup", "compute", "recompute", "recompute", "recompute", "warm",
                                  "warmup", "restart", "warmup", "restart"]
    assert phases["kvlab"] == ["warmup", "compute", "warm", "warmup", "restart", "warmup", "restart"]
    restored, *_ = engine.prompts[1:2]
    others = [p for p in engine.prompts if p != restored]
    assert all(p[:16] != restored[:16] for p in others)  # warm-ups and reference prompts share nothing with it
    assert len({tuple(p) for p in engine.prompts[2:5]}) == 3  # three fresh reference prompts


def test_a_named_recompute_setup_must_run_the_restore() -> None:
    d = {"name": "c", "model": {"tiny": {"seed": 0}}, "setups": ["kvlab"],
         "scenarios": {"restore": {"tokens": 100, "recompute_setup": "baseline"}}}
    with pytest.raises(campaign.CampaignError, match="recompute_setup: baseline does not run the restore"):
        campaign.parse(d)
    del d["scenarios"]["restore"]["recompute_setup"]  # the default: a reference where baseline runs
    assert campaign.parse(d).scenarios.restore.recompute_setup == "baseline"  # type: ignore[union-attr]


def test_the_embedded_campaign_turns_the_fair_sweep_and_real_answers_on() -> None:
    c, _ = campaign.load(ROOT / "campaigns/embedded.yml")
    assert c.scenarios.sweep and c.scenarios.sweep.drop_page_cache
    assert c.scenarios.agents and c.scenarios.agents.source.generator
    assert c.scenarios.agents.source.generator.answers == "engine"
    assert c.scenarios.restore and c.scenarios.restore.recompute_prompts >= 3
    assert "baseline" in (c.scenarios.restore.setups or c.setups)


def test_the_report_names_what_the_agents_send_back(tmp_path: Path) -> None:
    """From the plan the runner executed; a run from before plans were recorded, from its campaign.yml."""
    import json

    from kvlab.harness.report import RunInputs

    def of_plan(answers: str | None) -> str:
        run = tmp_path / f"plan-{answers}"
        run.mkdir()
        life = {"specs": {"agents": {"concurrency": [1], "answers": answers}}}
        (run / "plan.json").write_text(json.dumps({"campaign": "c", "setups": [{"setup": "kvlab", "lives": [life]}]}))
        return RunInputs.of_run(run).answers

    def of_campaign(source: dict) -> str:
        run = tmp_path / f"campaign-{len(list(tmp_path.iterdir()))}"
        run.mkdir()
        (run / "campaign.yml").write_text(json.dumps({"name": "c", "scenarios": {"agents": {"source": source}}}))
        return RunInputs.of_run(run).answers

    assert [of_plan(a) for a in (None, "seeded", "engine")] == ["trace", "seeded", "engine"]
    assert of_campaign({"mooncake": {"path": "t.jsonl"}}) == "trace"
    assert of_campaign({"generator": {"turns": 3}}) == "seeded"
    assert of_campaign({"generator": {"answers": "engine"}}) == "engine"
