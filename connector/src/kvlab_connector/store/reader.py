"""The store's read paths: open an object's fragments, read runs of adjacent sections with
one request each, into the memory the caller names (store/memory.py: host memory, or with
GDS device memory), and verify every section: anything missing, truncated, failing its
checksum or of another write than the object's first verified section is a miss, never KV."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from kvlab_connector import metrics
from kvlab_connector.io.posix import PosixEngine
from kvlab_connector.store.format import FragmentNames, ObjectShape
from kvlab_connector.store.memory import HOST, OpenObject, SectionMemory
from kvlab_connector.store.stats import StoreStats

# The size a read request aims at on one drive: adjacent sections of a fragment file are
# read together up to it (one 1 MiB request per section reached ~0.6-0.8 of what 2 MiB
# requests did on this project's drives; 4 MiB gave nothing more).
READ_REQUEST_BYTES = 2 << 20


class ReadPaths(FragmentNames):
    """The Store's reads (a mixin: the Store sets these attributes up)."""

    o_direct: list[bool]
    engine: PosixEngine
    stats: StoreStats
    _lock: threading.Lock

    def _open_for(self, frag: int, path: os.PathLike, flags: int) -> int:
        """A fragment file on drive `frag`, with O_DIRECT where the drive takes it (the
        writer's files too)."""
        if self.o_direct[frag]:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o640)

    def open_object(self, ns: str, key: str, shape: ObjectShape, memory: SectionMemory = HOST) -> OpenObject | None:
        """The object's fragments, opened for reads into `memory`; None if any is missing."""
        return memory.open(self, ns, key, shape)  # type: ignore[arg-type]

    def note_missing(self) -> None:
        with self._lock:
            self.stats.missing += 1

    def touch(self, ns: str, key: str, shape: ObjectShape) -> None:
        """Mark an object as recently used (its first fragment's mtime orders eviction)."""
        try:
            os.utime(self.fragment_path(ns, key, shape, 0))
        except OSError:
            pass

    def sections_per_read(self, shape: ObjectShape, most: int) -> int:
        """How many adjacent sections one read request takes: about READ_REQUEST_BYTES,
        at most `most` (what the caller's ring can lend at once)."""
        return max(1, min(-(-READ_REQUEST_BYTES // shape.section_bytes), most))

    def read_runs(self, key: str, shape: ObjectShape, sections: Sequence[int], max_run: int) -> list[list[int]]:
        """The sections cut into runs that one request can read: adjacent in one fragment
        file, at most `max_run` long, in offset order."""
        by_frag: dict[int, list[tuple[int, int]]] = {}
        for s in sections:
            frag, offset = self.placement(key, shape, s)
            by_frag.setdefault(frag, []).append((offset, s))
        runs: list[list[int]] = []
        for frag in sorted(by_frag):
            prev = None
            for offset, s in sorted(by_frag[frag]):
                if prev is not None and offset == prev + shape.stride and len(runs[-1]) < max_run:
                    runs[-1].append(s)
                else:
                    runs.append([s])
                prev = offset
        return runs

    def submit_read_section(
        self, obj: OpenObject, ns: str, key: str, shape: ObjectShape, section: int,
        buf: Any, tag: int = 0, memory: SectionMemory = HOST,
    ) -> Future[bool]:
        """Read one section into buf (ring slot, shape.stride bytes); the Future says
        whether it verified. buf[:section_bytes] then holds the payload."""
        out: Future[bool] = Future()
        inner = self.submit_read_sections(obj, ns, key, shape, [section], [buf], tag, memory)
        inner.add_done_callback(lambda f: out.set_result(f.result()[0]))
        return out

    def submit_read_sections(
        self, obj: OpenObject, ns: str, key: str, shape: ObjectShape, sections: Sequence[int],
        bufs: Sequence[Any], tag: int = 0, memory: SectionMemory = HOST,
    ) -> Future[list[bool]]:
        """Read a run of sections (one of `read_runs`) into `memory` with one request (host)
        or one each (device), each into its own buffer (shape.stride bytes); the Future
        says, per section, whether it verified."""
        return memory.read(self, obj, ns, key, shape, sections, bufs, tag)  # type: ignore[arg-type]

    def _checksum_matches(self, actual: int, expected: int) -> bool:
        if actual == expected:
            return True
        with self._lock:
            self.stats.checksum_failures += 1
        metrics.inc("checksum_failures")
        return False

    def _same_write(self, obj: OpenObject, write_id: int) -> bool:
        """The first verified section of an open object names its write; a section of any
        other write of the key is a miss."""
        with self._lock:
            if obj.write_id is None:
                obj.write_id = write_id
            return obj.write_id == write_id

    def _note_read(self, t0: float, oks: list[bool], shape: ObjectShape) -> None:
        n_ok = sum(oks)
        with self._lock:
            dt = time.perf_counter() - t0
            self.stats.note_latency(dt)
            self.stats.bytes_read += n_ok * shape.stride
            if n_ok == len(oks):
                self.stats.read_s += dt
            self.stats.sections_failed += len(oks) - n_ok
        metrics.observe_io(dt, read_bytes=n_ok * shape.stride)
