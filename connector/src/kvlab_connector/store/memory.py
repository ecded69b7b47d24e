"""The memory a section is read into or written from, as the store sees it: one interface,
two implementations, chosen once by whoever owns the memory (the worker's medium,
worker/media.py) and handed to every store call that touches section bytes.

- HOST: any host buffer (the staging ring, a bench's buffers). Files are plain descriptors
  (O_DIRECT where the drive takes it); adjacent sections are read and written with one
  vectored request; sections carry xxh3 checksums.
- DeviceMemory(device_io): device memory (GDS through kvikio, or its CPU stand-in in the
  tests). Files are device_io handles; each section is one request (kvikio splits it over
  its own threads); sections are checksummed where they are, with wsum64 on the device.

A section written from either memory reads back into either: its trailer says which
checksum it carries.
"""

from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvlab_connector.checksum import wsum64, wsum64_tensor
from kvlab_connector.io.gds import side_stream
from kvlab_connector.io.posix import PosixEngine, pwritev_full
from kvlab_connector.ring import align_up
from kvlab_connector.store.format import (
    MAGIC_WSUM,
    MAGIC_XXH3,
    TRAILER_BYTES,
    ObjectShape,
    WriteFields,
    check_trailer,
)
from kvlab_connector.store.fragments import Fragments
from kvlab_connector.store.stats import Recorder


class OpenObject(list):
    """The handles of an object's open fragments, and the write its first verified section
    came from: every later section must come from that write too."""

    __slots__ = ("_lock", "write_id")

    def __init__(self, handles: Sequence[Any] = ()):
        super().__init__(handles)
        self.write_id: int | None = None
        self._lock = threading.Lock()

    def same_write(self, write_id: int) -> bool:
        """The first verified section names the object's write; a section of any other
        write of the key is a miss."""
        with self._lock:
            if self.write_id is None:
                self.write_id = write_id
            return self.write_id == write_id


@dataclass(frozen=True)
class QueuedWrite:
    offset: int
    section: int
    buf: Any  # shape.stride bytes in `memory`: a host memoryview or a device tensor
    nbytes: int
    on_done: Callable[[bool], None]
    memory: SectionMemory


class FragmentFile:
    """A writer's temporary fragment file: its descriptor, and the device_io handle that a
    device memory opens on it at its first write there (one drain per file at a time)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        self.device_handle: Any = None

    def close(self) -> None:
        if self.device_handle is not None:
            try:
                self.device_handle.close()
            except Exception:
                pass
        try:
            os.close(self.fd)
        except OSError:
            pass


@dataclass(frozen=True)
class ReadParts:
    """What a read needs of the store: where the fragments are, the I/O threads, the stats."""

    fragments: Fragments
    engine: PosixEngine
    stats: Recorder


class SectionMemory(ABC):
    merges_writes: bool  # adjacent queued sections go out as one write request

    @abstractmethod
    def open(self, parts: ReadParts, ns: str, key: str, shape: ObjectShape) -> OpenObject | None:
        """The object's fragments opened for reads into this memory; None (counted missing)
        if any is missing."""

    @abstractmethod
    def close(self, obj: OpenObject) -> None: ...

    @abstractmethod
    def read(
        self, parts: ReadParts, obj: OpenObject, ns: str, key: str, shape: ObjectShape, sections: Sequence[int],
        bufs: Sequence[Any], tag: int,
    ) -> Future[list[bool]]:
        """Read adjacent sections (one of Reader.read_runs), each into its own buffer of
        shape.stride bytes; the Future says, per section, whether it verified."""

    @abstractmethod
    def section(self, section: object, buf: Any) -> tuple[Any, int, str | None]:
        """A buffer handed to a writer, as this memory writes it: (the buffer, its size,
        what is wrong with it or None)."""

    @abstractmethod
    def seal(self, fields: WriteFields, section: int, buf: Any) -> None:
        """Checksum the payload in buf[:section_bytes] and write the trailer after it."""

    @abstractmethod
    def write(self, file: FragmentFile, run: list[QueuedWrite]) -> bool:
        """Write a run of queued sections to a fragment's temporary file; whether every
        byte went out."""


class HostMemory(SectionMemory):
    merges_writes = True  # one vectored pwritev for a run of adjacent slots

    def open(self, parts: ReadParts, ns: str, key: str, shape: ObjectShape) -> OpenObject | None:
        fds = OpenObject()
        paths = parts.fragments.fragment_paths(ns, key, shape)
        try:
            for f, path in enumerate(paths):
                fds.append(parts.fragments.open_for(f, path, os.O_RDONLY))
        except OSError:
            self.close(fds)
            parts.stats.note_missing()
            return None
        return fds

    def close(self, obj: OpenObject) -> None:
        for fd in obj:
            os.close(fd)

    def read(self, parts, obj, ns, key, shape, sections, bufs, tag):  # type: ignore[no-untyped-def]
        frag, offset = parts.fragments.placement(key, shape, sections[0])
        t0 = time.perf_counter()
        inner = parts.engine.submit_readv(obj[frag], [b[:shape.stride] for b in bufs], offset)
        out: Future[list[bool]] = Future()

        def done(fut: Future[int]) -> None:
            try:
                got = fut.result()
                # A short read (a truncated fragment) still verifies the sections it filled.
                oks = [
                    got >= (i + 1) * shape.stride and self._verify(parts.stats, buf, ns, key, shape, s, tag, obj)
                    for i, (s, buf) in enumerate(zip(sections, bufs, strict=True))
                ]
            except Exception:  # an I/O error, or anything else: those sections are misses
                oks = [False] * len(sections)
            try:
                parts.stats.note_read(t0, oks, shape.stride)
            finally:  # whatever the accounting does, the read resolves
                out.set_result(oks)

        inner.add_done_callback(done)
        return out

    @staticmethod
    def _verify(stats: Recorder, buf: memoryview, ns: str, key: str, shape: ObjectShape, section: int, tag: int,
                obj: OpenObject) -> bool:  # fmt: skip
        pay = align_up(shape.section_bytes)
        checked = check_trailer(bytes(buf[pay:pay + TRAILER_BYTES]), ns, key, shape, section, tag)
        if checked is None:
            return False
        magic, write_id, expected = checked
        payload = buf[:shape.section_bytes]
        actual = xxhash.xxh3_64_intdigest(payload) if magic == MAGIC_XXH3 else wsum64(payload)
        return stats.checksum_matches(actual, expected) and obj.same_write(write_id)

    def section(self, section: object, buf: Any) -> tuple[Any, int, str | None]:
        try:
            view = memoryview(buf).cast("B")
        except (TypeError, ValueError):
            return None, 0, f"section {section!r}: {type(buf).__name__} is not a contiguous buffer"
        if view.readonly:
            return view, view.nbytes, f"section {section!r}: the buffer is read-only"
        return view, view.nbytes, None

    def seal(self, fields: WriteFields, section: int, buf: memoryview) -> None:
        pay = align_up(fields.shape.section_bytes)
        checksum = xxhash.xxh3_64_intdigest(buf[:fields.shape.section_bytes])
        buf[pay:pay + TRAILER_BYTES] = fields.trailer(section, MAGIC_XXH3, checksum)

    def write(self, file: FragmentFile, run: list[QueuedWrite]) -> bool:
        return pwritev_full(file.fd, [q.buf for q in run], run[0].offset) == sum(q.nbytes for q in run)


class DeviceMemory(SectionMemory):
    merges_writes = False  # device slots are not adjacent in memory; kvikio splits a request itself

    def __init__(self, device_io: Any):
        self.device_io = device_io  # gds.DeviceIO: kvikio, or gds.PosixFile in the tests

    def open(self, parts: ReadParts, ns: str, key: str, shape: ObjectShape) -> OpenObject | None:
        handles = OpenObject()
        paths = parts.fragments.fragment_paths(ns, key, shape)  # a malformed name is the caller's error, not a miss
        try:
            for path in paths:
                handles.append(self.device_io.open(path, "r"))
        except Exception:  # kvikio reports a missing file as a RuntimeError
            self.close(handles)
            parts.stats.note_missing()
            return None
        return handles

    def close(self, obj: OpenObject) -> None:
        for h in obj:
            h.close()

    def read(self, parts, obj, ns, key, shape, sections, bufs, tag):  # type: ignore[no-untyped-def]
        out: Future[list[bool]] = Future()
        oks = [False] * len(sections)
        left = [len(sections)]
        lock = threading.Lock()
        t0 = time.perf_counter()

        def one(i: int) -> None:
            s = sections[i]
            frag, offset = parts.fragments.placement(key, shape, s)
            try:
                got = self.device_io.pread(obj[frag], bufs[i], shape.stride, offset)
                with side_stream(bufs[i].device):
                    ok = got == shape.stride and self._verify(parts.stats, bufs[i], ns, key, shape, s, tag, obj)
            except Exception:  # an I/O error, or anything else: a miss
                ok = False
            with lock:
                oks[i] = ok
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    parts.stats.note_read(t0, oks, shape.stride)
                finally:  # whatever the accounting does, the read resolves
                    out.set_result(oks)

        for i in range(len(sections)):
            parts.engine.submit(one, i)
        return out

    @staticmethod
    def _verify(stats: Recorder, slot: Any, ns: str, key: str, shape: ObjectShape, section: int, tag: int,
                obj: OpenObject) -> bool:  # fmt: skip
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
        return stats.checksum_matches(actual, expected) and obj.same_write(write_id)

    def section(self, section: object, buf: Any) -> tuple[Any, int, str | None]:
        return buf, int(buf.numel()), None

    def seal(self, fields: WriteFields, section: int, buf: Any) -> None:
        import torch

        pay = align_up(fields.shape.section_bytes)
        with side_stream(buf.device):
            checksum = wsum64_tensor(buf[:fields.shape.section_bytes])
            trailer = fields.trailer(section, MAGIC_WSUM, checksum)
            buf[pay:pay + TRAILER_BYTES].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
            if buf.is_cuda:
                torch.cuda.current_stream().synchronize()  # kvikio writes from its own stream

    def write(self, file: FragmentFile, run: list[QueuedWrite]) -> bool:
        (q,) = run
        if file.device_handle is None:  # after the writer made the file; one drain per file at a time
            file.device_handle = self.device_io.open(file.path, "r+")
        return self.device_io.pwrite(file.device_handle, q.buf, q.nbytes, q.offset) == q.nbytes


HOST = HostMemory()
