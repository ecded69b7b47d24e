"""The target's configuration as a seed: kvlab-nvmet-apply --validate names every wrong field,
drives are found by serial or WWN at apply time, and an apply that fails half-way takes back
what it created (a wrong seed exports nothing). The role and the appliance share this code."""

from __future__ import annotations

import copy
import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_nvmet_apply import APPLY, HOST, OURS, THEIRS, config, load, run, snapshot, someone_elses

pytestmark = pytest.mark.unit

UUID2 = "7b3b6f6e-2c1a-4d6a-9e51-0a1b2c3d4e02"
HOST2 = "nqn.2014-08.org.nvmexpress:uuid:4f1d8a52-0c7e-4b7a-9a33-6b2c1e0d9f03"
SECOND = "nqn.2026-01.io.kvlab.test:store1"


def seed() -> dict:
    """A valid seed with every section: two subsystems, drives by serial and WWN, a secret, QoS."""
    return {
        "hosts": [{"nqn": HOST, "dhchap_key": "DHHC-1:00:ZmFrZS1rZXktbm90LWEtc2VjcmV0LTAwMDAwMDAwMDC8+9qF:"},
                  {"nqn": HOST2}],
        "subsystems": [
            {"nqn": OURS, "serial": "kvlab-store0", "allowed_hosts": [HOST],
             "namespaces": [{"nsid": 1, "device": {"serial": "S7MCNA0X100001"},
                             "uuid": "7b3b6f6e-2c1a-4d6a-9e51-0a1b2c3d4e01"}]},
            {"nqn": SECOND, "allowed_hosts": [HOST2],
             "namespaces": [{"nsid": 1, "device": {"wwn": "0x5002538f0000a104"}, "uuid": UUID2}]},
        ],
        "ports": [{"id": 1, "transport": "rdma", "family": "ipv4", "address": "10.77.0.1", "service": 4420,
                   "subsystems": [OURS, SECOND]}],
        "netdevs": [{"name": "eth1", "address": "10.77.0.1/24", "mtu": 9000}],
        "rxe_links": [{"name": "rxe0", "netdev": "eth1"}],
        "roce_lossless": {"enabled": True, "trust": "dscp", "dscp": 26, "pfc_priority": 3, "ecn": True},
    }  # fmt: skip


def validate(tmp_path: Path, cfg) -> subprocess.CompletedProcess:
    """The applier as the boot's validator unit and the role run it: a process on a file."""
    path = tmp_path / "nvmet.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return subprocess.run(
        [sys.executable, str(APPLY), "--validate", str(path)], capture_output=True, text=True
    )


def test_a_full_seed_is_valid(tmp_path):
    res = validate(tmp_path, seed())
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("valid")


def broken(edit) -> dict:
    cfg = seed()
    edit(cfg)
    return cfg


# One wrong field each: the message names its path and what is wrong.
BROKEN = {
    "malformed allowed host": (
        lambda c: c["subsystems"][1]["allowed_hosts"].__setitem__(0, "x"),
        'subsystems[1].allowed_hosts[0]: "x" is not an NQN (nqn.YYYY-MM.reverse.domain:...',
    ),
    "malformed subsystem NQN": (
        lambda c: (c["subsystems"][0].__setitem__("nqn", "nqn.2026-13.io.kvlab:s"),
                   c["ports"][0]["subsystems"].__setitem__(0, "nqn.2026-13.io.kvlab:s")),
        'subsystems[0].nqn: "nqn.2026-13.io.kvlab:s" is not an NQN',
    ),
    "empty allowlist": (
        lambda c: c["subsystems"][0].__setitem__("allowed_hosts", []),
        "subsystems[0].allowed_hosts: empty (hosts are never allowed by default",
    ),
    "allowed host without a host entry": (
        lambda c: c["hosts"].pop(1),
        f'subsystems[1].allowed_hosts[0]: "{HOST2}" is not in hosts',
    ),
    "no namespaces": (
        lambda c: c["subsystems"][0].__setitem__("namespaces", []),
        "subsystems[0].namespaces: empty",
    ),
    "relative device": (
        lambda c: c["subsystems"][0]["namespaces"][0].__setitem__("device", "nvme0n1"),
        'subsystems[0].namespaces[0].device: "nvme0n1" is not an absolute path',
    ),
    "device by something else": (
        lambda c: c["subsystems"][0]["namespaces"][0].__setitem__("device", {"model": "X"}),
        "subsystems[0].namespaces[0].device: {\"model\": \"X\"} must be",
    ),
    "a file's size on a drive": (
        lambda c: c["subsystems"][0]["namespaces"][0].__setitem__("size_mib", 64),
        "subsystems[0].namespaces[0].size_mib: creates a file, so device must be its path",
    ),
    "duplicate nsid": (
        lambda c: c["subsystems"][0]["namespaces"].append({"nsid": 1, "device": "/dev/sdb"}),
        "subsystems[0].namespaces[1].nsid: 1 is also subsystems[0].namespaces[0].nsid",
    ),
    "duplicate uuid": (
        lambda c: c["subsystems"][1]["namespaces"][0].__setitem__("uuid", c["subsystems"][0]["namespaces"][0]["uuid"]),
        "subsystems[1].namespaces[0].uuid: 7b3b6f6e-2c1a-4d6a-9e51-0a1b2c3d4e01 is also subsystems[0].namespaces[0].uuid",
    ),
    "bad uuid": (
        lambda c: c["subsystems"][0]["namespaces"][0].__setitem__("uuid", "1234"),
        'subsystems[0].namespaces[0].uuid: "1234" is not a UUID',
    ),
    "serial too long": (
        lambda c: c["subsystems"][0].__setitem__("serial", "s" * 21),
        "subsystems[0].serial:",
    ),
    "nsid as a string": (
        lambda c: c["subsystems"][0]["namespaces"][0].__setitem__("nsid", "1"),
        'subsystems[0].namespaces[0].nsid: must be an integer, not "1"',
    ),
    "typo in a key": (
        lambda c: c["subsystems"][0].__setitem__("allowed_host", [HOST]),
        "subsystems[0].allowed_host: unknown key",
    ),
    "typo at the top": (
        lambda c: c.__setitem__("port", []),
        "port: unknown key",
    ),
    "unknown transport": (
        lambda c: c["ports"][0].__setitem__("transport", "fc"),
        'ports[0].transport: "fc" is not one of rdma, tcp',
    ),
    "port of an unknown subsystem": (
        lambda c: c["ports"][0]["subsystems"].append("nqn.2026-01.io.kvlab.test:nope"),
        'ports[0].subsystems[2]: "nqn.2026-01.io.kvlab.test:nope" is not the nqn of one of subsystems',
    ),
    "address not an IP": (
        lambda c: c["ports"][0].__setitem__("address", "target.lab"),
        'ports[0].address: "target.lab" is not an IP address',
    ),
    "address of the other family": (
        lambda c: c["ports"][0].__setitem__("family", "ipv6"),
        "ports[0].address: 10.77.0.1 is not an ipv6 address",
    ),
    "service out of range": (
        lambda c: c["ports"][0].__setitem__("service", 70000),
        "ports[0].service: 70000 is out of range 1-65535",
    ),
    "two ports on one address": (
        lambda c: c["ports"].append(dict(c["ports"][0], id=2)),
        "ports[1]: listens where ports[0] does (rdma 10.77.0.1:4420)",
    ),
    "not a DH-HMAC-CHAP secret": (
        lambda c: c["hosts"][0].__setitem__("dhchap_key", "hunter2"),
        "hosts[0].dhchap_key: not a DH-HMAC-CHAP secret",
    ),
    "unknown hash": (
        lambda c: c["hosts"][0].__setitem__("dhchap_hash", "md5"),
        'hosts[0].dhchap_hash: "md5" is not one of',
    ),
    "netdev address without prefix": (
        lambda c: c["netdevs"][0].__setitem__("address", "10.77.0.1"),
        'netdevs[0].address: "10.77.0.1" is not an address in CIDR form',
    ),
    "PFC priority out of range": (
        lambda c: c["roce_lossless"].__setitem__("pfc_priority", 8),
        "roce_lossless.pfc_priority: 8 is out of range 0-7",
    ),
    "DSCP out of range": (
        lambda c: c["roce_lossless"].__setitem__("dscp", 64),
        "roce_lossless.dscp: 64 is out of range 0-63",
    ),
    "QoS on no device": (
        lambda c: c.pop("netdevs"),
        "roce_lossless.devices: empty and no netdevs",
    ),
    "nothing to export": (
        lambda c: (c.__setitem__("subsystems", []), c.__setitem__("ports", [])),
        "subsystems: empty, so this target would export nothing",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BROKEN)
def test_a_wrong_field_is_named(tmp_path, case):
    edit, message = BROKEN[case]
    res = validate(tmp_path, broken(edit))
    assert res.returncode == 2, res.stdout
    assert message in res.stderr, res.stderr
    assert "1 error(s): nothing will be exported" in res.stderr


def test_every_error_is_reported_not_just_the_first(tmp_path):
    cfg = broken(lambda c: (c["subsystems"][1]["allowed_hosts"].__setitem__(0, "x"),
                            c["ports"][0].__setitem__("transport", "fc"),
                            c["roce_lossless"].__setitem__("dscp", 64)))  # fmt: skip
    res = validate(tmp_path, cfg)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if not ln.endswith("nothing will be exported from it")]
    assert [ln.split(": ", 2)[2].split(":")[0] for ln in lines] == [
        "subsystems[1].allowed_hosts[0]", "ports[0].transport", "roce_lossless.dscp"
    ]  # fmt: skip


def test_a_secret_is_never_echoed(tmp_path):
    res = validate(tmp_path, broken(lambda c: c["hosts"][0].__setitem__("dhchap_key", "DHHC-1:00:c2VjcmV0")))
    assert res.returncode == 2 and "c2VjcmV0" not in res.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON: line 1 column 2"),
        ("[]", "the file: must be an object"),
        ('{"hosts": []}', "subsystems: missing"),
    ],
)
def test_a_file_that_is_not_a_configuration(tmp_path, text, message):
    res = validate(tmp_path, text)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_the_roles_rendering_is_valid(tmp_path):
    """What the role renders for the testbed today (a path device, no QoS) passes unchanged."""
    assert validate(tmp_path, config(tmp_path / "disk0")).returncode == 0


# ---- drives by serial or WWN, at apply time --------------------------------------------------


@pytest.fixture
def by_id(tmp_path, monkeypatch):
    """A /dev/disk/by-id: two NVMe drives (each also by its namespace and WWN) and a partition."""
    mod, root = load(tmp_path, monkeypatch)
    devs, ids = tmp_path / "dev", tmp_path / "by-id"
    devs.mkdir()
    ids.mkdir()
    for kernel, names in {
        "nvme0n1": ["nvme-SAMSUNG_MZWLO7T6HBLA-00A07_S7MCNA0X100001", "nvme-eui.002538b431a0e3c1"],
        "nvme1n1": ["nvme-SAMSUNG_MZWLO7T6HBLA-00A07_S7MCNA0X100002", "wwn-0x5002538f0000a104"],
        "nvme1n1p1": ["nvme-SAMSUNG_MZWLO7T6HBLA-00A07_S7MCNA0X100002-part1"],
        "vda": ["virtio-kvlab-target-data0"],
    }.items():
        (devs / kernel).write_bytes(b"")
        for name in names:
            (ids / name).symlink_to(f"../dev/{kernel}")
    monkeypatch.setattr(mod, "BY_ID", str(ids))
    monkeypatch.setattr(mod, "WAIT_S", 0)
    return mod, root, ids


@pytest.mark.parametrize(
    ("device", "name"),
    [
        ({"serial": "S7MCNA0X100002"}, "nvme-SAMSUNG_MZWLO7T6HBLA-00A07_S7MCNA0X100002"),
        ({"wwn": "0x5002538f0000a104"}, "wwn-0x5002538f0000a104"),
        ({"wwn": "eui.002538b431a0e3c1"}, "nvme-eui.002538b431a0e3c1"),
        ({"serial": "kvlab-target-data0"}, "virtio-kvlab-target-data0"),
    ],
)
def test_a_drive_is_found_by_serial_or_wwn(by_id, tmp_path, device, name):
    mod, root, ids = by_id
    cfg = config(Path("/unused"))
    cfg["subsystems"][0]["namespaces"][0]["device"] = device
    assert run(mod, tmp_path, cfg) == 0
    # nvmet gets the stable by-id name, never a kernel name that can change at boot
    assert (root / "subsystems" / OURS / "namespaces/1/device_path").read_text() == str(ids / name)
    assert run(mod, tmp_path, None, "--check") == 0


def test_an_unknown_drive_names_the_field_and_exports_nothing(by_id, tmp_path, capsys):
    mod, root, _ = by_id
    cfg = config(Path("/unused"))
    cfg["subsystems"][0]["namespaces"][0]["device"] = {"serial": "NOSUCHSERIAL"}
    assert run(mod, tmp_path, cfg) == 1
    err = capsys.readouterr().err
    assert "subsystems[0].namespaces[0].device.serial: no drive with serial NOSUCHSERIAL in" in err
    assert "nothing applied" in err
    assert snapshot(root, "subsystems") == snapshot(root, "ports") == snapshot(root, "hosts") == []


# ---- a failed apply takes back what it created -------------------------------------------------


def failing_write(mod, monkeypatch, suffix: str):
    """The kernel refuses one write (as it refuses to enable a namespace on a busy device)."""
    real, failed = mod.Applier.fs_write, []

    def write(path, value):
        if path.endswith(suffix) and (str(value) == "1" or not suffix.endswith("enable")) and not failed:
            failed.append(path)  # once: writing the old value back is allowed
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        real(path, value)

    monkeypatch.setattr(mod.Applier, "fs_write", staticmethod(write))


def kvlabs(root: Path) -> list[str]:
    """Every configfs path that is not the other user's."""
    return [p for d in ("subsystems", "ports", "hosts") for p in snapshot(root, d)
            if not p.startswith(("ports/7", f"subsystems/{THEIRS}", "hosts/nqn.2020-01"))]  # fmt: skip


@pytest.mark.parametrize(
    ("suffix", "field"),
    [
        (
            f"{SECOND}/namespaces/1/enable",
            "subsystems[1].namespaces[0]",
        ),  # after the first subsystem is built
        (f"{SECOND}/attr_serial", "subsystems[1]"),
        ("ports/1/addr_trsvcid", "ports[0]"),  # both subsystems built, the port half-way
    ],
)
def test_a_failure_half_way_leaves_nothing_of_kvlabs(tmp_path, monkeypatch, capsys, suffix, field):
    mod, root = load(tmp_path, monkeypatch)
    device = tmp_path / "disk0"
    device.write_bytes(b"")
    someone_elses(mod, root, device)
    theirs = {d: snapshot(root, d) for d in ("subsystems", "ports", "hosts")}
    cfg = config(device)
    cfg["subsystems"].append(copy.deepcopy(cfg["subsystems"][0]) | {"nqn": SECOND})
    (tmp_path / "disk1").write_bytes(b"")
    cfg["subsystems"][1]["namespaces"][0] |= {"uuid": UUID2, "device": str(tmp_path / "disk1")}
    failing_write(mod, monkeypatch, suffix)
    assert run(mod, tmp_path, cfg) == 1
    err = capsys.readouterr().err
    assert f"{field}: [Errno 16] Device or resource busy" in err
    assert "what this run created is removed" in err and "could not take back" not in err
    assert kvlabs(root) == []
    assert {d: snapshot(root, d) for d in theirs} == theirs
    # the mark says what is there: nothing of kvlab's
    assert json.loads((tmp_path / "state/nvmet-owned.json").read_text()) == {
        "subsystems": [],
        "ports": [],
        "hosts": [],
    }


def test_a_failed_change_keeps_what_was_exported(tmp_path, monkeypatch):
    """On a live target, a change that fails leaves the subsystems that were there as they were."""
    mod, root = load(tmp_path, monkeypatch)
    device = tmp_path / "disk0"
    device.write_bytes(b"")
    assert run(mod, tmp_path, config(device)) == 0
    before = kvlabs(root)
    path_before = (root / "subsystems" / OURS / "namespaces/1/device_path").read_text()
    other = tmp_path / "disk1"
    other.write_bytes(b"")
    cfg = config(other)  # the same subsystem, moved to another drive
    cfg["hosts"].append({"nqn": HOST2})
    cfg["subsystems"][0]["allowed_hosts"].append(HOST2)
    failing_write(mod, monkeypatch, f"{OURS}/namespaces/1/enable")
    assert run(mod, tmp_path, cfg) == 1
    assert kvlabs(root) == before
    assert (root / "subsystems" / OURS / "namespaces/1/device_path").read_text() == path_before
    assert (root / "subsystems" / OURS / "namespaces/1/enable").read_text().strip() == "1"
    owned = json.loads((tmp_path / "state/nvmet-owned.json").read_text())
    assert owned == {"subsystems": [OURS], "ports": ["1"], "hosts": [HOST]}


# The seed's fabric (netdevs, soft-RoCE links, RoCE QoS on both RDMA stacks): test_lab_fabric_qos.py.
