"""A slice of the Mooncake trace replayed against the embedded engine with kvlab's connector:
the trace's prefix reuse shows in the hit shares (campaigns/embedded-mooncake.yml, smaller)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from kvlab.harness import campaign
from kvlab.harness.compiler import run_campaign
from kvlab.harness.results import read_records
from kvlab.harness.sessions import mooncake_workload
from kvlab.harness.summary import AgentsPoint, summarize

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "campaigns" / "embedded-mooncake.yml"


@pytest.fixture(scope="module")
def replay(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[campaign.Campaign, AgentsPoint]:
    d = yaml.safe_load(SOURCE.read_text())
    d["name"] = "ci-mooncake"
    d["setups"] = ["kvlab"]
    d["scenarios"]["agents"]["concurrency"] = [2]
    src = d["scenarios"]["agents"]["source"]["mooncake"]
    src["path"] = str((SOURCE.parent / src["path"]).resolve())
    src["limit"] = 100
    tmp = tmp_path_factory.mktemp("mooncake")
    path = tmp / "ci-mooncake.yml"
    raw = yaml.safe_dump(d, sort_keys=False).encode()
    path.write_bytes(raw)
    c = campaign.parse(d, path)
    run_dir = run_campaign(c, path, hashlib.sha256(raw).hexdigest(), tmp / "runs")
    s = summarize(read_records(run_dir), c.setups)
    assert s.setups["kvlab"].errors == []
    return c, s.setups["kvlab"].agents["2"]


def test_the_slice_has_prefix_reuse_to_find(replay: tuple[campaign.Campaign, AgentsPoint]) -> None:
    c, _ = replay
    assert c.scenarios.agents and c.scenarios.agents.source.mooncake
    turns = mooncake_workload(c.scenarios.agents.source.mooncake.spec(), 1, c.seed).turns
    chunk = c.engine["kv_chunk_tokens"]
    assert sum(1 for t in turns if t.reusable_tokens >= chunk) >= 10


def test_every_request_was_answered(replay: tuple[campaign.Campaign, AgentsPoint]) -> None:
    _, p = replay
    assert p.answers == 100 and p.errors == 0


def test_prefix_reuse_shows_in_the_hit_shares(replay: tuple[campaign.Campaign, AgentsPoint]) -> None:
    _, p = replay
    # vLLM's own prefix caching is off: every cached token came from kvlab's drives.
    assert p.returning_turn_hit_share and p.returning_turn_hit_share > 0.1
    assert p.returning_token_hit_share and p.returning_token_hit_share > 0.1
    assert p.external_hit_tokens and p.external_hit_tokens > 0
