"""NVMe-oF initiators: every path live over the expected transport, the multipath I/O policy,
timeouts, mounts, O_DIRECT I/O. The judgements are kvlab.verify_checks' (unit-tested with broken
inputs: a down path, another I/O policy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab import verify_checks as vc

pytestmark = pytest.mark.infra
testinfra_hosts = ["ansible://nvmeof_initiators"]

CONTROLLERS = (
    'for d in /sys/class/nvme/nvme*; do t=$(cat $d/transport); [ "$t" = pcie ] && continue; '
    'printf \'%s|%s|%s|%s|%s|%s|%s\\n\' ${d##*/} $t "$(cat $d/subsysnqn)" "$(cat $d/state)" '
    '"$(cat $d/address | tr \'\\n\' \',\')" "$(cat $d/ctrl_loss_tmo 2>/dev/null)" "$(cat $d/fast_io_fail_tmo 2>/dev/null)"; done'
)


def controllers(host) -> list[dict]:
    rows = []
    for line in host.check_output(CONTROLLERS).splitlines():
        name, transport, nqn, state, address, loss, fail = line.split("|")
        rows.append({"name": name, "transport": transport, "subsysnqn": nqn, "state": state,
                     "address": address, "ctrl_loss_tmo": loss, "fast_io_fail_tmo": fail})  # fmt: skip
    return rows


def expected_subsystems(inv) -> list[str]:
    return sorted({nqn for t in inv["initiator_targets"] for nqn in t["subsystems"]})


def test_every_path_live(host, inv):
    """For every subsystem, a live controller to EVERY configured target address (one dead port
    of two is a failure, not a degraded pass)."""
    assert inv["initiator_targets"], "no NVMe-oF target configured on an initiator"
    ctrls = controllers(host)
    problems = vc.missing_paths(inv["initiator_targets"], ctrls)
    assert not problems, "\n".join(problems) + f"\ncontrollers: {[(c['name'], c['state'], c['address']) for c in ctrls]}"


SUBSYSTEM_POLICIES = (
    "for d in /sys/class/nvme-subsystem/nvme-subsys*; do [ -e $d/iopolicy ] || continue; "
    'printf \'%s|%s\\n\' "$(cat $d/subsysnqn)" "$(cat $d/iopolicy)"; done'
)


def test_multipath_iopolicy_as_configured(host, inv):
    """Native multipath spreads I/O over the paths only with the configured I/O policy
    (round-robin or queue-depth; `auto`: queue-depth from Linux 6.11): the kernel's default, numa,
    keeps it on one port."""
    policies = dict(line.split("|", 1) for line in host.check_output(SUBSYSTEM_POLICIES).splitlines() if "|" in line)
    want = vc.expected_iopolicy(inv["iopolicy"], host.check_output("uname -r"))
    problems = vc.iopolicy_problems(expected_subsystems(inv), policies, want)
    assert not problems, "\n".join(problems)


def test_paths_use_the_expected_transport_only(host, inv):
    ours = [c for c in controllers(host) if c["subsysnqn"] in expected_subsystems(inv)]
    assert ours
    assert {c["transport"] for c in ours} == {inv["initiator_transport"]}, ours


def test_paths_go_to_the_configured_targets(host, inv):
    ours = [c for c in controllers(host) if c["subsysnqn"] in expected_subsystems(inv)]
    addrs = {t["traddr"] for t in inv["initiator_targets"]}
    for c in ours:
        assert any(f"traddr={a}," in c["address"] + "," for a in addrs), c


def sysfs_tmo(value) -> str:
    """How /sys/class/nvme/*/ctrl_loss_tmo and fast_io_fail_tmo show a configured value (-1: off)."""
    return "off" if int(value) < 0 else str(value)


def test_timeouts_as_configured(host, inv):
    for c in controllers(host):
        if c["subsysnqn"] in expected_subsystems(inv):
            assert c["ctrl_loss_tmo"] == sysfs_tmo(inv["ctrl_loss_tmo"]), c
            assert c["fast_io_fail_tmo"] == sysfs_tmo(inv["fast_io_fail_tmo"]), c


def test_native_multipath(host, inv):
    want = "Y" if inv["multipath"] else "N"
    assert host.file("/sys/module/nvme_core/parameters/multipath").content_string.strip() == want


def test_reconnect_at_boot(host, inv):
    """The unit that connects at boot is enabled, and its configuration lists every subsystem at
    every target address (a port missing there is a path a reboot loses)."""
    assert host.service("kvlab-nvmeof-connect").is_enabled
    assert not host.service("nvmf-autoconnect").is_enabled  # one unit connects
    conf = host.file("/etc/nvme/config.json")
    assert conf.mode == 0o600, oct(conf.mode)  # it holds the DH-HMAC-CHAP keys
    listed = {(s["nqn"], p["transport"], p["traddr"]) for h in json.loads(host.check_output("cat /etc/nvme/config.json"))
              for s in h["subsystems"] for p in s["ports"]}  # fmt: skip
    for t in inv["initiator_targets"]:
        for nqn in t["subsystems"]:
            assert (nqn, inv["initiator_transport"], t["traddr"]) in listed, (nqn, t["traddr"])
    assert host.file("/etc/nvme/hostnqn").content_string.strip() == inv["initiator_hostnqn"]


def test_namespaces_mounted_as_configured(host, inv):
    assert inv["initiator_filesystems"], "no filesystem configured on an initiator"
    for fs in inv["initiator_filesystems"]:
        mp = host.mount_point(fs["path"])
        assert mp.exists, f"{fs['path']} not mounted"
        assert mp.filesystem == fs.get("fstype", "xfs")
        for opt in fs.get("options", "noatime").split(","):
            assert opt in mp.options
        # the mount's device is the remote namespace with the configured UUID
        dev = host.check_output(f"findmnt -no SOURCE {fs['path']}")
        real = host.check_output(f"readlink -f /dev/disk/by-id/nvme-uuid.{fs['namespace_uuid']}")
        assert host.check_output(f"readlink -f {dev}") == real
        assert "_netdev" in host.file("/etc/fstab").content_string


def test_o_direct_write_read_verified(host, inv):
    for fs in inv["initiator_filesystems"]:
        f = f"{fs['path']}/.kvlab-verify"
        cmd = (
            f"set -e; src=$(mktemp); head -c 16M /dev/urandom > $src; "
            f"dd if=$src of={f} bs=1M oflag=direct conv=fsync status=none; "
            f"a=$(sha256sum < $src); b=$(dd if={f} bs=1M iflag=direct status=none | sha256sum); "
            f'rm -f $src {f}; [ "$a" = "$b" ] && echo verified'
        )
        assert host.check_output(cmd) == "verified"


STORE_DEVICE = "/usr/bin/python3 - {paths} <<'PY'\n{script}\nPY"


def test_store_paths_on_their_namespaces(host, inv):
    """Each store folder lies under a mount that is exactly its NVMe-oF namespace (by the uuid the
    kernel reports for the mounted device), never the root disk; where the node serves no store
    (no kvlab_connector_store_paths), its mounts are checked the same way."""
    mounts = inv["store_namespaces"] or {fs["path"]: fs["namespace_uuid"] for fs in inv["initiator_filesystems"]}
    assert mounts, "no store namespace configured on an initiator"
    probe = (Path(__file__).resolve().parents[2] / "roles/kvlab_connector/files/kvlab-store-device").read_text()
    got = json.loads(host.check_output(STORE_DEVICE.format(paths=" ".join(mounts), script=probe)))
    for dev in got:
        assert dev["mounted"], f"nothing mounted at {dev['mountpoint']}"
        assert not dev["is_root_device"], f"{dev['mountpoint']} is on the root disk"
        assert dev["uuid"] == mounts[dev["mountpoint"]], dev
    for path in inv["store_paths"]:
        assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), f"{path} is under no store namespace"
        assert host.file(path).is_directory, f"{path} missing"
