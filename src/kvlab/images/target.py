"""The storage-target appliance image (images/target): a UEFI disk with a verified read-only root.

rootfs: kvlab.images.debian installs exactly packages.lock (each .deb checked against its sha256,
from the hash-keyed cache), the overlay goes in, customize.sh enables the boot units and makes the
initrd with dracut (a systemd initrd with systemd-veritysetup), the shared applier
(roles/nvmeof_target/files/kvlab-nvmet-apply, as /usr/libexec/kvlab/) is copied in, the tree is
normalised (keys, IDs, logs) and every file time is clamped to SOURCE_DATE_EPOCH. disk: kvlab.images.target_disk, run in the pinned trixie
tools tree (kvlab.images.target_tools). Secure Boot: with KVLAB_SB_KEY and KVLAB_SB_CERT (make
variables SB_KEY, SB_CERT; files outside the checkout) ukify signs the UKI; the certificate's hash
enters tools(), so a signed build has its own identity.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from kvlab import paths
from kvlab.images import ImageError, debian, target_disk, target_tools
from kvlab.images.identity import Built, sha256_file

FLAVORS = ("",)
ARTIFACT = "disk.raw"
# mmdebstrap's variant for the root: the Essential set and the lock, no apt (nothing installs
# packages on a read-only appliance)
VARIANT = "essential"


def definition_root() -> Path:
    return paths.repo_root() / "images" / "target"


def _shipped_scripts() -> dict[str, Path]:
    """Files of the roles that the appliance runs as they are: one applier for role and appliance."""
    repo = paths.repo_root()
    return {
        "usr/libexec/kvlab/kvlab-nvmet-apply": repo / "roles/nvmeof_target/files/kvlab-nvmet-apply",
    }


def inputs(flavor: str = "") -> list[Path]:
    own = sorted(Path(__file__).parent.glob("target*.py"))
    return [*debian.inputs(definition_root()), *_shipped_scripts().values(), *own]


def _signing() -> tuple[Path, Path] | None:
    key, cert = os.environ.get("KVLAB_SB_KEY"), os.environ.get("KVLAB_SB_CERT")
    if not key and not cert:
        return None
    if not (key and cert):
        raise ImageError(
            "Secure Boot signing needs both KVLAB_SB_KEY and KVLAB_SB_CERT (make SB_KEY=... SB_CERT=...)"
        )
    k, c = Path(key).resolve(), Path(cert).resolve()
    for p in (k, c):
        if not p.is_file():
            raise ImageError(f"{p}: no such file (KVLAB_SB_KEY/KVLAB_SB_CERT)")
        if p.is_relative_to(paths.repo_root()):
            raise ImageError(f"{p}: a Secure Boot key or certificate must live outside the checkout")
    return k, c


def tools(flavor: str = "") -> str:
    out = [target_tools.fingerprint(), debian.tools_fingerprint()]
    signing = _signing()
    if signing:
        out.append(f"secureboot-cert sha256:{sha256_file(signing[1])}")
    return "\n".join(out)


def _clamp_times(root: Path, epoch: int) -> None:
    """Files made during the build (initrd, byte-code, units' links) carry the build's clock."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            if os.lstat(p).st_mtime > epoch:
                os.utime(p, (epoch, epoch), follow_symlinks=False)
    os.utime(root, (epoch, epoch))


def repin(flavor: str, log: Callable[[str], None]) -> Path:
    """Re-pin the appliance's lock (essential variant: the appliance has no apt) and the lock of
    the tools tree that builds it, which has no image name of its own."""
    target_tools.repin(log)
    return debian.repin(debian.Definition.load(definition_root(), with_lock=False), log, variant=VARIANT)


def _stage_shipped(work: Path) -> Path:
    """The shipped role scripts (0755), in a folder that a copy-in hook puts into the tree."""
    staged = work / "shipped"
    for dest, src in _shipped_scripts().items():
        (staged / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, staged / dest)
        os.chmod(staged / dest, 0o755)
    for dirpath, _dirs, _names in os.walk(staged):
        os.chmod(dirpath, 0o755)  # whatever the umask: modes are bytes of the image
    return staged


def _kernel_version(defn: debian.Definition) -> str:
    kvers = [n for n in defn.lock if n.startswith("linux-image-") and n != "linux-image-amd64"]
    if len(kvers) != 1:
        raise ImageError(
            f"{defn.root / debian.LOCK_FILE}: expected one linux-image-<version> package, found {len(kvers)}"
        )
    return kvers[0].removeprefix("linux-image-")


def _rootfs(defn: debian.Definition, work: Path, log: Callable[[str], None]) -> tuple[debian.Tree, str]:
    kver = _kernel_version(defn)
    customize_env = {
        "KVLAB_KVER": kver,
        "KVLAB_INITRD_MODULES": " ".join(defn.field("initrd_modules")),
        "KVLAB_INITRD_DRIVERS": " ".join(defn.field("initrd_drivers")),
        "SOURCE_DATE_EPOCH": str(defn.source_date_epoch),
    }
    tree = debian.rootfs(
        defn,
        work,
        log,
        hooks=[f"copy-in {_stage_shipped(work)}/. /"],
        customize_env=customize_env,
        variant=VARIANT,
    )
    os.chmod(tree.path, 0o755)
    _clamp_times(tree.path, defn.source_date_epoch)
    return tree, kver


def build(flavor: str, work: Path, log: Callable[[str], None]) -> Built:
    try:
        return _build(work, log)
    finally:
        debian.unmount_under(work)  # what an interrupted mmdebstrap left mounted
        shutil.rmtree(work / "rootfs", ignore_errors=True)


def _build(work: Path, log: Callable[[str], None]) -> Built:
    defn = debian.Definition.load(definition_root())
    raw = defn.spec
    signing = _signing()
    tree = target_tools.ensure(log)
    root_tree, kver = _rootfs(defn, work, log)
    rootfs = root_tree.path
    # the kernel and initrd travel in the UKI; the root keeps no second copy of them
    boot = work / "boot"
    boot.mkdir()
    shutil.move(rootfs / "boot" / f"vmlinuz-{kver}", boot / "vmlinuz")
    shutil.move(rootfs / "boot" / f"initrd.img-{kver}", boot / "initrd.img")
    out = work / "out"
    out.mkdir()
    env = dict(
        os.environ,
        SOURCE_DATE_EPOCH=str(defn.source_date_epoch),
        # mke2fs (the seed partition) takes its superblock times from this, not from SOURCE_DATE_EPOCH
        E2FSPROGS_FAKE_TIME=str(defn.source_date_epoch),
        LC_ALL="C.UTF-8",
        TZ="UTC",
    )
    w = target_tools.WORK_IN_TREE
    repart_log = work / "repart.log"
    with target_tools.chroot(tree, work) as chroot:
        log("disk 1/2: erofs root + dm-verity (systemd-repart)")
        target_disk.write_definitions(work / "repart-root", target_disk.stage1_definitions())
        parts = target_disk.repart(
            chroot,
            ["--empty=create", "--size=auto", f"--seed={raw['repart_seed']}", f"--copy-source={w}/rootfs",
             f"--definitions={w}/repart-root", "--split=yes", f"{w}/root-stage.raw"],
            env, repart_log,
        )  # fmt: skip
        roothash = target_disk.roothash_of(parts)
        split = {"root": f"{w}/root-stage.root.raw", "root-verity": f"{w}/root-stage.root-verity.raw"}
        for name in split.values():
            if not (work / Path(name).relative_to(w)).exists():
                raise ImageError(f"systemd-repart wrote no {name} (log {repart_log})")
        log(f"UKI (ukify), roothash {roothash[:16]}...")
        cmdline = f"roothash={roothash} {' '.join(raw['cmdline'].split())}"
        esp = work / "esp" / "EFI" / "BOOT"
        esp.mkdir(parents=True)
        uki_cmd = [
            *chroot, "ukify", "build", f"--linux={w}/boot/vmlinuz", f"--initrd={w}/boot/initrd.img",
            f"--cmdline={cmdline}", f"--os-release=@{w}/rootfs/usr/lib/os-release", f"--uname={kver}",
            "--stub=/usr/lib/systemd/boot/efi/linuxx64.efi.stub", f"--output={w}/esp/{target_disk.UKI_PATH}",
        ]  # fmt: skip
        if signing:
            keys = work / "sb"
            keys.mkdir(mode=0o700)
            shutil.copyfile(signing[0], keys / "db.key")
            shutil.copyfile(signing[1], keys / "db.crt")
            uki_cmd += ["--signtool=sbsign", f"--secureboot-private-key={w}/sb/db.key",
                        f"--secureboot-certificate={w}/sb/db.crt"]  # fmt: skip
        try:
            res = subprocess.run(uki_cmd, env=env, capture_output=True, text=True, check=False)
        finally:
            shutil.rmtree(work / "sb", ignore_errors=True)
        if res.returncode:
            raise ImageError(f"ukify failed: {res.stderr.strip()[-800:]}")
        _clamp_times(work / "esp", defn.source_date_epoch)
        split["seed"] = f"{w}/seed.ext4"
        seed_mib = int(raw["seed_partition_mib"])
        res = subprocess.run(
            [*chroot, *target_disk.seed_filesystem_command(split["seed"], raw["repart_seed"], seed_mib)],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if res.returncode:
            raise ImageError(f"mke2fs of the seed partition failed: {res.stderr.strip()[-800:]}")
        log("disk 2/2: ESP + root + verity + seed (systemd-repart)")
        target_disk.write_definitions(
            work / "repart-disk",
            target_disk.stage2_definitions(
                roothash, split, int(raw["esp_mib"]), int(raw["seed_partition_mib"])
            ),
        )
        target_disk.repart(
            chroot,
            ["--empty=create", "--size=auto", f"--seed={raw['repart_seed']}", f"--copy-source={w}/esp",
             f"--definitions={w}/repart-disk", f"{w}/out/{ARTIFACT}"],
            env, repart_log,
        )  # fmt: skip
    shutil.copyfile(work / "esp" / target_disk.UKI_PATH, out / "kvlab-target.efi")
    (out / "roothash").write_text(roothash + "\n")
    files = {
        ARTIFACT: out / ARTIFACT,
        "kvlab-target.efi": out / "kvlab-target.efi",
        "roothash": out / "roothash",
    }
    meta = {
        "kernel": kver,
        "roothash": roothash,
        "cmdline": cmdline,
        "initrd": "dracut (systemd initrd, systemd-veritysetup)",
        "tools_tree": target_tools.identity(),
        "secure_boot_signed": bool(signing),
        "uki_sha256": sha256_file(out / "kvlab-target.efi"),
        "size_bytes": (out / ARTIFACT).stat().st_size,
    }
    return Built(artifact=out / ARTIFACT, files=files, components=root_tree.components, meta=meta)
