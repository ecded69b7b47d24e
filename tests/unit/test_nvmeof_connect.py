"""kvlab-nvmeof-connect, the program the initiator's boot unit runs: it connects every port of
libnvme's config.json that has no controller, through the kernel's fabrics device, with both
DH-HMAC-CHAP keys and never a key in what it prints. The device here is a FIFO, which hands back
what was written (the kernel answers instance=N,cntlid=M); the testbed runs it against a kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "roles/nvmeof_initiator/files/kvlab-nvmeof-connect"
HOST = "nqn.2014-08.org.nvmexpress:uuid:0c1f5e2a-6b1d-4e0a-9d7e-2a11c0de0011"
NQN = "nqn.2026-01.io.kvlab.test:store0"
KEY = "DHHC-1:00:aG9zdGtleWhvc3RrZXlob3N0a2V5aG9zdGtleTEyMzQ=:"
CTRL_KEY = "DHHC-1:00:Y3RybGtleWN0cmxrZXljdHJsa2V5Y3RybGtleTEyMzQ=:"


def config(tmp: Path) -> Path:
    port = {"transport": "rdma", "trsvcid": "4420", "ctrl_loss_tmo": -1, "fast_io_fail_tmo": 5,
            "reconnect_delay": 2, "keep_alive_tmo": 5, "dhchap_key": KEY, "dhchap_ctrl_key": CTRL_KEY}  # fmt: skip
    host = {"hostnqn": HOST, "hostid": "0c1f5e2a-6b1d-4e0a-9d7e-2a11c0de0011", "dhchap_key": KEY,
            "subsystems": [{"nqn": NQN, "ports": [port | {"traddr": "10.77.0.1"}, port | {"traddr": "10.78.0.1"}]}]}  # fmt: skip
    path = tmp / "config.json"
    path.write_text(json.dumps([host]))
    path.chmod(0o600)
    return path


def controller(sysfs: Path, name: str, traddr: str, state: str = "live") -> None:
    d = sysfs / "class/nvme" / name
    d.mkdir(parents=True)
    for attr, value in {"transport": "rdma", "subsysnqn": NQN, "hostnqn": HOST, "state": state,
                        "address": f"traddr={traddr},trsvcid=4420,src_addr=10.77.0.2"}.items():  # fmt: skip
        (d / attr).write_text(value + "\n")


def run(tmp: Path, fabrics: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"KVLAB_NVME_CONFIG": str(config(tmp)), "KVLAB_NVME_FABRICS": str(fabrics),
                        "KVLAB_SYSFS": str(tmp / "sys")}  # fmt: skip
    return subprocess.run([sys.executable, str(PROGRAM)], capture_output=True, text=True, env=env, timeout=60)


def test_a_missing_port_is_connected_with_every_option_and_both_keys(tmp_path: Path) -> None:
    controller(tmp_path / "sys", "nvme0", "10.77.0.1")  # the first path is there already
    fabrics = tmp_path / "nvme-fabrics"
    os.mkfifo(fabrics)
    proc = run(tmp_path, fabrics)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{NQN} at rdma:10.77.0.1:4420: connected already"
    written = lines[1].split("connected (", 1)[1].rstrip(")")  # what the device was given
    opts = dict(kv.split("=", 1) for kv in written.split(","))
    assert opts == {"nqn": NQN, "transport": "rdma", "traddr": "10.78.0.1", "trsvcid": "4420", "hostnqn": HOST,
                    "hostid": "0c1f5e2a-6b1d-4e0a-9d7e-2a11c0de0011", "ctrl_loss_tmo": "-1",
                    "fast_io_fail_tmo": "5", "reconnect_delay": "2", "keep_alive_tmo": "5",
                    "dhchap_secret": KEY, "dhchap_ctrl_secret": CTRL_KEY}  # fmt: skip


def test_a_reconnecting_controller_counts_as_connected(tmp_path: Path) -> None:
    controller(tmp_path / "sys", "nvme0", "10.77.0.1", state="connecting")
    controller(tmp_path / "sys", "nvme1", "10.78.0.1")
    proc = run(tmp_path, tmp_path / "absent-device")  # nothing is written: the device is not opened
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("connected already") == 2


def test_a_port_that_cannot_connect_fails_the_unit_naming_it_never_a_key(tmp_path: Path) -> None:
    proc = run(tmp_path, tmp_path / "absent-device")
    assert proc.returncode == 1
    assert f"{NQN} at rdma:10.77.0.1:4420: not connected: No such file or directory" in proc.stderr
    assert "2 port(s) not connected" in proc.stderr
    assert "DHHC" not in proc.stdout + proc.stderr


def test_an_unreadable_configuration_fails_naming_the_file(tmp_path: Path) -> None:
    env = os.environ | {"KVLAB_NVME_CONFIG": str(tmp_path / "none.json"), "KVLAB_SYSFS": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(PROGRAM)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1 and "cannot read" in proc.stderr and "none.json" in proc.stderr
