"""`make bench inventory=local`: playbooks/bench.yml runs a campaign on this machine through
roles/bench_runner, for real, and fetches its results folder to the controller.

The node is this machine (inventories/local: connection local, the checkout's .venv, engines
started by the harness). The campaign is a small slice of campaigns/embedded-mooncake.yml
(kvlab only, N=2), so that the trace it refers to is shipped and checked by sha256 on the
way. The play runs twice, as `make bench` would: each run gets its own folder, on the node
and on the controller, and the first is left as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvlab.harness.summary import Summary, validate

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "campaigns" / "embedded-mooncake.yml"
TRACE = "traces/mooncake-synthetic-3850-4049.jsonl"
REQUESTS = 24
CONCURRENCY = 2
PLAY_TIMEOUT_S = 420  # one run is ~1 min here (an engine start and 24 short requests)


@dataclass
class BenchRun:
    result: subprocess.CompletedProcess
    tasks: dict[str, list[dict[str, Any]]]  # task name -> localhost's results (json callback)
    folder: Path  # fetch_dir/<bench id>/ on the controller


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_sha256(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def campaign_with_trace(folder: Path) -> Path:
    d = yaml.safe_load(SOURCE.read_text())
    d["name"] = "ci-bench"
    d["setups"] = ["kvlab"]
    d["scenarios"]["agents"]["concurrency"] = [CONCURRENCY]
    d["scenarios"]["agents"]["source"]["mooncake"]["limit"] = REQUESTS
    assert d["scenarios"]["agents"]["source"]["mooncake"]["path"] == TRACE
    (folder / "traces").mkdir(parents=True)
    shutil.copy(SOURCE.parent / TRACE, folder / TRACE)
    path = folder / "ci-bench.yml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def stop_leftovers(marker: str) -> None:
    """A play killed mid-run leaves its async job behind: SIGTERM the `timeout` wrapper that
    bench_runner starts (found by PID through this test's own folder on its command line);
    it hands the signal to the harness, which stops its engines by PID. Whatever is left of
    that process tree after a grace period gets SIGKILL, by PID."""
    def procs() -> dict[int, tuple[int, list[str]]]:
        out = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out[int(d.name)] = (ppid, argv)
        return out

    table = procs()
    roots = [pid for pid, (_, argv) in table.items()
             if argv and Path(argv[0]).name == "timeout" and any(marker in a for a in argv)]
    tree = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in table.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    for pid in roots:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in tree):
        time.sleep(1)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def play(campaign_file: Path, tmp: Path, extra: tuple[str, ...] = (), expect_ok: bool = True) -> BenchRun:
    before = set((tmp / "fetched").iterdir()) if (tmp / "fetched").exists() else set()
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(ROOT / "inventories/local/hosts.yml"),
            str(ROOT / "playbooks/bench.yml"), "-e", f"bench_runner_campaign={campaign_file}",
            "-e", f"bench_runner_results_dir={tmp / 'node'}", "-e", f"bench_runner_fetch_dir={tmp / 'fetched'}",
            "-e", "bench_runner_poll_s=2", "-e", "bench_runner_timeout_s=360", *extra]
    env = os.environ | {
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json", "ANSIBLE_LOCAL_TEMP": str(tmp / ".ansible-local"),
        "ANSIBLE_REMOTE_TEMP": str(tmp / ".ansible-remote"), "ANSIBLE_ASYNC_DIR": str(tmp / ".ansible-async"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    try:
        r = subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PLAY_TIMEOUT_S,
                           check=False)
    finally:
        stop_leftovers(str(tmp / "node"))
    try:
        report = json.loads(r.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"bench.yml printed no JSON report (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    tasks: dict[str, list[dict[str, Any]]] = {}
    for p in report["plays"]:
        for t in p["tasks"]:
            name = t["task"]["name"].removeprefix("bench_runner : ")
            tasks.setdefault(name, []).append(t["hosts"].get("localhost", {}))
    failed = [(name, res.get("msg") or res.get("stderr", "")[-2000:]) for name, results in tasks.items()
              for res in results if res.get("failed")]
    if expect_ok:
        assert r.returncode == 0 and not failed, f"bench.yml failed (rc {r.returncode}): {failed}\n{r.stderr[-3000:]}"
    (folder,) = set((tmp / "fetched").iterdir()) - before
    return BenchRun(r, tasks, folder)


@pytest.fixture(scope="module")
def bench(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BenchRun, dict[str, str], BenchRun]:
    """Two runs of bench.yml with the same campaign; the first run's fetched files' sha256,
    taken before the second run started."""
    tmp = tmp_path_factory.mktemp("bench")
    campaign_file = campaign_with_trace(tmp / "controller")
    first = play(campaign_file, tmp)
    first_files = tree_sha256(first.folder)
    second = play(campaign_file, tmp)
    return campaign_file, first, first_files, second


def summary_of(run: BenchRun) -> Summary:
    return validate(json.loads((run.folder / "out" / "latest" / "report" / "summary.json").read_text()))


def test_the_run_fetches_the_harness_results_folder(bench: tuple[Path, BenchRun, dict[str, str], BenchRun]) -> None:
    campaign_file, first, _, _ = bench
    assert first.folder.name.startswith("ci-bench-localhost-")
    out = first.folder / "out" / "latest"
    assert out.is_symlink() and out.resolve().parent == first.folder / "out"
    for name in ("records.jsonl", "provenance.json", "campaign.yml", "report/report.md", "report/summary.json",
                 "logs/kvlab.engine.log"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "campaign.yml").read_bytes() == campaign_file.read_bytes()
    assert not list(first.folder.parent.glob("*.tar.gz"))  # unpacked, the packed copy removed


def test_the_campaign_and_its_trace_arrived_checked_by_sha256(
        bench: tuple[Path, BenchRun, dict[str, str], BenchRun]) -> None:
    campaign_file, first, _, _ = bench
    (checks,) = first.tasks["Check that every copy is the controller's file, byte for byte"]
    assert [(i["item"]["item"]["field"], i["item"]["item"]["dest"], i.get("skipped", False), i.get("failed", False))
            for i in checks["results"]] == [("(the campaign)", "ci-bench.yml", False, False),
                                            ("scenarios.agents.source.mooncake.path", TRACE, False, False)]
    shipped = first.folder / "campaign"
    assert sha256(shipped / "ci-bench.yml") == sha256(campaign_file)
    assert sha256(shipped / TRACE) == sha256(SOURCE.parent / TRACE)
    prov = json.loads((first.folder / "out" / "latest" / "provenance.json").read_text())
    assert prov["campaign_path"] == str(first.folder.parent.parent / "node" / first.folder.name / "campaign" / "ci-bench.yml")
    assert prov["campaign_sha256"] == sha256(campaign_file)
    assert prov["trace_sha256"] == {TRACE: sha256(SOURCE.parent / TRACE)}


def test_the_harness_is_this_checkouts_and_its_engines_ran_here(
        bench: tuple[Path, BenchRun, dict[str, str], BenchRun]) -> None:
    _, first, _, _ = bench
    prov = json.loads((first.folder / "out" / "latest" / "provenance.json").read_text())
    # the checkout's commit (others may commit on top of it while this runs)
    commit = prov["git"]["commit"]
    assert commit and subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=ROOT,
                                     check=False).returncode == 0
    assert prov["engine_control"] == {"kind": "local"}
    assert prov["model"]["kind"] == "tiny"
    # the engines were stopped: none still runs from this run's working folder
    work = f"campaigns/{prov['run_id']}/"
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and work in _cmdline(p)]


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_the_results_name_the_setups_that_ran(bench: tuple[Path, BenchRun, dict[str, str], BenchRun]) -> None:
    _, first, _, second = bench
    for run in (first, second):
        s = summary_of(run)
        assert list(s.setups) == ["kvlab"]
        k = s.setups["kvlab"]
        assert k.skipped is None and k.errors == [], k.errors
        point = k.agents[str(CONCURRENCY)]
        assert point.answers == REQUESTS and point.errors == 0
        assert "| Metric | kvlab |" in (run.folder / "out" / "latest" / "report" / "report.md").read_text()


def test_a_second_run_lands_in_its_own_folder_and_leaves_the_first_alone(
        bench: tuple[Path, BenchRun, dict[str, str], BenchRun]) -> None:
    _, first, first_files, second = bench
    assert second.folder != first.folder and second.folder.name.startswith("ci-bench-localhost-")
    assert (second.folder / "out" / "latest").resolve().name != (first.folder / "out" / "latest").resolve().name
    assert tree_sha256(first.folder) == first_files
    node = first.folder.parent.parent / "node"
    assert sorted(p.name for p in node.iterdir()) == sorted([first.folder.name, second.folder.name])


def test_the_checkouts_environment_is_used_as_it_is(bench: tuple[Path, BenchRun, dict[str, str], BenchRun]) -> None:
    """inventories/local: bench_runner_install false, so nothing is installed into .venv (its
    kvlab stays this checkout's editable install) and the install steps change nothing."""
    _, first, _, second = bench
    for run in (first, second):
        (harness,) = run.tasks["Check that the harness runs in vLLM's environment"]
        assert harness["cmd"][0] == str(ROOT / ".venv" / "bin" / "python") and harness["rc"] == 0
        for name in ("Install the extras (every file checked against its hash)",
                     "Install this build of kvlab (once per source hash)"):
            (res,) = run.tasks[name]
            assert res.get("skipped") and not res.get("changed"), (name, res)
    r = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", "import kvlab; print(kvlab.__file__)"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == str(ROOT / "src" / "kvlab" / "__init__.py")


def test_a_failed_run_still_comes_back_and_says_why(tmp_path: Path) -> None:
    """The harness exits non-zero (here: a flag it does not know): its folder is fetched all
    the same, and the play fails naming the exit status, the harness's own words and where
    the folder is."""
    campaign_file = campaign_with_trace(tmp_path / "controller")
    bad = {"bench_runner_command": ["campaign", "run", "{campaign}", "--no-such-flag"]}
    run = play(campaign_file, tmp_path, extra=("-e", json.dumps(bad)), expect_ok=False)
    assert run.result.returncode != 0
    (fail,) = [res for res in run.tasks["Fail a run that did not finish, saying why"] if res.get("failed")]
    assert "exit status 2" in fail["msg"] and "--no-such-flag" in fail["msg"], fail["msg"]
    assert str(run.folder) in fail["msg"] and (run.folder / "campaign" / campaign_file.name).is_file()
