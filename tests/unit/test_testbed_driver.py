"""The testbed driver's pure parts: status parsing, inventory, image input hash, qemu command line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from kvlab import inventory
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
    assert not list(inv.rglob("up.yml")) and not (inv / "host_vars").exists() or not list((inv / "host_vars").iterdir())


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


def test_lock_round_trip_and_errors():
    lock = {"bash": "5.2.37-2+b10", "linux-image-amd64": "6.12.118-1"}
    assert image.parse_lock(image.format_lock(lock)) == lock
    with pytest.raises(image.ImageError, match="name=version"):
        image.parse_lock("bash\n")


def test_real_definition_pins_every_package():
    defn = image.Definition.load(image.definition_root())
    assert defn.release == "trixie"
    assert set(defn.packages) <= set(defn.lock), "a top-level package is missing from packages.lock"


def test_qemu_command_uses_tcg_restricted_user_net_and_tcp_socket_fabric(tmp_path):
    spec = testbed.MACHINES[1]
    cmd = " ".join(vm.qemu_command(spec, tmp_path, tmp_path / "m", 2222, 4444, tmp_path / "k.pub"))
    assert "tcg" in cmd and "restrict=on" in cmd and "hostfwd=tcp:127.0.0.1:2222-:22" in cmd
    assert "socket,id=fabric,connect=127.0.0.1:4444" in cmd and "host_mtu=9000" in cmd
    target = " ".join(vm.qemu_command(testbed.MACHINES[0], tmp_path, tmp_path / "m", 1, 4444, tmp_path / "k"))
    assert "listen=127.0.0.1:4444" in target and "serial=kvlab-target-data0" in target


def test_interrupted_build_is_unmounted_deepest_first_and_only_inside_its_folder(tmp_path, monkeypatch):
    work = tmp_path / "build x"
    (work / "rootfs").mkdir(parents=True)
    root = str(work.resolve()).replace(" ", "\\040")
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / /proc rw - proc proc rw\n"
        f"90 1 0:50 / {root}/rootfs/proc ro - proc proc ro\n"
        f"91 90 0:51 / {root}/rootfs/dev/pts rw - devpts devpts rw\n"
        f"92 1 0:52 / {root}x/rootfs/sys ro - sysfs sys ro\n"
    )
    calls = []
    monkeypatch.setattr(image.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    points = image.unmount_under(work, info)
    inside = str(work.resolve())
    assert points == [f"{inside}/rootfs/dev/pts", f"{inside}/rootfs/proc"]
    assert calls == [["umount", "--lazy", p] for p in points]
