"""The pinned trixie tools tree (images/tools/trixie): systemd-repart 257, ukify, erofs-utils...

This host runs Debian 12, whose systemd 252 cannot lay out reproducible repart images; the tree is
made once with mmdebstrap from its lock and cached by its identity, `cache_dir()/tools/<name>-<id>/`.
Its identity (definition, lock, this file, the host's mmdebstrap) enters the fingerprint of every
image it builds. Tools run in it by a plain chroot: /proc, /dev and the build folder bind-mounted,
always unmounted again in `finally`, deepest first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from kvlab import paths
from kvlab.images import ImageError
from kvlab.testbed.image import _pinned_keyring, parse_lock, unmount_under

DEFINITION = Path("images/tools/trixie")
# Where the build folder appears inside the tree while a chroot runs.
WORK_IN_TREE = "/kvlab-work"


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a Debian tree is made from: images/<x>/image.yml and its packages.lock."""

    root: Path
    name: str
    release: str
    arch: str
    sources: tuple[str, ...]
    keyring: Path
    key_fingerprints: tuple[str, ...]
    source_date_epoch: int
    packages: tuple[str, ...]
    lock: dict[str, str]
    raw: dict

    @classmethod
    def load(cls, root: Path) -> Spec:
        spec_file = root / "image.yml"
        try:
            spec = yaml.safe_load(spec_file.read_text())
        except FileNotFoundError as e:
            raise ImageError(f"{spec_file}: no image definition there") from e
        lock_file = root / "packages.lock"
        return cls(
            root=root,
            name=spec["name"],
            release=spec["release"],
            arch=spec["arch"],
            sources=tuple(spec["sources"]),
            keyring=Path(spec["keyring"]),
            key_fingerprints=tuple(spec["key_fingerprints"]),
            source_date_epoch=int(spec["source_date_epoch"]),
            packages=tuple(spec["packages"]),
            lock=parse_lock(lock_file.read_text() if lock_file.exists() else ""),
            raw=spec,
        )


def definition_root() -> Path:
    return paths.repo_root() / DEFINITION


def inputs() -> list[Path]:
    root = definition_root()
    return sorted(p for p in root.rglob("*") if p.is_file()) + [Path(__file__)]


def _first_line(cmd: list[str]) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return f"{cmd[0]} missing"
    return ((res.stdout + res.stderr).splitlines() or [cmd[0]])[0]


def identity() -> str:
    """sha256 over the tree's inputs (paths relative to the checkout, bytes) and the host's mmdebstrap."""
    h = hashlib.sha256()
    repo = paths.repo_root()
    for p in inputs():
        rel = p.resolve().relative_to(repo).as_posix() if p.resolve().is_relative_to(repo) else p.name
        data = p.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    h.update(_first_line(["mmdebstrap", "--version"]).encode())
    return h.hexdigest()[:16]


def fingerprint() -> str:
    """The tools() fingerprint that images built in this tree carry."""
    spec = Spec.load(definition_root())
    return f"tools-tree {spec.name} {identity()}"


def mmdebstrap(
    spec: Spec, work: Path, target: Path, include: list[str], hooks: list[str], variant: str
) -> None:
    """Unpack exactly `include` (name=version) from the release's signed suites into `target`."""
    keyring = _pinned_keyring(spec, work)  # type: ignore[arg-type]  # uses keyring and fingerprints only
    cmd = [
        "mmdebstrap",
        "--mode=root",
        f"--variant={variant}",
        f"--architectures={spec.arch}",
        f"--keyring={keyring}",
        "--format=directory",
        '--aptopt=Acquire::Languages "none"',
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        f"--include={','.join(include)}",
        *(f"--customize-hook={h}" for h in hooks),
        '--customize-hook=chroot "$1" dpkg-query -W -f \'${Package}=${Version}\\n\' > "$1/../installed.txt"',
        spec.release,
        str(target),
        *spec.sources,
    ]
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(spec.source_date_epoch), LC_ALL="C.UTF-8", TZ="UTC")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    (work / "mmdebstrap.log").write_text(res.stdout + res.stderr)
    if res.returncode:
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-15:])
        raise ImageError(f"mmdebstrap failed for {spec.name} (log {work / 'mmdebstrap.log'}):\n{tail}")


def check_lock(spec: Spec, installed_file: Path) -> dict[str, str]:
    installed = parse_lock(installed_file.read_text())
    if installed != spec.lock:
        diff = sorted(set(installed.items()) ^ set(spec.lock.items()))
        raise ImageError(
            f"{spec.root}/packages.lock: the mirror resolved a different package set ({diff[:5]} ...); "
            f"re-pin with: kvlab image repin {spec.root.name}"
        )
    return installed


def ensure(log=print) -> Path:
    """The tools tree's root folder, made if this identity has none yet."""
    spec = Spec.load(definition_root())
    if not spec.lock:
        raise ImageError(f"{spec.root}/packages.lock is empty: pin it first")
    base = paths.cache_dir() / "tools"
    final = base / f"{spec.name}-{identity()}"
    if (final / "root" / "usr/bin/systemd-repart").exists():
        return final / "root"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-tools-", dir=base))
    try:
        log(f"tools tree {final.name}: mmdebstrap {spec.release}, {len(spec.lock)} packages")
        root = work / "root"
        mmdebstrap(spec, work, root, [f"{n}={v}" for n, v in sorted(spec.lock.items())], [], "apt")
        check_lock(spec, work / "installed.txt")
        (root / WORK_IN_TREE.lstrip("/")).mkdir()
        if final.exists():
            shutil.rmtree(final)
        os.rename(work, final)
        return final / "root"
    finally:
        unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def chroot(tree: Path, work: Path) -> Iterator[list[str]]:
    """A chroot command prefix into the tools tree with `work` at WORK_IN_TREE. One build at a
    time per tree (the mount point is shared); every mount is undone, deepest first, whatever happens."""
    lock = (tree.parent / "chroot.lock").open("w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    mounts = [("/proc", tree / "proc"), ("/dev", tree / "dev"), (str(work), tree / WORK_IN_TREE.lstrip("/"))]
    done: list[Path] = []
    try:
        for src, dst in mounts:
            subprocess.run(["mount", "--rbind", src, str(dst)], check=True)
            done.append(dst)
        yield ["chroot", str(tree)]
    finally:
        for dst in reversed(done):
            subprocess.run(["umount", "--recursive", "--lazy", str(dst)], check=False)
        lock.close()
