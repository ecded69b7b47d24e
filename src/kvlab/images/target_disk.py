"""The appliance's disk, laid out by systemd-repart (in the tools tree) from the finished rootfs.

Two repart runs, both --offline with the fixed --seed and SOURCE_DATE_EPOCH:
1. the erofs root and its dm-verity hash tree, split into two files, which gives the roothash;
2. the disk: ESP (the UKI, whose command line carries that roothash, as the default EFI boot
   path), the root and verity partitions copied block for block from run 1 under the partition
   UUIDs that systemd-veritysetup derives from the roothash, and the writable seed partition.
The UKI must hold the roothash and the ESP must hold the UKI, so the root cannot be laid out in
the same run as the ESP; copying its blocks keeps the erofs built once.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import uuid
from pathlib import Path

from kvlab.images import ImageError

SEED_LABEL = "kvlab-seed"
UKI_PATH = "EFI/BOOT/BOOTX64.EFI"  # the removable-media default boot path: no NVRAM entry needed


def stage1_definitions() -> dict[str, str]:
    return {
        "10-root.conf": "[Partition]\nType=root\nLabel=kvlab-root\nFormat=erofs\nCopyFiles=/\n"
        "Verity=data\nVerityMatchKey=root\nMinimize=best\nSplitName=root\n",
        "20-root-verity.conf": "[Partition]\nType=root-verity\nLabel=kvlab-root-verity\n"
        "Verity=hash\nVerityMatchKey=root\nMinimize=best\nSplitName=root-verity\n",
    }


def verity_uuids(roothash: str) -> tuple[str, str]:
    """The partition UUIDs that systemd-veritysetup-generator looks for: the roothash's first and last 128 bits."""
    return str(uuid.UUID(roothash[:32])), str(uuid.UUID(roothash[-32:]))


def stage2_definitions(roothash: str, split: dict[str, str], esp_mib: int, seed_mib: int) -> dict[str, str]:
    data_uuid, hash_uuid = verity_uuids(roothash)
    return {
        "00-esp.conf": f"[Partition]\nType=esp\nLabel=ESP\nFormat=vfat\nCopyFiles=/EFI:/EFI\n"
        f"SizeMinBytes={esp_mib}M\nSizeMaxBytes={esp_mib}M\n",
        "10-root.conf": f"[Partition]\nType=root\nLabel=kvlab-root\nUUID={data_uuid}\nCopyBlocks={split['root']}\n",
        "20-root-verity.conf": f"[Partition]\nType=root-verity\nLabel=kvlab-root-verity\nUUID={hash_uuid}\n"
        f"CopyBlocks={split['root-verity']}\n",
        # repart's own ext4 has a random directory-hash seed: the seed filesystem is made by
        # seed_filesystem_command (fixed UUID, hash seed and clock) and copied block for block
        "30-seed.conf": f"[Partition]\nType=linux-generic\nLabel={SEED_LABEL}\nCopyBlocks={split['seed']}\n"
        f"SizeMinBytes={seed_mib}M\nSizeMaxBytes={seed_mib}M\n",
    }


def seed_filesystem_command(path: str, repart_seed: str, seed_mib: int) -> list[str]:
    """mke2fs for the empty seed partition, every random field fixed (UUIDs from the repart seed;
    the clock from E2FSPROGS_FAKE_TIME in the environment)."""
    base = uuid.UUID(repart_seed)
    fs_uuid, hash_seed = uuid.uuid5(base, "kvlab-seed"), uuid.uuid5(base, "kvlab-seed-hash")
    return ["mke2fs", "-q", "-F", "-t", "ext4", "-L", SEED_LABEL, "-U", str(fs_uuid),
            "-E", f"hash_seed={hash_seed},lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0",
            path, f"{seed_mib}M"]  # fmt: skip


def write_definitions(folder: Path, defs: dict[str, str]) -> None:
    folder.mkdir(parents=True)
    for name, text in defs.items():
        (folder / name).write_text(text)


def repart(chroot: list[str], args: list[str], env: dict[str, str], log_file: Path) -> list[dict]:
    # 512-byte sectors: for an image file repart's default gave the ESP's FAT 4096-byte sectors,
    # which OVMF cannot read from a 512-byte disk ("failed to load Boot0001 ... Not Found")
    cmd = [*chroot, "systemd-repart", "--offline=yes", "--dry-run=no", "--json=short", "--no-pager",
           "--sector-size=512", *args]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    with log_file.open("a") as f:
        f.write(f"$ {shlex.join(cmd)}\n{res.stderr}\n{res.stdout}\n")
    if res.returncode:
        tail = "\n".join(res.stderr.splitlines()[-10:])
        raise ImageError(f"systemd-repart failed (log {log_file}):\n{tail}")
    return json.loads(res.stdout)


def roothash_of(parts: list[dict]) -> str:
    hashes = {p.get("roothash") for p in parts if p.get("roothash") and p.get("roothash") != "-"}
    if len(hashes) != 1:
        raise ImageError(f"systemd-repart reported no single roothash ({parts})")
    return hashes.pop()
