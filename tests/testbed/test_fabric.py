"""End to end on the VM testbed: deploy, idempotence, verification, allowlist, DH-HMAC-CHAP,
multipath over two links, link loss, reboot.

The target and the node are joined by two soft-RoCE links on two subnets (qemu netdevs `fabric`
and `fabric2`); the node reaches the store's subsystem over both (native NVMe multipath, the lab's
I/O policy, ctrl_loss_tmo -1) and authenticates with DH-HMAC-CHAP secrets `kvlab testbed up` made.
Order matters and is the file's order: the fault tests come last, the reboot after the link cuts
(it also proves the node recovers from them by itself).
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

from kvlab import verify_checks as vc
from kvlab.testbed import testbed as tb

# The first test also waits for the session's VMs and first deploy.
pytestmark = [pytest.mark.testbed, pytest.mark.timeout(3600)]

STORE_NQN = "nqn.2026-01.io.kvlab.testbed:store0"
TARGET = "10.77.0.1"
TARGETS = {"fabric": "10.77.0.1", "fabric2": "10.78.0.1"}  # qemu netdev -> the target's address on it
MOUNT = "/mnt/kvstore0"
# One line per path of every multipath head: head|path disk|controller|state|traddr|sectors read.
# The hidden path disks (nvme<subsys>c<ctrl>n<ns>) sit in /sys/block beside their head (nvme<subsys>n<ns>).
PATHS = (
    "for p in /sys/block/nvme*c*n*; do [ -e $p/stat ] || continue; n=${p##*/}; h=$(echo $n | sed 's/c[0-9]*n/n/'); "
    "c=$(basename $(readlink -f $p/device)); "
    'printf \'%s|%s|%s|%s|%s|%s\\n\' $h $n $c "$(cat /sys/class/nvme/$c/state)" '
    '"$(sed -n \'s/.*traddr=\\([^,]*\\).*/\\1/p\' /sys/class/nvme/$c/address)" "$(awk \'{print $3}\' $p/stat)"; done'
)


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
    declares kvlab_lab_hardware: false (so are the drive, time and QoS read-back checks), and the
    RoCE QoS checked as rendered (soft-RoCE); every path, the I/O policy, the path MTU, the counters
    under load and the DH-HMAC-CHAP keys checked and passing."""
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
        cwd=tb.paths.repo_root(), env=env, capture_output=True, text=True, timeout=1500, check=False,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-8000:]
    assert (tmp_path / "node-roce-counters.json").exists()
    for suite in ("test_storage_target.py on ansible://target", "test_storage_initiator.py on ansible://node",
                  "test_storage_rdma.py on ansible://target", "test_storage_rdma.py on ansible://node",
                  "test_storage_roce_load.py on ansible://node"):  # fmt: skip
        assert re.search(rf"{re.escape(suite)}: (\d+ \w+, )*\d+ passed", out), (suite, out[-4000:])
        assert not re.search(rf"{re.escape(suite)}: .*(failed|skipped)", out), (suite, out[-4000:])
    # the lab tests (GPU, drives, time, QoS read-back) are not run on VMs, and the run says so
    for suite in ("tests/lab/test_gpu_node.py on node", "tests/lab/test_gpu_health.py on node",
                  "tests/lab/test_target_drives.py on target", "tests/lab/test_time_sync.py on target",
                  "tests/infra/test_storage_rdma.py on target"):  # fmt: skip
        assert re.search(rf"{re.escape(suite)}: \d+ deselected, not run: the inventory declares "
                         r"kvlab_lab_hardware: false", out), (suite, out[-3000:])  # fmt: skip
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


def store_paths(node) -> dict[str, dict]:
    """The store head's paths, by the target address each reaches: {traddr: {disk, ctrl, state, sectors}}."""
    head = node.succeed(f"basename $(readlink -f $(findmnt -no SOURCE {MOUNT}))").strip()
    out = {}
    for line in node.succeed(PATHS).splitlines():
        h, disk, ctrl, state, traddr, sectors = line.split("|")
        if h == head:
            out[traddr] = {"disk": disk, "ctrl": ctrl, "state": state, "sectors": int(sectors or 0)}
    return out


def controllers(node) -> list[dict]:
    return tb.parse_controllers(node.succeed(tb.CONTROLLERS_SCRIPT))


def all_paths_live(node) -> None:
    node.wait_until_succeeds(
        f"test $(grep -l {STORE_NQN} /sys/class/nvme/nvme*/subsysnqn | sed 's/subsysnqn/state/' | xargs cat "
        f"| grep -cx live) -eq {len(TARGETS)}",
        timeout=120,
    )


PARALLEL_READ = (
    "for i in $(seq 0 7); do dd if={dev} of=/dev/null bs=64k count=64 skip=$((i * 64 + {offset})) "
    "iflag=direct status=none & done; wait"
)


def test_multipath_both_paths_live_and_both_carry_io(testbed, deployed):
    """The store's subsystem is reached over both links (one controller per target address, both
    live, the lab's I/O policy), and a read spreads over both: the per-path block statistics of
    the hidden nvmeXcYnZ devices both move."""
    node = testbed.node
    all_paths_live(node)
    ctrls = [c for c in controllers(node) if c["subsysnqn"] == STORE_NQN]
    targets = [{"traddr": a, "trsvcid": 4420, "subsystems": [STORE_NQN]} for a in TARGETS.values()]
    assert vc.missing_paths(targets, ctrls) == [], ctrls
    policy = node.succeed(f"grep -l {STORE_NQN} /sys/class/nvme-subsystem/*/subsysnqn | sed 's/subsysnqn/iopolicy/' | xargs cat").strip()
    assert policy in ("round-robin", "queue-depth"), f"iopolicy {policy}: numa keeps I/O on one path"
    dev = node.succeed(f"readlink -f $(findmnt -no SOURCE {MOUNT})").strip()
    before = store_paths(node)
    assert set(before) == set(TARGETS.values()), before
    node.succeed(PARALLEL_READ.format(dev=dev, offset=0))
    after = store_paths(node)
    moved = {a: after[a]["sectors"] - before[a]["sectors"] for a in after}
    assert all(v > 0 for v in moved.values()), f"iopolicy {policy}: sectors read per path {moved}"
    print(f"both paths carried the read ({policy}): sectors per target address {moved}")


def node_identity(node) -> tuple[str, str]:
    return node.succeed("cat /etc/nvme/hostnqn").strip(), node.succeed("cat /etc/nvme/hostid").strip()


def test_dhchap_node_connected_with_its_secret(testbed, deployed):
    """The node's controllers authenticated (DH-HMAC-CHAP, both ways): each has its host and
    controller secret set (read as set / not set, never printed), and the target holds a key for
    the node's NQN."""
    node = testbed.node
    for c in [c for c in controllers(node) if c["subsysnqn"] == STORE_NQN]:
        for attr in ("dhchap_secret", "dhchap_ctrl_secret"):
            got = node.succeed(f'[ -n "$(cat /sys/class/nvme/{c["name"]}/{attr} 2>/dev/null)" ] && echo set || echo unset')
            assert got.strip() == "set", f"{c['name']}: {attr} {got.strip()}"
    nqn, _ = node_identity(node)
    keyed = testbed.target.succeed(f'[ -n "$(cat /sys/kernel/config/nvmet/hosts/{nqn}/dhchap_key)" ] && echo set || echo unset')
    assert keyed.strip() == "set", f"the target holds no DH-HMAC-CHAP key for {nqn}"


# A connect as the kernel takes it (nvme-cli would add the node's own secrets, which it finds on the
# node's live controllers): the node's NQN and host ID, a duplicate of its live path, no or another secret.
RAW_CONNECT = "exec 3<>/dev/nvme-fabrics && echo '{opts}' >&3 && cat <&3"


@pytest.mark.parametrize("secret", ["none", "wrong"])
def test_dhchap_host_with_the_nodes_nqn_but_no_or_a_wrong_secret_is_refused(testbed, deployed, secret):
    """A host presenting the node's own NQN and host ID (on the allowlist) but without its secret,
    or with another one, is refused: the target demands DH-HMAC-CHAP and fails a wrong response,
    no controller appears on the node, and both kernels say why."""
    node, target = testbed.node, testbed.target
    nqn, hostid = node_identity(node)
    before = sorted(c["name"] for c in controllers(node))
    mark = f"kvlab-dhchap-{secret}-{uuid.uuid4().hex[:8]}"
    for m in (node, target):
        m.succeed(f"echo {mark} > /dev/kmsg")
    opts = (f"nqn={STORE_NQN},transport={testbed.transport},traddr={TARGET},trsvcid=4420,hostnqn={nqn},"
            f"hostid={hostid},duplicate_connect")  # fmt: skip
    if secret == "wrong":
        opts += f",dhchap_secret={tb.dhchap_secret()}"
    # the host waits out its admin timeout (60 s, 6 tries) after the target's failure1: shortened
    # for this connect only (a controller takes the value when it is made)
    admin_timeout = node.succeed("cat /sys/module/nvme_core/parameters/admin_timeout").strip()
    node.succeed("echo 3 > /sys/module/nvme_core/parameters/admin_timeout")
    try:
        rc, out = node.execute(RAW_CONNECT.format(opts=opts), timeout=180)
    finally:
        node.succeed(f"echo {admin_timeout} > /sys/module/nvme_core/parameters/admin_timeout")
    after = sorted(c["name"] for c in controllers(node))
    for name in set(after) - set(before):  # whatever came up must not stay
        node.execute(f"nvme disconnect -d {name}")
    node_log = node.succeed(f"dmesg | sed -n '/{mark}/,$p'")
    target_log = target.succeed(f"dmesg | sed -n '/{mark}/,$p'")
    assert rc != 0 and after == before, f"{secret} secret: rc {rc}, controllers {before} -> {after}: {out}\n{node_log}"
    assert "with DH-HMAC-CHAP" in target_log, f"the target did not demand DH-HMAC-CHAP:\n{target_log}"
    if secret == "none":
        assert re.search(r"no key|authentication setup failed", node_log), node_log
    else:
        assert re.search(r"host response mismatch|failure1", target_log), target_log
        assert "authentication failed" in node_log, node_log
    said = [line.split("] ", 1)[-1] for line in (node_log + target_log).splitlines() if re.search("auth|key|mismatch", line)]
    print(f"{secret} secret refused ({out.strip() or rc}): {said[:4]}")


def test_failover_one_path_cut_io_goes_on_then_an_outage_over_60s_and_the_path_comes_back(testbed, deployed):
    """One link cut (qemu set_link on the node's second fabric link): a read through the
    filesystem goes on over the other path with no error reaching it, verify's path check names
    the dead path; the cut lasts over 60 s (past the old ctrl_loss_tmo), the controller keeps
    reconnecting (ctrl_loss_tmo -1: never deleted), and when the link returns the path comes back
    live by itself."""
    node = testbed.node
    all_paths_live(node)
    cut, kept = TARGETS["fabric2"], TARGETS["fabric"]
    data = f"{MOUNT}/.failover"
    node.succeed(f"head -c 16M /dev/urandom > /tmp/failover && cp /tmp/failover {data} && sync {data}")
    node.succeed("echo 3 > /proc/sys/vm/drop_caches")
    mark = f"kvlab-failover-{uuid.uuid4().hex[:8]}"
    node.succeed(f"echo {mark} > /dev/kmsg")
    before = store_paths(node)
    node.set_link("fabric2", False)
    t_cut = time.monotonic()
    try:
        # the read through the filesystem, O_DIRECT: every byte from the target, over some path
        rc, out = node.execute(f"dd if={data} of=/tmp/failover.back bs=1M iflag=direct status=none "
                               f"&& cmp /tmp/failover /tmp/failover.back && echo same", timeout=180)  # fmt: skip
        took = time.monotonic() - t_cut
        assert rc == 0 and out.strip() == "same", f"I/O over the remaining path failed (rc {rc}, {took:.0f} s): {out}"
        after = store_paths(node)
        assert after[kept]["sectors"] > before[kept]["sectors"], (before, after)
        # make verify's check sees the dead path and says so
        node.wait_until_succeeds(
            f"grep -l {STORE_NQN} /sys/class/nvme/{after[cut]['ctrl']}/subsysnqn && "
            f"! grep -qx live /sys/class/nvme/{after[cut]['ctrl']}/state", timeout=60)  # fmt: skip
        targets = [{"traddr": a, "trsvcid": 4420, "subsystems": [STORE_NQN]} for a in TARGETS.values()]
        problems = vc.missing_paths(targets, [c for c in controllers(node) if c["subsysnqn"] == STORE_NQN])
        assert len(problems) == 1 and cut in problems[0], problems
        fs_errors = node.succeed(f"dmesg | sed -n '/{mark}/,$p' | grep -iE 'XFS .*(error|shutdown)|Buffer I/O error' || true")
        assert not fs_errors.strip(), fs_errors
        # the outage: past 60 s the controller of the cut path still exists and keeps reconnecting
        ctrl = after[cut]["ctrl"]
        while time.monotonic() - t_cut < 65:
            state = node.succeed(f"cat /sys/class/nvme/{ctrl}/state 2>/dev/null || echo deleted").strip()
            assert state in ("connecting", "resetting"), f"{ctrl} {state} {time.monotonic() - t_cut:.0f} s into the cut"
            time.sleep(5)
        outage = time.monotonic() - t_cut
    finally:
        node.set_link("fabric2", True)
    t_back = time.monotonic()
    all_paths_live(node)
    back = store_paths(node)
    assert back[cut]["ctrl"] == ctrl and back[cut]["state"] == "live", back
    node.succeed(f"rm -f {data} /tmp/failover /tmp/failover.back")
    print(f"read over the other path in {took:.0f} s; path to {cut} back {time.monotonic() - t_back:.0f} s "
          f"after a {outage:.0f} s outage")


def test_fabric_cut_fails_io_within_timeouts(testbed, deployed):
    """With every link cut, O_DIRECT reads fail once keep-alive and fast_io_fail expire: no hang
    (a load then falls back to recompute in seconds)."""
    dev = testbed.node.succeed(f"readlink -f $(findmnt -no SOURCE {MOUNT})").strip()
    testbed.node.succeed(f"dd if={dev} of=/dev/null bs=4k count=1 iflag=direct status=none")
    budget = 5 + 5 + 20  # keep-alive + fast_io_fail_tmo + detection slack under TCG
    for link in TARGETS:
        testbed.node.set_link(link, False)
    try:
        t0 = time.monotonic()
        rc, out = testbed.node.execute(
            f"dd if={dev} of=/dev/null bs=4k count=1 skip=$((RANDOM * 7)) iflag=direct status=none",
            timeout=120,
        )
        elapsed = time.monotonic() - t0
    finally:
        for link in TARGETS:
            testbed.node.set_link(link, True)
    assert rc not in (0, 124), f"I/O over a cut link: rc {rc} after {elapsed:.0f} s: {out}"
    assert elapsed < budget, f"I/O failed only after {elapsed:.0f} s (budget {budget} s)"
    # and both paths come back by themselves
    all_paths_live(testbed.node)
    # A write the filesystem had in flight (its log) failed on every path too: XFS then shuts down
    # and refuses writes until it is mounted again, which verify's O_DIRECT check catches. The
    # recovery the role's README gives (umount, mount: the log replays) must bring the store back.
    probe = f"sh -c 'echo probe > {MOUNT}/.kvlab-probe && sync -f {MOUNT}/.kvlab-probe && rm {MOUNT}/.kvlab-probe'"
    shut_down = testbed.node.execute(probe, timeout=60)[0] != 0
    if shut_down:
        testbed.node.succeed(f"umount {MOUNT} && mount {MOUNT}", timeout=180)
    testbed.node.succeed(probe, timeout=60)
    print(f"I/O failed in {elapsed:.0f} s with every link cut; the filesystem "
          + ("shut down and took writes again after a remount" if shut_down else "kept taking writes"))


def test_reboot_reconnects_and_remounts(testbed, deployed):
    waited = testbed.node.reboot()
    testbed.node.wait_for_unit("kvlab-nvmeof-connect.service", timeout=120)
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
