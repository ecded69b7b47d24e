"""Engine control through the systemd units the vllm_server role installs (the lab path).

On a lab node the engines are not children of the harness: the vllm_server role renders
one unit per setup from the setup registry (kvlab-vllm-<setup>.service, and
kvlab-cache-<setup>.service for a setup with a cache server) and writes each setup's
Deployment to /etc/kvlab/setups/<setup>.json. SystemdEngine drives those units with the
interface the runner and the scenarios use from EngineServer (start, stop, restart,
pids, memory, base_url, engine/companion with stop()), so nothing above it knows which
kind of engine it measures. Every systemctl and journalctl call goes through `run_command`.
Memory is each unit's cgroup v2 memory.current/memory.peak (kvlab.harness.memory).
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.engines.local import EngineError, EngineServer
from kvlab.harness.memory import CgroupUnreadable, Usage, cgroup_usage, process_tree
from kvlab.setups.registry import Deployment, EngineParams, ProcessSpec, SetupError

# vllm_server_config_dir (the role's default) + /setups: one <setup>.json per rendered setup.
SETUPS_DIR = Path("/etc/kvlab/setups")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# A campaign model on 8 GPUs loads and compiles for minutes: the units' TimeoutStartSec.
READY_TIMEOUT_S = 1800.0
# systemctl stop waits for TimeoutStopSec (120 s on the engine units) before SIGKILL.
COMMAND_TIMEOUT_S = 300.0
JOURNAL_LINES = 40

Run = Callable[[list[str]], subprocess.CompletedProcess]


def run_command(argv: list[str]) -> subprocess.CompletedProcess:
    """Run one systemctl or journalctl command line and return its result (never raises
    on a non-zero exit: the caller reads returncode and stderr).

    The only place the lab path touches the node. Unit tests hand `Systemd` a recording
    fake instead, because systemd is not PID 1 on development and CI machines; everything
    above this function runs for real in them."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise EngineError(
            f"{argv[0]} not found: --engine systemd runs on a node with systemd "
            "(the lab, via `make bench`); use --engine local elsewhere"
        ) from None
    except subprocess.TimeoutExpired:
        raise EngineError(f"`{' '.join(argv)}` did not finish within {COMMAND_TIMEOUT_S:.0f} s") from None


def unit_safe(setup: str) -> str:
    """A setup name as a unit name may spell it: 'lmcache-mp+kvlab' -> 'lmcache-mp_kvlab'."""
    return re.sub(r"[^A-Za-z0-9:_.-]", "_", setup)


def engine_unit(setup: str) -> str:
    return f"kvlab-vllm-{unit_safe(setup)}.service"


def cache_unit(setup: str) -> str:
    return f"kvlab-cache-{unit_safe(setup)}.service"


UNIT_PATTERNS = ("kvlab-vllm-*.service", "kvlab-cache-*.service")


class Systemd:
    """The systemctl and journalctl command lines the lab path issues."""

    def __init__(self, run: Run = run_command, cgroup_root: Path = CGROUP_ROOT):
        self.run = run
        self.cgroup_root = cgroup_root

    def _systemctl(self, verb: str, *units: str, ok: tuple[int, ...] = (0,)) -> None:
        r = self.run(["systemctl", "--no-ask-password", verb, *units])
        if r.returncode not in ok:
            unit = units[0] if len(units) == 1 else " ".join(units)
            raise EngineError(
                f"systemctl {verb} {unit} failed (exit {r.returncode}): "
                f"{(r.stderr or r.stdout).strip()}; see journalctl -u {units[0]}"
                + self.journal_tail(units[0])
            )

    def start(self, unit: str) -> None:
        self._systemctl("start", unit)

    def stop(self, *units: str) -> None:
        # Exit 5: a unit that is not loaded is not running either (and a failed start that
        # cleans up must report its own cause, not this).
        if units:
            self._systemctl("stop", *units, ok=(0, 5))

    def show(self, unit: str) -> dict[str, str]:
        props = ("ActiveState", "SubState", "Result", "MainPID", "NRestarts", "ControlGroup")
        r = self.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)])
        if r.returncode != 0:
            return {}
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def loaded_kvlab_units(self) -> dict[str, str]:
        """Every loaded kvlab unit on the node and its ActiveState."""
        r = self.run(["systemctl", "list-units", "--all", "--plain", "--no-legend", *UNIT_PATTERNS])
        if r.returncode != 0:
            raise EngineError(
                f"systemctl list-units failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}"
            )
        out = {}
        for line in r.stdout.splitlines():
            cols = line.split()
            if len(cols) >= 3:  # UNIT LOAD ACTIVE SUB DESCRIPTION...
                out[cols[0]] = cols[2]
        return out

    def journal(self, unit: str, since: float | None = None, lines: int | None = None) -> str:
        """The unit's journal (since a time, the last lines), or a line saying why none."""
        argv = ["journalctl", "--no-pager", "-o", "short-iso", "-u", unit]
        argv += ["-n", str(lines)] if lines else []
        argv += ["--since", f"@{int(since)}"] if since is not None else []
        try:
            r = self.run(argv)
        except EngineError as e:
            return f"(no journal: {e})"
        text = r.stdout.strip() if r.returncode == 0 else f"(journalctl failed: {r.stderr.strip()})"
        return text or "(journal empty)"

    def journal_tail(self, unit: str, since: float | None = None) -> str:
        return "\n" + self.journal(unit, since, JOURNAL_LINES)

    def cgroup_dir(self, control_group: str) -> Path:
        """A unit's folder on the unified (cgroup v2) hierarchy."""
        return self.cgroup_root / control_group.lstrip("/")

    def cgroup_pids(self, control_group: str) -> list[int]:
        """The processes of a unit's cgroup (unified hierarchy, else the v1 systemd one)."""
        for base in (self.cgroup_root, self.cgroup_root / "systemd"):
            try:
                text = (base / control_group.lstrip("/") / "cgroup.procs").read_text()
            except OSError:
                continue
            return [int(p) for p in text.split()]
        return []


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _serves(spec: ProcessSpec) -> bool:
    if spec.ready_url:
        try:
            with urllib.request.urlopen(spec.ready_url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False
    if spec.ready_port:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", spec.ready_port)) == 0
    return True


class SystemdUnit:
    """One unit in place of a child process: ManagedProcess's interface, so EngineServer's
    start/restart order and the scenarios' `server.engine.stop()` work on it unchanged."""

    def __init__(self, name: str, unit: str, spec: ProcessSpec, systemd: Systemd, log_path: Path):
        self.name = name
        self.unit = unit
        self.spec = spec  # its ready_url / ready_port say when the unit serves
        self.systemd = systemd
        # The unit logs to the journal: log_path is never written, so code that reads a local
        # process's log finds none; save_journal() copies the journal beside it (.journal).
        self.log_path = log_path
        self.first_start: float | None = None
        self._started_at: float | None = None
        self._restarts = "0"

    @property
    def pid(self) -> int | None:
        return self._pid(self.systemd.show(self.unit))

    def _pid(self, props: dict[str, str]) -> int | None:
        """MainPID; while systemd knows none, the cgroup's process whose parent is outside it
        (the root of the process tree)."""
        if props.get("MainPID", "0") not in ("", "0"):
            return int(props["MainPID"])
        members = self.systemd.cgroup_pids(props.get("ControlGroup", "")) if props.get("ControlGroup") else []
        roots = [p for p in members if _ppid(p) not in members]
        return min(roots) if roots else None

    def memory(self) -> Usage | None:
        """The unit's memory from its cgroup v2 files (the whole unit: children and page cache
        charged to it); the process tree, with the reason, where they cannot be read; None
        while the unit runs no process."""
        props = self.systemd.show(self.unit)
        pid = self._pid(props)
        if pid is None:
            return None
        cg = props.get("ControlGroup", "")
        if not cg:
            return process_tree(pid, f"systemd reports no ControlGroup for {self.unit}")
        try:
            return cgroup_usage(self.systemd.cgroup_dir(cg))
        except CgroupUnreadable as e:
            return process_tree(pid, str(e))

    def alive(self) -> bool:
        return self.systemd.show(self.unit).get("ActiveState") == "active"

    def start(self) -> None:
        self._started_at = time.time()
        self.first_start = self.first_start or self._started_at
        self._restarts = self.systemd.show(self.unit).get("NRestarts", "0")
        self.systemd.start(self.unit)

    def stop(self) -> None:
        self.systemd.stop(self.unit)

    def save_journal(self) -> None:
        """Append the journal since this object first started the unit to <log>.journal."""
        if self.first_start is None:
            return
        path = self.log_path.with_suffix(".journal")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"=== journalctl -u {self.unit} --since @{int(self.first_start)}\n")
            f.write(self.systemd.journal(self.unit, self.first_start) + "\n")
        self.first_start = None

    def _fail(self, why: str) -> EngineError:
        # The caller (EngineServer.start) stops the units: Restart=on-failure would retry.
        tail = self.systemd.journal_tail(self.unit, self._started_at)
        return EngineError(f"{self.unit} {why}; see journalctl -u {self.unit}:{tail}")

    def wait_ready(self, timeout_s: float, progress: bool = False) -> float:
        """Wait until the unit serves; a unit that fails, stops or is restarted by systemd
        meanwhile raises at once with its journal."""
        t0 = time.monotonic()
        last_note = t0
        what = self.spec.ready_url or f"port {self.spec.ready_port}"
        while True:
            props = self.systemd.show(self.unit)
            state = f"{props.get('ActiveState', '?')}/{props.get('SubState', '?')}"
            if props.get("ActiveState") in ("failed", "inactive") or props.get("SubState") == "auto-restart":
                raise self._fail(f"stopped before it was ready ({state}, result {props.get('Result', '?')})")
            if props.get("NRestarts", self._restarts) != self._restarts:
                raise self._fail(f"was restarted by systemd before it was ready ({state})")
            if _serves(self.spec):
                return time.monotonic() - t0
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise self._fail(f"not ready after {timeout_s:.0f} s ({state}, waiting for {what})")
            if progress and now - last_note > 15:
                print(
                    f"  … waiting for {self.unit} ({now - t0:.0f} s, {state}, {what})",
                    file=sys.stderr,
                    flush=True,
                )
                last_note = now
            time.sleep(1.0)


class SystemdEngine(EngineServer):
    """The engine of one deployed setup, with its cache server's unit where it has one.

    EngineServer's start (cache server first, then the engine, each awaited; everything
    stopped on failure), stop and restart (the cache server too unless the setup says it
    survives engine restarts) run unchanged on the units; only what differs is here."""

    def __init__(
        self,
        deployment: Deployment,
        endpoint: str,
        systemd: Systemd,
        log_dir: Path,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ):
        self.deployment = deployment
        self.endpoint = endpoint.rstrip("/")
        self.systemd = systemd
        self.ready_timeout_s = ready_timeout_s
        name = deployment.setup
        # The engine serves when /health answers at the endpoint the requests go to.
        health = dataclasses.replace(deployment.engine, ready_url=self.endpoint + "/health")
        self.engine = SystemdUnit(
            f"engine[{name}]", engine_unit(name), health, systemd, log_dir / f"{name}.engine.log"
        )
        self.companion = (
            SystemdUnit(
                f"cache-server[{name}]",
                cache_unit(name),
                deployment.companion,
                systemd,
                log_dir / f"{name}.cache-server.log",
            )
            if deployment.companion
            else None
        )
        self.last_start_s = None
        self._first_start = True

    @property
    def base_url(self) -> str:
        return self.endpoint

    def memory(self) -> dict[str, Usage | None]:
        """What the memory sampler records: each unit's cgroup (or its process tree, and why)."""
        return {"engine": self.engine.memory(), "cache_server": self.companion.memory() if self.companion else None}

    @property
    def units(self) -> list[str]:
        return [u.unit for u in (self.companion, self.engine) if u]

    def start(self, progress: bool = False) -> float:
        """Stop every other setup's units first (one engine owns the GPUs), then start.

        The first start also stops this setup's own units where they already run (as the
        role leaves the deployed setup): a campaign measures an engine it started, with
        empty caches, as the local engines are."""
        running = [
            u
            for u, state in self.systemd.loaded_kvlab_units().items()
            if state not in ("inactive", "failed") and (self._first_start or u not in self.units)
        ]
        self.systemd.stop(*running)
        self._first_start = False
        return super().start(progress)

    def stop(self) -> None:
        """Stop the units and keep their journals in the results folder (logs/*.journal)."""
        try:
            super().stop()
        finally:
            for unit in (self.companion, self.engine):
                if unit:
                    unit.save_journal()


def load_deployment(setup: str, setups_dir: Path = SETUPS_DIR) -> Deployment:
    """The Deployment the vllm_server role rendered for `setup` on this node."""
    path = setups_dir / f"{setup}.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise SetupError(
            f"setup {setup!r} has no unit on this node ({path} missing): add it to "
            "vllm_server_setups and deploy (make deploy)"
        ) from None
    except (OSError, ValueError) as e:
        raise SetupError(f"{path}: unreadable deployment ({e}): redeploy (make deploy)") from None

    def spec(s: dict[str, Any] | None) -> ProcessSpec | None:
        return (
            ProcessSpec(
                argv=tuple(s["argv"]),
                env=dict(s.get("env") or {}),
                ready_url=s.get("ready_url"),
                ready_port=s.get("ready_port"),
            )
            if s
            else None
        )

    engine = spec(d["engine"])
    assert engine is not None
    return Deployment(
        setup=d["setup"],
        engine=engine,
        kv_transfer_config=d.get("kv_transfer_config"),
        companion=spec(d.get("companion")),
        companion_survives_engine_restart=bool(d.get("companion_survives_engine_restart")),
    )


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


class SystemdEngines:
    """The runner's engine controller for `--engine systemd`: deployments read from the
    node, engines driven through their units, requests sent to `endpoint`."""

    def __init__(
        self,
        endpoint: str,
        setups_dir: Path = SETUPS_DIR,
        systemd: Systemd | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ):
        self.endpoint = endpoint
        self.setups_dir = setups_dir
        self.systemd = systemd or Systemd()
        self.ready_timeout_s = ready_timeout_s

    def deployment(self, setup: str, params: EngineParams) -> Deployment:
        """The node's deployment of `setup`, refused where it does not serve what the
        campaign asks for (another model, or prefix caching not as this engine life needs)."""
        d = load_deployment(setup, self.setups_dir)
        argv, unit = d.engine.argv, engine_unit(setup)
        for flag, want, field in (
            ("--model", params.model, "model.path"),
            ("--served-model-name", params.served_model_name, "model.served_name"),
        ):
            have = _flag(argv, flag)
            if have != want:
                raise SetupError(
                    f"{unit} serves {flag} {have} but the campaign's {field} is {want}: "
                    "make them the same (inventory vllm_server_* or the campaign)"
                )
        caching = "--enable-prefix-caching" in argv
        if caching != params.enable_prefix_caching:
            raise SetupError(
                f"{unit} runs with prefix caching {'on' if caching else 'off'}; scenarios that "
                f"need it {'on' if params.enable_prefix_caching else 'off'} cannot run on it: "
                "deploy with vllm_server_enable_prefix_caching to match"
            )
        return d

    def server(self, deployment: Deployment, log_dir: Path) -> SystemdEngine:
        return SystemdEngine(deployment, self.endpoint, self.systemd, log_dir, self.ready_timeout_s)

    def describe(self) -> dict[str, Any]:
        return {"kind": "systemd", "endpoint": self.endpoint, "setups_dir": str(self.setups_dir)}
