"""Issue 23, finding 2: the target appliance's RoCE QoS works on the RDMA stack it carries.

The appliance carries the inbox rdma-core and mlx5 driver, which have no ECN or traffic-class
files in sysfs (those are MLNX_OFED/DOCA's): the applier's network step used to write them and
fail, and the appliance then exported nothing. Now PFC and DSCP trust go through dcb on both
stacks, the traffic class through DOCA's tc/<port>/traffic_class where it exists and RDMA-CM's
configfs default_roce_tos where it does not; ECN is left to the NIC's firmware there. Each
stack is a fake sysfs (and configfs) tree in a temp folder; the tools are stand-ins that record
their arguments, as the rdma role's own units would call them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_nvmet_apply import load
from test_nvmet_seed import seed

pytestmark = pytest.mark.unit

RDMA_LINKS = "link mlx5_0/1 state ACTIVE physical_state LINK_UP netdev eth0\nlink mlx5_1/1 state ACTIVE physical_state LINK_UP netdev eth1\n"


class Stack:
    """A target's /sys (class/net, class/infiniband) and RDMA-CM configfs, shaped as the inbox
    driver or MLNX_OFED/DOCA leave them, and the commands the network step runs."""

    def __init__(self, tmp: Path, mod, monkeypatch, doca: bool) -> None:
        self.sys, self.cm = tmp / "sys", tmp / "config/rdma_cm"
        self.calls: list[list[str]] = []
        (self.sys / "class/net/eth1").mkdir(parents=True)
        (self.sys / "class/infiniband/mlx5_1/ports/1").mkdir(parents=True)
        if doca:
            for side in ("roce_np", "roce_rp"):
                (self.sys / f"class/net/eth1/ecn/{side}/enable").mkdir(parents=True)
                for p in range(8):
                    (self.sys / f"class/net/eth1/ecn/{side}/enable/{p}").write_text("0\n")
            (self.sys / "class/infiniband/mlx5_1/tc/1").mkdir(parents=True)
            (self.sys / "class/infiniband/mlx5_1/tc/1/traffic_class").write_text("0\n")
        monkeypatch.setattr(mod, "SYSFS", str(self.sys))
        monkeypatch.setattr(mod, "RDMA_CM", str(self.cm))

        def run(argv, **kw):
            self.calls.append(list(argv))
            if argv[:2] == ["modprobe", "rdma_cm"]:
                self.cm.mkdir(parents=True, exist_ok=True)  # the module registers its configfs subsystem
            out = RDMA_LINKS if argv == ["rdma", "link", "show"] else ""
            return subprocess.CompletedProcess(
                argv, 1 if argv[:3] == ["rdma", "link", "show"] and len(argv) > 3 else 0, out, ""
            )

        def cm_mkdir(path):  # configfs: a device's folder comes with its ports
            Path(path).mkdir()
            (Path(path) / "ports/1").mkdir(parents=True)
            (Path(path) / "ports/1/default_roce_tos").write_text("0\n")

        monkeypatch.setattr(mod.subprocess, "run", run)
        monkeypatch.setattr(mod, "rdma_cm_mkdir", cm_mkdir)


def lab_qos() -> dict:
    """The lab's seed fabric: one ConnectX port, lossless RoCE (trust DSCP, 26 -> priority 3)."""
    cfg = seed()
    cfg["netdevs"], cfg["rxe_links"] = [{"name": "eth1", "address": "192.168.100.31/24", "mtu": 9000}], []
    return cfg


DCB = [
    ["ip", "link", "set", "dev", "eth1", "mtu", "9000", "up"],
    ["ip", "address", "replace", "192.168.100.31/24", "dev", "eth1"],
    ["dcb", "app", "replace", "dev", "eth1", "dscp-prio", "26:3"],
    ["dcb", "pfc", "set", "dev", "eth1", "prio-pfc", "all:off", "3:on"],
    ["rdma", "link", "show"],
]


def test_inbox_stack_uses_dcb_and_rdma_cm_and_leaves_ecn_to_firmware(tmp_path, monkeypatch, capsys) -> None:
    mod, _ = load(tmp_path, monkeypatch)
    stack = Stack(tmp_path, mod, monkeypatch, doca=False)
    mod.apply_network(lab_qos())
    assert stack.calls == [*DCB, ["modprobe", "rdma_cm"]]
    # RoCE traffic of the port that carries eth1 leaves with DSCP 26 (ToS 104)
    assert (stack.cm / "mlx5_1/ports/1/default_roce_tos").read_text() == "104"
    assert not (stack.cm / "mlx5_0").exists()
    assert not (stack.sys / "class/net/eth1/ecn").exists()
    assert "eth1: ECN is the NIC's firmware setting on this RDMA stack" in capsys.readouterr().out


def test_doca_stack_uses_its_ecn_and_traffic_class_files(tmp_path, monkeypatch) -> None:
    mod, _ = load(tmp_path, monkeypatch)
    stack = Stack(tmp_path, mod, monkeypatch, doca=True)
    mod.apply_network(lab_qos())
    assert stack.calls == DCB
    ecn = stack.sys / "class/net/eth1/ecn"
    assert [
        (ecn / f"{s}/enable/{p}").read_text().strip() for s in ("roce_np", "roce_rp") for p in (2, 3)
    ] == ["0", "1", "0", "1"]
    assert (stack.sys / "class/infiniband/mlx5_1/tc/1/traffic_class").read_text() == "104"
    assert not stack.cm.exists()


def test_an_inbox_appliance_exports_with_qos_on(tmp_path, monkeypatch) -> None:
    """The whole apply, as the appliance runs it at boot: the network step no longer fails on a
    missing DOCA file, so the seed's subsystems are exported."""
    mod, root = load(tmp_path, monkeypatch)
    Stack(tmp_path, mod, monkeypatch, doca=False)
    cfg = lab_qos()
    for i, s in enumerate(cfg["subsystems"]):
        (tmp_path / f"disk{i}").write_bytes(b"")
        s["namespaces"][0]["device"] = str(tmp_path / f"disk{i}")
    cfg["hosts"][0].pop("dhchap_key")
    (tmp_path / "nvmet.json").write_text(__import__("json").dumps(cfg))
    assert mod.main([]) == 0
    assert {p.name for p in (root / "subsystems").iterdir()} == {s["nqn"] for s in cfg["subsystems"]}


def test_qos_on_a_netdev_without_rdma_port_stops_the_apply(tmp_path, monkeypatch) -> None:
    mod, _ = load(tmp_path, monkeypatch)
    Stack(tmp_path, mod, monkeypatch, doca=False)
    cfg = lab_qos()
    cfg["roce_lossless"]["devices"] = ["eth7"]
    with pytest.raises(OSError, match="eth7: no RDMA device on it"):
        mod.apply_network(cfg)


# What each tool the applier runs on the appliance comes from (Debian trixie's packages).
APPLIER_TOOLS = {
    "dcb": "iproute2",
    "rdma": "iproute2",
    "ip": "iproute2",
    "blkid": "util-linux",
    "modprobe": "kmod",
}


def test_the_appliance_carries_every_tool_the_applier_runs() -> None:
    """The inbox QoS path (dcb, rdma) and the drive probe (blkid) need no new package in the
    appliance image: every tool the applier calls is in its pinned package set."""
    import re

    root = Path(__file__).resolve().parents[2]
    source = (root / "roles/nvmeof_target/files/kvlab-nvmet-apply").read_text()
    called = set(re.findall(r'(?:subprocess\.run\(\[|\brun\()"([a-z]+)"', source))
    assert called == set(APPLIER_TOOLS), called  # a new tool needs its package named here
    lock = {
        ln.split("=", 1)[0]
        for ln in (root / "images/target/packages.lock").read_text().splitlines()
        if "=" in ln
    }
    assert {APPLIER_TOOLS[t] for t in called} <= lock
