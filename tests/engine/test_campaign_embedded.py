"""A small version of the embedded campaign on the real vLLM CPU engine: raw records, report,
plots and a summary that validates against kvlab.summary/5 (campaigns/ci-small.yml)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from kvlab.harness import campaign, results
from kvlab.harness.compiler import run_campaign
from kvlab.harness.report import render_run
from kvlab.harness.summary import Summary, validate

ROOT = Path(__file__).resolve().parents[2]
CI_CAMPAIGN = ROOT / "campaigns" / "ci-small.yml"


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Summary, campaign.Campaign]:
    c, sha = campaign.load(CI_CAMPAIGN)
    runs = tmp_path_factory.mktemp("runs")
    run_dir = run_campaign(c, CI_CAMPAIGN, sha, runs)
    _, md = render_run(runs / "latest")
    summary = validate(json.loads((md.parent / "summary.json").read_text()))
    return run_dir, summary, c


def test_every_setup_ran_without_errors(run: tuple[Path, Summary, campaign.Campaign]) -> None:
    _, s, c = run
    for name in c.setups:
        assert s.setups[name].skipped is None
        assert s.setups[name].errors == [], s.setups[name].errors


def test_the_summary_validates_and_has_every_scenario(run: tuple[Path, Summary, campaign.Campaign]) -> None:
    _, s, c = run
    assert c.scenarios.restore and c.scenarios.sweep and c.scenarios.agents
    for name in c.setups:
        st = s.setups[name]
        assert st.recompute_samples == 1
        assert st.restart_over_recompute is not None and st.warm_over_recompute is not None
        assert st.warm_restore_samples == c.scenarios.restore.warm_repeats
        assert st.restart_restore_samples == c.scenarios.restore.restart_repeats
        first, last = c.scenarios.sweep.average_rounds
        assert {k: p.samples for k, p in st.sweep.items()} == {str(n): last - first + 1 for n in c.scenarios.sweep.lengths}
        assert set(st.agents) == {str(n) for n in c.scenarios.agents.concurrency}
        for p in st.agents.values():
            assert p.errors == 0 and p.frozen_answers is not None and p.wall_s
        assert st.peak_rss_bytes.engine and st.peak_rss_bytes.engine > 100 << 20
        assert st.peak_rss_bytes.cache_server is None


def test_kvlab_restores_the_prompt_and_baseline_recomputes_it(run: tuple[Path, Summary, campaign.Campaign]) -> None:
    _, s, c = run
    assert c.scenarios.restore
    ref = s.recompute_reference
    assert ref is not None and ref.setup == "baseline" and ref.samples == c.scenarios.restore.recompute_prompts >= 3
    assert ref.tokens == c.scenarios.restore.tokens and ref.ttft_s
    chunk = c.engine["kv_chunk_tokens"]
    whole = c.scenarios.restore.tokens // chunk * chunk
    k, b = s.setups["kvlab"], s.setups["baseline"]
    assert k.io_mode == "posix-odirect"
    assert k.warm_restore_cached_tokens is not None and k.warm_restore_cached_tokens >= whole
    assert k.restart_restore_cached_tokens is not None and k.restart_restore_cached_tokens >= whole
    assert b.warm_restore_cached_tokens == 0 and b.restart_restore_cached_tokens == 0
    assert k.restore_read_bytes and k.restore_read_bytes >= whole * 16384


def test_the_tier_under_test_serves_the_sweep_and_the_returning_turns(
        run: tuple[Path, Summary, campaign.Campaign]) -> None:
    run_dir, s, c = run
    assert c.scenarios.sweep and not c.scenarios.sweep.prefix_caching
    longest = max(c.scenarios.sweep.lengths)
    first, last = c.scenarios.sweep.average_rounds
    chunk = c.engine["kv_chunk_tokens"]
    # What each averaged round of the longest prompt found in the tier (its TTFT against
    # baseline's is the report's finding, not a pass condition).
    cached = {setup: [r.get("cached_tokens") or 0 for r in results.read_records(run_dir)
                      if r.get("setup") == setup and r.get("scenario") == "sweep" and r.get("length") == longest
                      and first <= r["round"] <= last and "error" not in r] for setup in ("kvlab", "baseline")}
    assert len(cached["kvlab"]) == last - first + 1 and min(cached["kvlab"]) >= (longest - 1) // chunk * chunk, cached
    assert cached["baseline"] == [0] * (last - first + 1), cached
    k, b = s.setups["kvlab"], s.setups["baseline"]
    for n, p in k.agents.items():
        assert p.returning_turn_hit_share and p.returning_turn_hit_share > 0.5, n
        assert b.agents[n].returning_turn_hit_share == 0  # no prefix caching, no tier: nothing cached
        assert p.returning_reusable_hit_share is not None and p.returning_reusable_hit_share > 0, n
        assert b.agents[n].returning_reusable_hit_share == 0, n
    # the summary's sweep cells say what the records say
    for setup in ("kvlab", "baseline"):
        cell = s.setups[setup].sweep[str(longest)]
        assert cell.rounds == last - first + 1 and cell.cached_tokens == statistics.median(cached[setup])


def test_the_sweep_drops_the_page_cache_before_every_round_or_says_why_not(
        run: tuple[Path, Summary, campaign.Campaign]) -> None:
    run_dir, s, c = run
    assert c.scenarios.sweep and c.scenarios.sweep.drop_page_cache
    sweep = [r for r in results.read_records(run_dir) if r.get("kind") == "request" and r.get("scenario") == "sweep" and "error" not in r]
    assert sweep and all(isinstance(r["page_cache_dropped"], bool) for r in sweep)
    refused = [r["page_cache_drop_error"] for r in sweep if not r["page_cache_dropped"]]
    if os.geteuid() == 0:  # CI runs as root: every drop succeeds there
        assert refused == []
    first, last = c.scenarios.sweep.average_rounds
    for setup in c.setups:
        for length, cell in s.setups[setup].sweep.items():
            dropped = [r for r in sweep if r["setup"] == setup and str(r["length"]) == length
                       and first <= r["round"] <= last and r["page_cache_dropped"]]
            assert cell.page_cache_dropped_rounds == len(dropped), (setup, length)


def test_returning_turns_carry_the_engines_answers(run: tuple[Path, Summary, campaign.Campaign]) -> None:
    run_dir, s, c = run
    assert c.scenarios.agents and c.scenarios.agents.source.generator
    assert c.scenarios.agents.source.generator.answers == "engine"
    recs = [r for r in results.read_records(run_dir) if r.get("scenario") == "agents" and r["kind"] == "request"]
    by_turn = {(r["setup"], r["concurrency"], r["agent"], r["turn"]): r for r in recs}
    for (setup, n, a, k), r in by_turn.items():
        if k == 0:
            assert r["reusable_tokens"] == 0 and "carried_answer_tokens" not in r
            continue
        prev = by_turn[setup, n, a, k - 1]
        assert r["carried_answer_tokens"] == prev["output_tokens"] > 0
        assert r["reusable_tokens"] == prev["prompt_tokens"] + prev["output_tokens"] - 1
    for setup in c.setups:
        assert s.setups[setup].block_size == 128  # the CPU engine's, from vLLM's cache config


def test_wear_is_counted_per_setup_and_scenario(run: tuple[Path, Summary, campaign.Campaign]) -> None:
    """Issue 27: bytes each tier wrote to drives per scenario, across the restore's restarts,
    projected onto the campaign's declared drives; baseline has no drive tier (0)."""
    _, s, c = run
    assert c.scenarios.restore and c.scenarios.agents and c.drives
    keys = {"restore", "sweep", "all", *(f"agents:{n}" for n in c.scenarios.agents.concurrency)}
    k, b = s.setups["kvlab"].wear, s.setups["baseline"].wear
    assert set(k) == set(b) == keys
    assert s.drives is not None and s.drives.count == c.drives.count
    chunk = c.engine["kv_chunk_tokens"]
    whole = c.scenarios.restore.tokens // chunk * chunk
    r = k["restore"]
    assert r.tier == "kvlab" and r.segments == c.scenarios.restore.restart_repeats + 1  # one per engine life
    assert r.written_bytes is not None and r.written_bytes >= whole * 16384  # the prompt, saved once at least
    assert r.drive_written_bytes and sum(r.drive_written_bytes.values()) == r.written_bytes
    assert r.restored_bytes and r.written_over_restored is not None and r.written_over_restored > 0
    assert r.process_written_bytes is not None  # the engine's process tree was readable
    assert k["all"].drive_writes_per_day and k["all"].rated_life_years
    for w in b.values():
        assert w.tier == "none" and w.written_bytes == 0 and w.process_written_bytes is not None


def test_the_report_has_every_table_and_plot(run: tuple[Path, Summary, campaign.Campaign]) -> None:
    run_dir, _, _ = run
    text = (run_dir / "report" / "report.md").read_text()
    for heading in ("## Restore", "Mean TTFT", "Total token throughput", "## Agents", "## Memory", "## Wear",
                    "## Provenance"):
        assert heading in text
    assert len(list((run_dir / "report").glob("*.png"))) == 6


def test_raw_records_and_provenance_are_read_only(run: tuple[Path, Summary, campaign.Campaign]) -> None:
    run_dir, _, _ = run
    for name in (results.RECORDS, results.PROVENANCE, results.CAMPAIGN):
        assert not (os.stat(run_dir / name).st_mode & 0o222), name
    prov = json.loads((run_dir / results.PROVENANCE).read_text())
    assert prov["git"]["commit"] and prov["versions"]["vllm"] and prov["model"]["sha256"]
    assert "--kv-transfer-config" in prov["engine"]["kvlab"]["argv"]
