"""NixOS-test style handles on the testbed VMs: `succeed(cmd)`, `fail(cmd)`, `wait_for_unit(unit)`.

Every failure message names the machine, the command, its output and the console log to read.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from kvlab.testbed import vm


class MachineError(AssertionError):
    pass


SSH_TRIES = 3
SSH_CONNECT_ERROR = re.compile(
    r"Connection timed out during banner exchange|Connection (reset|closed) by|kex_exchange_identification|"
    r"Connection timed out$|Connection refused$",
    re.M,
)


class Machine:
    def __init__(self, state: vm.MachineState, key: Path):
        self.state = state
        self.key = key
        self.name = state.name

    def __repr__(self) -> str:
        return f"Machine({self.name}, ssh 127.0.0.1:{self.state.ssh_port})"

    @property
    def console_log(self) -> Path:
        return self.state.console_log

    def execute(self, cmd: str, timeout: float = 120.0) -> tuple[int, str]:
        """Run cmd over SSH. A connection that did not get as far as running it (ssh's own exit
        255 with a connection error: a TCG guest too busy to answer the banner in time) is tried
        again, at most SSH_TRIES times; the command's own exit codes are returned as they are."""
        for attempt in range(SSH_TRIES):
            try:
                res = vm.ssh(self.state, self.key, cmd, timeout=timeout)
            except subprocess.TimeoutExpired:
                return 124, f"timed out after {timeout:.0f} s"
            out = res.stdout + res.stderr
            if (
                not (res.returncode == 255 and SSH_CONNECT_ERROR.search(res.stderr))
                or attempt == SSH_TRIES - 1
            ):
                return res.returncode, out
            time.sleep(2)
        raise AssertionError("unreachable")

    def succeed(self, cmd: str, timeout: float = 120.0) -> str:
        rc, out = self.execute(cmd, timeout)
        if rc != 0:
            raise MachineError(
                f"{self.name}: `{cmd}` exited {rc}:\n{out[-3000:]}\n(console: {self.console_log})"
            )
        return out

    def fail(self, cmd: str, timeout: float = 120.0) -> str:
        rc, out = self.execute(cmd, timeout)
        if rc == 0:
            raise MachineError(f"{self.name}: `{cmd}` succeeded but should have failed:\n{out[-3000:]}")
        return out

    def wait_until_succeeds(self, cmd: str, timeout: float = 120.0, interval: float = 2.0) -> str:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            rc, last = self.execute(cmd, timeout=max(5.0, min(60.0, deadline - time.monotonic())))
            if rc == 0:
                return last
            time.sleep(interval)
        raise MachineError(
            f"{self.name}: `{cmd}` did not succeed within {timeout:.0f} s:\n{last[-2000:]}"
            f"\n(console: {self.console_log})"
        )

    def wait_for_unit(self, unit: str, timeout: float = 120.0) -> None:
        self.wait_until_succeeds(f"systemctl is-active --quiet {unit}", timeout)

    def wait_for_ssh(self, timeout: float = 300.0) -> float:
        return vm.wait_ssh(self.state, self.key, timeout)

    def reboot(self, timeout: float = 300.0) -> float:
        """Reboot from inside and wait for SSH again; returns seconds until it answered."""
        boot_id = self.succeed("cat /proc/sys/kernel/random/boot_id").strip()
        self.execute("systemctl reboot", timeout=10)
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            rc, out = self.execute("cat /proc/sys/kernel/random/boot_id", timeout=15)
            if rc == 0 and out.strip() and out.strip() != boot_id:
                return time.monotonic() - t0
            time.sleep(3)
        raise MachineError(
            f"{self.name}: did not come back from reboot within {timeout:.0f} s (console: {self.console_log})"
        )

    def set_link(self, netdev_id: str, up: bool) -> None:
        """Cut or restore a link at the qemu end (`fabric` or `mgmt`)."""
        out = vm.monitor(self.state, f"set_link {netdev_id} {'on' if up else 'off'}")
        if out:  # qemu answers a successful set_link with nothing
            raise MachineError(f"{self.name}: set_link {netdev_id}: {out}")
