"""roles/kvlab_connector's store-device probe: it answers for the exact mount point only.

The role once accepted `findmnt --target`, which names the root filesystem for a path where
nothing is mounted, so the KV store could fill the OS disk. The probe reads the mount table for
the exact mount point and the device's NVMe namespace uuid from sysfs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PROBE = Path(__file__).resolve().parents[2] / "roles/kvlab_connector/files/kvlab-store-device"
UUID = "7b3b6f6e-2c1a-4d6a-9e51-0a1b2c3d4e01"


def probe(tmp_path: Path, mountinfo: str, *paths: str) -> list[dict]:
    (tmp_path / "mountinfo").write_text(mountinfo)
    env = dict(os.environ, KVLAB_MOUNTINFO=str(tmp_path / "mountinfo"), KVLAB_SYSFS=str(tmp_path / "sys"))
    out = subprocess.run([sys.executable, str(PROBE), *paths], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    ns = tmp_path / "sys/devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1"
    ns.mkdir(parents=True)
    (ns / "uuid").write_text(UUID + "\n")
    (ns / "wwid").write_text("uuid." + UUID + "\n")
    root = tmp_path / "sys/devices/pci0000:00/0000:00:04.0/virtio1/block/vda/vda1"
    root.mkdir(parents=True)
    (tmp_path / "sys/dev/block").mkdir(parents=True)
    (tmp_path / "sys/dev/block/259:0").symlink_to(ns)
    (tmp_path / "sys/dev/block/254:1").symlink_to(root)
    return tmp_path


ROOT_ONLY = "21 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
WITH_STORE = ROOT_ONLY + "90 21 259:0 / /mnt/kvstore0 rw,noatime shared:40 - xfs /dev/nvme0n1 rw\n"


def test_an_unmounted_store_path_is_not_the_root_disk(sysfs):
    [got] = probe(sysfs, ROOT_ONLY, "/mnt/kvstore0")
    assert got == {"mountpoint": "/mnt/kvstore0", "mounted": False}


def test_the_namespace_mounted_there_is_named_by_its_uuid(sysfs):
    [got] = probe(sysfs, WITH_STORE, "/mnt/kvstore0/")
    assert got["mounted"] and got["device"] == "nvme0n1" and got["uuid"] == UUID
    assert got["fstype"] == "xfs" and got["is_root_device"] is False


def test_a_bind_of_the_root_disk_is_seen_as_the_root_device(sysfs):
    [got] = probe(sysfs, ROOT_ONLY + "91 21 254:1 /srv /mnt/kvstore0 rw - ext4 /dev/vda1 rw\n", "/mnt/kvstore0")
    assert got["mounted"] and got["is_root_device"] is True and got["uuid"] == ""
