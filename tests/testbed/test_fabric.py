"""End to end on the VM testbed: deploy, idempotence, verification, allowlist, link loss, reboot.

Order matters and is the file's order: the fault tests come last, the reboot after the link cut
(it also proves the node recovers from it by itself).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from kvlab.testbed import testbed as tb

# The first test also waits for the session's VMs and first deploy.
pytestmark = [pytest.mark.testbed, pytest.mark.timeout(3600)]

STORE_NQN = "nqn.2026-01.io.kvlab.testbed:store0"
TARGET = "10.77.0.1"
MOUNT = "/mnt/kvstore0"


def recap_changes(output: str) -> dict[str, int]:
    return {
        m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s+:\s+ok=\d+\s+changed=(\d+)", output, re.M)
    }


def test_deploy(deployed):
    if deployed is None:
        pytest.skip("attached testbed: deployed by make deploy")
    changes = recap_changes(deployed.stdout)
    assert set(changes) == {"target", "node"}, deployed.stdout[-2000:]


def test_make_pin_reads_the_vms_package_versions(testbed, deployed):
    """make pin's playbook on the VMs: each storage role's packages, at the versions the VM's own
    package sources give (here the VM reaches no repository: its dpkg database is the only source,
    so no SHA256 comes with them), written into the inventory, where the next deploy reads them."""
    res = testbed.ansible("playbooks/pin.yml")
    assert res.returncode == 0, res.stdout[-4000:]
    # nothing changes on the VMs: the only changes are the pins files written on the controller
    changed = [line for line in res.stdout.splitlines() if line.startswith("changed: [")]
    assert changed and all("-> localhost" in line for line in changed), res.stdout[-3000:]
    inv = testbed.inventory.parent
    roles = tb.paths.repo_root() / "roles"
    for group, role_names in (("nvmeof_targets", ("rdma", "nvmeof_target")),
                              ("nvmeof_initiators", ("rdma", "nvmeof_initiator"))):  # fmt: skip
        pins = yaml.safe_load((inv / "group_vars" / group / "pins.yml").read_text())
        for role in role_names:
            os_vars = yaml.safe_load((roles / role / "vars/Debian_13.yml").read_text())
            want = {k: v for key, table in os_vars.items() if key.endswith("_packages") and key != "__rdma_doca_packages"
                    for k, v in table.items()}  # fmt: skip
            assert pins[f"{role}_package_versions"] == want, (group, role, pins)


def test_second_deploy_changes_nothing(testbed, deployed):
    res = testbed.ansible("playbooks/site.yml")
    assert res.returncode == 0, res.stdout[-4000:]
    assert recap_changes(res.stdout) == {"target": 0, "node": 0}, res.stdout[-4000:]


def test_check_diff_mode_is_clean(testbed, deployed):
    res = testbed.ansible("playbooks/site.yml", "--check", "--diff")
    assert res.returncode == 0, res.stdout[-4000:]
    assert recap_changes(res.stdout) == {"target": 0, "node": 0}, res.stdout[-4000:]


def test_verify_suites_pass(testbed, deployed, tmp_path):
    """make verify's suites (scripts/verify): tests/infra on the fabric groups and tests/lab on
    gpu_nodes, each collecting the testbed's hosts; the GPU checks deselected because the inventory
    declares kvlab_gpus_expected: false, and the RoCE QoS checked as rendered (soft-RoCE)."""
    env = dict(
        os.environ,
        KVLAB_INFRA_RECORD=str(tmp_path),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_CONFIG=str(tb.paths.repo_root() / "ansible.cfg"),
        PATH=f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}",
        PYTHON=sys.executable,
    )
    res = subprocess.run(
        [str(tb.paths.repo_root() / "scripts" / "verify"), str(testbed.inventory), "-q", "-s"],
        cwd=tb.paths.repo_root(), env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-8000:]
    assert (tmp_path / "node-roce-counters.json").exists()
    for suite in ("test_storage_target.py on ansible://target", "test_storage_initiator.py on ansible://node",
                  "test_storage_rdma.py on ansible://target", "test_storage_rdma.py on ansible://node"):  # fmt: skip
        assert re.search(rf"{re.escape(suite)}: \d+ passed", out), (suite, out[-4000:])
    assert re.search(r"tests/lab/test_gpu_node.py on node: \d+ deselected, not run: the inventory declares "
                     r"kvlab_gpus_expected: false", out), out[-3000:]  # fmt: skip
    assert "checked the rendered configuration" in out  # soft-RoCE holds no DCB settings, and says so


def test_status_shows_controllers_over_the_chosen_transport(testbed, deployed):
    st = tb.status(testbed.state.name)
    node = next(m for m in st["machines"] if m["name"] == "node")
    ctrls = [c for c in node["nvme_controllers"] if c["subsysnqn"] == STORE_NQN]
    assert ctrls and all(c["transport"] == testbed.transport and c["state"] == "live" for c in ctrls), node
    assert st["transport_ok"]


def test_host_not_on_the_allowlist_is_refused(testbed, deployed):
    stranger = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
    before = testbed.node.succeed("ls /sys/class/nvme")
    out = testbed.node.fail(
        f"nvme connect --transport={testbed.transport} --traddr={TARGET} --trsvcid=4420 "
        f"--nqn={STORE_NQN} --hostnqn={stranger} --hostid={uuid.uuid4()}"
    )
    assert testbed.node.succeed("ls /sys/class/nvme") == before, out
    log = testbed.target.succeed("dmesg | tail -20")
    assert "not allowed" in log, log  # nvmet names the refused host


def test_fabric_cut_fails_io_within_timeouts(testbed, deployed):
    """With the link cut, O_DIRECT reads fail once keep-alive and fast_io_fail expire: no hang."""
    dev = testbed.node.succeed(f"readlink -f $(findmnt -no SOURCE {MOUNT})").strip()
    testbed.node.succeed(f"dd if={dev} of=/dev/null bs=4k count=1 iflag=direct status=none")
    budget = 5 + 5 + 20  # keep-alive + fast_io_fail_tmo + detection slack under TCG
    testbed.node.set_link("fabric", False)
    try:
        t0 = time.monotonic()
        rc, out = testbed.node.execute(
            f"dd if={dev} of=/dev/null bs=4k count=1 skip=$((RANDOM * 7)) iflag=direct status=none",
            timeout=120,
        )
        elapsed = time.monotonic() - t0
    finally:
        testbed.node.set_link("fabric", True)
    assert rc not in (0, 124), f"I/O over a cut link: rc {rc} after {elapsed:.0f} s: {out}"
    assert elapsed < budget, f"I/O failed only after {elapsed:.0f} s (budget {budget} s)"
    # and the path comes back by itself within ctrl_loss_tmo
    testbed.node.wait_until_succeeds(
        f"grep -l {STORE_NQN} /sys/class/nvme/nvme*/subsysnqn | sed 's/subsysnqn/state/' | xargs cat | grep -qx live",
        timeout=60,
    )


def test_reboot_reconnects_and_remounts(testbed, deployed):
    waited = testbed.node.reboot()
    testbed.node.wait_for_unit("nvmf-autoconnect.service", timeout=120)
    testbed.node.wait_until_succeeds(f"mountpoint -q {MOUNT}", timeout=120)
    ctrls = json.loads(testbed.node.succeed(
        "python3 -c 'import json,glob,os; print(json.dumps([{k: open(os.path.join(d,k)).read().strip() "
        "for k in (\"transport\",\"state\",\"subsysnqn\")} for d in glob.glob(\"/sys/class/nvme/nvme*\")]))'"
    ))  # fmt: skip
    assert any(
        c["subsysnqn"] == STORE_NQN and c["transport"] == testbed.transport and c["state"] == "live"
        for c in ctrls
    ), ctrls
    testbed.node.succeed(
        f"head -c 4M /dev/urandom > /tmp/x && dd if=/tmp/x of={MOUNT}/.after-reboot bs=1M oflag=direct status=none "
        f"&& cmp /tmp/x {MOUNT}/.after-reboot && rm {MOUNT}/.after-reboot"
    )
    print(f"node back after reboot in {waited:.0f} s")
