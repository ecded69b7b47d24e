"""`kvlab campaign run --engine systemd`: the lab path drives the vllm_server role's units.

Unit names come from the role's own files (vars/main.yml rendered with the role's filter
plugin), never from a copy here. systemd is not PID 1 on this machine, so systemctl and
journalctl cannot run: FakeSystemctl stands in for `engine_systemd.run_command` only, and
keeps each unit's state so that the real controller code (EngineServer's start and restart
order, the waits, the error messages) runs against it. /health and the cache server's
healthcheck are answered by a real HTTP server on this machine.
"""

from __future__ import annotations

import dataclasses
import http.server
import importlib.util
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from ansible.plugins.filter.core import FilterModule as AnsibleCore
from ansible.plugins.filter.mathstuff import FilterModule as AnsibleMath
from jinja2.nativetypes import NativeEnvironment

from kvlab.cli import main
from kvlab.engines import systemd as engine_systemd
from kvlab.engines.local import EngineError
from kvlab.engines.systemd import Systemd, SystemdEngine, SystemdEngines, load_deployment
from kvlab.setups import registry as setups

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
ROLE = ROOT / "roles" / "vllm_server"
SETUPS = sorted(setups.REGISTRY)
CAMPAIGN = ROOT / "campaigns" / "embedded.yml"


def role_units(kind: str, names: list[str]) -> dict[str, str]:
    """The role's __vllm_server_<kind>_units for vllm_server_setups=names, rendered from
    roles/vllm_server/vars/main.yml with the role's filter plugin, as Ansible renders it."""
    spec = importlib.util.spec_from_file_location(
        "vllm_server_filters", ROLE / "filter_plugins" / "kvlab_setups.py"
    )
    assert spec and spec.loader
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    env = NativeEnvironment()
    for module in (AnsibleCore(), AnsibleMath(), plugin.FilterModule()):
        env.filters.update(module.filters())
    expr = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())[f"__vllm_server_{kind}_units"]
    return env.from_string(expr).render(vllm_server_setups=names)


@pytest.mark.parametrize("setup", SETUPS)
def test_unit_names_are_the_roles(setup: str) -> None:
    assert engine_systemd.engine_unit(setup) == role_units("engine", SETUPS)[setup]
    assert engine_systemd.cache_unit(setup) == role_units("cache", SETUPS)[setup]


class FakeSystemctl:
    """Records every command line and answers as systemd would for units that start and
    stop as told; `failing` units go to failed right after their start."""

    def __init__(
        self,
        active: dict[str, str] | None = None,
        failing: tuple[str, ...] = (),
        unknown: tuple[str, ...] = (),
    ):
        self.state = dict(active or {})  # unit -> ActiveState
        self.failing = failing
        self.unknown = unknown
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> subprocess.CompletedProcess:
        self.calls.append(argv)
        ok = subprocess.CompletedProcess(argv, 0, "", "")
        if argv[0] == "journalctl":
            return subprocess.CompletedProcess(argv, 0, "… vllm: CUDA out of memory\n", "")
        if argv[1] == "list-units":
            rows = [
                f"{u} loaded {s} {'running' if s == 'active' else 'dead'} kvlab"
                for u, s in self.state.items()
            ]
            return subprocess.CompletedProcess(argv, 0, "\n".join(rows) + "\n", "")
        if argv[1] == "show":
            unit, s = argv[2], self.state.get(argv[2], "inactive")
            pid = 4242 if "vllm" in unit else 4343
            sub = {"active": "running", "failed": "failed"}.get(s, "dead")
            return subprocess.CompletedProcess(
                argv,
                0,
                (
                    f"ActiveState={s}\nSubState={sub}\n"
                    f"Result={'exit-code' if s == 'failed' else 'success'}\n"
                    f"MainPID={pid if s == 'active' else 0}\n"
                    f"NRestarts=0\nControlGroup=/system.slice/{unit}\n"
                ),
                "",
            )
        verb, units = argv[2], argv[3:]
        for u in units:
            if u in self.unknown:
                return subprocess.CompletedProcess(
                    argv, 5, "", f"Failed to {verb} {u}: Unit {u} not found.\n"
                )
            self.state[u] = ("failed" if u in self.failing else "active") if verb == "start" else "inactive"
        return ok

    def actions(self) -> list[str]:
        """What changes the node: starts and stops, as `verb unit...`."""
        return [" ".join(c[2:]) for c in self.calls if c[0] == "systemctl" and c[1] == "--no-ask-password"]


@pytest.fixture(scope="module")
def health_port() -> Iterator[int]:
    """A real HTTP server answering 200 on every path (/health, the cache server's /healthcheck)."""

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def deployment(setup: str, port: int | None = None) -> setups.Deployment:
    """The setup as the role renders it for a lab node; the cache server's healthcheck moved
    to `port` where one is given."""
    d = setups.render(
        setup,
        setups.EngineParams(
            model="/models/m",
            python="/opt/kvlab/venv/bin/python",
            device="cuda",
            host="0.0.0.0",
            kv_store_paths=("/mnt/kv0/kvlab",),
            example_storage_path="/mnt/kv0/example",
            cache_server_l2_path="/mnt/kv0/l2",
            offload_cpu_bytes=1 << 30,
        ),
    )
    if d.companion and port:
        d = dataclasses.replace(
            d, companion=dataclasses.replace(d.companion, ready_url=f"http://127.0.0.1:{port}/healthcheck")
        )
    return d


def engine(setup: str, port: int, fake: FakeSystemctl, logs: Path, timeout_s: float = 5) -> SystemdEngine:
    return SystemdEngine(deployment(setup, port), f"http://127.0.0.1:{port}/", Systemd(fake), logs, timeout_s)


@pytest.mark.parametrize("setup", SETUPS)
def test_start_stops_the_other_setup_then_starts_cache_server_and_engine(
    setup: str, health_port: int, tmp_path: Path
) -> None:
    other = "kvlab-vllm-baseline.service" if setup != "baseline" else "kvlab-vllm-kvlab.service"
    fake = FakeSystemctl(active={other: "active", "kvlab-cache-lmcache-mp.service": "inactive"})
    server = engine(setup, health_port, fake, tmp_path)
    server.start()
    eng, cache = role_units("engine", [setup])[setup], role_units("cache", [setup])[setup]
    starts = ([f"start {cache}"] if server.deployment.companion else []) + [f"start {eng}"]
    assert fake.actions() == [f"stop {other}", *starts]
    assert server.base_url == f"http://127.0.0.1:{health_port}"
    assert server.pids() == {"engine": 4242, "cache_server": 4343 if server.deployment.companion else None}
    del fake.calls[:]
    server.stop()
    assert fake.actions() == [f"stop {eng}"] + ([f"stop {cache}"] if server.deployment.companion else [])
    # The units log to the journal; a copy of it is kept in the results folder's logs/.
    journal = (tmp_path / f"{setup}.engine.journal").read_text()
    assert journal.startswith(f"=== journalctl -u {eng} --since @") and "CUDA out of memory" in journal
    assert not server.engine.log_path.exists()


def test_first_start_restarts_an_engine_already_running(health_port: int, tmp_path: Path) -> None:
    """The role leaves the deployed setup running: a campaign measures an engine it started."""
    fake = FakeSystemctl(active={"kvlab-vllm-kvlab.service": "active"})
    engine("kvlab", health_port, fake, tmp_path).start()
    assert fake.actions() == ["stop kvlab-vllm-kvlab.service", "start kvlab-vllm-kvlab.service"]


@pytest.mark.parametrize("setup", ["lmcache-mp", "lmcache-mp+kvlab-detached"])
def test_restart_takes_the_cache_server_down_only_when_it_does_not_survive(
    setup: str, health_port: int, tmp_path: Path
) -> None:
    fake = FakeSystemctl()
    server = engine(setup, health_port, fake, tmp_path)
    server.start()
    del fake.calls[:]
    server.restart()
    eng, cache = engine_systemd.engine_unit(setup), engine_systemd.cache_unit(setup)
    if server.deployment.companion_survives_engine_restart:
        assert fake.actions() == [f"stop {eng}", f"start {eng}"]
    else:
        assert fake.actions() == [f"stop {eng}", f"stop {cache}", f"start {cache}", f"start {eng}"]


def test_pids_fall_back_to_the_root_of_the_units_cgroup(tmp_path: Path) -> None:
    """Without a MainPID the sampler gets the cgroup's process whose parent is outside it."""
    cg = tmp_path / "system.slice" / "kvlab-vllm-kvlab.service"
    cg.mkdir(parents=True)
    (cg / "cgroup.procs").write_text(f"{os.getpid()}\n{os.getppid()}\n")
    unit = engine_systemd.SystemdUnit(
        "engine[kvlab]",
        "kvlab-vllm-kvlab.service",
        deployment("kvlab").engine,
        Systemd(FakeSystemctl(), cgroup_root=tmp_path),
        tmp_path / "kvlab.engine.log",
    )
    assert unit.pid == os.getppid()


def test_a_unit_that_fails_is_named_with_its_journal(health_port: int, tmp_path: Path) -> None:
    fake = FakeSystemctl(failing=("kvlab-vllm-kvlab.service",))
    with pytest.raises(EngineError) as err:
        engine("kvlab", health_port, fake, tmp_path).start()
    msg = str(err.value)
    assert msg.startswith(
        "kvlab-vllm-kvlab.service stopped before it was ready (failed/failed, result exit-code)"
    )
    assert "see journalctl -u kvlab-vllm-kvlab.service:" in msg and "CUDA out of memory" in msg
    assert fake.actions()[-1] == "stop kvlab-vllm-kvlab.service"  # no Restart=on-failure loop left behind


def test_an_engine_that_never_serves_times_out_naming_its_unit(tmp_path: Path) -> None:
    fake = FakeSystemctl()
    closed = SystemdEngine(deployment("kvlab"), "http://127.0.0.1:9", Systemd(fake), tmp_path, 0)
    with pytest.raises(
        EngineError,
        match=r"^kvlab-vllm-kvlab.service not ready after 0 s .*"
        r"http://127.0.0.1:9/health.*journalctl -u kvlab-vllm-kvlab.service",
    ):
        closed.start()


def test_a_unit_systemd_does_not_know_is_a_one_line_cause(health_port: int, tmp_path: Path) -> None:
    fake = FakeSystemctl(unknown=("kvlab-vllm-kvlab.service",))
    with pytest.raises(
        EngineError,
        match=r"^systemctl start kvlab-vllm-kvlab.service failed \(exit 5\): "
        r"Failed to start .* not found\.; see journalctl -u kvlab-vllm-kvlab",
    ):
        engine("kvlab", health_port, fake, tmp_path).start()


# ---- the node's deployments ------------------------------------------------------------
def params(**changes: object) -> setups.EngineParams:
    return setups.EngineParams(model="/models/m", served_model_name="kvlab-model", device="cuda").with_(
        **changes
    )


@pytest.mark.parametrize("setup", SETUPS)
def test_deployment_reads_back_what_the_role_wrote(setup: str, tmp_path: Path) -> None:
    d = deployment(setup)
    (tmp_path / f"{setup}.json").write_text(d.to_json())  # what configure.yml writes (to_nice_json of asdict)
    assert load_deployment(setup, tmp_path) == d


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({}, None),
        (
            {"model": "/models/other"},
            "serves --model /models/m but the campaign's model.path is /models/other",
        ),
        (
            {"served_model_name": "glm"},
            "serves --served-model-name kvlab-model but the campaign's model.served_name",
        ),
        (
            {"enable_prefix_caching": False},
            "runs with prefix caching on; scenarios that need it off cannot run",
        ),
    ],
)
def test_a_deployment_that_is_not_the_campaigns_is_refused(
    changes: dict, message: str | None, tmp_path: Path
) -> None:
    (tmp_path / "kvlab.json").write_text(deployment("kvlab").to_json())
    engines = SystemdEngines("http://127.0.0.1:8000", tmp_path, Systemd(FakeSystemctl()))
    if message is None:
        assert engines.deployment("kvlab", params()) == deployment("kvlab")
    else:
        with pytest.raises(setups.SetupError, match=message):
            engines.deployment("kvlab", params(**changes))


def test_a_setup_the_node_does_not_deploy_says_how_to_add_it(tmp_path: Path) -> None:
    with pytest.raises(setups.SetupError, match="has no unit on this node .* add it to vllm_server_setups"):
        load_deployment("lmcache-mp", tmp_path)


# ---- the command line ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engine", "systemd"], "kvlab: --engine systemd needs --endpoint URL"),
        (["--engine", "systemd", "--dry-run"], "kvlab: --engine systemd needs --endpoint URL"),
        (["--endpoint", "http://127.0.0.1:8000"], "kvlab: --endpoint is for --engine systemd"),
        (["--engine", "systemd", "--endpoint", "127.0.0.1:8000"], "kvlab: --endpoint 127.0.0.1:8000: give"),
    ],
)
def test_engine_options_are_checked_in_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["campaign", "run", str(CAMPAIGN), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_the_bench_runner_roles_command_is_a_kvlab_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """roles/bench_runner's default command, filled in as its run task fills it, parses and
    (with --dry-run, which starts nothing) plans the campaign."""
    defaults = yaml.safe_load((ROOT / "roles" / "bench_runner" / "defaults" / "main.yml").read_text())
    fill = {"{campaign}": str(CAMPAIGN), "{endpoint}": "http://127.0.0.1:8000", "{out}": "/nonexistent/out"}
    argv = [fill.get(a, a) for a in defaults["bench_runner_command"]]
    assert argv[:2] == ["campaign", "run"] and "systemd" in argv
    assert main([*argv, "--dry-run"]) == 0
    assert "estimate" in capsys.readouterr().out.lower()


def test_a_network_bound_unit_has_no_prefix_cache_reset(tmp_path: Path) -> None:
    """The role's lab unit bound to 0.0.0.0 runs without dev mode: the harness says so at
    once, from the deployment the role wrote, and sends nothing to an open route."""
    path = tmp_path / "kvlab.json"
    path.write_text(deployment("kvlab").to_json())
    d = load_deployment("kvlab", tmp_path)
    assert not d.serves_dev_routes
    server = SystemdEngine(d, "http://127.0.0.1:9/", Systemd(FakeSystemctl()), tmp_path)
    with pytest.raises(EngineError, match="no /reset_prefix_cache"):
        server.reset_prefix_cache()
