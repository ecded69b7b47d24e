"""The target appliance's disk layout and seed writer, without building anything: the repart
definitions put the verity partitions where systemd-veritysetup looks for them, and the host-side
seed writer finds the seed partition in a GPT."""

from __future__ import annotations

import shutil
import struct
import uuid
import zlib
from pathlib import Path

import pytest

from kvlab.images import target, target_disk, target_seed

pytestmark = pytest.mark.unit

ROOTHASH = "80b64b922e75ef9bcb5abaedc938844a9d06893b17236d5634b59eb81962b9f6"


def test_verity_partition_uuids_are_the_roothash_halves():
    data, hashpart = target_disk.verity_uuids(ROOTHASH)
    assert data == "80b64b92-2e75-ef9b-cb5a-baedc938844a"
    assert hashpart == "9d06893b-1723-6d56-34b5-9eb81962b9f6"


def test_the_disk_definitions_copy_the_split_root_under_those_uuids():
    split = {"root": "/w/root.raw", "root-verity": "/w/verity.raw", "seed": "/w/seed.ext4"}
    defs = target_disk.stage2_definitions(ROOTHASH, split, 96, 32)
    assert "UUID=80b64b92-2e75-ef9b-cb5a-baedc938844a\nCopyBlocks=/w/root.raw" in defs["10-root.conf"]
    assert (
        "UUID=9d06893b-1723-6d56-34b5-9eb81962b9f6\nCopyBlocks=/w/verity.raw" in defs["20-root-verity.conf"]
    )
    assert f"Label={target_disk.SEED_LABEL}\nCopyBlocks=/w/seed.ext4" in defs["30-seed.conf"]
    assert "Type=esp" in defs["00-esp.conf"] and "CopyFiles=/EFI:/EFI" in defs["00-esp.conf"]


def test_roothash_must_be_reported_once():
    parts = [{"type": "root", "roothash": ROOTHASH}, {"type": "root-verity", "roothash": ROOTHASH}]
    assert target_disk.roothash_of(parts) == ROOTHASH
    with pytest.raises(Exception, match="no single roothash"):
        target_disk.roothash_of([{"type": "esp", "roothash": "-"}])


def _gpt(path: Path, parts: list[tuple[str, int, int]]) -> None:
    """A minimal GPT (header at LBA 1, 128 entries from LBA 2), enough for find_partition."""
    entries = b""
    for name, first, last in parts:
        e = uuid.uuid4().bytes_le + uuid.uuid4().bytes_le + struct.pack("<QQQ", first, last, 0)
        entries += e + name.encode("utf-16-le").ljust(72, b"\0")
    entries = entries.ljust(128 * 128, b"\0")
    hdr = b"EFI PART" + struct.pack("<IIII", 0x10000, 92, 0, 0) + struct.pack("<QQQQ", 1, 0, 34, 0)
    hdr += uuid.uuid4().bytes_le + struct.pack("<QIII", 2, 128, 128, zlib.crc32(entries))
    with path.open("wb") as f:
        f.truncate(4 << 20)
        f.seek(512)
        f.write(hdr)
        f.seek(1024)
        f.write(entries)


def test_find_partition_by_gpt_label(tmp_path):
    disk = tmp_path / "disk.raw"
    _gpt(disk, [("ESP", 2048, 4095), ("kvlab-seed", 4096, 8191)])
    assert target_seed.find_partition(disk) == (4096 * 512, 4096 * 512)
    with pytest.raises(target_seed.SeedError, match="no partition labelled 'nope'"):
        target_seed.find_partition(disk, "nope")


def test_find_partition_refuses_a_disk_without_gpt(tmp_path):
    disk = tmp_path / "blank.raw"
    disk.write_bytes(b"\0" * 4096)
    with pytest.raises(target_seed.SeedError, match="no GPT header"):
        target_seed.find_partition(disk)


@pytest.mark.skipif(
    not shutil.which("mke2fs") or not shutil.which("debugfs"), reason="e2fsprogs not installed"
)
def test_seed_filesystem_holds_the_files(tmp_path):
    import subprocess

    fs = tmp_path / "seed.ext4"
    target_seed.make_seed_fs(
        {"nvmet.json": b'{"hosts": []}\n', "ssh/authorized_keys": b"ssh-ed25519 AAAA x\n"}, 8 << 20, fs
    )
    out = subprocess.run(
        ["debugfs", "-R", "cat /nvmet.json", str(fs)], capture_output=True, text=True, check=True
    )
    assert out.stdout == '{"hosts": []}\n'
    stat = subprocess.run(
        ["debugfs", "-R", "stat /ssh/authorized_keys", str(fs)], capture_output=True, text=True
    )
    assert "Mode:  0600" in stat.stdout


def test_inputs_cover_the_definition_the_applier_and_the_builder():
    names = {p.name for p in target.inputs("")}
    assert {
        "image.yml",
        "packages.lock",
        "customize.sh",
        "kvlab-nvmet-apply",
        "target.py",
        "target_disk.py",
    } <= names
    assert "appliance" in names  # the role's marker, from the overlay


def test_a_secure_boot_key_inside_the_checkout_is_refused(monkeypatch, tmp_path):
    from kvlab import paths

    key = paths.repo_root() / "images" / "target" / "image.yml"  # any file in the checkout
    cert = tmp_path / "db.crt"
    cert.write_text("x")
    monkeypatch.setenv("KVLAB_SB_KEY", str(key))
    monkeypatch.setenv("KVLAB_SB_CERT", str(cert))
    with pytest.raises(Exception, match="must live outside the checkout"):
        target._signing()
    monkeypatch.delenv("KVLAB_SB_CERT")
    with pytest.raises(Exception, match="needs both KVLAB_SB_KEY and KVLAB_SB_CERT"):
        target._signing()
