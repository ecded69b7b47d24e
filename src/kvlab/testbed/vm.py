"""One qemu VM of the testbed: its command line, its process (tracked by PID), SSH into it.

Machines run under TCG (no KVM here), boot the image's kernel directly, write to a
copy-on-write overlay of the cached image, and keep their serial console in a log that
survives restarts. Management is qemu user-mode networking restricted to the host, with SSH
forwarded on 127.0.0.1; the fabric is one qemu TCP socket link per fabric port between the two
VMs (MTU 9000): netdev `fabric` (the guest's eth1), then `fabric2` (eth2) and so on.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from kvlab.net import free_port
from kvlab_connector.osutil import pid_alive

SSH_OPTS = (
    "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
    "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=5",
)  # fmt: skip
# Host keys are made on each VM's first boot, on loopback only: nothing to pin them against.
SSH_COMMON_ARGS = " ".join(SSH_OPTS[:6])


class VMError(Exception):
    """A VM that did not start, boot or answer; the message says where its console log is."""


@dataclasses.dataclass
class MachineSpec:
    name: str
    mgmt_mac: str
    fabric_mac: str
    fabric_role: str  # "listen" or "connect"
    # further fabric links, one MAC each: netdevs fabric2, fabric3, ... (guest eth2, eth3, ...)
    more_fabric_macs: tuple[str, ...] = ()
    memory_mib: int = 1024
    cpus: int = 1
    data_disk_mib: int = 0  # >0: a blank raw disk with serial kvlab-<name>-data0
    uefi: bool = False  # boot the image's disk.raw through OVMF (an appliance's UKI), not its kernel


@dataclasses.dataclass
class MachineState:
    name: str
    pid: int
    ssh_port: int
    dir: str

    @property
    def console_log(self) -> Path:
        return Path(self.dir) / "console.log"

    @property
    def monitor(self) -> Path:
        return Path(self.dir) / "monitor.sock"


def is_our_qemu(pid: int, machine_dir: Path) -> bool:
    """The PID still belongs to the qemu we started (guards against PID reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and b"qemu-system" in cmdline[0] and str(machine_dir).encode() in b" ".join(cmdline)


def fabric_netdev_ids(spec: MachineSpec) -> list[str]:
    """qemu's names of the VM's fabric links, in the guest's interface order (eth1, eth2, ...)."""
    return ["fabric", *(f"fabric{i + 2}" for i in range(len(spec.more_fabric_macs)))]


def fabric_ports(fabric_port: int | Sequence[int]) -> list[int]:
    return [fabric_port] if isinstance(fabric_port, int) else list(fabric_port)


def _fabric_args(spec: MachineSpec, ports: list[int]) -> list[str]:
    macs = [spec.fabric_mac, *spec.more_fabric_macs]
    if len(ports) != len(macs):
        raise VMError(f"{spec.name}: {len(macs)} fabric link(s), {len(ports)} fabric port(s) given")
    how = "listen" if spec.fabric_role == "listen" else "connect"
    out = []
    for netdev, mac, port in zip(fabric_netdev_ids(spec), macs, ports, strict=True):
        out += ["-netdev", f"socket,id={netdev},{how}=127.0.0.1:{port}",
                "-device", f"virtio-net-pci,netdev={netdev},mac={mac},host_mtu=9000"]  # fmt: skip
    return out


def qemu_command(
    spec: MachineSpec,
    image_dir: Path,
    machine_dir: Path,
    ssh_port: int,
    fabric_port: int | Sequence[int],
    pubkey: Path,
) -> list[str]:
    """fabric_port: one TCP port per fabric link (an int for a one-link machine)."""
    boot = uefi_boot(machine_dir) if spec.uefi else [
        "-kernel", str(image_dir / "vmlinuz"), "-initrd", str(image_dir / "initrd.img"),
        "-append", f"root=LABEL=kvlab-root rw console=ttyS0,115200 net.ifnames=0 systemd.hostname={spec.name} "
                   "panic=-1 quiet systemd.show_status=error",
    ]  # fmt: skip
    cmd = [
        "qemu-system-x86_64", "-name", spec.name, "-nodefaults", "-no-user-config",
        "-machine", "pc", "-accel", "tcg,tb-size=256", "-cpu", os.environ.get("KVLAB_TESTBED_CPU", "qemu64"),
        "-smp", str(spec.cpus), "-m", str(spec.memory_mib),
        "-display", "none", "-vga", "none",
        *boot,
        "-drive", f"file={machine_dir / 'root.qcow2'},if=virtio,format=qcow2,cache=unsafe,discard=unmap",
        "-netdev", f"user,id=mgmt,restrict=on,hostfwd=tcp:127.0.0.1:{ssh_port}-:22",
        "-device", f"virtio-net-pci,netdev=mgmt,mac={spec.mgmt_mac}",
        *_fabric_args(spec, fabric_ports(fabric_port)),
        "-fw_cfg", f"name=opt/kvlab/authorized_keys,file={pubkey}",
        "-chardev", f"file,id=console,path={machine_dir / 'console.log'},append=on",
        "-serial", "chardev:console",
        "-monitor", f"unix:{machine_dir / 'monitor.sock'},server,nowait",
        "-pidfile", str(machine_dir / "qemu.pid"),
    ]  # fmt: skip
    if spec.data_disk_mib:
        cmd += [
            "-drive",
            f"file={machine_dir / 'data0.raw'},if=none,id=data0,format=raw,cache=unsafe",
            "-device",
            f"virtio-blk-pci,drive=data0,serial=kvlab-{spec.name}-data0",
        ]
    return cmd


# UEFI boot, for appliance images (a disk whose ESP holds a UKI): OVMF from Debian's `ovmf`
# package, read-only code and a per-machine copy of its variable store. Secure Boot stays off:
# the testbed boots unsigned builds.
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")


def uefi_boot(machine_dir: Path) -> list[str]:
    return [
        "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
        "-drive", f"if=pflash,format=raw,unit=1,file={machine_dir / 'ovmf-vars.fd'}",
    ]  # fmt: skip


def prepare_disks(spec: MachineSpec, image_dir: Path, machine_dir: Path) -> None:
    machine_dir.mkdir(parents=True, exist_ok=True)
    if spec.uefi and not (machine_dir / "ovmf-vars.fd").exists():
        if not OVMF_CODE.exists():
            raise VMError(f"{spec.name}: {OVMF_CODE} missing (install ovmf: scripts/testbed-deps)")
        shutil.copyfile(OVMF_VARS, machine_dir / "ovmf-vars.fd")
    overlay = machine_dir / "root.qcow2"
    if not overlay.exists():
        subprocess.run(
            [
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                "-F",
                "raw",
                "-b",
                str(image_dir / "disk.raw"),
                str(overlay),
            ],
            check=True,
        )
    data = machine_dir / "data0.raw"
    if spec.data_disk_mib and not data.exists():
        with data.open("wb") as f:
            f.truncate(spec.data_disk_mib * 1024 * 1024)


def start(
    spec: MachineSpec, image_dir: Path, machine_dir: Path, fabric_port: int | Sequence[int], pubkey: Path
) -> MachineState:
    prepare_disks(spec, image_dir, machine_dir)
    ssh_port = free_port()
    cmd = qemu_command(spec, image_dir, machine_dir, ssh_port, fabric_port, pubkey)
    (machine_dir / "qemu.cmd").write_text(shlex.join(cmd) + "\n")
    with (machine_dir / "qemu.log").open("ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    time.sleep(0.5)
    if proc.poll() is not None:
        raise VMError(f"{spec.name}: qemu exited at once ({tail(machine_dir / 'qemu.log')})")
    return MachineState(name=spec.name, pid=proc.pid, ssh_port=ssh_port, dir=str(machine_dir))


def stop(state: MachineState, timeout: float = 20.0) -> None:
    """Stop this VM's qemu by its PID: quit through the monitor, then SIGTERM, then SIGKILL."""
    pid = state.pid
    if not pid_alive(pid) or not is_our_qemu(pid, Path(state.dir)):
        return
    try:
        monitor(state, "quit")
    except OSError:
        pass  # qemu closes the monitor as it quits
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and pid_alive(pid):
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout / 2
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.2)


def monitor(state: MachineState, command: str, timeout: float = 10.0) -> str:
    """One human-monitor command (e.g. `set_link fabric off`); returns its output once
    qemu has run it. The banner's prompt is read before the command goes out, and the
    command's echo and the next prompt after: closing the socket earlier can drop a
    command qemu has not read yet (a `set_link on` was lost that way)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(state.monitor))
        _until_prompt(s, b"")
        s.sendall(command.encode() + b"\n")
        out = _until_prompt(s, b"\r\n")
    text = out.decode(errors="replace")
    return text[text.index("\r\n") + 2:].rsplit("(qemu)", 1)[0].strip()


def _until_prompt(s: socket.socket, after: bytes) -> bytes:
    out = b""
    while not (after in out and out.rstrip().endswith(b"(qemu)")):
        chunk = s.recv(4096)
        if not chunk:
            raise OSError("qemu's monitor closed the connection")
        out += chunk
    return out


def ssh_base(state: MachineState, key: Path) -> list[str]:
    return ["ssh", *SSH_OPTS, "-i", str(key), "-p", str(state.ssh_port), "root@127.0.0.1"]


def ssh(state: MachineState, key: Path, command: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    # Its own /dev/null for stdin: ssh makes a non-tty stdin non-blocking, and one that is killed on a
    # timeout leaves it so; inherited, that is our stdin's open file, shared with every later child
    # (ansible-playbook then refuses to start).
    return subprocess.run(
        [*ssh_base(state, key), command],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def wait_ssh(state: MachineState, key: Path, timeout: float) -> float:
    """Wait until the VM answers over SSH; returns seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not pid_alive(state.pid):
            raise VMError(f"{state.name}: qemu died (console {state.console_log}: {tail(state.console_log)})")
        try:
            if ssh(state, key, "true", timeout=15).returncode == 0:
                return time.monotonic() - t0
        except subprocess.TimeoutExpired:
            pass
        time.sleep(2)
    raise VMError(
        f"{state.name}: no SSH after {timeout:.0f} s (console {state.console_log}: {tail(state.console_log)})"
    )


def listening(port: int) -> bool:
    """Some socket listens on 127.0.0.1:port, read from /proc/net/tcp: probing with a connect
    would become the peer of qemu's socket netdev."""
    want = f"0100007F:{port:04X}"
    try:
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1] == want and r.split()[3] == "0A" for r in rows)


def wait_listening(port: int, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if listening(port):
            return
        time.sleep(0.2)
    raise VMError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


def tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) or "empty"
