"""The storage-target appliance (images/target) booted in place of the role-provisioned target.

Reads like a NixOS VM test: the target VM boots the appliance's disk through OVMF with a seed
written into its seed partition, and the node (the testbed image, no roles: it only needs
nvme-cli and soft-RoCE) connects to it over NVMe-oF/RDMA on the testbed's fabric link. No
Ansible runs: the appliance serves from its seed alone. A broken seed boots a second appliance
VM that must export nothing and name the field on its console. Every qemu is stopped by PID,
console logs are kept under the test's folder. Last, site.yml manages the booted appliance from
the testbed's own inventory (the target declared an appliance) and must change its seed and
nothing else.

Cost (2 cores, TCG): cold ~2 min for the appliance image (+ the testbed image when not cached),
then about 3 OVMF/TCG boots; warm: the boots only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from kvlab.images import build as images
from kvlab.images import target as target_image
from kvlab.images import target_seed
from kvlab.net import free_port
from kvlab.testbed import testbed as tb
from kvlab.testbed import vm
from kvlab.testbed.machine import Machine

pytestmark = [pytest.mark.testbed, pytest.mark.appliance, pytest.mark.timeout(3600)]

STORE_NQN = "nqn.2026-01.io.kvlab.testbed:store0"
NODE_NQN = "nqn.2014-08.org.nvmexpress:uuid:4f1d8a52-0c7e-4b7a-9a33-6b2c1e0d9f02"
STRANGER_NQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000dead"
DATA_DEVICE = "/dev/disk/by-id/virtio-kvlab-target-data0"  # the seed names it by serial
BOOT_TIMEOUT_S = 900  # OVMF + the UKI under TCG on two shared cores


def _missing() -> str | None:
    for tool in ("qemu-system-x86_64", "qemu-img", "qemu-io", "mmdebstrap", "mke2fs", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} not installed (run scripts/testbed-deps)"
    if not vm.OVMF_CODE.exists():
        return f"{vm.OVMF_CODE} missing (run scripts/testbed-deps: ovmf)"
    if os.geteuid() != 0:
        return "the image builds need root (mmdebstrap --mode=root, chroot)"
    return None


def good_seed(pubkey: bytes) -> dict[str, bytes]:
    """The seed the role would write for the testbed's target: its fabric, one subsystem, one host."""
    nvmet = {
        "hosts": [{"nqn": NODE_NQN}],
        "subsystems": [
            {
                "nqn": STORE_NQN,
                "serial": "kvlab-store0",
                "allowed_hosts": [NODE_NQN],
                "namespaces": [
                    {"nsid": 1, "device": {"serial": "kvlab-target-data0"}, "uuid": "7b3b6f6e-2c1a-4d6a-9e51-0a1b2c3d4e01"}
                ],
            }
        ],
        "ports": [
            {"id": 1, "transport": "rdma", "address": "10.77.0.1", "service": 4420, "family": "ipv4",
             "subsystems": [STORE_NQN]},
        ],
        "netdevs": [{"name": "eth1", "address": "10.77.0.1/24", "mtu": 9000}],
        "rxe_links": [{"name": "rxe0", "netdev": "eth1"}],
    }  # fmt: skip
    return {"nvmet.json": json.dumps(nvmet, indent=2).encode(), "ssh/authorized_keys": pubkey}


def malformed_nqn(nvmet: dict) -> dict:
    nvmet["hosts"][0]["nqn"] = "not-an-nqn"
    nvmet["subsystems"][0]["allowed_hosts"] = ["not-an-nqn"]
    return nvmet


def unknown_drive(nvmet: dict) -> dict:
    nvmet["subsystems"][0]["namespaces"][0]["device"] = {"serial": "no-such-drive"}
    return nvmet


class Fleet:
    """The VMs this module started, stopped by PID at the end whatever happened."""

    def __init__(self, root: Path, key: Path):
        self.root = root
        self.key = key
        self.states: list[vm.MachineState] = []
        self.fabric_port = 0  # the good target's fabric link, which the node joins

    def boot_appliance(self, name: str, image_dir: Path, seed: dict[str, bytes], fabric_port: int) -> Machine:
        spec = vm.MachineSpec(name=name, mgmt_mac="52:54:00:6b:76:11", fabric_mac="52:54:00:6b:77:11",
                              fabric_role="listen", data_disk_mib=256, uefi=True)  # fmt: skip
        mdir = self.root / name
        vm.prepare_disks(spec, image_dir, mdir)
        target_seed.write_seed(image_dir / target_image.ARTIFACT, mdir / "root.qcow2", seed)
        # the appliance's data drive has the serial the seed names (kvlab-<vm>-data0): the VM is "target"
        state = vm.start(spec, image_dir, mdir, fabric_port, self.key.with_suffix(".pub"))
        self.states.append(state)
        vm.wait_listening(fabric_port)
        return Machine(state, self.key)

    def boot_node(self, image_dir: Path, fabric_port: int) -> Machine:
        # one fabric link: the appliance VM has one port, its only peer
        spec = dataclasses.replace(next(m for m in tb.MACHINES if m.name == "node"), more_fabric_macs=())
        state = vm.start(spec, image_dir, self.root / "node", fabric_port, self.key.with_suffix(".pub"))
        self.states.append(state)
        return Machine(state, self.key)

    def stop(self) -> None:
        for s in reversed(self.states):
            vm.stop(s)
        print(
            "appliance test console logs:\n" + "\n".join(f"  {s.console_log}" for s in self.states),
            file=sys.stderr,
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    why = _missing()
    if why:
        pytest.skip(why)  # under CI=true, tests/conftest.py turns this skip into a failure
    root = tmp_path_factory.mktemp("appliance")
    key = tb.ensure_key(root / "ssh")
    f = Fleet(root, key)
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def appliance_image() -> Path:
    return images.ensure("target", log=lambda m: print(m, file=sys.stderr))


@pytest.fixture(scope="module")
def target(fleet, appliance_image) -> Machine:
    port = free_port()
    fleet.fabric_port = port
    m = fleet.boot_appliance(
        "target", appliance_image, good_seed(fleet.key.with_suffix(".pub").read_bytes()), port
    )
    m.wait_for_ssh(BOOT_TIMEOUT_S)
    return m


@pytest.fixture(scope="module")
def node(fleet, target) -> Machine:
    image_dir = images.ensure("testbed", log=lambda m: print(m, file=sys.stderr))
    m = fleet.boot_node(image_dir, fleet.fabric_port)
    m.wait_for_ssh(BOOT_TIMEOUT_S)
    # no roles: the fabric address and soft-RoCE by hand, as the rdma role would make them
    m.succeed("ip link set eth1 mtu 9000 up && ip addr add 10.77.0.2/24 dev eth1 && modprobe rdma_rxe "
              "&& rdma link add rxe0 type rxe netdev eth1 && modprobe nvme-rdma")  # fmt: skip
    return m


def test_the_seed_is_exported_at_boot_without_ansible(target):
    target.wait_for_unit("kvlab-nvmet-export.service", timeout=300)
    base = "/sys/kernel/config/nvmet"
    assert target.succeed(f"ls {base}/subsystems").split() == [STORE_NQN]
    assert target.succeed(f"ls {base}/subsystems/{STORE_NQN}/allowed_hosts").split() == [NODE_NQN]
    assert target.succeed(f"cat {base}/subsystems/{STORE_NQN}/attr_allow_any_host").strip() == "0"
    ns = f"{base}/subsystems/{STORE_NQN}/namespaces/1"
    assert target.succeed(f"cat {ns}/device_path").strip() == DATA_DEVICE
    assert target.succeed(f"cat {ns}/enable").strip() == "1"
    assert target.succeed(f"cat {base}/ports/1/addr_trtype").strip() == "rdma"
    assert target.succeed(f"ls {base}/ports/1/subsystems").split() == [STORE_NQN]


def test_no_unit_failed_at_boot(target):
    """A unit that fails on every boot (efi.automount did: the ESP that the UKI's stub reports)
    hides a real failure among expected ones."""
    target.wait_for_unit("kvlab-nvmet-export.service", timeout=300)
    failed = target.succeed("systemctl list-units --failed --plain --no-legend --no-pager").strip()
    assert failed == "", failed


def test_the_root_is_verified_and_cannot_be_written(target):
    assert target.succeed("findmnt -no FSTYPE,SOURCE /").split() == ["erofs", "/dev/mapper/root"]
    # dm-verity's status is V (every block read so far verified) or C (corruption seen); the
    # appliance has dmsetup, not veritysetup (cryptsetup-bin is not in its lock)
    _start, _length, kind, state = target.succeed("dmsetup status root").split()[:4]
    assert (kind, state) == ("verity", "V")
    out = target.fail("touch /kvlab-write-probe")
    assert "Read-only file system" in out, out
    target.fail("mount -o remount,rw /")
    target.fail("dd if=/dev/zero of=/dev/mapper/root bs=4096 count=1 conv=notrunc")
    # /etc is read-only too; /var is the tmpfs of systemd.volatile=state
    target.fail("touch /etc/kvlab-write-probe")
    assert target.succeed("findmnt -no FSTYPE /var").strip() == "tmpfs"


def test_the_node_connects_over_rdma_to_the_seeds_namespace(target, node):
    target.wait_for_unit("kvlab-nvmet-export.service", timeout=300)
    node.succeed(
        f"nvme connect -t rdma -a 10.77.0.1 -s 4420 -n {STORE_NQN} --hostnqn={NODE_NQN}", timeout=120
    )
    try:
        node.wait_until_succeeds(f"grep -l {STORE_NQN} /sys/class/nvme/nvme*/subsysnqn", timeout=60)
        assert node.succeed("cat /sys/class/nvme/nvme*/transport").split() == ["rdma"]
        node.wait_until_succeeds("lsblk -dno NAME | grep -q '^nvme'", timeout=60)
    finally:
        node.execute(f"nvme disconnect -n {STORE_NQN}")


def test_a_host_not_in_the_seed_is_refused(target, node):
    target.wait_for_unit("kvlab-nvmet-export.service", timeout=300)
    node.fail(
        f"nvme connect -t rdma -a 10.77.0.1 -s 4420 -n {STORE_NQN} --hostnqn={STRANGER_NQN}", timeout=120
    )
    node.fail(f"grep -ls {STORE_NQN} /sys/class/nvme/nvme*/subsysnqn")


SEED_FILE = "/var/lib/kvlab-seed/nvmet.json"


def changed_tasks(output: str, host: str) -> list[str]:
    """The tasks and handlers (role : name) that reported `changed` on `host`, in run order."""
    changed: list[str] = []
    task = ""
    for line in output.splitlines():
        if m := re.match(r"^(?:TASK|RUNNING HANDLER) \[(.+?)\]", line):
            task = m.group(1)
        elif line.startswith(f"changed: [{host}]") and task not in changed:
            changed.append(task)
    return changed


def appliance_inventory(fleet: Fleet, image_dir: Path, target: Machine, node: Machine, root: Path) -> Path:
    """The committed testbed inventory for these two VMs, its target declared an appliance."""
    state = tb.State(name="appliance", transport="rdma", image_dir=str(image_dir), fabric_port=fleet.fabric_port,
                     key=str(fleet.key), machines=[target.state, node.state])  # fmt: skip
    hosts_file = tb.write_inventory(state, root / "hosts.yml")
    hosts = yaml.safe_load(hosts_file.read_text())
    hosts["all"]["children"]["nvmeof_targets"]["hosts"]["target"]["nvmeof_target_appliance"] = True
    # its node connects by hand, without the secrets `kvlab testbed up` makes for the testbed
    hosts["all"]["children"]["nvmeof_targets"]["hosts"]["target"]["nvmeof_target_dhchap_required"] = False
    # these VMs have one fabric link (the testbed's first subnet), not the testbed's two
    node_vars = hosts["all"]["children"]["gpu_nodes"]["children"]["h200"]["hosts"]["node"]
    for host_vars in (hosts["all"]["children"]["nvmeof_targets"]["hosts"]["target"], node_vars):
        host_vars["kvlab_storage_ports"] = host_vars["kvlab_storage_ports"][:1]
        host_vars["rdma_rxe_links"] = [{"name": "rxe0", "netdev": host_vars["kvlab_storage_ports"][0]["name"]}]
    hosts_file.write_text(yaml.safe_dump(hosts, sort_keys=False))
    return hosts_file


def test_site_yml_changes_the_seed_and_nothing_else(fleet, appliance_image, target, node, playbook, tmp_path):
    target.wait_for_unit("kvlab-nvmet-export.service", timeout=300)
    inventory = appliance_inventory(fleet, appliance_image, target, node, tmp_path / "inventory")
    before = target.succeed(f"sha256sum {SEED_FILE}").split()[0]
    target.succeed("touch /run/kvlab-before-site && sleep 1")  # -newer compares whole seconds on tmpfs too
    res = playbook(inventory, "playbooks/site.yml", "--limit", "target")
    assert res.returncode == 0, f"{res.stdout[-6000:]}\n{res.stderr[-2000:]}"
    # the role recognised the appliance: its seed rewritten and applied, nothing installed
    assert changed_tasks(res.stdout, "target") == [
        "nvmeof_target : Write the seed", "nvmeof_target : Restart kvlab-nvmet"
    ], res.stdout[-6000:]
    # and on the machine no file changed but the seed (the root and /etc are read-only; the
    # journal and systemd's own state under /var are the units' restart, not the role; the
    # seed is a partition of its own, mounted in /var)
    written = target.succeed(
        f"find /var {os.path.dirname(SEED_FILE)} /tmp /root /srv /home -xdev -type f -newer /run/kvlab-before-site "
        "-not -path '/var/log/journal/*' -not -path '/var/lib/systemd/*' 2>/dev/null || true"
    ).split()
    assert written == [SEED_FILE], written
    assert target.succeed(f"sha256sum {SEED_FILE}").split()[0] != before
    seed = json.loads(target.succeed(f"cat {SEED_FILE}"))
    assert [s["nqn"] for s in seed["subsystems"]] == [STORE_NQN]
    assert seed["subsystems"][0]["allowed_hosts"] == [NODE_NQN]
    # the exports are the role's seed, applied by the appliance's own units
    target.wait_for_unit("kvlab-nvmet-export.service", timeout=300)
    base = "/sys/kernel/config/nvmet"
    assert target.succeed(f"ls {base}/subsystems").split() == [STORE_NQN]
    assert target.succeed(f"ls {base}/subsystems/{STORE_NQN}/allowed_hosts").split() == [NODE_NQN]
    ns = f"{base}/subsystems/{STORE_NQN}/namespaces/1"
    assert target.succeed(f"readlink -f $(cat {ns}/device_path)") == target.succeed(f"readlink -f {DATA_DEVICE}")
    node.succeed(f"nvme connect -t rdma -a 10.77.0.1 -s 4420 -n {STORE_NQN} --hostnqn={NODE_NQN}", timeout=120)
    try:
        node.wait_until_succeeds(f"grep -l {STORE_NQN} /sys/class/nvme/nvme*/subsysnqn", timeout=60)
    finally:
        node.execute(f"nvme disconnect -n {STORE_NQN}")
    # a second run finds nothing to change
    again = playbook(inventory, "playbooks/site.yml", "--limit", "target")
    assert again.returncode == 0, again.stdout[-6000:]
    assert changed_tasks(again.stdout, "target") == [], again.stdout[-6000:]


def _exports_nothing(m: Machine) -> None:
    m.fail("systemctl is-active --quiet kvlab-nvmet-export.service")
    for kind in ("subsystems", "ports", "hosts"):
        assert m.succeed(f"ls /sys/kernel/config/nvmet/{kind} 2>/dev/null || true").split() == [], kind


def _named(m: Machine, unit: str, field: str, console_from: int) -> None:
    journal = m.succeed(f"journalctl -b -u {unit} --no-pager")
    assert field in journal, journal[-3000:]
    console = m.console_log.read_bytes()[console_from:].decode(errors="replace")
    assert field in console, console[-3000:]


def test_a_broken_seed_exports_nothing_and_names_the_field(fleet, appliance_image, target, node):
    # a malformed host NQN, at boot: the validator names the field and the export never runs
    seed = good_seed(fleet.key.with_suffix(".pub").read_bytes())
    seed["nvmet.json"] = json.dumps(malformed_nqn(json.loads(seed["nvmet.json"]))).encode()
    m = fleet.boot_appliance("target-broken", appliance_image, seed, free_port())
    m.wait_for_ssh(BOOT_TIMEOUT_S)
    m.wait_until_succeeds("systemctl is-failed --quiet kvlab-seed-validate.service", timeout=300)
    _exports_nothing(m)
    _named(m, "kvlab-seed-validate.service", "hosts[0].nqn", 0)
    # an unknown drive passes the schema but not the apply: nothing exported, the field named
    nvmet = unknown_drive(json.loads(good_seed(b"")["nvmet.json"]))
    mark = len(m.console_log.read_bytes())
    m.succeed(f"cat > /var/lib/kvlab-seed/nvmet.json <<'EOF'\n{json.dumps(nvmet)}\nEOF")
    m.succeed("systemctl restart kvlab-seed-validate.service")
    m.fail("systemctl restart kvlab-nvmet-export.service", timeout=300)
    _exports_nothing(m)
    _named(m, "kvlab-nvmet-export.service", "namespaces[0].device.serial", mark)
