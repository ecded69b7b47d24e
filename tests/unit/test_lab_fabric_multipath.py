"""Issue 23, finding 4: NVMe multipath over every port of the lab, and paths that come back.

The kernel's default I/O policy (numa) keeps a dual-port NIC's I/O on one path; the role sets
round-robin (queue-depth from Linux 6.11, which has it) persistently, per subsystem, by a udev
rule and as nvme_core's default. A lost controller reconnects forever (ctrl_loss_tmo -1, the
lab's value), while fast_io_fail_tmo stays short, so a load fails over (or to recompute) in
seconds, before the connector's load timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_roles_plan import HOSTS, exports, lab_plan, nvme_ports  # noqa: F401  (lab_plan: the lab's plan, rendered once)

from kvlab_connector.config import ConnectorConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0c1f5e2a-6b1d-4e0a-9d7e-2a11c0de0011"
SUBSYSTEMS = ["nqn.2026-01.io.kvlab.test:store0", "nqn.2026-01.io.kvlab.test:store1"]
RULES = "etc/udev/rules.d/71-kvlab-nvme-iopolicy.rules"
LOAD_TIMEOUT_S = ConnectorConfig.__dataclass_fields__["load_timeout_s"].default  # the connector's own default


def iopolicy_rules(root: Path) -> dict[str, str]:
    """{subsystem NQN: policy} as the role's udev rule sets them on each subsystem as it appears."""
    out = {}
    for line in (root / RULES).read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        assert 'SUBSYSTEM=="nvme-subsystem"' in line and re.search(r'ACTION=="add\|change"', line), line
        nqn = re.search(r'ATTR\{subsysnqn\}=="([^"]+)"', line).group(1)
        out[nqn] = re.search(r'ATTR\{iopolicy\}="([^"]+)"', line).group(1)
    return out


@pytest.mark.parametrize("host", HOSTS)
def test_lab_spreads_io_over_every_port(lab_plan: Path, host: str) -> None:  # noqa: F811
    root = lab_plan / host
    [mine] = [e["nqn"] for e in exports() if e["node"] == host]
    # the lab's kernel (kvlab_plan_facts: 6.8) has round-robin, not yet queue-depth
    assert iopolicy_rules(root) == {mine: "round-robin"}
    modprobe = (root / "etc/modprobe.d/kvlab-nvme.conf").read_text()
    assert re.search(r"^options nvme_core multipath=Y iopolicy=round-robin$", modprobe, re.M), modprobe


@pytest.mark.parametrize("host", HOSTS)
def test_lab_reconnects_forever_and_fails_io_in_seconds(lab_plan: Path, host: str) -> None:  # noqa: F811
    ports = nvme_ports(lab_plan / host)
    assert len({p["traddr"] for p in ports}) == 2  # both ports of the 800G variant
    for p in ports:
        assert p["ctrl_loss_tmo"] == -1, p["traddr"]
        assert 0 <= p["fast_io_fail_tmo"] < LOAD_TIMEOUT_S, p["traddr"]


# ---- the role alone, with what a node reports (connection local, rendered into a folder) ------


def initiator(tmp: Path, kernel: str, **extra: object) -> subprocess.CompletedProcess:
    """nvmeof_initiator rendered into tmp/plan/localhost for a node running `kernel`."""
    pb = tmp / "play.yml"
    pb.write_text(yaml.safe_dump([{"name": "Initiator", "hosts": "localhost", "gather_facts": False,
                                   "connection": "local", "roles": ["nvmeof_initiator"]}]))  # fmt: skip
    facts = {"distribution": "Debian", "distribution_version": "13", "distribution_major_version": "13",
             "os_family": "Debian", "kernel": kernel}  # fmt: skip
    ev = {"ansible_python_interpreter": sys.executable, "ansible_facts": facts,
          "nvmeof_initiator_plan_dir": str(tmp / "plan"), "nvmeof_initiator_hostnqn": HOSTNQN,
          "nvmeof_initiator_hostid": "0c1f5e2a-6b1d-4e0a-9d7e-2a11c0de0011",
          "nvmeof_initiator_targets": [{"traddr": "192.168.100.31", "subsystems": SUBSYSTEMS},
                                       {"traddr": "192.168.101.31", "subsystems": SUBSYSTEMS}], **extra}  # fmt: skip
    env = os.environ | {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    return subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", str(pb), "-e", json.dumps(ev)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip


def said(proc: subprocess.CompletedProcess) -> str:
    return " ".join((proc.stdout + proc.stderr).split())


@pytest.mark.parametrize(
    ("kernel", "policy"), [("6.10.14", "round-robin"), ("6.11.0-1-amd64", "queue-depth")]
)
def test_the_policy_follows_the_kernel_and_paths_reconnect_forever(
    tmp_path: Path, kernel: str, policy: str
) -> None:
    proc = initiator(tmp_path, kernel, nvmeof_initiator_ctrl_loss_tmo=-1)
    assert proc.returncode == 0, said(proc)[-3000:]
    root = tmp_path / "plan/localhost"
    assert iopolicy_rules(root) == dict.fromkeys(SUBSYSTEMS, policy)
    assert f"iopolicy={policy}" in (root / "etc/modprobe.d/kvlab-nvme.conf").read_text()
    # every subsystem at both addresses
    assert [p["ctrl_loss_tmo"] for p in nvme_ports(root)] == [-1] * 2 * len(SUBSYSTEMS)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"nvmeof_initiator_iopolicy": "queue-depth"},
         "nvmeof_initiator_iopolicy: queue-depth needs Linux 6.11 or later; this node runs 6.8.0-85-generic"),
        # I/O on a lost path would wait for the controller: forever, with ctrl_loss_tmo -1
        ({"nvmeof_initiator_ctrl_loss_tmo": -1, "nvmeof_initiator_fast_io_fail_tmo": -1},
         "nvmeof_initiator_fast_io_fail_tmo (-1) must be 0-29"),
        ({"nvmeof_initiator_fast_io_fail_tmo": 45, "nvmeof_initiator_ctrl_loss_tmo": 600},
         "nvmeof_initiator_fast_io_fail_tmo (45) must be 0-29"),
        ({"nvmeof_initiator_ctrl_loss_tmo": -2}, "nvmeof_initiator_ctrl_loss_tmo (-2) must be -1 (reconnect forever) or"),
        ({"nvmeof_initiator_ctrl_loss_tmo": 4}, "below nvmeof_initiator_ctrl_loss_tmo (4)"),
    ],
)  # fmt: skip
def test_policies_and_timeouts_that_hang_or_give_up_are_refused(
    tmp_path: Path, extra: dict, message: str
) -> None:
    proc = initiator(tmp_path, "6.8.0-85-generic", **extra)
    assert proc.returncode != 0
    assert message in said(proc), said(proc)[-3000:]
