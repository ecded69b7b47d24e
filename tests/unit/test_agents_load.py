"""The agents scenario under load, without an engine: the working set against the engine's own
KV cache, the saves dropped, and the load campaign's sizing (campaigns/embedded-agents.yml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.harness import campaign
from kvlab.harness.compiler import compile_campaign
from kvlab.harness.report import agents_load_rows
from kvlab.harness.scenarios import engine_cache_tokens_of, working_set_tokens
from kvlab.harness.sessions import workload
from kvlab.harness.summary import summarize

ROOT = Path(__file__).resolve().parents[2]
LOAD = ROOT / "campaigns" / "embedded-agents.yml"


def test_the_working_set_counts_a_shared_prefix_once_and_partial_blocks_by_their_tokens() -> None:
    system = tuple(range(100, 108))  # two blocks of 4, shared
    a = system + (1, 2, 3, 4, 5)  # + one whole block and one token
    b = system + (9, 9)  # + a partial block
    assert working_set_tokens([a], 4) == 13
    assert working_set_tokens([a, b], 4) == 13 + 2
    assert working_set_tokens([a, a], 4) == 13  # the same prompt twice is one working set
    # equal tokens after different prefixes are different KV: counted twice
    assert working_set_tokens([(1, 2, 3, 4, 7, 7, 7, 7), (5, 6, 7, 8, 7, 7, 7, 7)], 4) == 16
    assert working_set_tokens([], 4) == 0


def test_the_engine_cache_is_blocks_times_block_size_from_the_served_cache_config() -> None:
    key = (
        'vllm:cache_config_info{_block_size_resolved="True",block_size="128",num_cpu_blocks="None",'
        'num_gpu_blocks="16",num_gpu_blocks_override="16"}'
    )
    assert engine_cache_tokens_of({key: 1.0}) == 2048
    assert engine_cache_tokens_of({'vllm:cache_config_info{block_size="16"}': 1.0}) is None
    assert engine_cache_tokens_of({}) is None


def agents_records(setup: str, ws: int | None, cache: int | None, counters: dict) -> list[dict]:
    recs = [
        {
            "kind": "request",
            "setup": setup,
            "scenario": "agents",
            "concurrency": 8,
            "agent": 0,
            "session": 0,
            "turn": 1,
            "reusable_tokens": 600,
            "ttft_s": 0.5,
            "total_s": 1.5,
            "prompt_tokens": 900,
            "output_tokens": 20,
            "cached_tokens": 512,
            "max_gap_s": 0.1,
            "t_start": 0.0,
            "t_end": 1.5,
        }
    ]
    recs.append(
        {
            "kind": "step",
            "scenario": "agents",
            "setup": setup,
            "concurrency": 8,
            "wall_s": 10.0,
            "frozen_threshold_s": 7.5,
            "hit_min_fraction": 0.5,
            "counters": counters,
            "working_set_tokens": ws,
            "engine_cache_tokens": cache,
        }
    )
    return recs


def test_each_agents_cell_reports_the_working_set_over_the_engine_cache_and_the_saves_dropped() -> None:
    recs = agents_records("kvlab", 7680, 2048, {"connector_saves_dropped": 3.0, "external_hits": 512})
    recs += agents_records("baseline", 7680, None, {})
    s = summarize(recs, ["baseline", "kvlab"])
    kv = s.setups["kvlab"].agents["8"]
    assert (kv.working_set_tokens, kv.engine_cache_tokens) == (7680, 2048)
    assert kv.working_set_over_engine_cache == pytest.approx(3.75)
    assert kv.saves_dropped == 3.0
    base = s.setups["baseline"].agents["8"]
    assert (
        base.working_set_over_engine_cache is None and base.saves_dropped is None
    )  # not measured: not made up
    rows = dict(agents_load_rows())
    assert rows["Working set / engine's own KV cache, tokens"](kv) == "7,680/2,048 = 3.8×"
    assert rows["Working set / engine's own KV cache, tokens"](base) == "—"
    assert rows["Saves dropped"](kv) == "3" and rows["Saves dropped"](base) == "—"


def test_the_load_campaign_runs_the_seeds_concurrency_with_enough_returning_turns_and_a_large_working_set() -> (
    None
):
    c, _ = campaign.load(LOAD)
    assert c.name == "embedded-agents"
    assert set(c.setups) >= {"kvlab", "lmcache-mp", "lmcache-mp+kvlab", "baseline"}
    ag = c.scenarios.agents
    assert ag is not None and ag.concurrency == [8, 16, 32]
    gen = ag.source.generator
    assert gen is not None and gen.answers == "engine"
    # the engine's own cache: num_gpu_blocks_override blocks of the CPU engine's 128 tokens
    args = list(c.engine["extra_engine_args"])
    blocks = int(args[args.index("--num-gpu-blocks-override") + 1])
    cache = blocks * 128
    # vLLM keeps one block back (its null block) and refuses an engine whose other blocks
    # cannot hold one request of max_model_len
    assert c.engine["max_model_len"] <= (blocks - 1) * 128
    steps = [s for s in compile_campaign(c, LOAD.parent).setups[0].steps if s.kind == "agents"]
    assert [s.arg for s in steps] == ag.concurrency
    for step in steps:  # the workloads the plan runs, with their seeds
        assert step.workload is not None and step.workload.seed == c.seed
        n, wl = step.arg, workload(step.workload)
        returning = sum(1 for a in wl.agents for t in a[1:])
        if n >= 16:
            # the first-token figures leave out the ramp's returning turns: about one per agent
            # under vLLM's first-come-first-served queue
            assert returning - n >= 48, (n, returning)
        # the latest prompts, with the shortest answers the engine may give: a lower bound
        latest = []
        for turns in wl.agents:
            prev: tuple[int, ...] | None = None
            for k, t in enumerate(turns):
                prompt, _ = t.sent(prev, tuple(range(9000 + k * 64, 9000 + k * 64 + gen.output_tokens[0])))
                prev = prompt
            assert len(prev) + gen.output_tokens[1] <= c.engine["max_model_len"]  # every turn fits
            latest.append(prev)
        assert working_set_tokens(latest, 128) >= 3 * cache, n


def turn(agent: int, k: int, start: float, ttft: float, reusable: int = 600) -> dict:
    return {"kind": "request", "setup": "kvlab", "scenario": "agents", "concurrency": 2, "agent": agent,
            "session": agent, "turn": k, "reusable_tokens": reusable if k else 0, "ttft_s": ttft,
            "total_s": ttft + 0.5, "prompt_tokens": 900, "output_tokens": 20, "cached_tokens": 512 if k else 0,
            "max_gap_s": 0.1, "t_start": start, "t_end": start + ttft + 0.5}


def test_the_first_token_figures_take_the_returning_turns_sent_once_every_agent_is_active() -> None:
    recs = [turn(0, 0, 100.0, 0.5), turn(1, 0, 100.0, 1.5),  # both first turns answered by 102.0
            turn(0, 1, 101.0, 9.0),  # sent in the ramp: queued behind agent 1's first turn
            turn(0, 2, 111.0, 0.4), turn(1, 1, 103.0, 0.6), turn(1, 2, 104.0, 0.5)]
    step = {"kind": "step", "scenario": "agents", "setup": "kvlab", "concurrency": 2, "wall_s": 12.0,
            "frozen_threshold_s": 7.5, "hit_min_fraction": 0.5, "counters": {}, "t_start": 100.0}
    p = summarize([*recs, {**step, "all_active_t": 102.0}], ["kvlab"]).setups["kvlab"].agents["2"]
    assert (p.returning_turns, p.samples, p.ramp_turns, p.ramp_s) == (4, 3, 1, pytest.approx(2.0))
    assert p.returning_ttft_p99_s == pytest.approx(0.6, abs=0.01) and p.returning_ttft_median_s == 0.5
    assert p.returning_turn_hit_share == 1.0  # the hit shares still count every returning turn
    # a trace's sessions start at their own times (no all_active_t): every returning turn counts
    p = summarize([*recs, step], ["kvlab"]).setups["kvlab"].agents["2"]
    assert (p.samples, p.ramp_turns, p.ramp_s) == (4, 0, None) and p.returning_ttft_p99_s > 8


def test_the_ramp_ends_when_every_agent_that_starts_at_once_has_its_first_answer() -> None:
    from kvlab.harness.scenarios import all_active_t
    from kvlab.harness.sessions import TurnSpec, Workload

    together = Workload(((TurnSpec(0, 0, (1,), 4), TurnSpec(0, 1, (2,), 4, think_s=1.0)),
                         (TurnSpec(1, 0, (3,), 4),)))
    assert all_active_t(together, {0: 5.0, 1: 7.0}) == 7.0
    assert all_active_t(together, {0: 5.0}) is None  # agent 1's first turn failed: no steady state to tell
    traced = Workload(((TurnSpec(0, 0, (1,), 4, at_s=0.0),), (TurnSpec(1, 0, (3,), 4, at_s=30.0),)))
    assert all_active_t(traced, {0: 1.0, 1: 31.0}) is None
