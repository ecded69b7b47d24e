"""The testbed driver's pure parts: status parsing, inventory, image definition, qemu command line."""

from __future__ import annotations

import base64
import dataclasses
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest
import yaml

from kvlab import inventory
from kvlab.images import debian
from kvlab.testbed import image, status, testbed, vm

pytestmark = pytest.mark.unit


def test_parse_controllers_reads_transport_address_state():
    text = (
        "nvme0|rdma|traddr=10.77.0.1,trsvcid=4420,src_addr=10.77.0.2 |live|nqn.2026-01.io.kvlab.testbed:store0\n"
        "garbage line\n"
    )
    [c] = status.parse_controllers(text)
    assert c["transport"] == "rdma" and c["state"] == "live"
    assert c["address"] == {"traddr": "10.77.0.1", "trsvcid": "4420", "src_addr": "10.77.0.2"}


def _state(tmp_path: Path, transport: str = "rdma") -> testbed.State:
    return testbed.State(
        name="t", transport=transport, image_dir=str(tmp_path), fabric_port=4000, key=str(tmp_path / "k"),
        machines=[vm.MachineState("target", 1, 2201, str(tmp_path / "target")),
                  vm.MachineState("node", 2, 2202, str(tmp_path / "node"))],
    )  # fmt: skip


def test_up_writes_only_its_ports_key_and_transport_beside_the_committed_tree(tmp_path):
    path = testbed.write_inventory(_state(tmp_path, "tcp"), tmp_path / "inv" / "hosts.yml")
    inv = tmp_path / "inv"
    # the committed group tree and group_vars, copied; the run-time values beside them
    assert path.read_text() == (testbed.committed_inventory() / "hosts.yml").read_text()
    assert yaml.safe_load((inv / "host_vars/target/up.yml").read_text()) == {"ansible_port": 2201}
    assert yaml.safe_load((inv / "host_vars/node/up.yml").read_text()) == {"ansible_port": 2202}
    up = yaml.safe_load((inv / "group_vars/all/up.yml").read_text())
    assert up == {"ansible_ssh_private_key_file": str(tmp_path / "k"), "testbed_transport": "tcp"}
    written = sorted(str(p.relative_to(inv)) for p in inv.rglob("up.yml"))
    assert written == ["group_vars/all/up.yml", "host_vars/node/up.yml", "host_vars/target/up.yml"]
    testbed.remove_run_time_vars(path)
    assert (
        not list(inv.rglob("up.yml"))
        and not (inv / "host_vars").exists()
        or not list((inv / "host_vars").iterdir())
    )


def test_run_time_files_are_ignored_by_git_and_the_tree_is_committed():
    root = testbed.committed_inventory().parents[1]
    files = [f"inventories/testbed/{rel}" for rel in testbed.run_time_vars(_state(Path("/x")))]
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", *files], capture_output=True, text=True)
    assert sorted(ignored.stdout.split()) == sorted(files)
    tracked = subprocess.run(["git", "-C", str(root), "ls-files", "inventories/testbed/hosts.yml"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    assert tracked.stdout.strip() == "inventories/testbed/hosts.yml"


def test_committed_tree_holds_the_driver_machines_in_their_groups():
    inv = inventory.load(testbed.committed_inventory() / "hosts.yml")
    got: dict[str, set] = {}
    for group in inv.groups():
        for host in inv.hosts(group):
            got.setdefault(host, set()).add(group)
    assert got == {m: {"all", *groups} for m, groups in testbed.GROUPS.items()}
    assert {spec.name for spec in testbed.MACHINES} == set(got)
    # the driver's own SSH options are the inventory's
    gv = yaml.safe_load((testbed.committed_inventory() / "group_vars/all/main.yml").read_text())
    assert gv["ansible_ssh_common_args"] == vm.SSH_COMMON_ARGS


def test_unknown_transport_is_refused():
    with pytest.raises(testbed.TestbedError, match="transport"):
        testbed.up("x", transport="roce-please")


def test_real_definition_pins_every_package():
    defn = debian.Definition.load(image.definition_root())
    assert defn.release == "trixie"
    assert set(defn.packages) <= set(defn.lock), "a top-level package is missing from packages.lock"


def test_qemu_command_uses_tcg_restricted_user_net_and_tcp_socket_fabric(tmp_path):
    spec = testbed.MACHINES[1]
    cmd = " ".join(vm.qemu_command(spec, tmp_path, tmp_path / "m", 2222, [4444, 4445], tmp_path / "k.pub"))
    assert "tcg" in cmd and "restrict=on" in cmd and "hostfwd=tcp:127.0.0.1:2222-:22" in cmd
    assert "socket,id=fabric,connect=127.0.0.1:4444" in cmd and "host_mtu=9000" in cmd
    target = " ".join(vm.qemu_command(testbed.MACHINES[0], tmp_path, tmp_path / "m", 1, [4444, 4445], tmp_path / "k"))
    assert "listen=127.0.0.1:4444" in target and "serial=kvlab-target-data0" in target


def test_two_fabric_links_one_socket_each_in_the_guests_interface_order(tmp_path):
    """Two links (eth1, eth2 in the guest), as a lab node reaches its target over two ports; the
    first keeps the netdev name `fabric` that set_link and the fault tests use."""
    assert testbed.FABRIC_LINKS == 2
    for spec in testbed.MACHINES:
        assert vm.fabric_netdev_ids(spec) == ["fabric", "fabric2"]
    cmd = vm.qemu_command(testbed.MACHINES[1], tmp_path, tmp_path / "m", 1, [4444, 4445], tmp_path / "k")
    netdevs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-netdev" and "socket" in cmd[i + 1]]
    assert netdevs == ["socket,id=fabric,connect=127.0.0.1:4444", "socket,id=fabric2,connect=127.0.0.1:4445"]
    nics = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-device" and "netdev=fabric" in cmd[i + 1]]
    assert [n.split(",")[1] for n in nics] == ["netdev=fabric", "netdev=fabric2"]
    assert all("host_mtu=9000" in n for n in nics)
    with pytest.raises(vm.VMError, match="2 fabric link"):
        vm.qemu_command(testbed.MACHINES[1], tmp_path, tmp_path / "m", 1, 4444, tmp_path / "k")
    # a one-link machine (the appliance test's) still takes one port
    one = dataclasses.replace(testbed.MACHINES[1], more_fabric_macs=())
    assert "socket,id=fabric,connect=127.0.0.1:4444" in vm.qemu_command(one, tmp_path, tmp_path / "m", 1, 4444, tmp_path / "k")


def test_the_committed_inventory_gives_every_vm_a_port_on_each_fabric_subnet():
    inv = inventory.load(testbed.committed_inventory() / "hosts.yml")
    subnets = {s["name"] for s in inv.render("target", ["rdma_roce_subnets"])["rdma_roce_subnets"]}
    assert len(subnets) == testbed.FABRIC_LINKS
    for host in ("target", "node"):
        ports = inv.render(host, ["rdma_netdevs"])["rdma_netdevs"]
        assert sorted(p["subnet"] for p in ports) == sorted(subnets), (host, ports)
        assert [p["name"] for p in ports] == [f"eth{i + 1}" for i in range(testbed.FABRIC_LINKS)]


def test_dhchap_secret_is_what_nvme_gen_dhchap_key_writes():
    """DHHC-1:00:<base64 of a 32-byte key and its CRC-32, little-endian>: (the kernel checks the CRC)."""
    secret = testbed.dhchap_secret()
    m = re.fullmatch(r"DHHC-1:00:([A-Za-z0-9+/]+={0,2}):", secret)
    assert m, secret
    raw = base64.b64decode(m.group(1))
    key, crc = raw[:-4], raw[-4:]
    assert len(key) == 32 and int.from_bytes(crc, "little") == zlib.crc32(key)
    pair = testbed.new_dhchap()
    assert pair["host"] != pair["ctrl"] and pair["host"] != testbed.dhchap_secret()


def test_run_time_vars_carry_the_secrets_into_the_roles_variables_readable_by_the_owner_only(tmp_path):
    """The node's pair (testbed_dhchap, where the lab has its vault) into the node's variables, and
    the target's allowlist keys derived from it (as in the lab)."""
    state = dataclasses.replace(_state(tmp_path), dhchap={"host": "DHHC-1:00:aG9zdA==:", "ctrl": "DHHC-1:00:Y3RybA==:"})
    path = testbed.write_inventory(state, tmp_path / "inv" / "hosts.yml")
    assert yaml.safe_load((path.parent / "host_vars/target/up.yml").read_text()) == {"ansible_port": 2201}
    up = yaml.safe_load((path.parent / "group_vars/all/up.yml").read_text())
    assert up["testbed_dhchap"] == {"node": {"secret": "DHHC-1:00:aG9zdA==:", "ctrl_secret": "DHHC-1:00:Y3RybA==:"}}
    inv = inventory.load(path)
    node = inv.render("node", ["nvmeof_initiator_hostnqn", "nvmeof_initiator_dhchap_secret",
                               "nvmeof_initiator_dhchap_ctrl_secret"])  # fmt: skip
    assert node["nvmeof_initiator_dhchap_secret"] == "DHHC-1:00:aG9zdA==:"
    assert node["nvmeof_initiator_dhchap_ctrl_secret"] == "DHHC-1:00:Y3RybA==:"
    nqn = node["nvmeof_initiator_hostnqn"]
    got = inv.render("target", ["nvmeof_target_host_secrets", "nvmeof_target_dhchap_required"])
    assert got == {"nvmeof_target_dhchap_required": True, "nvmeof_target_host_secrets": {
        nqn: {"dhchap_key": "DHHC-1:00:aG9zdA==:", "dhchap_ctrl_key": "DHHC-1:00:Y3RybA==:"}}}  # fmt: skip
    for f in path.parent.rglob("up.yml"):
        assert f.stat().st_mode & 0o077 == 0, f
    # and the state file that keeps them
    state = dataclasses.replace(state, name="t-secrets")
    try:
        testbed.save_state(state)
        f = testbed.state_root("t-secrets") / "state.json"
        assert f.stat().st_mode & 0o077 == 0
        assert testbed.load_state("t-secrets").dhchap == state.dhchap
    finally:
        shutil.rmtree(testbed.state_root("t-secrets"), ignore_errors=True)
