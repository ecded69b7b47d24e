"""The testbed tier: two VMs from the cached image, provisioned by the real roles, then probed.

Reads like a NixOS VM test: the session fixture declares the machines and starts them, tests
call `succeed`, `fail`, `wait_for_unit` on them; a global timeout bounds the session, qemu is
stopped by PID whatever happens, and the console logs stay for the failure report.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab import paths
from kvlab.testbed import testbed as tb
from kvlab.testbed.machine import Machine

REPO = paths.repo_root()
NAME = "pytest"
# For working on the tests: run them against a testbed already up and deployed
# (`make testbed && make deploy inventory=testbed`, then KVLAB_TESTBED_ATTACH=default);
# it is neither deployed again nor stopped. CI never sets it.
ATTACH = os.environ.get("KVLAB_TESTBED_ATTACH")
# The first deploy of fresh TCG VMs took 9-26 min here (two cores shared with engines).
DEPLOY_TIMEOUT_S = 2400
# Where the session's bring-up went (the image, each VM's boot, the first deploy): printed at the
# end of the run, since --durations gives the whole of it to the first test's set-up.
PHASES: list[str] = []


def _phase(message: str) -> None:
    print(message, file=sys.stderr)
    PHASES.append(message)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if PHASES:
        terminalreporter.write_sep("-", "testbed bring-up")
        for line in PHASES:
            terminalreporter.write_line(line)


def _missing() -> str | None:
    for tool in ("qemu-system-x86_64", "qemu-img", "mmdebstrap", "mke2fs", "cc", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} not installed (run scripts/testbed-deps)"
    if os.geteuid() != 0:
        return "the image build needs root (mmdebstrap --mode=root)"
    if not (Path(sys.executable).parent / "ansible-playbook").exists():
        return "ansible-playbook not in this environment (make setup)"
    return None


def ansible_playbook(
    inventory: Path, *args: str, timeout: float = DEPLOY_TIMEOUT_S, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """ansible-playbook from this environment, with the project's ansible.cfg, from the repo root."""
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_NOCOLOR="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        **(env_extra or {}),
    )
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), *args],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.fixture(scope="session")
def playbook():
    """ansible_playbook, for tests that make an inventory of their own VMs."""
    return ansible_playbook


class Testbed:
    def __init__(self, state: tb.State, inventory: Path):
        self.state = state
        self.inventory = inventory
        self.machines = {m.name: Machine(m, Path(state.key)) for m in state.machines}
        self.transport = state.transport

    def __getattr__(self, name: str) -> Machine:
        try:
            return self.__dict__["machines"][name]
        except KeyError as e:
            raise AttributeError(name) from e

    def ansible(self, *args: str, timeout: float = DEPLOY_TIMEOUT_S) -> subprocess.CompletedProcess:
        return ansible_playbook(self.inventory, *args, timeout=timeout)

    def console_logs(self) -> str:
        return "\n".join(f"  {m.name}: {m.console_log}" for m in self.machines.values())


@pytest.fixture(scope="session")
def testbed(tmp_path_factory) -> Testbed:
    why = _missing()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"testbed tier cannot run in CI: {why}")
        pytest.skip(why)
    transport = os.environ.get("KVLAB_TESTBED_TRANSPORT", "rdma")
    # the committed inventory (inventories/testbed), copied with this session's run-time values
    inventory = tmp_path_factory.mktemp("inventory") / "hosts.yml"
    if ATTACH:
        attached = tb.load_state(ATTACH)
        if not tb.running(attached):
            pytest.fail(f"KVLAB_TESTBED_ATTACH={ATTACH}: no testbed {ATTACH} running "
                        "(make testbed && make deploy inventory=testbed first)")
        assert attached is not None
        tb.write_inventory(attached, inventory)
        yield Testbed(attached, inventory)
        return
    state = tb.up(NAME, transport=transport, inventory_path=inventory, log=_phase)
    bed = Testbed(state, inventory)
    try:
        yield bed
    finally:
        tb.down(NAME, log=lambda m: print(m, file=sys.stderr))
        print(f"testbed console logs:\n{bed.console_logs()}", file=sys.stderr)


@pytest.fixture(scope="session")
def deployed(testbed) -> subprocess.CompletedProcess | None:
    """The whole site deployed once by the real playbook (site.yml); later tests build on it."""
    if ATTACH:
        return None  # deployed by `make deploy inventory=testbed`
    t0 = time.monotonic()
    # profile_tasks, beside the callbacks ansible.cfg enables: the deploy's slowest tasks go into
    # the bring-up summary
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "ansible.cfg")
    callbacks = f"{cfg.get('defaults', 'callbacks_enabled')},ansible.posix.profile_tasks"
    res = ansible_playbook(testbed.inventory, "playbooks/site.yml", env_extra={
        "ANSIBLE_CALLBACKS_ENABLED": callbacks,
        "PROFILE_TASKS_TASK_OUTPUT_LIMIT": "12",
    })  # fmt: skip
    _phase(f"site.yml deployed in {time.monotonic() - t0:.0f} s (rc {res.returncode}); its slowest tasks:")
    _phase(res.stdout.rsplit("=" * 20, 1)[-1].strip()[-2000:])
    if res.returncode != 0:
        pytest.fail(
            f"deploy failed (rc {res.returncode}):\n{res.stdout[-6000:]}\n{res.stderr[-2000:]}\n"
            f"console logs:\n{testbed.console_logs()}"
        )
    return res
