"""The on-drive object store: striped, checksummed, atomically committed, bounded.

An object is the KV of one chunk of tokens (or of a shorter tail): sections, one per layer,
striped over the drives, each verified when read. The store's jobs, a module each:

- format: how objects are cut and named on the drives, and each section's trailer;
- writer: an object's sections written as they come, committed by renames;
- reader: the read paths, verifying every section;
- memory: what reads land in and writes come from, one interface: HOST (any host
  buffer) or DeviceMemory (GDS: device memory through kvikio), named by the caller;
- ledger: the capacity bound shared by every process, eviction, the start-up rebuild;
- fragments: where an object's fragment files are and how they open; stats: the counts.

`Store` ties them to one set of drives, handing each part what it needs (the fragments,
the I/O engine, the stats, the ledger), never itself; this module's names are the store's
public API.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvlab_connector.config import is_positive_int
from kvlab_connector.io.posix import PosixEngine, supports_o_direct
from kvlab_connector.store.format import (
    MAGIC_WSUM,
    MAGIC_XXH3,
    ROOT_NAME,
    TRAILER_BYTES,
    FragmentNames,
    ObjectShape,
    check_name,
    check_trailer_fields,
    pack_trailer,
)
from kvlab_connector.store.fragments import Fragments
from kvlab_connector.store.ledger import LOW_WATER, Ledger, ObjectId, ScanResult
from kvlab_connector.store.memory import HOST, DeviceMemory, OpenObject, ReadParts, SectionMemory
from kvlab_connector.store.reader import READ_REQUEST_BYTES, Reader
from kvlab_connector.store.stats import Recorder, StoreStats
from kvlab_connector.store.writer import ObjectWriter

__all__ = [
    "HOST", "IO_THREADS_PER_DRIVE", "LOW_WATER", "MAGIC_WSUM", "MAGIC_XXH3", "READ_REQUEST_BYTES", "ROOT_NAME",
    "TRAILER_BYTES", "DeviceMemory", "ObjectId", "ObjectShape", "ObjectWriter", "OpenObject", "ScanResult",
    "SectionMemory", "Store", "StoreStats", "check_name", "pack_trailer",
]

# I/O threads per drive when none are configured: each thread keeps one request in flight,
# and 8 on one drive reached fio's queue-depth-32 read limit here. A store striped over
# more drives gets as many per drive, so adding drives adds requests in flight.
IO_THREADS_PER_DRIVE = 8


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem that holds `path` (an existing path)."""
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def _make_drive_dir(path: Path, require_mount: bool) -> None:
    """A drive's directory, made if it is missing, but never the path to it: where a
    drive's filesystem is not mounted, the directories above would be made on the root
    filesystem, and the store would fill it. With `require_mount`, the directory must sit
    on a filesystem mounted below the root."""
    if not path.parent.is_dir():
        raise ValueError(
            f"paths: {str(path)!r} cannot be made: {str(path.parent)!r} does not exist (the store never makes "
            "a drive path's parents: is its drive mounted?)"
        )
    if require_mount and mount_point(path if path.exists() else path.parent) == Path("/"):
        raise ValueError(
            f"require_mount: nothing is mounted at {str(path)!r} (it is on the root filesystem): mount its "
            "drive's filesystem, or set require_mount false for a store on the root filesystem"
        )
    path.mkdir(exist_ok=True)


class Store(FragmentNames):
    """The drives of one store; thread-safe; any number of processes may share it.

    `io_threads`: requests in flight over all drives (None: IO_THREADS_PER_DRIVE each)."""

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        capacity_bytes: int,
        io_threads: int | None = None,
        o_direct: bool | None = None,
        engine: PosixEngine | None = None,
        require_mount: bool = False,
    ):
        if isinstance(paths, str | bytes | os.PathLike) or not paths:
            raise ValueError(f"paths: give a list of directories, one per drive, got {paths!r}")
        paths = list(paths)
        if not is_positive_int(capacity_bytes):
            raise ValueError(f"capacity_bytes must be a positive integer (bytes), got {capacity_bytes!r}")
        if io_threads is not None and not is_positive_int(io_threads):
            raise ValueError(f"io_threads must be a positive integer or None (8 per drive), got {io_threads!r}")
        if o_direct not in (None, True, False):
            raise ValueError(f"o_direct must be True, False or None (probe each drive), got {o_direct!r}")
        if not isinstance(require_mount, bool):
            raise ValueError(f"require_mount must be true or false, got {require_mount!r}")
        self.drives = [Path(p) / ROOT_NAME for p in paths]
        seen: dict[tuple[int, int], int] = {}
        for i, (p, d) in enumerate(zip(paths, self.drives, strict=True)):
            _make_drive_dir(Path(p), require_mount)
            d.mkdir(exist_ok=True)
            st = os.stat(p)
            # A directory given twice, or reached twice (a symlink, a bind mount), would count
            # every object as partial: refuse it.
            first = seen.setdefault((st.st_dev, st.st_ino), i)
            if first != i:
                raise ValueError(
                    f"paths: {str(p)!r} is the same directory as {str(paths[first])!r} (one filesystem object "
                    "reached twice): give each drive's directory once"
                )
        if o_direct is None:
            self.o_direct = [supports_o_direct(d) for d in self.drives]
        else:
            self.o_direct = [o_direct] * len(self.drives)
        self.engine = engine or PosixEngine(io_threads or IO_THREADS_PER_DRIVE * len(self.drives))
        # The parts, each given what it needs and no more.
        self.fragments = Fragments(self.drives, self.o_direct)
        self.recorder = Recorder([str(p) for p in paths])
        self.stats: StoreStats = self.recorder.stats
        self.ledger = Ledger(self.drives, capacity_bytes, self.stats, self.recorder.lock)
        self.reader = Reader(ReadParts(self.fragments, self.engine, self.recorder))
        self._writers: weakref.WeakSet[ObjectWriter] = weakref.WeakSet()

    @property
    def io_mode(self) -> str:
        return self.fragments.io_mode

    @property
    def _lock(self) -> threading.Lock:
        """The lock the parts count under (a test swaps it to prove an idle step takes none)."""
        return self.recorder.lock

    @_lock.setter
    def _lock(self, lock: threading.Lock) -> None:
        self.recorder.lock = lock

    # ---- read (reader.Reader) -------------------------------------------------------
    def open_object(self, ns: str, key: str, shape: ObjectShape, memory: SectionMemory = HOST) -> OpenObject | None:
        """The object's fragments, opened for reads into `memory`; None if any is missing."""
        return self.reader.open_object(ns, key, shape, memory)

    def touch(self, ns: str, key: str, shape: ObjectShape) -> None:
        """Mark an object as recently used (its first fragment's mtime orders eviction)."""
        self.reader.touch(ns, key, shape)

    def sections_per_read(self, shape: ObjectShape, most: int) -> int:
        return self.reader.sections_per_read(shape, most)

    def read_runs(self, key: str, shape: ObjectShape, sections: Sequence[int], max_run: int) -> list[list[int]]:
        return self.reader.read_runs(key, shape, sections, max_run)

    def submit_read_section(
        self, obj: OpenObject, ns: str, key: str, shape: ObjectShape, section: int,
        buf: Any, tag: int = 0, memory: SectionMemory = HOST,
    ) -> Future[bool]:
        return self.reader.submit_read_section(obj, ns, key, shape, section, buf, tag, memory)

    def submit_read_sections(
        self, obj: OpenObject, ns: str, key: str, shape: ObjectShape, sections: Sequence[int],
        bufs: Sequence[Any], tag: int = 0, memory: SectionMemory = HOST,
    ) -> Future[list[bool]]:
        return self.reader.submit_read_sections(obj, ns, key, shape, sections, bufs, tag, memory)

    # ---- lookup ---------------------------------------------------------------------
    def exists(self, ns: str, key: str, shape: ObjectShape) -> bool:
        check_name("namespace", ns)
        check_name("key", key)
        for f in range(self.n_fragments(shape)):
            try:
                os.stat(self._path(ns, key, shape, f))  # the first one missing ends it
            except OSError:
                return False
        return True

    def count_prefix(self, ns: str, keys: Sequence[str], shape: ObjectShape) -> int:
        """How many leading keys exist on the drives."""
        for key in keys:
            check_name("key", key)
        n = 0
        for key in keys:
            if not self.exists(ns, key, shape):
                break
            n += 1
        return n

    # ---- write ----------------------------------------------------------------------
    def begin_write(self, ns: str, key: str, shape: ObjectShape, num_tokens: int, tag: int = 0) -> ObjectWriter:
        check_trailer_fields(num_tokens, tag)
        writer = ObjectWriter(self.fragments, self.engine, self.recorder, self.ledger, ns, key, shape, num_tokens, tag)
        with self._lock:
            self._writers.add(writer)
        return writer

    # ---- the capacity ledger (ledger.Ledger) ----------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """The bound now: capacity_bytes as configured, lower while a drive is full."""
        return self.ledger.capacity_bytes

    def usage_bytes(self) -> int:
        return self.ledger.usage_bytes()

    def flush_usage(self) -> None:
        self.ledger.flush()

    def scan(self) -> ScanResult:
        """What the drives hold now (committed objects and bytes), changing nothing."""
        return self.ledger.scan()

    def rebuild(self) -> ScanResult:
        """Rebuild the index from the drives alone (Ledger.rebuild)."""
        return self.ledger.rebuild()

    def exists_any_shape(self, ns: str, key: str) -> bool:
        """Whether a committed object has this key, whatever its shape."""
        return self.ledger.exists_any_shape(ns, key)

    def remove(self, ns: str, key: str) -> int:
        """Delete the object with this key, whatever its shape; returns the bytes freed."""
        return self.ledger.remove(ns, key)

    def close(self) -> None:
        # A writer still waiting for sections would wait forever: it fails now. Writers
        # with every section submitted finish (the engine's shutdown waits for them).
        with self._lock:
            writers = list(self._writers)
        for w in writers:
            w.abort_unfinished()
        self.engine.shutdown()
        self.flush_usage()
