"""Issue 23, finding 3: no drive exported twice, none in use.

Two namespaces on one drive make two nodes mount one filesystem: silent corruption of both
caches. The target's validator refuses it from the file alone (a path, a by-id alias, a serial
or a WWN naming one drive), naming both fields; the applier refuses it again once every device
is resolved (a serial and a WWN of one drive), and refuses a drive that this target mounts or
swaps on, that device mapper/md holds, that is partitioned, or that carries a signature other
than the filesystem its node makes on it, unless the seed says to take it."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
from test_nvmet_apply import HOST, config, load, run, snapshot
from test_nvmet_seed import seed, validate
from test_roles_plan import lab_plan  # noqa: F401  (lab_plan: the lab's plan, rendered once)

pytestmark = pytest.mark.unit

MODEL = "nvme-SAMSUNG_MZWLO7T6HBLA-00A07"


def twice(cfg: dict, device) -> dict:
    """cfg with subsystems[1].namespaces[0] on `device` (the copy-paste of a re-split)."""
    out = copy.deepcopy(cfg)
    out["subsystems"][1]["namespaces"][0]["device"] = device
    return out


def test_the_labs_seed_validates_and_exporting_a_drive_twice_is_refused(
    lab_plan: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cfg = json.loads((lab_plan / "nvmeof-01/etc/kvlab/nvmet.json").read_text())
    assert validate(tmp_path, cfg).returncode == 0
    first = cfg["subsystems"][0]["namespaces"][0]["device"]
    res = validate(tmp_path, twice(cfg, first))
    assert res.returncode == 2
    assert (
        f"subsystems[1].namespaces[0].device: {first} is also subsystems[0].namespaces[0].device: "
        "one drive exported twice" in res.stderr
    ), res.stderr
    # the namespace's filesystem is said, so that the target expects it on the drive
    assert {n["fstype"] for s in cfg["subsystems"] for n in s["namespaces"]} == {"xfs"}


# One drive named two ways in subsystems[0].namespaces[0] and subsystems[1].namespaces[0].
ALIASES = {
    "by-id path and serial": (f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001", {"serial": "S7MCNA0X100001"}, "serial S7MCNA0X100001"),
    "WWN and its by-id path": ({"wwn": "0x5002538F0000A104"}, "/dev/disk/by-id/wwn-0x5002538f0000a104", "/dev/disk/by-id/wwn-0x5002538f0000a104"),
    "EUI and its by-id path": ({"wwn": "eui.002538b431a0e3c1"}, "/dev/disk/by-id/nvme-eui.002538b431a0e3c1", "/dev/disk/by-id/nvme-eui.002538b431a0e3c1"),
    "a drive and its namespace's name": (f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001", f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001_1", f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001_1"),
    "a serial and its namespace's name": ({"serial": "S7MCNA0X100001"}, f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001_1", f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001_1"),
    "a partition and its whole drive": (f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001-part1", {"serial": "S7MCNA0X100001"}, "serial S7MCNA0X100001"),
    "one path twice": ("/dev/sdb", "/dev/../dev/sdb", "/dev/sdb"),
    "virtio serial": ("/dev/disk/by-id/virtio-kvlab-target-data0", {"serial": "kvlab-target-data0"}, "serial kvlab-target-data0"),
}  # fmt: skip


@pytest.mark.parametrize("case", ALIASES)
def test_one_drive_by_two_names_is_refused_naming_both(tmp_path: Path, case: str) -> None:
    first, second, what = ALIASES[case]
    cfg = seed()
    cfg["subsystems"][0]["namespaces"][0]["device"] = first
    res = validate(tmp_path, twice(cfg, second))
    assert res.returncode == 2
    assert (
        f"subsystems[1].namespaces[0].device: {what} is also subsystems[0].namespaces[0].device" in res.stderr
    ), res.stderr


def test_namespace_names_of_two_drives_are_two_drives(tmp_path: Path) -> None:
    """udev's <model>_<serial>_<nsid> names: the same nsid on two drives is no clash."""
    cfg = seed()
    cfg["subsystems"][0]["namespaces"][0]["device"] = f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001_1"
    assert validate(tmp_path, twice(cfg, f"/dev/disk/by-id/{MODEL}_S7MCNA0X100002_1")).returncode == 0


def test_two_partitions_of_a_drive_are_two_drives(tmp_path: Path) -> None:
    cfg = seed()
    cfg["subsystems"][0]["namespaces"][0]["device"] = f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001-part1"
    assert validate(tmp_path, twice(cfg, f"/dev/disk/by-id/{MODEL}_S7MCNA0X100001-part2")).returncode == 0


def test_one_drive_twice_in_one_subsystem_is_refused(tmp_path: Path) -> None:
    cfg = seed()
    cfg["subsystems"][0]["namespaces"].append({"nsid": 2, "device": {"serial": "S7MCNA0X100001"}})
    res = validate(tmp_path, cfg)
    assert (
        res.returncode == 2
        and "subsystems[0].namespaces[1].device: serial S7MCNA0X100001 is also" in res.stderr
    )


def test_an_unknown_filesystem_is_named(tmp_path: Path) -> None:
    cfg = seed()
    cfg["subsystems"][0]["namespaces"][0]["fstype"] = "btrfs"
    res = validate(tmp_path, cfg)
    assert (
        res.returncode == 2
        and 'subsystems[0].namespaces[0].fstype: "btrfs" is not one of xfs, ext4' in res.stderr
    )


# ---- at apply time: what the drives are, on the target ----------------------------------------


class Target:
    """A target's drives as the applier sees them: /dev/disk/by-id links, /sys/class/block, the
    mount table and swaps, and what blkid -p finds on each drive (the stand-in for the probe)."""

    def __init__(self, tmp: Path, mod, monkeypatch) -> None:
        self.tmp, self.mod = tmp, mod
        self.ids, self.sys, self.proc = tmp / "by-id", tmp / "sys/class/block", tmp / "proc"
        for d in (self.ids, self.sys, self.proc / "self", tmp / "dev"):
            d.mkdir(parents=True, exist_ok=True)
        (self.proc / "self/mountinfo").write_text("22 1 259:9 / / rw,relatime - ext4 /dev/nvme9n1p2 rw\n")
        (self.proc / "swaps").write_text("Filename Type Size Used Priority\n")
        self.signatures: dict[str, str] = {}
        monkeypatch.setattr(mod, "BY_ID", str(self.ids))
        monkeypatch.setattr(mod, "WAIT_S", 0)

        def fake_run(argv, **kw):
            if argv[0] == "blkid":
                found = self.signatures.get(Path(argv[-1]).name, "")
                return subprocess.CompletedProcess(argv, 0 if found else 2, found, "")
            return None

        monkeypatch.setattr(mod.subprocess, "run", fake_run)

    def drive(self, kernel: str, *names: str, devno: str = "259:0") -> Path:
        dev = self.tmp / "dev" / kernel
        dev.write_bytes(b"")
        (self.sys / kernel / "holders").mkdir(parents=True)
        (self.sys / kernel / "dev").write_text(devno + "\n")
        for name in names:
            (self.ids / name).symlink_to(dev)
        return dev


@pytest.fixture
def target(tmp_path, monkeypatch):
    mod, root = load(tmp_path, monkeypatch)
    t = Target(tmp_path, mod, monkeypatch)
    t.drive("nvme0n1", f"{MODEL}_S7MCNA0X100001", "wwn-0x5002538f0000a101", devno="259:0")
    t.drive("nvme1n1", f"{MODEL}_S7MCNA0X100002", devno="259:1")
    return mod, root, t


def two_subsystems(first, second) -> dict:
    cfg = config(Path("/unused"))
    cfg["subsystems"][0]["namespaces"][0] |= {"device": first, "fstype": "xfs"}
    sub = copy.deepcopy(cfg["subsystems"][0]) | {"nqn": "nqn.2026-01.io.kvlab.test:store1"}
    sub["namespaces"][0] |= {"device": second, "uuid": "7b3b6f6e-2c1a-4d6a-9e51-0a1b2c3d4e02"}
    cfg["subsystems"].append(sub)
    cfg["ports"][0]["subsystems"].append(sub["nqn"])
    return cfg


def nothing_applied(root: Path) -> bool:
    return snapshot(root, "subsystems") == snapshot(root, "ports") == snapshot(root, "hosts") == []


def test_a_serial_and_a_wwn_of_one_drive_are_refused_once_resolved(target, tmp_path, capsys) -> None:
    mod, root, _ = target
    cfg = two_subsystems({"serial": "S7MCNA0X100001"}, {"wwn": "0x5002538f0000a101"})
    assert mod.validate(cfg) == []  # the file alone cannot tell
    assert run(mod, tmp_path, cfg) == 1
    err = capsys.readouterr().err
    assert (
        "subsystems[1].namespaces[0].device: " in err
        and "as subsystems[0].namespaces[0].device is: one drive exported twice" in err
    )
    assert nothing_applied(root)


def test_blank_drives_and_the_nodes_own_filesystem_are_exported(target, tmp_path) -> None:
    mod, root, t = target
    t.signatures["nvme1n1"] = (
        "DEVNAME=/dev/nvme1n1\nUUID=0a1b\nTYPE=xfs\nUSAGE=filesystem\n"  # its node made it
    )
    assert run(mod, tmp_path, two_subsystems({"serial": "S7MCNA0X100001"}, {"serial": "S7MCNA0X100002"})) == 0
    assert (
        root / "subsystems/nqn.2026-01.io.kvlab.test:store1/namespaces/1/enable"
    ).read_text().strip() == "1"


IN_USE = {
    "mounted": (lambda t: (t.proc / "self/mountinfo").write_text(
        (t.proc / "self/mountinfo").read_text() + "40 22 259:1 / /srv/old rw,relatime - xfs /dev/nvme1n1 rw\n"),
        "mounted on this target at /srv/old", False),
    "swap": (lambda t: (t.proc / "swaps").write_text(
        "Filename Type Size Used Priority\n/dev/nvme1n1 partition 8388604 0 -2\n"),
        "in use as swap on this target", False),
    "held by device mapper": (lambda t: (t.sys / "nvme1n1/holders/dm-0").mkdir(),
                              "held by dm-0 (device mapper, md or bcache on this target)", False),
    "partitioned": (lambda t: ((t.sys / "nvme1n1/nvme1n1p1").mkdir(), (t.sys / "nvme1n1/nvme1n1p1/partition").write_text("1\n")),
                    "has partitions (nvme1n1p1)", True),
    "a partition table": (lambda t: t.signatures.__setitem__("nvme1n1", "PTUUID=ab\nPTTYPE=gpt\n"),
                          "carries PTTYPE=gpt, expected nothing or xfs, the filesystem its node makes", True),
    "another filesystem": (lambda t: t.signatures.__setitem__("nvme1n1", "TYPE=ext4\n"),
                           "carries TYPE=ext4, expected nothing or xfs", True),
    "an LVM physical volume": (lambda t: t.signatures.__setitem__("nvme1n1", "TYPE=LVM2_member\n"),
                               "carries TYPE=LVM2_member", True),
}  # fmt: skip


@pytest.mark.parametrize("case", IN_USE)
def test_a_drive_in_use_is_refused_and_nothing_exported(target, tmp_path, capsys, case) -> None:
    mod, root, t = target
    make, message, _ = IN_USE[case]
    make(t)
    assert run(mod, tmp_path, two_subsystems({"serial": "S7MCNA0X100001"}, {"serial": "S7MCNA0X100002"})) == 1
    err = capsys.readouterr().err
    assert f"subsystems[1].namespaces[0].device: {t.ids}/{MODEL}_S7MCNA0X100002: {message}" in err, err
    assert "nothing applied" in err and nothing_applied(root)


@pytest.mark.parametrize("case", IN_USE)
def test_take_accepts_what_it_holds_never_what_this_target_uses(target, tmp_path, case) -> None:
    mod, root, t = target
    make, _, takeable = IN_USE[case]
    make(t)
    cfg = two_subsystems({"serial": "S7MCNA0X100001"}, {"serial": "S7MCNA0X100002"})
    cfg["subsystems"][1]["namespaces"][0]["take"] = True
    assert run(mod, tmp_path, cfg) == (0 if takeable else 1)
    assert nothing_applied(root) is not takeable


def test_a_file_backed_namespace_is_not_a_drive(tmp_path, monkeypatch) -> None:
    """The testbed's and unit tests' files: no sysfs entry, nothing to probe."""
    mod, root = load(tmp_path, monkeypatch)
    Target(tmp_path, mod, monkeypatch).signatures["disk0"] = "TYPE=ext4\n"
    (tmp_path / "disk0").write_bytes(b"")
    assert run(mod, tmp_path, config(tmp_path / "disk0")) == 0
    assert (root / "hosts" / HOST).is_dir()
