"""Results folder, summary and report from synthetic raw records (no engine)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvlab.cli import main
from kvlab.harness import results
from kvlab.harness.report import render_run
from kvlab.harness.summary import summarize, validate

ROOT = Path(__file__).resolve().parents[2]


def req(setup: str, **kw: object) -> dict:
    base = {"kind": "request", "setup": setup, "t_start": 0.0, "t_end": 1.0, "output_tokens": 16,
            "max_gap_s": 0.1, "cached_tokens": 0}
    return base | kw


def records() -> list[dict]:
    recs: list[dict] = []
    for setup, ttft_hit, cached in (("baseline", None, 0), ("kvlab", 0.2, 4096)):
        recs.append({"kind": "io_mode", "setup": setup, "io_mode": "posix-odirect" if setup == "kvlab" else None})
        recs.append(req(setup, scenario="restore", phase="compute", ttft_s=6.0, total_s=6.0, prompt_tokens=4097))
        for i, t in enumerate((0.3, 0.1, 0.2)):
            recs.append(req(setup, scenario="restore", phase="warm", repeat=i, ttft_s=t if ttft_hit else 6.0,
                            total_s=1.0, prompt_tokens=4097, cached_tokens=cached))
        recs.append(req(setup, scenario="restore", phase="restart", repeat=0, ttft_s=0.5 if ttft_hit else 6.0,
                        total_s=1, prompt_tokens=4097, cached_tokens=cached,
                        counters={"connector_read_bytes": 64 << 20}))
        # sweep: 10 rounds at 1000 tokens; the first round is cold
        for r in range(1, 11):
            t = 2.0 if (r == 1 or not ttft_hit) else 0.5
            recs.append(req(setup, scenario="sweep", length=1000, round=r, ttft_s=t, total_s=t + 0.5,
                            prompt_tokens=1000, output_tokens=16))
        # agents at N=2: two agents, two turns each; gaps of 0.1 and 25 s
        for a in range(2):
            recs.append(req(setup, scenario="agents", concurrency=2, agent=a, session=a, turn=0,
                            reusable_tokens=0, ttft_s=1.0, total_s=2.0, prompt_tokens=600, output_tokens=11))
            recs.append(req(setup, scenario="agents", concurrency=2, agent=a, session=a, turn=1,
                            reusable_tokens=600, ttft_s=0.4 + a, total_s=2.4 + a, prompt_tokens=1000,
                            output_tokens=21, cached_tokens=512 if ttft_hit else 0,
                            max_gap_s=25.0 if a else 0.1))
        recs.append({"kind": "step", "scenario": "agents", "setup": setup, "concurrency": 2, "wall_s": 12.5,
                     "frozen_threshold_s": 20.0, "hit_min_fraction": 0.5, "counters": {"external_hits": 1024}})
        for k, rss in enumerate((1 << 30, 3 << 30, 2 << 30)):
            recs.append({"kind": "memory", "setup": setup, "phase": "x", "t": 100.0 + k, "engine_rss_bytes": rss,
                         "engine_pinned_bytes": 0, "cache_server_rss_bytes": None, "cache_server_pinned_bytes": None})
    recs.append({"kind": "skip", "setup": "lmcache-gds", "reason": "setup 'lmcache-gds' runs on cuda"})
    return recs


def test_summary_by_hand() -> None:
    s = summarize(records(), ["baseline", "kvlab", "lmcache-gds"], avg_rounds=(2, 9))
    k, b = s.setups["kvlab"], s.setups["baseline"]
    assert k.io_mode == "posix-odirect" and b.io_mode is None
    assert (k.recompute_ttft_s, k.recompute_samples) == (6.0, 1)
    assert (k.warm_restore_ttft_s, k.warm_restore_samples) == (0.2, 3)
    assert (k.restart_restore_ttft_s, k.restart_restore_samples) == (0.5, 1)
    assert k.restore_read_bytes == 64 << 20
    p = k.sweep["1000"]
    assert (p.ttft_s, p.samples) == (0.5, 8)  # rounds 2-9 only: the cold 2.0 s round is out
    assert p.throughput_tok_s == pytest.approx(1016 / 1.0)
    assert p.ttft_improvement == pytest.approx(4.0)  # 2.0 / 0.5
    assert p.throughput_improvement == pytest.approx((1016 / 1.0) / (1016 / 2.5))
    a = k.agents["2"]
    assert a.returning_turn_hit_share == 1.0  # 512 >= 0.5 * 600 for both returning turns
    assert a.returning_token_hit_share == pytest.approx(1024 / 2000)
    assert a.returning_ttft_median_s == pytest.approx(0.9)  # (0.4 + 1.4) / 2
    assert a.frozen_answers == 1 and a.wall_s == 12.5 and a.samples == 2 and a.answers == 4
    # agent 0: (10 + 20) tokens over (1 + 2) s; agent 1: (10 + 20) over (1 + 2) s
    assert a.decode_tok_s_per_agent == pytest.approx(10.0)
    assert b.agents["2"].returning_turn_hit_share == 0.0
    assert k.peak_rss_bytes.engine == 3 << 30 and k.peak_rss_bytes.cache_server is None
    assert s.setups["lmcache-gds"].skipped and s.setups["lmcache-gds"].warm_restore_ttft_s is None


def make_run(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    w = results.RunWriter(runs, "r1")
    w.write_once(results.CAMPAIGN, (ROOT / "campaigns/embedded.yml").read_bytes())
    w.write_once(results.PROVENANCE, json.dumps({"git": results.git_state(), "versions": results.versions()}))
    for r in records():
        w.append(r)
    w.close()
    results.point_latest(runs, "r1")
    return runs


def test_raw_files_are_never_rewritten(tmp_path: Path) -> None:
    runs = make_run(tmp_path)
    w_dir = runs / "r1"
    assert not os.access(w_dir / results.RECORDS, os.W_OK) or os.geteuid() == 0
    with pytest.raises(FileExistsError):
        results.RunWriter(runs, "r1")
    assert (runs / "latest").resolve() == w_dir.resolve()


def test_report_has_every_table_and_plot_and_a_valid_summary(tmp_path: Path) -> None:
    runs = make_run(tmp_path)
    _, md = render_run(runs / "latest")
    text = md.read_text()
    for heading in ("## Restore", "## Sweep", "Mean TTFT", "Total token throughput", "improvement over baseline",
                    "## Agents", "Returning turns found in the cache", "Answers frozen for more than 3 s",
                    "## Memory", "## Provenance", "lmcache-gds** skipped"):
        assert heading in text, heading
    pngs = sorted(p.name for p in md.parent.glob("*.png"))
    assert pngs == ["improvement.png", "memory.png", "restore.png", "returning_ttft_cdf.png",
                    "throughput_vs_length.png", "ttft_vs_length.png"]
    validate(json.loads((md.parent / "summary.json").read_text()))


def test_summary_json_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = make_run(tmp_path)
    assert main(["report", str(runs / "latest"), "--summary-json"]) == 0
    j = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    k = j["setups"]["kvlab"]
    assert k["warm_restore_ttft_s"] == 0.2
    assert k["agents"][max(k["agents"], key=int)]["frozen_answers"] == 1
    assert j["setups"]["baseline"]["sweep"]["1000"]["samples"] == 8


def test_summary_schema_rejects_a_missing_field() -> None:
    s = summarize(records(), ["kvlab"], avg_rounds=(2, 9))
    obj = json.loads(s.model_dump_json(by_alias=True))
    del obj["setups"]["kvlab"]["warm_restore_ttft_s"]
    with pytest.raises(ValueError):
        validate(obj)


def test_two_runs_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = make_run(tmp_path)
    out = tmp_path / "both"
    assert main(["report", str(runs / "r1"), str(runs / "latest"), "--out", str(out)]) == 0
    assert "r1:kvlab" in (out / "report.md").read_text()


def test_provenance_takes_the_controllers_commit_where_there_is_no_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvlab installed from a wheel (a lab node through bench_runner) has no checkout to ask."""
    monkeypatch.setattr(results, "repo_root", lambda: tmp_path)
    monkeypatch.delenv("KVLAB_SOURCE_COMMIT", raising=False)
    assert results.git_state() == {"commit": None, "dirty": None, "from": None}
    monkeypatch.setenv("KVLAB_SOURCE_COMMIT", "ab" * 20)
    monkeypatch.setenv("KVLAB_SOURCE_DIRTY", "false")
    assert results.git_state() == {"commit": "ab" * 20, "dirty": False, "from": "controller"}
    monkeypatch.setattr(results, "repo_root", lambda: ROOT)
    assert results.git_state()["from"] == "checkout", "a checkout's own commit wins"
