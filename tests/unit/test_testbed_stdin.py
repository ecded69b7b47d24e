"""The testbed's ssh never shares our stdin: CI's testbed tier failed when an ssh child left the
shared /dev/null non-blocking and the next ansible-playbook refused to start ("Ansible requires
blocking IO on stdin/stdout/stderr")."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvlab.testbed import vm

# What OpenSSH does to a stdin that is not a tty, and leaves so when it is killed on a timeout.
FAKE_SSH = f"""#!{sys.executable}
import os
os.set_blocking(0, False)
"""


@pytest.fixture
def blocking_stdin():
    was = os.get_blocking(0)
    os.set_blocking(0, True)
    yield
    os.set_blocking(0, was)


def test_ssh_leaves_our_stdin_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocking_stdin
) -> None:
    (tmp_path / "ssh").write_text(FAKE_SSH)
    (tmp_path / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    state = vm.MachineState(name="m", pid=0, ssh_port=1, dir=str(tmp_path))
    assert vm.ssh(state, tmp_path / "key", "true").returncode == 0
    assert os.get_blocking(0), "vm.ssh let its child make our stdin non-blocking"
