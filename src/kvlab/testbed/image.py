"""The testbed VM image: a pinned definition in images/testbed, built reproducibly.

Build: kvlab.images.debian installs exactly the packages of packages.lock (each .deb checked
against its sha256) and applies the overlay and customize.sh, removing everything that differs
between builds; then `mke2fs -d` writes an ext4 root filesystem with a fixed UUID, hash seed and
clock (SOURCE_DATE_EPOCH; a small LD_PRELOAD shim clamps the atime/ctime that mke2fs copies from
the unpacked tree). The kernel and initrd are taken out of the tree so that qemu boots them
directly: no bootloader, no partition table.

This module is the "testbed" builder of kvlab.images.build, which stores the image outside the
checkout at `cache_dir()/images/testbed-<identity>/`; the identity covers every file of the
definition, this builder and kvlab.images.debian, and the versions of the host tools they run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kvlab import paths
from kvlab.images import ImageError, debian
from kvlab.images.identity import Built, files_under

# Bumped when the build procedure changes in a way the hashed files do not show.
BUILDER_VERSION = "2"
IMAGE_FILES = ("disk.raw", "vmlinuz", "initrd.img")
HOST_TOOLS = (*debian.HOST_TOOLS, ["mke2fs", "-V"], ["cc", "--version"])

# The builder interface of kvlab.images.build (registered there as "testbed").
FLAVORS = ("",)


def definition_root(name: str = "testbed") -> Path:
    return paths.repo_root() / "images" / name


def inputs(flavor: str) -> list[Path]:
    """The definition folder, the shared image tools, this builder and the Debian tree code."""
    root = definition_root()
    return [*debian.inputs(root), *files_under(root.parent / "tools"), Path(__file__)]


def tools(flavor: str) -> str:
    return f"builder {BUILDER_VERSION}\n{debian.tools_fingerprint(HOST_TOOLS)}"


def repin(flavor: str, log) -> Path:
    return debian.repin(debian.Definition.load(definition_root(), with_lock=False), log)


def _mkfs(defn: debian.Definition, work: Path, rootfs: Path, disk: Path) -> None:
    tools_dir = defn.root.parent / "tools"
    shim = work / "clamp_stat.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(tools_dir / "clamp_stat.c"), "-ldl"],
        check=True,
    )
    with disk.open("wb") as f:
        f.truncate(int(defn.field("size_mib")) * 1024 * 1024)
    mkfs_env = dict(
        debian.env(defn),
        LD_PRELOAD=str(shim),
        E2FSPROGS_FAKE_TIME=str(defn.source_date_epoch),
        MKE2FS_CONFIG=str(tools_dir / "mke2fs.conf"),
    )
    seed = defn.field("hash_seed")
    subprocess.run(
        ["mke2fs", "-q", "-F", "-t", "ext4", "-L", "kvlab-root", "-U", defn.field("filesystem_uuid"),
         "-E", f"hash_seed={seed},lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0",
         "-d", str(rootfs), str(disk)],
        env=mkfs_env, check=True,
    )  # fmt: skip


def build(flavor: str, work: Path, log) -> Built:
    """Build the image into `work` (the orchestrator stores it under its identity)."""
    defn = debian.Definition.load(definition_root())
    tree = debian.rootfs(defn, work, log)
    try:
        boot = tree.path / "boot"
        kernels = sorted(boot.glob("vmlinuz-*"))
        initrds = sorted(boot.glob("initrd.img-*"))
        if len(kernels) != 1 or len(initrds) != 1:
            raise ImageError(f"expected one kernel and one initrd in /boot, found {kernels + initrds}")
        out = work / "out"
        out.mkdir()
        shutil.copyfile(kernels[0], out / "vmlinuz")
        shutil.copyfile(initrds[0], out / "initrd.img")
        log("writing the ext4 root filesystem")
        _mkfs(defn, work, tree.path, out / "disk.raw")
    finally:
        shutil.rmtree(tree.path, ignore_errors=True)
    return Built(
        artifact=out / "disk.raw",
        files={f: out / f for f in IMAGE_FILES},
        components=tree.components,
        meta={"kernel": kernels[0].name.removeprefix("vmlinuz-"), "release": defn.release},
    )
