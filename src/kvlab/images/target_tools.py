"""The pinned trixie tools tree (images/tools/trixie): systemd-repart 257, ukify, erofs-utils...

This host runs Debian 12, whose systemd 252 cannot lay out reproducible repart images; the tree is
made once by kvlab.images.debian from its lock (every .deb checked against its sha256) and cached
by its identity, `cache_dir()/tools/<name>-<id>/`. Its identity (definition, lock,
kvlab.images.debian, this file, the host's mmdebstrap and dpkg-deb) enters the fingerprint of every
image it builds. Tools run in it by a plain chroot: /proc, /dev and the build folder bind-mounted,
always unmounted again in `finally`, deepest first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvlab import paths
from kvlab.images import debian

DEFINITION = Path("images/tools/trixie")
# Where the build folder appears inside the tree while a chroot runs.
WORK_IN_TREE = "/kvlab-work"


def definition_root() -> Path:
    return paths.repo_root() / DEFINITION


def definition(*, with_lock: bool = True) -> debian.Definition:
    return debian.Definition.load(definition_root(), with_lock=with_lock)


def inputs() -> list[Path]:
    """The definition, its lock, kvlab.images.debian (which installs the tree) and this file."""
    return [*debian.inputs(definition_root()), Path(__file__)]


def identity() -> str:
    """sha256 over the tree's inputs (paths relative to the checkout, bytes) and the host's tools."""
    h = hashlib.sha256()
    repo = paths.repo_root()
    for p in sorted(inputs()):
        rel = p.resolve().relative_to(repo).as_posix() if p.resolve().is_relative_to(repo) else p.name
        data = p.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    h.update(debian.tools_fingerprint().encode())
    return h.hexdigest()[:16]


def fingerprint() -> str:
    """The tools() fingerprint that images built in this tree carry."""
    return f"tools-tree {definition(with_lock=False).name} {identity()}"


def repin(log) -> Path:
    return debian.repin(definition(with_lock=False), log)


def ensure(log=print) -> Path:
    """The tools tree's root folder, made if this identity has none yet."""
    defn = definition()
    base = paths.cache_dir() / "tools"
    final = base / f"{defn.name}-{identity()}"
    if (final / "root" / "usr/bin/systemd-repart").exists():
        return final / "root"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-tools-", dir=base))
    try:
        log(f"tools tree {final.name}: {defn.release}, {len(defn.lock)} packages")
        tree = debian.rootfs(defn, work, log)
        tree.path.rename(work / "root")
        (work / "root" / WORK_IN_TREE.lstrip("/")).mkdir()
        for scratch in ("repo", "download", "overlay"):
            shutil.rmtree(work / scratch, ignore_errors=True)  # the .debs stay in the cache only
        if final.exists():
            shutil.rmtree(final)
        os.rename(work, final)
        return final / "root"
    finally:
        debian.unmount_under(work)
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
