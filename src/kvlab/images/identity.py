"""What an image is made of and the hash that names it, like a Nix store path.

A builder reports what it built as a `Built`; the orchestrator (kvlab.images.build) names the
cached build by `identity()` of its inputs, so two checkouts with the same inputs share one
cache entry and any changed byte of an input gives a new one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

IDENTITY_HEX = 16  # as many hex digits as a store path needs to be unique in one cache


@dataclasses.dataclass(frozen=True)
class Component:
    kind: str  # "deb" | "wheel"
    name: str
    version: str
    sha256: str  # of the .deb / wheel file that was installed
    arch: str = ""  # a .deb's architecture (the purl's ?arch=); "" for a wheel


@dataclasses.dataclass(frozen=True)
class Built:
    artifact: Path  # the one file whose sha256 is the image digest (a disk image, an OCI archive)
    files: dict[str, Path]  # everything the build outputs (kernel, initrd, roothash, ...), artifact included
    components: list[Component]
    meta: dict  # builder facts for provenance (kernel version, roothash, OCI manifest digest...)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def relative_name(path: Path, root: Path) -> str:
    """An input's name in the identity: relative to the checkout, so that two checkouts agree."""
    path = path.resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"{path}: image inputs must lie inside the checkout {root}")
    return path.relative_to(root).as_posix()


def executable(path: Path) -> bool:
    """The one mode bit git records; the rest follows the checkout's umask and must not count."""
    return bool(path.stat().st_mode & 0o100)


def identity(name: str, flavor: str, inputs: Iterable[Path], tools: str, root: Path) -> str:
    """sha256 over the image's name, flavour, every input (path, exec bit, bytes) and the tools'
    fingerprint; its first IDENTITY_HEX hex digits. Inputs are taken in path order, once each."""
    h = hashlib.sha256()
    h.update(f"kvlab-image\0{name}\0{flavor}\0".encode())
    named = {relative_name(p, root): p for p in inputs}
    for rel in sorted(named):
        p = named[rel]
        if not p.is_file():
            raise FileNotFoundError(f"image input {rel} is not a file")
        data = p.read_bytes()
        h.update(f"file\0{rel}\0{'x' if executable(p) else '-'}\0{len(data)}\0".encode())
        h.update(data)
    h.update(f"tools\0{tools}".encode())
    return h.hexdigest()[:IDENTITY_HEX]


def input_digests(inputs: Iterable[Path], root: Path) -> dict[str, str]:
    """Each input's sha256 by its checkout-relative name, for the provenance."""
    return {relative_name(p, root): sha256_file(p) for p in sorted(inputs)}


def files_under(*folders: Path) -> list[Path]:
    """Every file below the folders (what a definition folder contributes to the inputs)."""
    out = []
    for folder in folders:
        for dirpath, _dirs, names in os.walk(folder):
            out += [Path(dirpath) / n for n in names]
    return sorted(out)
