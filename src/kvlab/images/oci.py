"""A small, deterministic OCI image writer: layer tars, config, manifest, an oci-archive.

Why not umoci (Debian's 0.4.7) or buildah: both take a layer as the diff of an unpacked bundle,
so they read the build host's file times, owners' names, xattrs and walk order; umoci's gzip
(pgzip, parallel) and the bundle's mtree add more that two hosts may differ in, and neither has
a switch to clamp file times (buildah 1.28 has no --rewrite-timestamp). Here every byte is ours:

- a layer is an uncompressed POSIX (pax) tar of a subtree, entries in path order, parents first;
  each file time is clamped to SOURCE_DATE_EPOCH, owner names are empty (numeric ids stay: a
  Debian root has files of group shadow, mail, ...), hard links are written as links to the
  first path, device nodes, sockets and xattrs are not written (the runtime makes /dev).
- Uncompressed layers: an OCI media type of its own, nothing to make deterministic, and no
  compression time in the build (the archive is copied to a node, not pulled from a registry).
- config, manifest and index are JSON with sorted keys and no blanks; created = the epoch.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"


def canonical_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _walk(root: Path, rel: str, skip: Callable[[str], bool]) -> Iterator[str]:
    """Relative paths below root/rel, parents before children, each folder's entries sorted."""
    base = root / rel if rel else root
    for name in sorted(os.listdir(base)):
        child = f"{rel}/{name}" if rel else name
        if skip(child):
            continue
        yield child
        p = root / child
        if p.is_dir() and not p.is_symlink():
            yield from _walk(root, child, skip)


def write_layer(
    root: Path,
    out: Path,
    epoch: int,
    subtrees: tuple[str, ...] = ("",),
    skip: Callable[[str], bool] = lambda rel: False,
) -> tuple[str, int]:
    """Write the files of root below `subtrees` (with their parent folders) as a layer tar;
    returns (sha256 hex, size). `skip(rel)` leaves a path and everything below it out."""
    seen: set[str] = set()
    links: dict[tuple[int, int], str] = {}
    h = hashlib.sha256()

    class Hashing(io.RawIOBase):
        def __init__(self, f):
            self.f = f

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            h.update(b)
            return self.f.write(b)

    def paths() -> Iterator[str]:
        for sub in subtrees:
            parts = sub.split("/") if sub else []
            for i in range(1, len(parts) + 1):
                yield "/".join(parts[:i])
            if (root / sub).is_dir() and not (root / sub).is_symlink():
                yield from _walk(root, sub, skip)

    with out.open("wb") as raw:
        sink = Hashing(raw)
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
            for rel in paths():
                if rel in seen:
                    continue
                seen.add(rel)
                p = root / rel
                st = os.lstat(p)
                info = tarfile.TarInfo(rel + ("/" if stat.S_ISDIR(st.st_mode) else ""))
                info.mode = stat.S_IMODE(st.st_mode)
                info.uid, info.gid = st.st_uid, st.st_gid
                info.uname = info.gname = ""
                info.mtime = min(int(st.st_mtime), epoch)
                data = None
                if stat.S_ISDIR(st.st_mode):
                    info.type = tarfile.DIRTYPE
                elif stat.S_ISLNK(st.st_mode):
                    info.type = tarfile.SYMTYPE
                    info.linkname = os.readlink(p)
                elif stat.S_ISREG(st.st_mode):
                    key = (st.st_dev, st.st_ino)
                    if st.st_nlink > 1 and key in links:
                        info.type = tarfile.LNKTYPE
                        info.linkname = links[key]
                    else:
                        links[key] = rel
                        info.type = tarfile.REGTYPE
                        info.size = st.st_size
                        data = p
                else:
                    continue  # devices, fifos, sockets: the runtime provides /dev and /run
                if data is None:
                    tar.addfile(info)
                else:
                    with data.open("rb") as f:
                        tar.addfile(info, f)
    return h.hexdigest(), out.stat().st_size


@dataclass(frozen=True)
class Layer:
    path: Path  # the tar
    digest: str  # sha256 hex of the tar (uncompressed: also its diff_id)
    size: int
    comment: str  # the history entry: what this layer holds


def _blob(blobs: Path, data: bytes) -> tuple[str, int]:
    d = hashlib.sha256(data).hexdigest()
    (blobs / d).write_bytes(data)
    return d, len(data)


def write_archive(
    layers: list[Layer],
    out: Path,
    epoch: int,
    config: dict,
    ref_name: str,
    work: Path,
) -> dict:
    """Write the oci-archive (an OCI layout in a tar) to `out`; returns the digests
    {"manifest": "sha256:..", "config": "sha256:..", "layers": [...]}."""
    import datetime

    created = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    layout = work / "oci-layout"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for layer in layers:
        os.link(layer.path, blobs / layer.digest) if _same_fs(layer.path, blobs) else _copy(
            layer.path, blobs / layer.digest
        )
    cfg = {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer.digest}" for layer in layers]},
        "history": [
            {"created": created, "created_by": "kvlab image build", "comment": layer.comment}
            for layer in layers
        ],
    }
    cfg_digest, cfg_size = _blob(blobs, canonical_json(cfg))
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": f"sha256:{cfg_digest}", "size": cfg_size},
        "layers": [
            {"mediaType": LAYER_MEDIA_TYPE, "digest": f"sha256:{layer.digest}", "size": layer.size}
            for layer in layers
        ],
    }
    man_digest, man_size = _blob(blobs, canonical_json(manifest))
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [
            {
                "mediaType": MANIFEST_MEDIA_TYPE,
                "digest": f"sha256:{man_digest}",
                "size": man_size,
                "annotations": {REF_NAME: ref_name},
            }
        ],
    }
    (layout / "index.json").write_bytes(canonical_json(index))
    (layout / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
    for p in [
        layout,
        layout / "blobs",
        blobs,
        *blobs.iterdir(),
        layout / "index.json",
        layout / "oci-layout",
    ]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if os.geteuid() == 0:  # builds run as root; a unit test need not
            os.chown(p, 0, 0)
    write_layer(layout, out, epoch)
    return {
        "manifest": f"sha256:{man_digest}",
        "config": f"sha256:{cfg_digest}",
        "layers": [f"sha256:{layer.digest}" for layer in layers],
    }


def _same_fs(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def _copy(src: Path, dst: Path) -> None:
    import shutil

    shutil.copyfile(src, dst)
