"""Memory under `--engine systemd`: a unit's cgroup v2 files, else its process tree and why.

systemctl is the recording fake of test_engine_systemd (systemd is not PID 1 here); the
cgroup hierarchy is a folder in tmp_path laid out as /sys/fs/cgroup is (memory.current,
memory.peak, cgroup.procs, cgroup.controllers), handed to `Systemd(cgroup_root=...)`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_engine_systemd import FakeSystemctl, deployment

from kvlab.engines.local import EngineServer
from kvlab.engines.systemd import Systemd, SystemdEngine, cache_unit, engine_unit
from kvlab.harness.memory import CGROUP, PROCESS_TREE, MemorySampler, process_tree
from kvlab.harness.report import memory_table
from kvlab.harness.summary import summarize

pytestmark = pytest.mark.unit

GIB = 1 << 30


class ShowFake(FakeSystemctl):
    """FakeSystemctl whose units run this test's own process (a tree psutil can walk) and
    whose ControlGroup is what the test says ('' as systemd prints it for a unit without one)."""

    def __init__(self, control_group: dict[str, str] | None = None, main_pid: int | None = None):
        super().__init__(active={engine_unit("lmcache-mp"): "active", cache_unit("lmcache-mp"): "active"})
        self.control_group = control_group or {}
        self.main_pid = os.getpid() if main_pid is None else main_pid

    def __call__(self, argv: list[str]) -> subprocess.CompletedProcess:
        r = super().__call__(argv)
        if argv[0] == "systemctl" and argv[1] == "show":
            unit = argv[2]
            cg = self.control_group.get(unit, f"/system.slice/{unit}")
            lines = [
                f"MainPID={self.main_pid}" if ln.startswith("MainPID=") else
                f"ControlGroup={cg}" if ln.startswith("ControlGroup=") else ln
                for ln in r.stdout.splitlines()
            ]
            r = subprocess.CompletedProcess(argv, 0, "\n".join(lines) + "\n", "")
        return r


def cgroup(root: Path, unit: str, current: int | None, peak: int | None, v2: bool = True) -> Path:
    """A unit's folder as the unified hierarchy shows it; None leaves that file out."""
    cg = root / "system.slice" / unit
    cg.mkdir(parents=True)
    (cg / "cgroup.procs").write_text(f"{os.getpid()}\n")
    if v2:
        (cg / "cgroup.controllers").write_text("cpu io memory pids\n")
    if current is not None:
        (cg / "memory.current").write_text(f"{current}\n")
    if peak is not None:
        (cg / "memory.peak").write_text(f"{peak}\n")
    return cg


def server(fake: FakeSystemctl, root: Path, logs: Path) -> SystemdEngine:
    return SystemdEngine(deployment("lmcache-mp"), "http://127.0.0.1:9", Systemd(fake, cgroup_root=root), logs, 1)


def test_the_units_cgroup_gives_current_and_peak(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    cgroup(root, engine_unit("lmcache-mp"), 3 * GIB, 5 * GIB)
    cgroup(root, cache_unit("lmcache-mp"), 1 * GIB, 2 * GIB)
    mem = server(ShowFake(), root, tmp_path).memory()
    assert mem["engine"] is not None and mem["cache_server"] is not None
    assert (mem["engine"].source, mem["engine"].current_bytes, mem["engine"].peak_bytes) == (CGROUP, 3 * GIB, 5 * GIB)
    assert (mem["cache_server"].current_bytes, mem["cache_server"].peak_bytes) == (1 * GIB, 2 * GIB)
    assert mem["engine"].fallback is None and mem["engine"].pinned_bytes >= 0


def test_the_cgroup_path_is_the_one_systemctl_show_names(tmp_path: Path) -> None:
    """Delegated or custom slices: the folder is ControlGroup's, not one built from the unit name."""
    root = tmp_path / "cgroup"
    eng = engine_unit("lmcache-mp")
    cg = root / "kvlab.slice" / "kvlab-engines.slice" / eng
    cg.mkdir(parents=True)
    (cg / "memory.current").write_text("7\n")
    (cg / "memory.peak").write_text("9\n")
    fake = ShowFake({eng: f"/kvlab.slice/kvlab-engines.slice/{eng}"})
    u = server(fake, root, tmp_path).memory()["engine"]
    assert u is not None and (u.source, u.current_bytes, u.peak_bytes) == (CGROUP, 7, 9)
    assert ["systemctl", "show", eng] == fake.calls[0][:3] and "--property=ControlGroup" in fake.calls[0]


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        ("no-folder", "no cgroup folder {cg}"),
        ("v1", "{cg} is not on a cgroup v2 (unified) hierarchy"),
        ("no-memory-controller", "no {cg}/memory.current: the memory controller is not enabled for this cgroup"),
        ("no-control-group", "systemd reports no ControlGroup for kvlab-vllm-lmcache-mp.service"),
    ],
)
def test_without_the_cgroup_files_the_process_tree_stands_in_and_says_why(
    layout: str, reason: str, tmp_path: Path
) -> None:
    root = tmp_path / "cgroup"
    eng = engine_unit("lmcache-mp")
    cg = root / "system.slice" / eng
    if layout == "v1":
        cgroup(root, eng, None, None, v2=False)
    elif layout == "no-memory-controller":
        cgroup(root, eng, None, None)
    fake = ShowFake({eng: ""} if layout == "no-control-group" else None)
    u = server(fake, root, tmp_path).memory()["engine"]
    assert u is not None and u.source == PROCESS_TREE and u.peak_bytes is None
    assert u.fallback == reason.format(cg=cg)
    assert u.current_bytes > 0  # this test's own process, walked as the unit's MainPID


def test_a_kernel_without_memory_peak_keeps_the_cgroup_and_says_so(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    cgroup(root, engine_unit("lmcache-mp"), 3 * GIB, None)
    u = server(ShowFake(), root, tmp_path).memory()["engine"]
    assert u is not None and (u.source, u.current_bytes, u.peak_bytes) == (CGROUP, 3 * GIB, None)
    assert u.fallback == "no memory.peak (kernel < 5.19): peaks are the sampled memory.current"


def test_a_unit_that_runs_no_process_is_not_sampled(tmp_path: Path) -> None:
    """Between a stop and a start: no MainPID and an empty cgroup, so no record."""
    root = tmp_path / "cgroup"
    cg = cgroup(root, engine_unit("lmcache-mp"), 0, 5 * GIB)
    (cg / "cgroup.procs").write_text("")
    s = server(ShowFake(main_pid=0), root, tmp_path)
    assert s.memory()["engine"] is None
    assert MemorySampler(s.memory, 1, lambda r: None, "lmcache-mp").sample() is None


def test_records_summary_and_report_say_which_source(tmp_path: Path) -> None:
    """The sampler's records carry the source; the summary's peak is memory.peak (it holds
    what rose and fell between two samples); the report's memory table names the source."""
    root = tmp_path / "cgroup"
    cgroup(root, engine_unit("lmcache-mp"), 3 * GIB, 5 * GIB)
    cgroup(root, cache_unit("lmcache-mp"), 1 * GIB, 2 * GIB)
    records: list[dict] = []
    sampler = MemorySampler(server(ShowFake(), root, tmp_path).memory, 1, records.append, "lmcache-mp")
    rec = sampler.sample()
    assert rec is not None
    assert {k: v for k, v in rec.items() if k.startswith("engine_") and k != "engine_pinned_bytes"} == {
        "engine_rss_bytes": 3 * GIB, "engine_peak_bytes": 5 * GIB,
        "engine_memory_source": "cgroup", "engine_memory_fallback": None,
    }
    assert rec["cache_server_memory_source"] == "cgroup" and rec["cache_server_peak_bytes"] == 2 * GIB
    s = summarize([rec], ["lmcache-mp"]).setups["lmcache-mp"]
    assert (s.peak_rss_bytes.engine, s.peak_rss_bytes.cache_server) == (5 * GIB, 2 * GIB)
    assert s.memory_source is not None and (s.memory_source.engine, s.memory_source.cache_server) == ("cgroup", "cgroup")
    table = memory_table([("lmcache-mp", s, None)])  # type: ignore[list-item]
    assert table[0].endswith("| source (engine / cache server) |") and table[2].endswith("| 1 | cgroup |")


def test_local_engines_are_measured_over_their_process_tree(tmp_path: Path) -> None:
    """The embedded default: no unit, so the process tree, with no fallback to explain."""
    local = EngineServer(deployment("kvlab"), tmp_path)
    assert local.memory() == {"engine": None, "cache_server": None}  # not started: nothing to sample
    u = process_tree(os.getpid())
    rec = MemorySampler(lambda: {"engine": u, "cache_server": None}, 1, lambda r: None, "kvlab").sample()
    assert rec is not None and rec["engine_memory_source"] == "process_tree" and rec["engine_rss_bytes"] > 0
    assert rec["engine_peak_bytes"] is None and rec["engine_memory_fallback"] is None
    assert rec["cache_server_rss_bytes"] is None and rec["cache_server_memory_source"] is None


def test_older_records_without_a_source_summarize_as_process_tree() -> None:
    old = {"kind": "memory", "setup": "kvlab", "phase": "x", "t": 1.0, "engine_rss_bytes": 10,
           "engine_pinned_bytes": 0, "cache_server_rss_bytes": None, "cache_server_pinned_bytes": None}
    s = summarize([old], ["kvlab"]).setups["kvlab"]
    assert s.peak_rss_bytes.engine == 10
    assert s.memory_source is not None and (s.memory_source.engine, s.memory_source.cache_server) == (
        "process_tree", None)
