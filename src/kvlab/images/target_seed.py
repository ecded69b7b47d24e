"""Write a seed into a copy of the target appliance's disk, from the host (the testbed's way in).

The seed partition is the GPT partition labelled kvlab-seed; its ext4 filesystem holds
nvmet.json (the nvmeof_target role's file, with the appliance's fabric: netdevs, rxe_links,
roce_lossless) and, optionally, ssh/authorized_keys (which turns SSH on). This module reads the GPT itself, makes the filesystem with mke2fs -d and
writes it over the partition of a qcow2 overlay with qemu-io, so the cached image is never touched.
"""

from __future__ import annotations

import struct
import subprocess
import tempfile
from pathlib import Path

from kvlab.images.target_disk import SEED_LABEL

SECTOR = 512


class SeedError(Exception):
    pass


def find_partition(disk: Path, label: str = SEED_LABEL) -> tuple[int, int]:
    """(offset, size) in bytes of the GPT partition named `label` in a raw disk image."""
    with disk.open("rb") as f:
        f.seek(SECTOR)
        hdr = f.read(92)
        if hdr[:8] != b"EFI PART":
            raise SeedError(f"{disk}: no GPT header")
        entries_lba, count, entry_size = struct.unpack_from("<QII", hdr, 72)
        f.seek(entries_lba * SECTOR)
        table = f.read(count * entry_size)
    for i in range(count):
        e = table[i * entry_size : (i + 1) * entry_size]
        if e[:16] == b"\0" * 16:
            continue
        first, last = struct.unpack_from("<QQ", e, 32)
        name = e[56:128].decode("utf-16-le").rstrip("\0")
        if name == label:
            return first * SECTOR, (last - first + 1) * SECTOR
    raise SeedError(f"{disk}: no partition labelled {label!r}")


def make_seed_fs(files: dict[str, bytes], size: int, out: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for rel, data in files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            p.chmod(0o600 if rel.startswith("ssh/") else 0o644)
        with out.open("wb") as f:
            f.truncate(size)
        subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-L", SEED_LABEL, "-d", d, str(out)], check=True)


def write_seed(base_disk: Path, overlay: Path, files: dict[str, bytes]) -> None:
    """Replace the seed partition's filesystem in `overlay` (a qcow2 over `base_disk`) with `files`."""
    offset, size = find_partition(base_disk)
    with tempfile.TemporaryDirectory() as d:
        fs = Path(d) / "seed.ext4"
        make_seed_fs(files, size, fs)
        res = subprocess.run(
            ["qemu-io", "-f", "qcow2", "-c", f"write -s {fs} {offset} {size}", str(overlay)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if res.returncode or "error" in (res.stdout + res.stderr).lower():
            raise SeedError(f"qemu-io could not write the seed into {overlay}: {res.stdout}{res.stderr}")
