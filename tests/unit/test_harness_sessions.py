"""Session sources: seeded coding-agent sessions and the Mooncake trace loader."""

from __future__ import annotations

import json
from pathlib import Path

from kvlab.harness.campaign_sources import GeneratorSource, MooncakeSource
from kvlab.harness.sessions import (
    coding_agent_sessions,
    mooncake_workload,
    token_ids,
)

GEN = GeneratorSource(turns=4, system_tokens=100, first_user_tokens=10, tool_output_tokens=(20, 40),
                      assistant_tokens=(5, 10), output_tokens=(3, 6), think_time_s=(0.1, 0.2)).spec(3)


def test_token_ids_are_reproducible_from_the_key() -> None:
    assert token_ids("a", 50) == token_ids("a", 50)
    assert token_ids("a", 50) != token_ids("b", 50)


def test_generated_sessions_are_seeded() -> None:
    assert coding_agent_sessions(GEN, 3, seed=1, step="s") == coding_agent_sessions(GEN, 3, seed=1, step="s")
    assert coding_agent_sessions(GEN, 3, seed=1, step="s") != coding_agent_sessions(GEN, 3, seed=2, step="s")


def test_each_turn_extends_the_previous_one_which_is_all_reusable() -> None:
    wl = coding_agent_sessions(GEN, 2, seed=1, step="s")
    for agent in wl.agents:
        assert agent[0].reusable_tokens == 0  # a first turn is not a returning turn
        for prev, turn in zip(agent, agent[1:], strict=False):
            assert turn.prompt[:len(prev.prompt)] == prev.prompt
            assert turn.reusable_tokens == len(prev.prompt)
            grown = len(turn.prompt) - len(prev.prompt)
            assert 25 <= grown <= 50  # assistant 5-10 + tool 20-40
            assert 0.1 <= turn.think_s <= 0.2


def test_agents_of_a_step_share_the_system_prompt_only() -> None:
    a, b = coding_agent_sessions(GEN, 2, seed=1, step="s").agents
    assert a[0].prompt[:100] == b[0].prompt[:100]
    assert a[0].prompt[100:] != b[0].prompt[100:]


def trace(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 1000, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 3000, "input_length": 1500, "output_length": 500, "hash_ids": [0, 1, 2]},
        {"timestamp": 4000, "input_length": 600, "output_length": 7, "hash_ids": [9, 10]},
        {"timestamp": 9000, "input_length": 1024, "output_length": 7, "hash_ids": [0, 5]},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_mooncake_equal_hash_ids_become_equal_blocks(tmp_path: Path) -> None:
    src = MooncakeSource(path=str(trace(tmp_path)), limit=10, block_tokens=8, time_scale=0.5, max_output_tokens=32).spec()
    turns = sorted(mooncake_workload(src, 2, seed=3).turns, key=lambda t: t.session)
    assert [len(t.prompt) for t in turns] == [16, 23, 9, 16]  # input_length * 8 / 512, capped at the blocks
    assert turns[1].prompt[:16] == turns[0].prompt  # ids 0, 1 shared
    assert turns[3].prompt[:8] == turns[0].prompt[:8] and turns[3].prompt[8:] != turns[0].prompt[8:16]
    assert [t.reusable_tokens for t in turns] == [0, 16, 0, 8]
    assert [t.at_s for t in turns] == [0.0, 1.0, 1.5, 4.0]  # (ts - 1000) ms * 0.5
    assert [t.max_tokens for t in turns] == [5, 32, 7, 7]


def test_mooncake_requests_go_round_robin_to_the_agents(tmp_path: Path) -> None:
    src = MooncakeSource(path=str(trace(tmp_path)), limit=10, block_tokens=8).spec()
    wl = mooncake_workload(src, 2, seed=3)
    assert [[t.session for t in a] for a in wl.agents] == [[0, 2], [1, 3]]


def test_mooncake_slice_start_and_limit(tmp_path: Path) -> None:
    src = MooncakeSource(path=str(trace(tmp_path)), start=1, limit=2, block_tokens=8).spec()
    turns = mooncake_workload(src, 1, seed=3).turns
    assert len(turns) == 2 and turns[0].at_s == 0.0
    assert turns[0].reusable_tokens == 0  # reuse counts within the replayed slice only
