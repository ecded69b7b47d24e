"""A start that fails is stopped at once: a real process that says what vLLM says when its engine
core fails and, as vLLM does while it starts, does not stop on SIGTERM. Each start's IPC folder
(vLLM's sockets) goes with its process."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from kvlab.engines import local
from kvlab.net import free_port
from kvlab.setups.registry import ProcessSpec

FAILED_ENGINE = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # vLLM defers SIGTERM during start-up
print("RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
time.sleep(600)
"""


def test_a_failed_start_is_killed_after_a_short_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    wait_exited = local._wait_exited

    def spy(pid: int, timeout_s: float) -> None:
        waits.append(timeout_s)
        wait_exited(pid, timeout_s)

    monkeypatch.setattr(local, "_wait_exited", spy)
    spec = ProcessSpec((sys.executable, "-c", FAILED_ENGINE), ready_url=f"http://127.0.0.1:{free_port()}/health")
    proc = local.ManagedProcess("engine", spec, tmp_path / "engine.log")
    proc.start()
    pid = proc.pid
    assert pid is not None
    try:
        with pytest.raises(local.EngineError, match="failed to start"):
            proc.wait_ready(timeout_s=60)
    finally:
        proc.stop()
    assert waits and waits[0] < 20, f"SIGTERM's grace: {waits} (stop()'s default is 20 s)"
    assert not local.group_alive(pid)  # SIGKILL reached what ignored SIGTERM


LEAVES_FILES = """
import os, socket, sys, tempfile, time, uuid
path = os.path.join(os.environ.get("VLLM_RPC_BASE_PATH", "/nonexistent"), str(uuid.uuid4()))
s = socket.socket(socket.AF_UNIX)
s.bind(path)  # as vLLM's ZMQ ipc:// sockets are: a file left behind unless unlinked
fd, rendezvous = tempfile.mkstemp(prefix="vllm_dist_")  # as torch distributed's file store is
print(os.environ["TORCHINDUCTOR_CACHE_DIR"], flush=True)
print(rendezvous, flush=True)
print(path, flush=True)
time.sleep(600)
"""


def test_what_a_process_leaves_in_its_temp_folder_goes_with_it(tmp_path: Path) -> None:
    spec = ProcessSpec((sys.executable, "-c", LEAVES_FILES))
    first, second = (local.ManagedProcess(f"engine{i}", spec, tmp_path / f"engine{i}.log") for i in (1, 2))
    try:
        first.start()
        second.start()
        printed = [_printed_paths(p, 3) for p in (first, second)]
        sockets = [p[2] for p in printed]
        assert sockets[0].parent != sockets[1].parent  # a folder per start, never the shared temp folder
        assert all(s.is_socket() for s in sockets)
        for inductor, rendezvous, socket_path in printed:
            assert rendezvous.parent == socket_path.parent, "the temp folder (TMPDIR) is the life's folder"
            assert str(inductor) == local.inductor_cache_dir(), "compiled kernels stay in the shared cache"
            assert not str(inductor).startswith(str(socket_path.parent))
    finally:
        first.stop()
        second.stop()
    assert not any(p.exists() for paths in printed for p in paths[1:])
    assert not any(s.parent.exists() for s in sockets)


def _printed_paths(proc: local.ManagedProcess, n: int) -> list[Path]:
    for _ in range(200):
        lines = [ln for ln in proc.log_path.read_text().splitlines() if ln.startswith("/")]
        if len(lines) >= n:
            return [Path(ln) for ln in lines[-n:]]
        time.sleep(0.05)
    raise AssertionError(f"{proc.name} printed fewer than {n} paths:\n{proc.log_path.read_text()}")
