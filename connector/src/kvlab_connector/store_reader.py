"""The store's read paths: open an object's fragments, read runs of adjacent sections with
one request each, into host memory or (GDS) straight into device memory, and verify every
section: anything missing, truncated, failing its checksum or of another write than the
object's first verified section is a miss, never KV."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import xxhash

from kvlab_connector import metrics
from kvlab_connector.checksum import wsum64, wsum64_tensor
from kvlab_connector.io_gds import side_stream
from kvlab_connector.io_posix import PosixEngine
from kvlab_connector.ring import align_up
from kvlab_connector.store_format import (
    MAGIC_WSUM,
    MAGIC_XXH3,
    TRAILER_BYTES,
    FragmentNames,
    ObjectShape,
    check_trailer,
)
from kvlab_connector.store_stats import StoreStats

# The size a read request aims at on one drive: adjacent sections of a fragment file are
# read together up to it (one 1 MiB request per section reached ~0.6-0.8 of what 2 MiB
# requests did on this project's drives; 4 MiB gave nothing more).
READ_REQUEST_BYTES = 2 << 20


class OpenObject(list):
    """The handles of an object's open fragments, and the write its first verified section
    came from: every later section must come from that write too."""

    __slots__ = ("write_id",)

    def __init__(self, handles: Sequence[Any] = ()):
        super().__init__(handles)
        self.write_id: int | None = None


class ReadPaths(FragmentNames):
    """The Store's reads (a mixin: the Store sets these attributes up)."""

    o_direct: list[bool]
    engine: PosixEngine
    stats: StoreStats
    device_io: Any
    _lock: threading.Lock

    def _open_for(self, frag: int, path: os.PathLike, flags: int) -> int:
        """A fragment file on drive `frag`, with O_DIRECT where the drive takes it (the
        writer's files too)."""
        if self.o_direct[frag]:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o640)

    def open_object(self, ns: str, key: str, shape: ObjectShape) -> OpenObject | None:
        """File descriptors of the object's fragments, or None if any is missing."""
        fds = OpenObject()
        paths = self.fragment_paths(ns, key, shape)
        try:
            for f, path in enumerate(paths):
                fds.append(self._open_for(f, path, os.O_RDONLY))
        except OSError:
            for fd in fds:
                os.close(fd)
            with self._lock:
                self.stats.missing += 1
            return None
        return fds

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
        self, fds: OpenObject, ns: str, key: str, shape: ObjectShape, section: int,
        buf: memoryview, tag: int = 0,
    ) -> Future[bool]:
        """Read one section into buf (ring slot, shape.stride bytes); the Future says
        whether it verified. buf[:section_bytes] then holds the payload."""
        out: Future[bool] = Future()
        inner = self.submit_read_sections(fds, ns, key, shape, [section], [buf], tag)
        inner.add_done_callback(lambda f: out.set_result(f.result()[0]))
        return out

    def submit_read_sections(
        self, fds: OpenObject, ns: str, key: str, shape: ObjectShape, sections: Sequence[int],
        bufs: Sequence[memoryview], tag: int = 0,
    ) -> Future[list[bool]]:
        """Read a run of sections (one of `read_runs`) with one request, each into its
        own buffer (shape.stride bytes); the Future says, per section, whether it verified."""
        frag, offset = self.placement(key, shape, sections[0])
        t0 = time.perf_counter()
        inner = self.engine.submit_readv(fds[frag], [b[:shape.stride] for b in bufs], offset)
        out: Future[list[bool]] = Future()

        def done(fut: Future[int]) -> None:
            try:
                got = fut.result()
                # A short read (a truncated fragment) still verifies the sections it filled.
                oks = [
                    got >= (i + 1) * shape.stride and self._verify(buf, ns, key, shape, s, tag, fds)
                    for i, (s, buf) in enumerate(zip(sections, bufs, strict=True))
                ]
            except Exception:  # an I/O error, or anything else: those sections are misses
                oks = [False] * len(sections)
            self._note_read(t0, oks, shape)
            out.set_result(oks)

        inner.add_done_callback(done)
        return out

    def _verify(
        self, buf: memoryview, ns: str, key: str, shape: ObjectShape, section: int, tag: int, obj: OpenObject,
    ) -> bool:
        pay = align_up(shape.section_bytes)
        checked = check_trailer(bytes(buf[pay:pay + TRAILER_BYTES]), ns, key, shape, section, tag)
        if checked is None:
            return False
        magic, write_id, expected = checked
        payload = buf[:shape.section_bytes]
        actual = xxhash.xxh3_64_intdigest(payload) if magic == MAGIC_XXH3 else wsum64(payload)
        return self._checksum_matches(actual, expected) and self._same_write(obj, write_id)

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

    # ---- device memory (GDS) ----------------------------------------------------------
    def open_object_device(self, ns: str, key: str, shape: ObjectShape) -> OpenObject | None:
        """device_io handles of the object's fragments, or None if any is missing."""
        handles = OpenObject()
        paths = self.fragment_paths(ns, key, shape)  # a malformed name is the caller's error, not a miss
        try:
            for path in paths:
                handles.append(self.device_io.open(path, "r"))
        except Exception:  # kvikio reports a missing file as a RuntimeError
            for h in handles:
                h.close()
            with self._lock:
                self.stats.missing += 1
            return None
        return handles

    def submit_read_sections_device(
        self, handles: OpenObject, ns: str, key: str, shape: ObjectShape, sections: Sequence[int],
        slots: Sequence[Any], tag: int = 0,
    ) -> Future[list[bool]]:
        """Read sections straight into device memory (each slot a uint8 tensor of
        shape.stride bytes), one request each, verified on the device; the Future says,
        per section, whether it verified."""
        out: Future[list[bool]] = Future()
        oks = [False] * len(sections)
        left = [len(sections)]
        t0 = time.perf_counter()

        def one(i: int) -> None:
            s = sections[i]
            frag, offset = self.placement(key, shape, s)
            try:
                got = self.device_io.pread(handles[frag], slots[i], shape.stride, offset)
                with side_stream(slots[i].device):
                    ok = got == shape.stride and self._verify_device(slots[i], ns, key, shape, s, tag, handles)
            except Exception:  # an I/O error, or anything else: a miss
                ok = False
            with self._lock:
                oks[i] = ok
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._note_read(t0, oks, shape)
                out.set_result(oks)

        for i in range(len(sections)):
            self.engine.submit(one, i)
        return out

    def _verify_device(
        self, slot: Any, ns: str, key: str, shape: ObjectShape, section: int, tag: int, obj: OpenObject,
    ) -> bool:
        """The trailer (one small copy to the host) and the payload's checksum, computed
        where the payload is: wsum64 on the device; xxh3 (a section written from host
        memory) needs the payload on the host, once."""
        pay = align_up(shape.section_bytes)
        trailer = slot[pay:pay + TRAILER_BYTES].cpu().numpy().tobytes()
        checked = check_trailer(trailer, ns, key, shape, section, tag)
        if checked is None:
            return False
        magic, write_id, expected = checked
        payload = slot[:shape.section_bytes]
        if magic == MAGIC_WSUM:
            actual = wsum64_tensor(payload)
        else:
            actual = xxhash.xxh3_64_intdigest(payload.cpu().numpy())
        return self._checksum_matches(actual, expected) and self._same_write(obj, write_id)

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
