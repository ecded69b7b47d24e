"""The VM testbed: a storage target and a "GPU" node (no GPU), joined by an NVMe-oF fabric.

`up` boots both from the cached image (building it when its inputs changed), target first
because its end of each fabric link listens (two links, as a lab node has two storage ports on
two subnets: qemu netdevs `fabric` and `fabric2`, the guests' eth1 and eth2), makes the node's
DH-HMAC-CHAP secrets (host and controller; kept in the state folder, mode 0600, never printed),
writes what it picked (SSH ports, key, transport, secrets) beside the committed inventory
(inventories/testbed: the lab's group tree), and records every PID in a state file; `down` stops exactly those PIDs; `status` reports each VM and the
node's NVMe controllers as /sys/class/nvme shows them.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import time
import zlib
from pathlib import Path

import yaml

from kvlab import paths
from kvlab.images import build as images
from kvlab.net import free_port
from kvlab.testbed import vm
from kvlab.testbed.status import CONTROLLERS_SCRIPT, parse_controllers

TRANSPORTS = ("rdma", "tcp")

MACHINES = (
    vm.MachineSpec(name="target", mgmt_mac="52:54:00:6b:76:01", fabric_mac="52:54:00:6b:77:01",
                   more_fabric_macs=("52:54:00:6b:78:01",), fabric_role="listen", data_disk_mib=2048),
    vm.MachineSpec(name="node", mgmt_mac="52:54:00:6b:76:02", fabric_mac="52:54:00:6b:77:02",
                   more_fabric_macs=("52:54:00:6b:78:02",), fabric_role="connect"),
)  # fmt: skip
FABRIC_LINKS = 1 + len(MACHINES[0].more_fabric_macs)
# The node is also the inventory's GPU node: the GPU roles find no GPU there and say so, the
# serving roles install the connector and render the units. The committed inventory
# (inventories/testbed/hosts.yml) holds this tree; a unit test keeps the two in step.
GROUPS = {"target": ("nvmeof_targets",), "node": ("nvmeof_initiators", "gpu_nodes", "h200", "bench")}
# The files `up` writes beside the committed inventory (git ignores them).
UP_FILE = "up.yml"


class TestbedError(Exception):
    """A testbed that cannot be brought up or reached; one line naming the cause and the fix."""


@dataclasses.dataclass
class State:
    name: str
    transport: str
    image_dir: str
    fabric_port: int
    key: str
    machines: list[vm.MachineState]
    # every fabric link's TCP port (fabric_port is the first); the node's DH-HMAC-CHAP secrets
    fabric_ports: list[int] = dataclasses.field(default_factory=list)
    dhchap: dict[str, str] = dataclasses.field(default_factory=dict)

    def machine(self, name: str) -> vm.MachineState:
        for m in self.machines:
            if m.name == name:
                return m
        raise TestbedError(f"testbed {self.name} has no machine {name!r}")


def state_root(name: str) -> Path:
    return paths.state_dir() / "testbed" / name


def load_state(name: str) -> State | None:
    f = state_root(name) / "state.json"
    if not f.exists():
        return None
    raw = json.loads(f.read_text())
    raw["machines"] = [vm.MachineState(**m) for m in raw["machines"]]
    return State(**raw)


def save_state(state: State) -> None:
    f = state_root(state.name) / "state.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    # it holds the DH-HMAC-CHAP secrets: readable by its owner only, from its first byte
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(dataclasses.asdict(state), indent=2) + "\n")


def dhchap_secret(key_bytes: int = 32) -> str:
    """A DH-HMAC-CHAP secret as `nvme gen-dhchap-key` writes it (nvme-cli, NVMe Base 2.0 8.13.5.8):
    DHHC-1:00:<base64 of the key and its CRC-32, little-endian>: (00: the key is used as it is)."""
    key = secrets.token_bytes(key_bytes)
    return "DHHC-1:00:" + base64.b64encode(key + zlib.crc32(key).to_bytes(4, "little")).decode() + ":"


def new_dhchap() -> dict[str, str]:
    """The node's secret (the target authenticates the node) and the controller's (the node
    authenticates the target: bidirectional)."""
    return {"host": dhchap_secret(), "ctrl": dhchap_secret()}


def ensure_key(root: Path) -> Path:
    key = root / "id_ed25519"
    if not key.exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kvlab-testbed", "-f", str(key)], check=True
        )
    return key


def committed_inventory() -> Path:
    return paths.repo_root() / "inventories" / "testbed"


def run_time_vars(state: State) -> dict[str, dict]:
    """What `up` picked, by file under the inventory folder: the key and transport for every
    host, each VM's forwarded SSH port, and where the testbed has them, the node's DH-HMAC-CHAP
    pair (testbed_dhchap, where the lab has its vault: the node's nvmeof_initiator_dhchap_secret
    and _ctrl_secret, and the target's allowlist keys, derive from it). Everything else is in the
    committed inventory."""
    out = {
        f"group_vars/all/{UP_FILE}": {
            "ansible_ssh_private_key_file": state.key,
            "testbed_transport": state.transport,
        }
    }
    for m in state.machines:
        out[f"host_vars/{m.name}/{UP_FILE}"] = {"ansible_port": m.ssh_port}
    if state.dhchap:
        out[f"group_vars/all/{UP_FILE}"]["testbed_dhchap"] = {
            m.name: {"secret": state.dhchap["host"], "ctrl_secret": state.dhchap["ctrl"]}
            for m in state.machines
            if "nvmeof_initiators" in GROUPS.get(m.name, ())
        }
    return out


def write_inventory(state: State, path: Path) -> Path:
    """Write the run-time values beside `path` (an inventory's hosts.yml). Anywhere else than the
    committed inventory (a test's own folder), the committed one is copied there first."""
    inv_dir = path.parent
    src = committed_inventory()
    if inv_dir.resolve() != src.resolve():
        if path.exists() or inv_dir.exists():
            for sub in ("hosts.yml", "group_vars", "host_vars"):
                target = inv_dir / sub
                if target.is_symlink() or target.is_file():
                    target.unlink()
                elif target.is_dir():
                    shutil.rmtree(target)
        shutil.copytree(src, inv_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(UP_FILE, "*.md"))
    header = f"# Written by `kvlab testbed up` for testbed {state.name!r}; not committed (git ignores it).\n"
    for rel, values in run_time_vars(state).items():
        f = inv_dir / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold secrets
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(header + "---\n" + yaml.safe_dump(values, sort_keys=True))
    return path


def remove_run_time_vars(path: Path) -> None:
    inv_dir = path.parent
    for f in [*inv_dir.glob(f"group_vars/*/{UP_FILE}"), *inv_dir.glob(f"host_vars/*/{UP_FILE}")]:
        f.unlink()
        if f.parent.parent.name == "host_vars" and not any(f.parent.iterdir()):
            f.parent.rmdir()


def default_inventory_path() -> Path:
    return committed_inventory() / "hosts.yml"


def running(state: State | None) -> bool:
    return bool(state) and all(
        vm.pid_alive(m.pid) and vm.is_our_qemu(m.pid, Path(m.dir)) for m in state.machines
    )


def up(
    name: str = "default",
    transport: str = "rdma",
    inventory_path: Path | None = None,
    boot_timeout: float = 600.0,
    log=print,
) -> State:
    if transport not in TRANSPORTS:
        raise TestbedError(f"transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
    old = load_state(name)
    if running(old):
        assert old is not None
        if old.transport != transport:
            raise TestbedError(
                f"testbed {name} runs with transport {old.transport}; `kvlab testbed down` first"
            )
        write_inventory(old, inventory_path or default_inventory_path())
        log(f"testbed {name} already up")
        return old
    if old:
        down(name, log=lambda *_: None)
    t0 = time.monotonic()
    image_dir = images.ensure("testbed")
    log(f"image {image_dir} ({time.monotonic() - t0:.0f} s)")
    root = state_root(name)
    key = ensure_key(root)
    ports = [free_port() for _ in range(FABRIC_LINKS)]
    state = State(
        name=name,
        transport=transport,
        image_dir=str(image_dir),
        fabric_port=ports[0],
        key=str(key),
        machines=[],
        fabric_ports=ports,
        dhchap=new_dhchap(),
    )
    try:
        for spec in MACHINES:
            mdir = root / spec.name
            # a fresh overlay each time: `up` starts from the image, as CI does
            for stale in ("root.qcow2", "data0.raw"):
                (mdir / stale).unlink(missing_ok=True)
            m = vm.start(spec, image_dir, mdir, state.fabric_ports, key.with_suffix(".pub"))
            state.machines.append(m)
            save_state(state)
            if spec.fabric_role == "listen":
                for port in state.fabric_ports:
                    vm.wait_listening(port)
        for m in state.machines:
            waited = vm.wait_ssh(m, key, boot_timeout)
            log(f"{m.name}: SSH on 127.0.0.1:{m.ssh_port} after {waited:.0f} s (console {m.console_log})")
    except Exception:
        down(name, log=lambda *_: None)
        raise
    write_inventory(state, inventory_path or default_inventory_path())
    log(
        f"testbed {name} up in {time.monotonic() - t0:.0f} s; inventory {inventory_path or default_inventory_path()}"
    )
    return state


def down(name: str = "default", log=print) -> None:
    state = load_state(name)
    if not state:
        log(f"testbed {name}: nothing recorded")
        return
    for m in reversed(state.machines):
        vm.stop(m)
        log(f"{m.name}: stopped (pid {m.pid}); console log kept at {m.console_log}")
    (state_root(name) / "state.json").unlink(missing_ok=True)
    if name == "default":
        remove_run_time_vars(default_inventory_path())


def status(name: str = "default") -> dict:
    state = load_state(name)
    if not state:
        return {"testbed": name, "up": False, "machines": []}
    machines = []
    for m in state.machines:
        alive = vm.pid_alive(m.pid) and vm.is_our_qemu(m.pid, Path(m.dir))
        entry: dict = {
            "name": m.name,
            "pid": m.pid,
            "running": alive,
            "ssh_port": m.ssh_port,
            "console_log": str(m.console_log),
            "groups": list(GROUPS.get(m.name, ())),
        }
        if alive:
            try:
                res = vm.ssh(m, Path(state.key), CONTROLLERS_SCRIPT, timeout=30)
                entry["reachable"] = res.returncode == 0
                if res.returncode == 0:
                    entry["nvme_controllers"] = parse_controllers(res.stdout)
            except subprocess.TimeoutExpired:
                entry["reachable"] = False
        machines.append(entry)
    node_ctrls = [c for m in machines for c in m.get("nvme_controllers", [])]
    return {
        "testbed": name,
        "up": all(m["running"] for m in machines),
        "transport": state.transport,
        "transport_ok": bool(node_ctrls) and all(c["transport"] == state.transport for c in node_ctrls),
        "image": state.image_dir,
        "fabric_port": state.fabric_port,
        "fabric_ports": state.fabric_ports,
        "machines": machines,
    }
