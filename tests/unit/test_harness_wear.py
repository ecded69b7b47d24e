"""Issue 27's wear in the campaign results: bytes each setup's tier wrote to drives per
scenario (kvlab's counters; files through /proc/PID/io, read for real from a child process
that writes), written_over_restored, the drive writes per day and rated life the run implies
against the campaign's declared drives, with one arithmetic shared with the planner's bill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from kvlab import wear as wear_math
from kvlab.harness import campaign, results
from kvlab.harness import wear as counted
from kvlab.harness.report import render_run
from kvlab.harness.summary import SCHEMA, summarize, validate
from kvlab.planner import bill as bill_mod
from kvlab.planner.geometry import Geometry
from kvlab.planner.node import PRESETS
from kvlab.setups import registry as setups

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
LAB = wear_math.Drives(count=4, capacity_tb=7.68, dwpd=1.0, model="Samsung PM1743 7.68 TB")


# ---- the arithmetic -------------------------------------------------------------------------
def test_the_issue_figures() -> None:
    # 470 TB a day on eight 15.36 TB drives rated 1 DWPD: ~3.8 drive writes a day, so their
    # rated five years last about a quarter of that (the issue's GLM-5.3 node).
    w = wear_math.wear(470e12, wear_math.Drives(count=8, capacity_tb=15.36, dwpd=1.0))
    assert w.drive_writes_per_day == pytest.approx(470e12 / (8 * 15.36e12))
    assert w.drive_writes_per_day == pytest.approx(3.825, abs=1e-3)
    assert w.rated_life_years == pytest.approx(5 / 3.825, rel=1e-3)


def test_tbw_and_dwpd_are_one_rating() -> None:
    tbw = wear_math.Drives(count=4, capacity_tb=7.68, tbw=7.68 * 365 * 5)
    assert tbw.rated_dwpd == pytest.approx(1.0)
    assert tbw.rated_bytes == pytest.approx(LAB.rated_bytes)
    per_day = wear_math.bytes_per_day(2e9, 10.0)
    assert per_day == pytest.approx(2e8 * 86400)
    assert wear_math.wear(per_day, tbw) == wear_math.wear(per_day, LAB)
    assert wear_math.wear(0.0, LAB).rated_life_years is None  # nothing written: no end
    assert wear_math.bytes_per_day(1.0, 0.0) is None


@pytest.mark.parametrize(
    "kw",
    [
        {"count": 4, "capacity_tb": 7.68},
        {"count": 4, "capacity_tb": 7.68, "dwpd": 1, "tbw": 14016},
        {"count": 0, "capacity_tb": 7.68, "dwpd": 1},
        {"count": 4, "capacity_tb": 1, "dwpd": -1},
    ],
)
def test_drives_refuse_an_impossible_rating(kw: dict) -> None:
    with pytest.raises(ValueError, match="drives"):
        wear_math.Drives(**kw)


def test_the_bill_and_the_report_share_one_arithmetic() -> None:
    assert bill_mod.wear is wear_math.wear and counted.wear is wear_math.wear
    node = PRESETS["h200"]
    g = Geometry(name="llama-70b", attention="gqa", layers=80, kv_heads=8, head_dim=128)
    b = bill_mod.bill(g, node, None, 8, bill_mod.BillInputs(prompt_tokens=1000, save_tokens_s=100_000))
    expect = wear_math.wear(
        b["drive_write_bytes_per_day"],
        wear_math.Drives(count=node.drives, capacity_tb=node.drive.capacity_tb, dwpd=node.drive.dwpd),
    )
    assert b["drive_writes_per_day_needed"] == expect.drive_writes_per_day
    assert b["drive_rated_life_years"] == expect.rated_life_years
    c = counted.Counted("kvlab", segments=1, first_t=0.0, last_t=100.0, kvlab_written=5e9, kvlab_read=1e9)
    f = counted.figures(c, LAB)
    w = wear_math.wear(5e9 / 100 * 86400, LAB)
    assert (f["drive_writes_per_day"], f["rated_life_years"]) == (w.drive_writes_per_day, w.rated_life_years)


# ---- the campaign's declaration -------------------------------------------------------------
def embedded() -> dict:
    return yaml.safe_load((ROOT / "campaigns/embedded.yml").read_text())


@pytest.mark.parametrize(
    ("drives", "message"),
    [
        ({"count": 4, "capacity_tb": 7.68}, "drives: give exactly one rating: dwpd"),
        ({"count": 4, "capacity_tb": 7.68, "dwpd": 1, "tbw": 14016}, "drives: give exactly one rating"),
        (
            {"count": 0, "capacity_tb": 7.68, "dwpd": 1},
            "drives.count: Input should be greater than or equal to 1",
        ),
        ({"count": 4, "capacity_tb": 0, "dwpd": 1}, "drives.capacity_tb: Input should be greater than 0"),
        (
            {"count": 4, "capacity_tb": 7.68, "dwpd": 1, "capacity_gb": 7680},
            "drives.capacity_gb: unknown field",
        ),
    ],
)
def test_a_wrong_drive_declaration_names_the_field(drives: dict, message: str) -> None:
    with pytest.raises(campaign.CampaignError, match=message.replace(".", r"\.")) as e:
        campaign.parse({**embedded(), "drives": drives}, "c.yml")
    assert str(e.value).startswith("c.yml: drives")


@pytest.mark.parametrize("path", sorted((ROOT / "campaigns").glob("*.yml")), ids=lambda p: p.name)
def test_every_embedded_campaign_declares_the_lab_drive(path: Path) -> None:
    """The lab inventory's drive (kvlab_store_drive), as many as its nodes' namespaces."""
    storage = yaml.safe_load((ROOT / "inventories/lab/group_vars/all/storage.yml").read_text())
    lab = storage["kvlab_store_drive"]
    per_node = {len(e["namespaces"]) for e in storage["kvlab_store_exports"]}
    c, _ = campaign.load(path)
    assert c.drives is not None, f"{path.name}: no drives declared"
    assert c.drives.model_dump(exclude_none=True) == {**lab, "count": per_node.pop()}
    assert "inventories/lab" in path.read_text()  # and it says whose drive it is


def test_drives_on_the_command_line_replace_the_campaigns(capsys: pytest.CaptureFixture[str]) -> None:
    """`campaign plan|run --drives` (roles/bench_runner: the node's own drives) wins over the
    campaign's example; a wrong one is a one-line error naming the field."""
    from kvlab.cli import main

    path = str(ROOT / "campaigns/ci-small.yml")
    assert main(["campaign", "plan", path]) == 0
    assert "wear projected onto 4 x Samsung PM1743 7.68 TB of 7.68 TB, rated 1 DWPD over 5 years" in capsys.readouterr().out
    node = {"model": "Kioxia CM7-R 3.84 TB", "count": 8, "capacity_tb": 3.84, "tbw": 7008, "warranty_years": 5}
    assert main(["campaign", "plan", path, "--drives", json.dumps(node)]) == 0
    assert "wear projected onto 8 x Kioxia CM7-R 3.84 TB of 3.84 TB, rated 7008 TBW each (1.00 DWPD) over 5 years" in capsys.readouterr().out
    for bad, field in (({"count": 8, "dwpd": 1}, "--drives: capacity_tb"), ({**node, "dwpd": 1.0}, "exactly one rating"),
                       ({**node, "count": 0}, "--drives: count"), ("{count: 8", "--drives: not JSON")):
        assert main(["campaign", "plan", path, "--drives", bad if isinstance(bad, str) else json.dumps(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert field in err and len(err.splitlines()) == 1, err


# ---- /proc/PID/io, for real -----------------------------------------------------------------
WRITER = """
import os, sys
sys.stdin.readline()  # wait until told
with open(sys.argv[1], "wb") as f:
    f.write(os.urandom(int(sys.argv[2])))
    f.flush()
    os.fsync(f.fileno())
print("done", flush=True)
sys.stdin.readline()
"""
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
child.wait()
"""


def test_a_process_tree_s_writes_are_counted_per_scenario(tmp_path: Path) -> None:
    """An engine-like parent whose child writes a file: the sampler's open/close around the
    write count what the child wrote (the child was born after nothing: it counts from 0)."""
    target = tmp_path / "kv.bin"
    n = 3 * MiB
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, WRITER, str(target), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    recs: list[dict] = []
    try:
        while not psutil.Process(parent.pid).children():  # the child exists once the parent started it
            time.sleep(0.05)
        s = counted.WearSampler(
            "vllm-example",
            "files",
            1024,
            lambda: {"engine": parent.pid, "cache_server": None},
            lambda: {"external_hits": 0.0},
            dict,
            recs.append,
        )
        s.open("sweep")
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "done"
        s.close()
        parent.stdin.write("end\n")
        parent.stdin.flush()
    finally:
        parent.wait(timeout=30)
    assert [r["mark"] for r in recs] == ["open", "close"]
    assert len(recs[1]["io"]["engine"]) == 2  # parent and child
    c = counted.count(recs)["sweep"]
    assert n <= c.process_written < n + MiB  # the file, and the little else the two processes wrote
    f = counted.figures(c, LAB)
    assert f["written_bytes"] == c.process_written and f["restored_bytes"] == 0.0
    assert f["written_over_restored"] is None  # nothing restored


def test_proc_io_reads_this_process() -> None:
    io = counted.proc_io(os.getpid())
    assert {"read_bytes", "write_bytes", "cancelled_write_bytes"} <= set(io)


# ---- counting from synthetic samples --------------------------------------------------------
def sample(
    mark: str,
    t: float,
    scenario: str = "restore",
    tier: str = "kvlab",
    written: float | None = None,
    read: float | None = None,
    hits: float | None = None,
    io: dict | None = None,
    **kw: object,
) -> dict:
    return {
        "kind": "wear_sample",
        "setup": "x",
        "scenario": scenario,
        "mark": mark,
        "t": t,
        "drive_tier": tier,
        "kv_bytes_per_token": 1000,
        "counters": {"connector_written_bytes": written, "connector_read_bytes": read, "external_hits": hits},
        "drive_written_bytes": kw.pop("drives", {}),
        "io": io or {},
        **kw,
    }


def test_kvlab_counts_across_a_restart() -> None:
    """The connector's counters start again with every engine life: a close before the stop
    and an open after the start keep the restore's count exact."""
    recs = [
        sample("open", 0.0, written=100, read=0, hits=0, drives={"/d0": 50, "/d1": 50}),
        sample("close", 10.0, written=1100, read=400, hits=0, drives={"/d0": 550, "/d1": 550}),
        # the new engine life, its connector not serving yet: a fresh process counts from 0
        sample("open", 25.0, written=None, read=None, hits=None, drives={}, after_start=True),
        sample("close", 30.0, written=200, read=600, hits=0, drives={"/d0": 100, "/d1": 100}),
        sample("open", 40.0, scenario="sweep", written=200, read=600, hits=0),
        sample("open", 41.0, scenario="agents", concurrency=4, written=200, read=600, hits=0),  # never closed
    ]
    c = counted.count(recs)
    assert set(c) == {"restore"}
    r = c["restore"]
    assert (r.kvlab_written, r.kvlab_read, r.segments, r.wall_s) == (1200, 1000, 2, 30.0)
    assert r.drive_written == {"/d0": 600, "/d1": 600}
    f = counted.figures(r, LAB)
    assert f["written_over_restored"] == pytest.approx(1.2)
    assert f["write_bytes_per_s"] == pytest.approx(40.0)
    assert f["drive_writes_per_day"] == pytest.approx(40.0 * 86400 / (4 * 7.68e12))


def test_files_count_every_process_of_the_trees() -> None:
    """Per PID: a process born between the samples counts from 0; the cache server's tree too;
    cancelled writes (files deleted before writeback) are not drive writes."""
    a = {
        "engine": {"10": {"write_bytes": 1000, "cancelled_write_bytes": 0}},
        "cache_server": {"20": {"write_bytes": 50, "cancelled_write_bytes": 0}},
    }
    b = {
        "engine": {
            "10": {"write_bytes": 3000, "cancelled_write_bytes": 500},
            "11": {"write_bytes": 700, "cancelled_write_bytes": 0},
        },
        "cache_server": {"20": {"write_bytes": 150, "cancelled_write_bytes": 0}},
    }
    recs = [
        sample("open", 0, scenario="agents", concurrency=8, tier="files", hits=10, io=a),
        sample("close", 4, scenario="agents", concurrency=8, tier="files", hits=30, io=b),
    ]
    c = counted.count(recs)["agents:8"]
    assert c.process_written == (3000 - 500 - 1000) + 700 + 100
    f = counted.figures(c, None)
    assert f["restored_bytes"] == 20 * 1000  # hit tokens x KV bytes per token
    assert f["written_over_restored"] == pytest.approx(2300 / 20000)
    assert f["drive_writes_per_day"] is None and f["rated_life_years"] is None  # no drives declared


def test_a_child_reaped_between_samples_is_not_counted_twice() -> None:
    """The kernel adds a reaped child's counts to its parent's: what the child had written
    before the first sample must not count again through the parent."""
    a = {"engine": {"10": {"write_bytes": 100}, "11": {"write_bytes": 5000}}}
    b = {"engine": {"10": {"write_bytes": 100 + 5000 + 300}}}  # 11 wrote 300 more, then was reaped by 10
    assert counted.io_delta(b, a, "write") == 300


def test_a_real_reaped_child_moves_its_writes_to_its_parent(tmp_path: Path) -> None:
    """What the rule above rests on, checked on this kernel: a child that wrote and was reaped."""
    before = counted.proc_io(os.getpid())["write_bytes"]
    subprocess.run(
        [sys.executable, "-c", WRITER, str(tmp_path / "f"), str(MiB)],
        input="go\n\n",
        text=True,
        check=True,
        capture_output=True,
    )
    assert counted.proc_io(os.getpid())["write_bytes"] - before >= MiB


def test_an_unreadable_tree_is_an_error() -> None:
    with pytest.raises(OSError, match="process tree of"):
        counted.tree_io(2**22 + 12345)  # above pid_max's default: no such process


def test_unreadable_processes_are_not_counted_as_zero() -> None:
    recs = [
        sample("open", 0, tier="files", hits=0, io={"engine": {}}, io_error="engine 1: PermissionError"),
        sample("close", 1, tier="files", hits=0, io={"engine": {}}),
    ]
    assert counted.figures(counted.count(recs)["restore"], LAB)["written_bytes"] is None


def test_no_drive_tier_writes_zero() -> None:
    recs = [
        sample("open", 0, tier="none", hits=0, io={"engine": {"1": {"write_bytes": 0}}}),
        sample("close", 5, tier="none", hits=100, io={"engine": {"1": {"write_bytes": 9999}}}),
    ]
    f = counted.figures(counted.count(recs)["restore"], LAB)
    assert f["written_bytes"] == 0.0 and f["written_over_restored"] == 0.0
    assert f["process_written_bytes"] == 9999  # what the engine wrote (logs) is kept, apart
    assert f["drive_writes_per_day"] == 0.0 and f["rated_life_years"] is None


def test_every_setup_says_how_its_writes_are_counted() -> None:
    tiers = {name: setups.get(name).drive_tier for name in setups.REGISTRY}
    assert tiers["baseline"] == tiers["lmcache-mp"] == tiers["lmcache-cpu"] == "none"
    assert tiers["kvlab"] == "kvlab"
    assert tiers["vllm-example"] == tiers["lmcache-mp+kvlab"] == tiers["lmcache-mp+fs"] == "files"


# ---- summary and report ---------------------------------------------------------------------
def run_records() -> list[dict]:
    out: list[dict] = [counted.drives_record(LAB)]  # type: ignore[list-item]
    for setup, tier, written in (("baseline", "none", None), ("kvlab", "kvlab", 64 * MiB)):
        for mark, t, w, r in (("open", 0.0, 0, 0), ("close", 20.0, written, 32 * MiB)):
            out.append(
                {**sample(mark, t, scenario="sweep", tier=tier, written=w, read=r, hits=0), "setup": setup}
            )
    return out


def test_the_summary_carries_wear_per_setup_and_scenario() -> None:
    s = summarize(run_records(), ["baseline", "kvlab"])
    assert s.schema_ == SCHEMA == "kvlab.summary/5"
    assert s.drives is not None and s.drives.rated_dwpd == 1.0 and s.drives.count == 4
    k = s.setups["kvlab"].wear
    assert set(k) == {"sweep", "all"}
    assert k["sweep"].written_bytes == 64 * MiB and k["sweep"].written_over_restored == 2.0
    assert k["sweep"].drive_writes_per_day == pytest.approx(64 * MiB / 20 * 86400 / 30.72e12)
    assert k["all"].written_bytes == 64 * MiB and k["all"].wall_s == 20.0
    assert s.setups["baseline"].wear["sweep"].written_bytes == 0.0
    again = validate(json.loads(json.dumps(s.model_dump(by_alias=True))))
    assert again.setups["kvlab"].wear["sweep"] == k["sweep"]


def test_the_report_shows_the_wear_table(tmp_path: Path) -> None:
    w = results.RunWriter(tmp_path / "runs", "r1")
    w.write_once(results.CAMPAIGN, (ROOT / "campaigns/embedded.yml").read_bytes())
    w.write_once(results.PROVENANCE, json.dumps({}))
    for r in run_records():
        w.append(r)
    w.close()
    _, md = render_run(tmp_path / "runs" / "r1")
    text = md.read_text()
    assert "## Wear: bytes written to drives" in text
    assert "4 x Samsung PM1743 7.68 TB of 7.68 TB, rated 1 DWPD over 5 years" in text
    per_day = 64 * MiB / 20 * 86400 / 30.72e12
    life = 5 / per_day
    assert f"| kvlab | sweep | kvlab | 64 | 32 | 2.00 | 20.0 | 3.36 | {per_day:.3g} | {life:.2f} |" in text
    assert "| baseline | sweep | none | 0 | 0 | — | 20.0 | 0.00 | 0 | — |" in text


# ---- the restore scenario's restarts ---------------------------------------------------------
def test_a_restore_with_restarts_counts_every_engine_life(monkeypatch: pytest.MonkeyPatch) -> None:
    """scenarios.restore stops the engine for each restart: the sampler closes the life before
    the stop (before_stop) and opens the next once the engine serves, so bytes written in every
    life are counted though the connector's counters start again from zero in each."""
    from test_harness_fair import FakeEngine, FakeServer

    from kvlab.harness import scenarios
    from kvlab.harness.compiler import restore_spec
    from kvlab.harness.plan import restore_steps

    life = {"written": 0.0, "stopped": 0}
    events: list[str] = []
    fake = FakeEngine()

    def complete(*a: object, **kw: object) -> object:
        life["written"] += 1000.0  # every request saves
        return fake(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(scenarios, "complete", complete)
    monkeypatch.setattr(scenarios.time, "sleep", lambda s: None)
    monkeypatch.setattr(scenarios, "drop_page_cache", lambda: None)
    server = FakeServer()

    def stop() -> None:
        events.append("stop")
        life["written"] = 0.0  # a new process: its counters start again

    monkeypatch.setattr(server.engine, "stop", stop)
    recs: list[dict] = []
    t = scenarios.Target("kvlab", server, "m", None, recs.append, lambda m: None, lambda ph: None)  # type: ignore[arg-type]
    t.counters = lambda: {"connector_written_bytes": life["written"], "connector_read_bytes": 0.0}  # type: ignore[method-assign]
    sampler = counted.WearSampler(
        "kvlab", "kvlab", 1024, dict, t.counters, dict, lambda r: (events.append(r["mark"]), recs.append(r))
    )
    t.before_stop = sampler.pause

    def restart() -> float:
        events.append("start")
        sampler.resume()
        return 1.0

    sc = campaign.RestoreScenario(tokens=300, warm_repeats=1, restart_repeats=2)
    sampler.open("restore")
    for step in restore_steps("kvlab", restore_spec(sc)):  # the plan's steps, as the runner runs them
        scenarios.run_step(t, step, 1, restart)
    sampler.close()
    assert events == ["open", "close", "stop", "start", "open", "close", "stop", "start", "open", "close"]
    requests = sum(1 for r in recs if r.get("kind") == "request")  # warm-ups included: each one saves
    c = counted.count([r for r in recs if r.get("kind") == "wear_sample"])["restore"]
    assert c.segments == 3 and c.kvlab_written == requests * 1000.0


# ---- the runner's wiring ---------------------------------------------------------------------
class CountingServer:
    """An engine as the runner drives it: every answered request saves 1000 bytes on one
    drive; a stop ends the process, so its counters start again. Its PID is this process's, so
    the /proc/PID/io read is real."""

    def __init__(self, deployment: setups.Deployment, life: dict[str, float]) -> None:
        from test_harness_fair import FakeEngineProc

        self.deployment, self.life = deployment, life
        self.base_url, self.companion = "http://fake", None
        self.engine = FakeEngineProc()
        self.engine.stop = self.stop  # type: ignore[method-assign]

    def start(self, progress: bool = False) -> float:
        self.life["starts"] += 1
        return 1.0

    def stop(self) -> None:
        self.life["written"] = 0.0

    def pids(self) -> dict[str, int | None]:
        return {"engine": os.getpid(), "cache_server": None}

    def memory(self) -> dict[str, None]:
        return {"engine": None, "cache_server": None}

    def metrics(self) -> dict[str, float]:
        return {'vllm:cache_config_info{block_size="128"}': 1.0}

    def reset_prefix_cache(self) -> None:
        pass


def test_the_runner_samples_every_scenario_and_engine_life(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_harness_fair import FakeEngine

    from kvlab.harness import runner, scenarios
    from kvlab.harness.compiler import compile_campaign

    life = {"written": 0.0, "starts": 0}
    fake = FakeEngine()

    def complete(*a: object, **kw: object) -> object:
        life["written"] += 1000.0
        return fake(*a, **kw)  # type: ignore[arg-type]

    def connector_metrics(self: scenarios.Target) -> dict[str, float]:
        return {
            "kvlab_written_bytes_total": life["written"],
            'kvlab_drive_written_bytes_total{drive="/d0"}': life["written"],
            "kvlab_read_bytes_total": 0.0,
        }

    monkeypatch.setattr(scenarios, "complete", complete)
    monkeypatch.setattr(scenarios.time, "sleep", lambda s: None)
    monkeypatch.setattr(scenarios, "drop_page_cache", lambda: None)
    monkeypatch.setattr(scenarios.Target, "connector_metrics", connector_metrics)

    class Engines(runner.LocalEngines):
        def server(self, deployment: setups.Deployment, log_dir: Path) -> CountingServer:  # type: ignore[override]
            return CountingServer(deployment, life)

    path = ROOT / "campaigns/ci-small.yml"
    c, _ = campaign.load(path)
    compiled = compile_campaign(c, path.parent)
    p = next(x for x in compiled.setups if x.setup == "kvlab")
    w = results.RunWriter(tmp_path / "runs", "r1")
    runner.run_setup(
        compiled,
        p,
        tmp_path / "model",
        "tiny",
        tmp_path / "work",
        w,
        runner.Progress(list(p.steps)),
        Engines(),
    )
    w.close()
    recs = [json.loads(line) for line in (tmp_path / "runs/r1" / results.RECORDS).read_text().splitlines()]
    assert c.scenarios.restore and c.scenarios.agents
    assert not [r for r in recs if r["kind"] == "error"]
    samples = [r for r in recs if r["kind"] == "wear_sample"]
    counts = counted.count(samples)
    assert set(counts) == {"restore", "sweep", *(f"agents:{n}" for n in c.scenarios.agents.concurrency)}
    assert counts["restore"].segments == c.scenarios.restore.restart_repeats + 1
    assert life["starts"] == len(p.lives) + c.scenarios.restore.restart_repeats
    # every request of a scenario, and nothing else, counted in it (1000 bytes each)
    requests: dict[str, int] = {}
    for r in recs:
        if r["kind"] == "request":
            key = counted.scenario_key(r)
            requests[key] = requests.get(key, 0) + 1
    for key, cnt in counts.items():
        assert cnt.kvlab_written == requests[key] * 1000.0, key
        assert cnt.drive_written == {"/d0": requests[key] * 1000.0}, key
        assert cnt.process_written is not None, key  # this process's /proc/PID/io, read for real


def test_every_wear_field_is_documented() -> None:
    from kvlab.harness.summary import DrivesDeclared, WearPoint

    doc = (ROOT / "docs/results-schema.md").read_text()
    assert "kvlab.summary/5" in doc
    missing = [f for m in (WearPoint, DrivesDeclared) for f in m.model_fields if f'"{f}"' not in doc]
    assert missing == []
