"""The lab and the testbed are one inventory shape: the same group tree, the same storage
variables, both valid for every role site.yml and teardown.yml run on their hosts; every play
reaches hosts, a play that matches none fails the run, and `make verify` fails on a group with no
host, naming it. Nothing here contacts a host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvlab import inventory

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = ("lab", "testbed")
PLAYBOOKS = ("site.yml", "teardown.yml")
ENV = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
           PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")  # fmt: skip


@pytest.fixture(scope="module")
def inventories() -> dict[str, inventory.Inventory]:
    return {name: inventory.load(ROOT / "inventories" / name / "hosts.yml") for name in INVENTORIES}


def tree(inv: inventory.Inventory) -> dict[str, list[str]]:
    return {name: sorted(c.name for c in g.child_groups) for name, g in inv.groups().items() if name != "ungrouped"}


def plays(playbook: str) -> list[dict]:
    """Every play of a playbook, imports followed."""
    out = []
    for play in yaml.safe_load((ROOT / "playbooks" / playbook).read_text()):
        if "ansible.builtin.import_playbook" in play:
            out += plays(play["ansible.builtin.import_playbook"])
        else:
            out.append(play)
    return out


def test_same_group_tree(inventories):
    lab, testbed = (tree(inventories[n]) for n in INVENTORIES)
    assert lab == testbed
    assert lab["gpu_nodes"] == ["h20", "h200"] and "gpu_nodes" in lab["nvmeof_initiators"]
    assert {"nvmeof_targets", "nvmeof_initiators", "gpu_nodes", "bench"} <= set(lab["all"])


@pytest.mark.parametrize("name", INVENTORIES)
@pytest.mark.parametrize("playbook", [*PLAYBOOKS, "storage.yml"])
def test_every_play_reaches_hosts(inventories, name, playbook):
    for play in plays(playbook):
        assert inventories[name].hosts(play["hosts"]), f"{name}: play {play['name']!r} ({play['hosts']}) has no host"


def group_keys(name: str, group: str, skip: tuple[str, ...] = ("vault.yml",)) -> set[str]:
    keys: set[str] = set()
    for f in sorted((ROOT / "inventories" / name / "group_vars" / group).glob("*.yml")):
        if f.name not in skip and f.name != "up.yml":
            keys |= set(yaml.safe_load(f.read_text()) or {})
    return keys


@pytest.mark.parametrize("group", ["all", "nvmeof_targets", "nvmeof_initiators"])
def test_same_storage_variables(group):
    """What the lab sets for the storage fabric, the testbed sets too (the testbed may set more:
    its soft-RoCE links, connection values, the QoS it cannot apply)."""
    lab = group_keys("lab", group) - {"kvlab_plan_facts"}
    assert lab and lab <= group_keys("testbed", group), lab - group_keys("testbed", group)


def test_same_gpu_node_wiring():
    wiring = set(yaml.safe_load((ROOT / "inventories/lab/group_vars/gpu_nodes/wiring.yml").read_text()))
    assert "kvlab_gpus_expected" in wiring
    assert wiring <= group_keys("testbed", "gpu_nodes")


def test_hosts_declare_their_storage_ports_and_identity(inventories):
    for name, inv in inventories.items():
        for host in inv.hosts("nvmeof_targets:nvmeof_initiators"):
            v = inv.render(host, ["kvlab_storage_ports", "rdma_netdevs"])
            assert v["kvlab_storage_ports"] and v["rdma_netdevs"], f"{name}/{host}"
        for host in inv.hosts("nvmeof_initiators"):
            v = inv.render(host, ["nvmeof_initiator_hostnqn", "nvmeof_initiator_filesystems", "nvmeof_initiator_targets"])
            assert v["nvmeof_initiator_hostnqn"] and v["nvmeof_initiator_filesystems"] and v["nvmeof_initiator_targets"]


def test_gpus_expected_is_declared_lab_true_testbed_false(inventories):
    for name, want in (("lab", True), ("testbed", False)):
        inv = inventories[name]
        assert {inv.render(h, ["kvlab_gpus_expected"])["kvlab_gpus_expected"] for h in inv.hosts("gpu_nodes")} == {want}


def test_no_unread_fabric_variables():
    """Every variable of the lab's fabric and storage files is read: by a role (its own name, or
    a role's default that reads it), or by another inventory value's template."""
    gv = ROOT / "inventories/lab/group_vars"
    texts = "".join(p.read_text() for p in gv.rglob("*.yml")) + (ROOT / "inventories/lab/hosts.yml").read_text()
    roles = [p.name for p in (ROOT / "roles").iterdir()]
    role_defaults_text = "".join(p.read_text() for p in (ROOT / "roles").glob("*/defaults/main.yml"))
    for f in ("all/fabric.yml", "all/storage.yml"):
        for key in yaml.safe_load((gv / f).read_text()):
            role_input = any(key.startswith(r + "_") for r in roles) or key in role_defaults_text
            assert role_input or texts.count(key) > 1, f"{f}: {key} is read by nothing"
    for gone in ("kvlab_roce_subnets", "kvlab_nfs_rdma", "nfsrdma-01", "storage_targets", "mlnx_qos"):
        assert gone not in texts


def role_spec(role: str) -> dict:
    """The role's options; a default that is a template (derived at run time from other
    variables, as Ansible renders it before validating) is left to the run."""
    spec = yaml.safe_load((ROOT / "roles" / role / "meta/argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    return {k: {f: v for f, v in o.items() if not (f == "default" and "{{" in str(v))} for k, o in options.items()}


def role_defaults(role: str) -> dict:
    return yaml.safe_load((ROOT / "roles" / role / "defaults/main.yml").read_text()) or {}


CASES = [
    (name, playbook, play["name"], role if isinstance(role, str) else role["role"], {} if isinstance(role, str) else role.get("vars", {}))
    for name in INVENTORIES for playbook in PLAYBOOKS for play in plays(playbook) for role in play.get("roles", [])
]  # fmt: skip


@pytest.mark.parametrize(("name", "playbook", "play", "role", "play_vars"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])  # fmt: skip
def test_inventory_passes_the_role_argument_specs(inventories, name, playbook, play, role, play_vars):
    """What each inventory gives a role, rendered by Ansible, over the role's defaults, is valid
    for the role's argument spec, on every host of the play (as Ansible checks at role start)."""
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    inv = inventories[name]
    spec = role_spec(role)
    [pattern] = [p["hosts"] for p in plays(playbook) if p["name"] == play]
    for host in inv.hosts(pattern):
        given = inv.render(host, list(spec))
        params = {k: v for k, v in role_defaults(role).items() if k in spec and "{{" not in str(v)}
        params |= given | {k: v for k, v in play_vars.items() if "{{" not in str(v)}
        result = ArgumentSpecValidator(spec).validate(params)
        assert not result.error_messages, f"{name}/{host} for {role}: {result.error_messages}"


def test_bench_runner_projects_wear_onto_each_nodes_own_drives(inventories):
    """roles/bench_runner passes `kvlab campaign run --drives`: the inventory's kvlab_store_drive,
    one per store path of the node; an inventory without it (local) keeps the campaign's."""
    from kvlab.harness.campaign import DrivesSpec

    default = role_defaults("bench_runner")["bench_runner_drives"]
    for name, per_node in (("lab", 4), ("testbed", 1)):
        inv = inventories[name]
        drive = yaml.safe_load((ROOT / "inventories" / name / "group_vars/all/storage.yml").read_text())["kvlab_store_drive"]
        hosts = inv.hosts("bench")
        assert hosts, name
        for host in hosts:
            drives = inv.template(host, default)
            assert drives == {**drive, "count": per_node}, f"{name}/{host}"
            DrivesSpec.model_validate(drives)  # what --drives accepts
    local = inventory.load(ROOT / "inventories/local/hosts.yml")
    assert [local.template(h, default) for h in local.hosts("bench")] == [{}]


def test_a_play_that_matches_no_host_fails_the_run(tmp_path):
    (tmp_path / "hosts.yml").write_text("all:\n  children:\n    nvmeof_targets:\n    bench:\n      hosts:\n        localhost:\n")
    (tmp_path / "p.yml").write_text(
        "- name: Nothing to configure\n  hosts: nvmeof_targets\n  gather_facts: false\n  tasks: []\n"
        "- name: Never reached\n  hosts: bench\n  gather_facts: false\n  connection: local\n"
        "  tasks:\n    - name: Say\n      ansible.builtin.debug: {msg: reached}\n"
    )
    res = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"),
                          str(tmp_path / "p.yml")], env=ENV, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode != 0, res.stdout
    assert "play 'Nothing to configure' matches no host" in res.stderr and "nvmeof_targets" in res.stderr
    assert "reached" not in res.stdout


def make(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    venv = Path(sys.executable).parent.parent
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args, f"VENV={venv}"], env=ENV,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_deploy_on_the_local_inventory_says_what_it_runs():
    res = make("deploy", "inventory=local")
    assert res.returncode == 2
    assert "inventories/local runs playbooks/bench.yml only" in res.stdout + res.stderr


def test_verify_fails_on_a_group_with_no_host_naming_it(tmp_path):
    """A copy of the testbed inventory whose target group is empty: make verify stops before any
    connection, naming the group and the suite that would have checked nothing."""
    inv = tmp_path / "inv"
    (inv / "group_vars").mkdir(parents=True)
    tree_ = yaml.safe_load((ROOT / "inventories/testbed/hosts.yml").read_text())
    tree_["all"]["children"]["nvmeof_targets"] = None
    (inv / "hosts.yml").write_text(yaml.safe_dump(tree_))
    res = make("verify", f"inventory={inv}")
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "group 'nvmeof_targets'" in out and "has no host" in out, out[-3000:]
