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
- A large layer is not a file of its own: it is written from its tree twice, once into a hash
  to learn its digest and size (the archive names its blob by them) and once into the archive,
  where its digest is checked again. A multi-GB Python layer is then written to disk once, not
  twice (a layer tar, then its copy in the archive).
- config, manifest and index are JSON with sorted keys and no blanks; created = the epoch.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
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


class _Sink(io.RawIOBase):
    """Where a tar goes: `out` (or nowhere), counted and, unless hashed=False, hashed on the way."""

    def __init__(self, out=None, hashed: bool = True):
        self.out, self.sha256, self.size = out, hashlib.sha256() if hashed else None, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if self.sha256 is not None:
            self.sha256.update(b)
        self.size += len(b)
        if self.out is not None:
            self.out.write(b)
        return len(b)


def _keep_all(rel: str) -> bool:
    return False


def _write_tree(
    root: Path, sink: _Sink, epoch: int, subtrees: tuple[str, ...], skip: Callable[[str], bool]
) -> None:
    """The files of root below `subtrees` (with their parent folders) as a tar, into sink."""
    seen: set[str] = set()
    links: dict[tuple[int, int], str] = {}

    def paths() -> Iterator[str]:
        for sub in subtrees:
            parts = sub.split("/") if sub else []
            for i in range(1, len(parts) + 1):
                yield "/".join(parts[:i])
            if (root / sub).is_dir() and not (root / sub).is_symlink():
                yield from _walk(root, sub, skip)

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


def write_layer(
    root: Path,
    out: Path,
    epoch: int,
    subtrees: tuple[str, ...] = ("",),
    skip: Callable[[str], bool] = _keep_all,
) -> tuple[str, int]:
    """Write the files of root below `subtrees` (with their parent folders) as a layer tar;
    returns (sha256 hex, size). `skip(rel)` leaves a path and everything below it out."""
    with out.open("wb") as f:
        sink = _Sink(f)
        _write_tree(root, sink, epoch, subtrees, skip)
    return sink.sha256.hexdigest(), sink.size


@dataclass(frozen=True)
class Layer:
    """A layer's tar: a file (`tar`, from write_layer), or the files of `root` below `subtrees`,
    less what `skip` leaves out, measured when that tree is done (tree_layer()) and written into
    the archive from the same tree (write_archive): a tree that later steps of the build change
    around (a base whose /tmp and /usr/local they write in) is a file instead."""

    digest: str  # sha256 hex of the tar (uncompressed: also its diff_id)
    size: int
    comment: str  # the history entry: what this layer holds
    tar: Path | None = None
    root: Path | None = None
    subtrees: tuple[str, ...] = ("",)
    skip: Callable[[str], bool] = _keep_all

    def write(self, sink: _Sink, epoch: int) -> None:
        if self.tar is not None:
            with self.tar.open("rb") as f:
                shutil.copyfileobj(f, sink, 1 << 20)
        else:
            assert self.root is not None
            _write_tree(self.root, sink, epoch, self.subtrees, self.skip)


def file_layer(
    root: Path, out: Path, epoch: int, comment: str, skip: Callable[[str], bool] = _keep_all
) -> Layer:
    """The files of root, less what `skip` leaves out, as a layer tar file `out` (write_layer)."""
    digest, size = write_layer(root, out, epoch, skip=skip)
    return Layer(digest, size, comment, tar=out)


def tree_layer(root: Path, epoch: int, comment: str, subtrees: tuple[str, ...]) -> Layer:
    """Measure the layer of root's `subtrees` (its tar's sha256 and size), writing it nowhere."""
    sink = _Sink()
    _write_tree(root, sink, epoch, subtrees, _keep_all)
    return Layer(sink.sha256.hexdigest(), sink.size, comment, root=root, subtrees=subtrees)


class LayerChanged(Exception):
    """A layer's tree changed between its measuring and the archive's writing."""


def _entry(sink: _Sink, name: str, size: int, epoch: int) -> None:
    """An archive member's header: a folder (name ends in /) or a file of `size` bytes, root's,
    with the epoch's time; the file's bytes and their padding follow (_pad)."""
    folder = name.endswith("/")
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if folder else tarfile.REGTYPE
    info.mode = 0o755 if folder else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = epoch
    info.size = 0 if folder else size
    sink.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))


def _pad(sink: _Sink, size: int) -> None:
    if size % tarfile.BLOCKSIZE:
        sink.write(tarfile.NUL * (tarfile.BLOCKSIZE - size % tarfile.BLOCKSIZE))


def write_archive(layers: list[Layer], out: Path, epoch: int, config: dict, ref_name: str) -> dict:
    """Write the oci-archive (an OCI layout in a tar: blobs/sha256/<digest>, index.json,
    oci-layout) to `out`, each layer streamed from its tree; returns the digests
    {"manifest": "sha256:..", "config": "sha256:..", "layers": [...]}. The tar is what tarfile
    writes for that layout: members in path order, parents first, root's, at the epoch."""
    import datetime

    created = datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cfg = canonical_json({
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer.digest}" for layer in layers]},
        "history": [
            {"created": created, "created_by": "kvlab image build", "comment": layer.comment}
            for layer in layers
        ],
    })  # fmt: skip
    cfg_digest = hashlib.sha256(cfg).hexdigest()
    manifest = canonical_json({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": f"sha256:{cfg_digest}", "size": len(cfg)},
        "layers": [
            {"mediaType": LAYER_MEDIA_TYPE, "digest": f"sha256:{layer.digest}", "size": layer.size}
            for layer in layers
        ],
    })  # fmt: skip
    man_digest = hashlib.sha256(manifest).hexdigest()
    index = canonical_json({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [{
            "mediaType": MANIFEST_MEDIA_TYPE,
            "digest": f"sha256:{man_digest}",
            "size": len(manifest),
            "annotations": {REF_NAME: ref_name},
        }],
    })  # fmt: skip
    blobs: dict[str, bytes | Layer] = {cfg_digest: cfg, man_digest: manifest}
    blobs |= {layer.digest: layer for layer in layers}
    files: list[tuple[str, bytes | Layer | None]] = [("blobs/", None), ("blobs/sha256/", None)]
    files += [(f"blobs/sha256/{d}", blobs[d]) for d in sorted(blobs)]
    files += [("index.json", index), ("oci-layout", canonical_json({"imageLayoutVersion": "1.0.0"}))]
    with out.open("wb") as f:
        sink = _Sink(f, hashed=False)  # the store hashes the archive once it is written (kvlab.images.build)
        for name, data in files:
            if data is None:
                _entry(sink, name, 0, epoch)
            elif isinstance(data, bytes):
                _entry(sink, name, len(data), epoch)
                sink.write(data)
                _pad(sink, len(data))
            else:
                _entry(sink, name, data.size, epoch)
                again = _Sink(sink)
                data.write(again, epoch)
                if (again.sha256.hexdigest(), again.size) != (data.digest, data.size):
                    raise LayerChanged(
                        f"layer {data.comment!r} changed after it was measured: sha256 {data.digest} "
                        f"({data.size} bytes), now {again.sha256.hexdigest()} ({again.size} bytes)"
                    )
                _pad(sink, data.size)
        sink.write(tarfile.NUL * (2 * tarfile.BLOCKSIZE))  # the end of the archive, as tar writes it
        if sink.size % tarfile.RECORDSIZE:
            sink.write(tarfile.NUL * (tarfile.RECORDSIZE - sink.size % tarfile.RECORDSIZE))
    return {
        "manifest": f"sha256:{man_digest}",
        "config": f"sha256:{cfg_digest}",
        "layers": [f"sha256:{layer.digest}" for layer in layers],
    }
