"""nvmeof_target on a target appliance: `make plan` of a lab whose target is declared an
appliance renders only its seed (the rdma and nvmeof_target roles write nothing else), the seed
is what the role-managed target gets plus its fabric, and the role's validator is the applier's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_lab_engine_cmdline import ROOT, run_plan
from test_roles_plan import group_vars, lab_plan  # noqa: F401  (lab_plan: the lab's plan, rendered once)

pytestmark = pytest.mark.unit

APPLY = ROOT / "roles/nvmeof_target/files/kvlab-nvmet-apply"
SEED = "var/lib/kvlab-seed/nvmet.json"


def lab_copy(tmp_path: Path, edit) -> Path:
    """The lab inventory, copied, with hosts.yml edited."""
    inv = tmp_path / "lab"
    shutil.copytree(ROOT / "inventories/lab", inv)
    hosts = yaml.safe_load((inv / "hosts.yml").read_text())
    edit(hosts["all"]["children"])
    (inv / "hosts.yml").write_text(yaml.safe_dump(hosts))
    return inv


@pytest.fixture(scope="module")
def appliance_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("appliance")

    def declare(groups):
        groups["nvmeof_targets"]["hosts"]["nvmeof-01"]["nvmeof_target_appliance"] = True

    return run_plan(lab_copy(tmp, declare), tmp / "plan", "--limit", "nvmeof-01")


def test_an_appliance_gets_only_its_seed(appliance_plan: Path) -> None:
    files = sorted(str(p.relative_to(appliance_plan)) for p in appliance_plan.rglob("*") if p.is_file())
    assert files == [f"nvmeof-01/{SEED}"]


def test_the_seed_is_the_targets_configuration_and_its_fabric(appliance_plan: Path, lab_plan: Path) -> None:  # noqa: F811
    seed = json.loads((appliance_plan / "nvmeof-01" / SEED).read_text())
    managed = json.loads((lab_plan / "nvmeof-01/etc/kvlab/nvmet.json").read_text())
    assert {k: seed[k] for k in managed} == managed  # the same exports, the same meaning
    fabric = group_vars("all")
    assert seed["roce_lossless"] == fabric["rdma_roce_lossless"]
    assert seed["netdevs"] == [
        {"name": "ens1f0np0", "address": "192.168.100.31/24", "mtu": 9000},
        {"name": "ens1f1np1", "address": "192.168.101.31/24", "mtu": 9000},
    ]
    assert seed["rxe_links"] == []
    proc = subprocess.run([sys.executable, str(APPLY), "--validate", str(appliance_plan / "nvmeof-01" / SEED)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_the_role_refuses_what_the_validator_refuses_naming_the_field(tmp_path: Path) -> None:
    def malform(groups):
        groups["gpu_nodes"]["children"]["h200"]["hosts"]["h200-01"]["nvmeof_initiator_hostnqn"] = "x"

    proc = subprocess.run(
        [str(ROOT / "scripts/plan"), str(lab_copy(tmp_path, malform)), str(tmp_path / "plan"), "--limit", "nvmeof-01"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert 'subsystems[0].allowed_hosts[0]: "x" is not an NQN (nqn.YYYY-MM.reverse.domain:' in said, said[
        -4000:
    ]
    assert "nvmet.json" not in {p.name for p in (tmp_path / "plan").rglob("*")}


@pytest.mark.parametrize("marked", [True, False])
def test_a_host_carrying_the_appliance_marker_is_one(tmp_path: Path, marked: bool) -> None:
    """Undeclared in the inventory, a host whose image ships the marker is still an appliance."""
    marker = tmp_path / "appliance"
    if marked:
        marker.write_text("")
    (tmp_path / "p.yml").write_text(
        "- name: Recognise\n  hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        "    - name: Recognise\n      ansible.builtin.include_role: {name: nvmeof_target, tasks_from: recognise}\n"
        "    - name: Say\n      ansible.builtin.debug: {msg: 'appliance={{ __nvmeof_target_is_appliance }}'}\n"
    )
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", str(tmp_path / "p.yml"),
         "-e", f"__nvmeof_target_appliance_marker={marker}", "-e", f"ansible_python_interpreter={sys.executable}"],
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(ROOT / "roles")},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"appliance={marked}" in proc.stdout
