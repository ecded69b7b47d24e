"""The on-drive object store: striped, checksummed, atomically committed, bounded.

An object is the KV of one chunk of tokens (or of a shorter tail): sections, one per layer,
striped over the drives, each verified when read. The store's jobs, a module each:

- format: how objects are cut and named on the drives, and each section's trailer;
- writer: an object's sections written as they come, committed by renames;
- reader: the read paths, verifying every section;
- memory: what reads land in and writes come from, one interface: HOST (any host
  buffer) or DeviceMemory (GDS: device memory through kvikio), named by the caller;
- ledger: the capacity bound shared by every process, eviction, the start-up rebuild.

`Store` ties them to one set of drives; this module's names are the store's public API.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

from kvlab_connector.config import is_positive_int
from kvlab_connector.io.posix import PosixEngine, supports_o_direct
from kvlab_connector.store.format import (
    MAGIC_WSUM,
    MAGIC_XXH3,
    ROOT_NAME,
    TRAILER_BYTES,
    ObjectShape,
    check_name,
    pack_trailer,
)
from kvlab_connector.store.ledger import LOW_WATER, Ledger, ObjectId, ScanResult
from kvlab_connector.store.memory import HOST, DeviceMemory, OpenObject, SectionMemory
from kvlab_connector.store.reader import READ_REQUEST_BYTES, ReadPaths
from kvlab_connector.store.stats import StoreStats
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


class Store(ReadPaths):
    """The drives of one store; thread-safe; any number of processes may share it.

    `io_threads`: requests in flight over all drives (None: IO_THREADS_PER_DRIVE each)."""

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        capacity_bytes: int,
        io_threads: int | None = None,
        o_direct: bool | None = None,
        engine: PosixEngine | None = None,
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
        self.drives = [Path(p) / ROOT_NAME for p in paths]
        seen: dict[tuple[int, int], int] = {}
        for i, (p, d) in enumerate(zip(paths, self.drives, strict=True)):
            d.mkdir(parents=True, exist_ok=True)
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
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self.ledger = Ledger(self.drives, capacity_bytes, self.stats, self._lock)
        self._writers: weakref.WeakSet[ObjectWriter] = weakref.WeakSet()

    @property
    def io_mode(self) -> str:
        if all(self.o_direct):
            return "posix-odirect"
        if any(self.o_direct):
            return "posix-mixed"
        return "posix-buffered"

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
        writer = ObjectWriter(self, ns, key, shape, num_tokens, tag)
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
