"""A start that fails is stopped at once: a real process that says what vLLM says when its engine
core fails and, as vLLM does while it starts, does not stop on SIGTERM."""

from __future__ import annotations

import sys
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
