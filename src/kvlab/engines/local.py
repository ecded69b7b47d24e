"""Engine control: start, stop and restart the processes of a rendered setup.

Every process runs in its own session (process group) and is stopped by its PID and
group, also when the caller fails. A process that dies before it is ready raises
EngineError with the tail of its log, never a silent hang.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.setups.registry import Deployment, ProcessSpec
from kvlab_connector.osutil import drop_page_cache, pid_alive

if TYPE_CHECKING:
    from kvlab.harness.memory import Usage

__all__ = ["EngineError", "EngineServer", "ManagedProcess", "drop_page_cache", "group_alive", "log_tail",
           "metric_sum", "parse_prometheus"]


class EngineError(RuntimeError):
    """An engine or cache server that died or never became ready."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text[-lines:])


@dataclass
class ManagedProcess:
    """One started process, its log and its readiness check."""

    name: str
    spec: ProcessSpec
    log_path: Path
    popen: subprocess.Popen | None = None
    temp_dir: Path | None = None  # this start's temp folder (see start), removed at stop

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def start(self) -> None:
        if self.alive():
            raise EngineError(f"{self.name} is already running (pid {self.popen.pid})")
        port = self.port
        if port is not None and not _port_free(port):
            # Readiness is checked on this port: another server there would answer for us.
            raise EngineError(f"{self.name}: port {port} is in use by another process; stop it or choose another port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # vLLM leaves files in the temp folder at each life's end when stopped by a signal: its
        # processes' ZMQ sockets (VLLM_RPC_BASE_PATH, default the temp folder) and torch
        # distributed's rendezvous file (vllm_dist_*): 2,015 and 398 of them had gathered in /tmp
        # here. Each start gets a temp folder of its own, removed with the process. Torch's
        # compiled kernels keep their cache where it was, shared by every life.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kvlab-life-"))
        env = os.environ.copy() | {
            "TMPDIR": str(self.temp_dir),
            "VLLM_RPC_BASE_PATH": str(self.temp_dir),
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or inductor_cache_dir(),
        } | self.spec.env
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%Y-%m-%dT%H:%M:%S')}: {' '.join(self.spec.argv)}\n".encode())
            log.flush()
            try:
                self.popen = subprocess.Popen(
                    list(self.spec.argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )
            except BaseException:
                self._remove_temp_dir()
                raise

    @property
    def port(self) -> int | None:
        if self.spec.ready_port:
            return self.spec.ready_port
        if self.spec.ready_url:
            return urllib.parse.urlparse(self.spec.ready_url).port
        return None

    def alive(self) -> bool:
        return self.popen is not None and not _exited(self.popen.pid)

    def exit_code(self) -> int | None:
        if self.popen is None:
            return None
        try:
            info = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self.popen.returncode
        return info.si_status if info else None

    def wait_ready(self, timeout_s: float, progress: bool = False) -> float:
        """Wait until the process serves; returns seconds waited. A start that failed is stopped
        with a short grace (FAILED_START_GRACE_S): it has nothing to finish."""
        t0 = time.monotonic()
        last_note = t0
        while True:
            if not self.alive():
                code = self.exit_code()
                self.stop(FAILED_START_GRACE_S)
                raise EngineError(
                    f"{self.name} exited with code {code} before it was ready; log {self.log_path}:\n"
                    f"{log_tail(self.log_path)}"
                )
            if _start_failed(self.log_path):
                # vLLM's API server can outlive a failed engine core: do not wait it out.
                self.stop(FAILED_START_GRACE_S)
                raise EngineError(f"{self.name} failed to start; log {self.log_path}:\n{log_tail(self.log_path, 60)}")
            if self._ready():
                return time.monotonic() - t0
            now = time.monotonic()
            if now - t0 > timeout_s:
                self.stop(FAILED_START_GRACE_S)
                raise EngineError(
                    f"{self.name} not ready after {timeout_s:.0f} s; log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if progress and now - last_note > 15:
                print(f"  … waiting for {self.name} ({now - t0:.0f} s)", file=sys.stderr, flush=True)
                last_note = now
            time.sleep(0.25)

    def _ready(self) -> bool:
        if self.spec.ready_url:
            try:
                with urllib.request.urlopen(self.spec.ready_url, timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                return False
        if self.spec.ready_port:
            with socket.socket() as s:
                s.settimeout(1)
                return s.connect_ex(("127.0.0.1", self.spec.ready_port)) == 0
        return True

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left; never leaves orphans.

        The leader is reaped last: until then its PID, and so the group id, cannot be
        reused (PIDs wrap quickly on a busy machine), so a signal to the group can only
        reach this engine's own processes."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # start_new_session: the group id is the leader's pid
        if self.popen.returncode is None:
            _signal_group(pgid, signal.SIGTERM)
            _wait_exited(pgid, grace_s)
            # Workers of the engine share the group: kill any that outlived the leader.
            _signal_group(pgid, signal.SIGKILL)
            _wait_exited(pgid, 10)
            _wait_group_gone(pgid, 10)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.popen = None
        self._remove_temp_dir()

    def _remove_temp_dir(self) -> None:
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def inductor_cache_dir() -> str:
    """Where torch keeps compiled kernels when TORCHINDUCTOR_CACHE_DIR is not set
    (torch._inductor's default_cache_dir): under the temp folder of the process that asks,
    so an engine given a temp folder of its own would compile its kernels anew at each start."""
    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):  # no name for this uid (a container): torch says the same
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


_START_FAILURES = (b"EngineCore failed to start", b"Engine core initialization failed")
# vLLM defers SIGTERM while it starts, so stopping a start that failed waited out stop()'s whole
# 20 s grace (20 of the 55 s in which a bad connector setting reached the user); such a process
# has nothing to finish.
FAILED_START_GRACE_S = 2.0


def _start_failed(log_path: Path) -> bool:
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))
            tail = f.read()
    except OSError:
        return False
    last_start = tail.rfind(b"\n=== start ")
    return any(m in tail[last_start:] for m in _START_FAILURES)


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (WNOWAIT keeps its PID ours)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # already reaped


def _wait_exited(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not _exited(pid):
        time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _group_members(pgid: int) -> list[int]:
    """Live processes of a group, the (zombie) leader aside."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == pgid:
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":  # fields: state, ppid, pgrp, ...
            members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies awaiting their reaper do not)."""
    return bool(_group_members(pgid)) or pid_alive(pgid)


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


class EngineServer:
    """The engine of one deployment, with its companion cache server if it has one."""

    def __init__(self, deployment: Deployment, log_dir: Path, ready_timeout_s: float = 600):
        self.deployment = deployment
        self.ready_timeout_s = ready_timeout_s
        name = deployment.setup
        self.engine = ManagedProcess(f"engine[{name}]", deployment.engine, log_dir / f"{name}.engine.log")
        self.companion = (
            ManagedProcess(f"cache-server[{name}]", deployment.companion, log_dir / f"{name}.cache-server.log")
            if deployment.companion
            else None
        )
        self.last_start_s: float | None = None

    @property
    def base_url(self) -> str:
        url = self.deployment.engine.ready_url or ""
        return url.rsplit("/health", 1)[0]

    def start(self, progress: bool = False) -> float:
        t0 = time.monotonic()
        try:
            if self.companion and not self.companion.alive():
                self.companion.start()
                self.companion.wait_ready(self.ready_timeout_s, progress)
            self.engine.start()
            self.engine.wait_ready(self.ready_timeout_s, progress)
        except BaseException:
            self.stop()
            raise
        self.last_start_s = time.monotonic() - t0
        return self.last_start_s

    def stop(self) -> None:
        self.engine.stop()
        if self.companion:
            self.companion.stop()

    def restart(self, progress: bool = False, with_companion: bool | None = None) -> float:
        """Restart the engine; the companion too unless it is meant to outlive the engine."""
        if with_companion is None:
            with_companion = not self.deployment.companion_survives_engine_restart
        self.engine.stop()
        if with_companion and self.companion:
            self.companion.stop()
        return self.start(progress)

    def pids(self) -> dict[str, int | None]:
        return {
            "engine": self.engine.pid,
            "cache_server": self.companion.pid if self.companion else None,
        }

    def memory(self) -> dict[str, Usage | None]:
        """What the memory sampler records: each process tree (a local engine is no unit)."""
        from kvlab.harness.memory import process_tree

        return {role: process_tree(pid) if pid is not None else None for role, pid in self.pids().items()}

    def reset_prefix_cache(self) -> None:
        if not self.deployment.serves_dev_routes:
            raise EngineError(
                f"setup {self.deployment.setup}: the engine binds a network address, so it runs without "
                "vLLM's dev mode and has no /reset_prefix_cache (dev routes check no API key); bind it "
                "to 127.0.0.1 (vllm_server_host, the harness runs on the node) to reset its prefix cache"
            )
        req = urllib.request.Request(self.base_url + "/reset_prefix_cache", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=60) as r:
            if r.status != 200:
                raise EngineError(f"reset_prefix_cache answered {r.status}")

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus metrics as {name{labels}: value} (summed over nothing)."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as r:
            return parse_prometheus(r.read().decode())

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """Sum a metric over all its label sets."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))
