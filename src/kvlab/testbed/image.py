"""The testbed VM image: a pinned definition in images/testbed, built reproducibly, cached by input hash.

Build: mmdebstrap (root mode) unpacks exactly the versions in packages.lock from the release's
signed suites, a customisation script runs in the chroot, everything non-deterministic is removed
(logs, caches, machine-id, SSH host keys, NVMe host NQN, byte-code), then `mke2fs -d` writes an ext4
root filesystem with a fixed UUID, hash seed and clock (SOURCE_DATE_EPOCH; a small LD_PRELOAD shim
clamps the atime/ctime that mke2fs copies from the unpacked tree). The kernel and initrd are taken
out of the tree so that qemu boots them directly: no bootloader, no partition table.

This module is the "testbed" builder of kvlab.images.build, which stores the image outside the
checkout at `cache_dir()/images/testbed-<identity>/`; the identity covers every file of the
definition, this builder and the versions of the host tools it runs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from kvlab import paths
from kvlab.images import ImageError
from kvlab.images.identity import Built, Component, files_under

# Bumped when the build procedure changes in a way the hashed files do not show.
BUILDER_VERSION = "1"
IMAGE_FILES = ("disk.raw", "vmlinuz", "initrd.img")
HOST_TOOLS = (["mmdebstrap", "--version"], ["mke2fs", "-V"], ["cc", "--version"])


@dataclasses.dataclass(frozen=True)
class Definition:
    root: Path  # images/<name>
    name: str
    release: str
    arch: str
    sources: tuple[str, ...]
    keyring: Path
    key_fingerprints: tuple[str, ...]
    source_date_epoch: int
    filesystem_uuid: str
    hash_seed: str
    size_mib: int
    packages: tuple[str, ...]
    lock: dict[str, str]  # package -> exact version, every package in the image

    @classmethod
    def load(cls, root: Path) -> Definition:
        spec_file = root / "image.yml"
        try:
            spec = yaml.safe_load(spec_file.read_text())
        except FileNotFoundError as e:
            raise ImageError(f"{spec_file}: no image definition there") from e
        lock = parse_lock((root / "packages.lock").read_text() if (root / "packages.lock").exists() else "")
        return cls(
            root=root,
            name=spec["name"],
            release=spec["release"],
            arch=spec["arch"],
            sources=tuple(spec["sources"]),
            keyring=Path(spec["keyring"]),
            key_fingerprints=tuple(spec["key_fingerprints"]),
            source_date_epoch=int(spec["source_date_epoch"]),
            filesystem_uuid=spec["filesystem_uuid"],
            hash_seed=spec["hash_seed"],
            size_mib=int(spec["size_mib"]),
            packages=tuple(spec["packages"]),
            lock=lock,
        )


def parse_lock(text: str) -> dict[str, str]:
    """packages.lock: one `name=version` a line; `#` comments."""
    lock: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("=")
        if not sep or not name or not version:
            raise ImageError(f"packages.lock: {raw!r} is not name=version")
        lock[name] = version
    return lock


def format_lock(installed: dict[str, str]) -> str:
    lines = ["# Every package in the image at its exact version; written by `kvlab testbed image --repin`."]
    lines += [f"{n}={v}" for n, v in sorted(installed.items())]
    return "\n".join(lines) + "\n"


def definition_root(name: str = "testbed") -> Path:
    return paths.repo_root() / "images" / name


def tools_fingerprint() -> str:
    """Versions of the host tools whose output ends up in the image."""
    out = []
    for cmd in HOST_TOOLS:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            out.append((res.stdout + res.stderr).splitlines()[0] if (res.stdout + res.stderr) else cmd[0])
        except FileNotFoundError:
            out.append(f"{cmd[0]} missing")
    return "\n".join(out)


# The builder interface of kvlab.images.build (registered there as "testbed").
FLAVORS = ("",)


def inputs(flavor: str) -> list[Path]:
    """The definition folder, the shared image tools and this builder."""
    root = definition_root()
    return [*files_under(root, root.parent / "tools"), Path(__file__)]


def tools(flavor: str) -> str:
    return f"builder {BUILDER_VERSION}\n{tools_fingerprint()}"


def repin_command(root: Path) -> str:
    rel = root.relative_to(paths.repo_root()) if root.is_relative_to(paths.repo_root()) else root
    return f"kvlab image build {root.name} --repin   (then commit {rel}/packages.lock)"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def _pinned_keyring(defn: Definition, out: Path) -> Path:
    """A keyring holding only the pinned release keys; fails if the host keyring lacks one."""
    keyring = out / "release-keys.gpg"
    home = out / "gnupg"
    home.mkdir(mode=0o700)
    res = subprocess.run(
        [
            "gpg",
            "--homedir",
            str(home),
            "--no-default-keyring",
            "--keyring",
            str(defn.keyring),
            "--export",
            *defn.key_fingerprints,
        ],
        capture_output=True,
        check=False,
    )
    if res.returncode or not res.stdout:
        raise ImageError(
            f"{defn.keyring}: cannot export the pinned release keys ({res.stderr.decode().strip()})"
        )
    listed = subprocess.run(
        ["gpg", "--homedir", str(home), "--with-colons", "--show-keys"],
        input=res.stdout,
        capture_output=True,
        check=True,
    ).stdout.decode()
    have = {line.split(":")[9] for line in listed.splitlines() if line.startswith("fpr:")}
    missing = [f for f in defn.key_fingerprints if f not in have]
    if missing:
        raise ImageError(
            f"{defn.keyring}: release key(s) {', '.join(missing)} missing (install debian-archive-keyring)"
        )
    keyring.write_bytes(res.stdout)
    shutil.rmtree(home)
    return keyring


def _mmdebstrap(defn: Definition, work: Path, rootfs: Path, include: list[str], env: dict[str, str]) -> None:
    keyring = _pinned_keyring(defn, work)
    cmd = [
        "mmdebstrap",
        "--mode=root",
        "--variant=apt",
        f"--architectures={defn.arch}",
        f"--keyring={keyring}",
        "--format=directory",
        '--aptopt=Acquire::Languages "none"',
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        f"--include={','.join(include)}",
        f"--customize-hook=copy-in {_overlay(defn, work)}/. /",
        f'--customize-hook=chroot "$1" /bin/sh -eu < {defn.root / "customize.sh"}',
        '--customize-hook=chroot "$1" dpkg-query -W -f \'${Package}=${Version}\\n\' > "$1/../installed.txt"',
        defn.release,
        str(rootfs),
        *defn.sources,
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    (work / "mmdebstrap.log").write_text(res.stdout + res.stderr)
    if res.returncode:
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-15:])
        gone = [
            ln for ln in tail.splitlines() if "was not found" in ln or "has no installation candidate" in ln
        ]
        if gone:
            raise ImageError(
                f"a pinned package version has left the mirror ({gone[0].strip()}); re-pin with:\n  "
                + repin_command(defn.root)
            )
        raise ImageError(f"mmdebstrap failed (log {work / 'mmdebstrap.log'}):\n{tail}")


def _normalize(rootfs: Path, epoch: int) -> None:
    """Remove what differs between two builds or must not ship (keys, IDs, logs, caches)."""
    for pattern in (
        "var/log/**/*",
        "var/cache/apt/**/*",
        "var/lib/apt/lists/**/*",
        "var/cache/debconf/*-old",
        "var/lib/dpkg/*-old",
        "var/cache/ldconfig/aux-cache",
        "var/lib/systemd/random-seed",
        "etc/ssh/ssh_host_*",
        "etc/nvme/hostnqn",
        "etc/nvme/hostid",
        "var/lib/dbus/machine-id",
        "etc/*-",
        "var/cache/man/**/*",
        "root/.bash_history",
        "tmp/*",
        "var/tmp/*",
        "var/lib/systemd/catalog/database",
        "var/lib/initramfs-tools/*",
    ):
        for p in sorted(rootfs.glob(pattern), reverse=True):
            if p.is_symlink() or p.is_file():
                p.unlink()  # folders stay: services expect them
    # byte-code stays: customize.sh compiles it with --invalidation-mode unchecked-hash (no file times)
    (rootfs / "etc/machine-id").write_text("")  # systemd writes a fresh one on first boot
    # dpkg's and shadow's own times: clamp "last password change" to the epoch day
    shadow = rootfs / "etc/shadow"
    day = str(epoch // 86400)
    rows = []
    for line in shadow.read_text().splitlines():
        f = line.split(":")
        if len(f) > 2 and f[2]:
            f[2] = day
        rows.append(":".join(f))
    shadow.write_text("\n".join(rows) + "\n")
    os.chmod(shadow, 0o640)


def _mkfs(defn: Definition, work: Path, rootfs: Path, disk: Path, env: dict[str, str]) -> None:
    shim = work / "clamp_stat.so"
    _run(
        [
            "cc",
            "-shared",
            "-fPIC",
            "-O2",
            "-o",
            str(shim),
            str(defn.root.parent / "tools" / "clamp_stat.c"),
            "-ldl",
        ]
    )
    with disk.open("wb") as f:
        f.truncate(defn.size_mib * 1024 * 1024)
    mkfs_env = dict(
        env,
        LD_PRELOAD=str(shim),
        E2FSPROGS_FAKE_TIME=str(defn.source_date_epoch),
        MKE2FS_CONFIG=str(defn.root.parent / "tools" / "mke2fs.conf"),
    )
    _run(
        [
            "mke2fs",
            "-q",
            "-F",
            "-t",
            "ext4",
            "-L",
            "kvlab-root",
            "-U",
            defn.filesystem_uuid,
            "-E",
            f"hash_seed={defn.hash_seed},lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0",
            "-d",
            str(rootfs),
            str(disk),
        ],
        env=mkfs_env,
    )


def _env(defn: Definition) -> dict[str, str]:
    return dict(
        os.environ,
        SOURCE_DATE_EPOCH=str(defn.source_date_epoch),
        LC_ALL="C.UTF-8",
        TZ="UTC",
        PYTHONHASHSEED="0",
    )


def _overlay(defn: Definition, work: Path) -> Path:
    """The overlay with the modes git means (0755 if executable, else 0644), whatever the umask
    of the checkout: copy-in keeps modes, and they are bytes of the image."""
    out = work / "overlay"
    src = defn.root / "overlay"
    shutil.copytree(src, out, symlinks=True, copy_function=shutil.copyfile)
    for dirpath, _dirs, names in os.walk(out):
        os.chmod(dirpath, 0o755)
        for n in names:
            p = Path(dirpath) / n
            if not p.is_symlink():
                orig = src / p.relative_to(out)
                os.chmod(p, 0o755 if orig.stat().st_mode & 0o100 else 0o644)
    return out


def repin(flavor: str, log) -> Path:
    """Rewrite packages.lock from what the mirror resolves for the top-level packages today."""
    defn = Definition.load(definition_root())
    work = Path(tempfile.mkdtemp(prefix=".repin-", dir=defn.root.parent))
    try:
        rootfs = work / "rootfs"
        log(f"mmdebstrap {defn.release} resolving {len(defn.packages)} packages (log {work}/mmdebstrap.log)")
        _mmdebstrap(defn, work, rootfs, list(defn.packages), _env(defn))
        installed = parse_lock((work / "installed.txt").read_text())
        (defn.root / "packages.lock").write_text(format_lock(installed))
        log(f"wrote {defn.root}/packages.lock ({len(installed)} packages); build again to use it")
        return defn.root / "packages.lock"
    finally:
        unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)


def build(flavor: str, work: Path, log) -> Built:
    """Build the image into `work` (the orchestrator stores it under its identity)."""
    defn = Definition.load(definition_root())
    if not defn.lock:
        raise ImageError(f"{defn.root}/packages.lock is empty; pin with:\n  {repin_command(defn.root)}")
    env = _env(defn)
    try:
        rootfs = work / "rootfs"
        include = [f"{n}={v}" for n, v in sorted(defn.lock.items())]
        log(f"mmdebstrap {defn.release} with {len(include)} packages (log {work}/mmdebstrap.log)")
        _mmdebstrap(defn, work, rootfs, include, env)
        installed = parse_lock((work / "installed.txt").read_text())
        if installed != defn.lock:
            extra = sorted(set(installed.items()) ^ set(defn.lock.items()))
            raise ImageError(
                f"the mirror resolved a different package set than packages.lock ({extra[:5]} …); re-pin with:\n  "
                + repin_command(defn.root)
            )
        boot = rootfs / "boot"
        kernels = sorted(boot.glob("vmlinuz-*"))
        initrds = sorted(boot.glob("initrd.img-*"))
        if len(kernels) != 1 or len(initrds) != 1:
            raise ImageError(f"expected one kernel and one initrd in /boot, found {kernels + initrds}")
        out = work / "out"
        out.mkdir()
        shutil.copyfile(kernels[0], out / "vmlinuz")
        shutil.copyfile(initrds[0], out / "initrd.img")
        components = [
            Component(kind="deb", name=n, version=v, sha256="", arch=defn.arch) for n, v in sorted(installed.items())
        ]
        _normalize(rootfs, defn.source_date_epoch)
        log("writing the ext4 root filesystem")
        _mkfs(defn, work, rootfs, out / "disk.raw", env)
        return Built(
            artifact=out / "disk.raw",
            files={f: out / f for f in IMAGE_FILES},
            components=components,
            meta={"kernel": kernels[0].name.removeprefix("vmlinuz-"), "release": defn.release},
        )
    finally:
        unmount_under(work)
        shutil.rmtree(work / "rootfs", ignore_errors=True)


def unmount_under(root: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[str]:
    """Unmount what an interrupted mmdebstrap left mounted in the build folder (/proc, /sys,
    /dev/pts of the chroot), deepest first, so that removing the folder never walks into them."""
    prefix = str(root.resolve()) + "/"
    points = []
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        # mountinfo escapes blanks in paths as octal (\040)
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point.startswith(prefix):
            points.append(point)
    points.sort(key=len, reverse=True)
    for point in points:
        subprocess.run(["umount", "--lazy", point], check=False, capture_output=True)
    return points
