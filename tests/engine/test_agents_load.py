"""A small version of the load campaign (campaigns/embedded-agents.yml) on the real vLLM CPU engine:
a few agents whose working set exceeds the engine's own KV cache (num_gpu_blocks_override), so
that returning turns come back from the tier; the step reports the working set, the engine's
cache and the saves dropped. Two engine lives, ~2-3 min on two quiet cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvlab.harness import campaign
from kvlab.harness.compiler import run_campaign
from kvlab.harness.report import render_run
from kvlab.harness.summary import Summary, validate

ROOT = Path(__file__).resolve().parents[2]
LOAD = ROOT / "campaigns" / "embedded-agents.yml"


def small(tmp: Path) -> Path:
    """The load campaign, cut down: kvlab and baseline, 4 agents of 3 turns, an engine cache of
    9 blocks (vLLM keeps one back: 1,024 tokens of KV) and prompts that fit it."""
    data = yaml.safe_load(LOAD.read_text())
    data["name"] = "embedded-agents-small"
    data["setups"] = ["kvlab", "baseline"]
    data["engine"] |= {"max_model_len": 1024, "extra_engine_args": ["--num-gpu-blocks-override", "9"]}
    ag = data["scenarios"]["agents"]
    ag["concurrency"] = [4]
    ag["source"]["generator"] |= {
        "turns": 3,
        "system_tokens": 256,
        "first_user_tokens": 64,
        "tool_output_tokens": [128, 256],
        "output_tokens": [16, 24],
        "think_time_s": [0.1, 0.3],
    }
    path = tmp / "embedded-agents-small.yml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Summary, campaign.Campaign]:
    tmp = tmp_path_factory.mktemp("agents-load")
    path = small(tmp)
    c, sha = campaign.load(path)
    run_campaign(c, path, sha, tmp / "runs")
    _, md = render_run(tmp / "runs" / "latest")
    assert "Working set / engine's own KV cache" in md.read_text()
    return validate(json.loads((md.parent / "summary.json").read_text())), c


def test_the_working_set_exceeds_the_engines_own_cache(run: tuple[Summary, campaign.Campaign]) -> None:
    s, _ = run
    for name in ("kvlab", "baseline"):
        p = s.setups[name].agents["4"]
        assert p.errors == 0 and p.returning_turns == 8  # 4 agents x 2 returning turns
        # the agents start together: a ramp until every first turn is answered, its returning
        # turns left out of the first-token figures
        assert p.ramp_s is not None and p.ramp_s > 0 and p.samples + p.ramp_turns == 8
        assert p.engine_cache_tokens == 9 * 128  # the override took: 9 blocks of the CPU engine's 128 tokens
        assert (
            p.working_set_tokens and p.working_set_over_engine_cache and p.working_set_over_engine_cache > 1.5
        )


def test_returning_turns_come_back_from_kvlab_and_saves_are_counted(
    run: tuple[Summary, campaign.Campaign],
) -> None:
    s, _ = run
    k, b = s.setups["kvlab"].agents["4"], s.setups["baseline"].agents["4"]
    assert k.returning_reusable_hit_share is not None and k.returning_reusable_hit_share >= 0.9
    assert b.returning_token_hit_share == 0  # no prefix caching, no tier: baseline recomputes
    assert k.saves_dropped is not None and b.saves_dropped is None
