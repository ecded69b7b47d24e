"""The on-drive object store: striped, checksummed, atomically committed, bounded.

An object is the KV of one chunk of tokens: `n_sections` sections (one per layer) of
`section_bytes` each. Sections are striped round-robin over the drives; the sections
that land on one drive form that object's fragment file there:

    <drive>/kvlab-v1/<namespace>/<key[:2]>/<key>.<fragment>-<fragments>.<bytes>

(the size in the name lets the start-up rebuild count usage from directory listings alone,
without a stat per file).

Each section is stored as its payload (padded to a page) followed by a one-page trailer
that carries the namespace, key, section index, length, the id of the write it belongs
to and a checksum of the payload:
xxh3 for sections written from host memory, wsum64 (checksum.py) for sections a GPU wrote
straight from device memory; the trailer's magic says which, and either path reads either.
Fragment files are written under temporary names and renamed into place once
every section of the object is on the drives; an object exists only when all of its
fragment files do. A reader verifies every section it reads: anything missing,
truncated, or failing its checksum is a miss, never KV; so is a section of another write
of the same key than the one the reader met first in that object (two writers' renames can
interleave, or a crash can stop one halfway, and leave fragments of both).

Capacity: a usage ledger beside the lock file of the first drive counts committed bytes;
a commit that crosses the capacity evicts least-recently-used objects (file mtime, which
reads refresh) under an flock, so several processes share one bound. A drive that fills up
before the bound (other data on it, or a bound set too high) lowers the bound below what the
drives hold, and evicts below that: saves go on, at the size the drives allow; the bound grows
back (up to capacity_bytes) when room returns.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvlab_connector import metrics
from kvlab_connector.checksum import wsum64, wsum64_tensor
from kvlab_connector.config import is_positive_int
from kvlab_connector.io_gds import side_stream
from kvlab_connector.io_posix import PosixEngine, pwritev_full, supports_o_direct
from kvlab_connector.osutil import pid_alive, syncfs
from kvlab_connector.ring import PAGE, align_up

log = logging.getLogger("vllm.kvlab_connector")

ROOT_NAME = "kvlab-v1"
# The magic names the trailer's format and the payload's checksum. Format 1 (KVLBSEC1,
# KVLBSECW) had no write id: its sections fail the check, so objects written by an older
# connector are clean misses, counted and evicted like any other until they age out.
MAGIC_XXH3 = b"KVLBSX02"
MAGIC_WSUM = b"KVLBSW02"
# magic, namespace, key, section, n_sections, payload_len, num_tokens, tag, write id, payload checksum
_TRAILER = struct.Struct("<8s16s16sIIQIQQQ")
_TRAILER_CHECK = struct.Struct("<Q")
_FRAGMENT_RE = re.compile(r"^([0-9a-f]{32})\.(\d+)-(\d+)\.(\d+)$")
_TMP_RE = re.compile(r"^\.([0-9a-f]{32})\.(\d+)-(\d+)\.(\d+)\.(\d+)\.[0-9a-f]+\.tmp$")
# Namespaces and keys: what the names above can hold, and what the trailer's bytes encode.
_NAME_RE = re.compile(r"[0-9a-f]{32}")
LOW_WATER = 0.9  # eviction frees down to this share of the capacity
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full drive, or the store's user's quota
# I/O threads per drive when none are configured: each thread keeps one request in flight,
# and 8 on one drive reached fio's queue-depth-32 read limit here. A store striped over
# more drives gets as many per drive, so adding drives adds requests in flight.
IO_THREADS_PER_DRIVE = 8
# The size a read request aims at on one drive: adjacent sections of a fragment file are
# read together up to it (one 1 MiB request per section reached ~0.6-0.8 of what 2 MiB
# requests did on this project's drives; 4 MiB gave nothing more).
READ_REQUEST_BYTES = 2 << 20
# One write request carries at most this much (and fewer buffers than IOV_MAX, 1024).
MAX_WRITE_BYTES = 8 << 20
MAX_WRITE_BUFFERS = 256
# (offset, bytes: a host memoryview or a device tensor, on_done)
_QueuedWrite = tuple[int, "memoryview | Any", Callable[[bool], None]]


@dataclass(frozen=True)
class ObjectShape:
    """How an object is cut: `n_sections` sections of `section_bytes` payload each."""

    n_sections: int
    section_bytes: int

    def __post_init__(self) -> None:
        for name in ("n_sections", "section_bytes"):
            v = getattr(self, name)
            if not is_positive_int(v):
                raise ValueError(f"ObjectShape.{name} must be a positive integer, got {v!r}")

    @property
    def stride(self) -> int:
        """Bytes one section takes on a drive and in a ring slot: payload + trailer page."""
        return align_up(self.section_bytes) + PAGE

    @property
    def object_bytes(self) -> int:
        return self.n_sections * self.stride


@dataclass
class StoreStats:
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    objects_written: int = 0
    objects_read: int = 0
    sections_failed: int = 0
    checksum_failures: int = 0
    missing: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    writes_aborted: int = 0
    out_of_space: int = 0  # times a drive was full below the capacity bound
    io_latency_s: list[float] = field(default_factory=list)

    def note_latency(self, s: float) -> None:
        # A bounded sample keeps the histogram's memory constant.
        if len(self.io_latency_s) < 100_000:
            self.io_latency_s.append(s)


# An object on the drives: (namespace, key, fragments). TP ranks write the same keys into
# a namespace each, and one key may be stored in several shapes (a whole chunk, a tail).
ObjectId = tuple[str, str, int]


@dataclass(frozen=True)
class ScanResult:
    objects: int
    bytes: int
    removed_partial: int
    seconds: float
    entries: list[tuple[float, int, ObjectId]]  # (mtime or 0, bytes, object)
    paths: dict[ObjectId, list[str]]  # object -> its fragment files


def check_name(what: str, value: object) -> str:
    """A namespace or key as the store names files: 32 lowercase hex characters."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(f"kvlab store: {what} {value!r} is not 32 lowercase hex characters")
    return value


class OpenObject(list):
    """The handles of an object's open fragments, and the write its first verified section
    came from: every later section must come from that write too."""

    __slots__ = ("write_id",)

    def __init__(self, handles: Sequence[Any] = ()):
        super().__init__(handles)
        self.write_id: int | None = None


class Store:
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
        self.capacity_limit = capacity_bytes  # as configured; the bound comes back up to it
        self.capacity_bytes = capacity_bytes  # the bound now: lower while the drives are full
        if o_direct is None:
            self.o_direct = [supports_o_direct(d) for d in self.drives]
        else:
            self.o_direct = [o_direct] * len(self.drives)
        self.engine = engine or PosixEngine(io_threads or IO_THREADS_PER_DRIVE * len(self.drives))
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._meta = self.drives[0] / ".meta"
        self._meta.mkdir(exist_ok=True)
        self._lock_path = self._meta / "lock"
        self._usage_path = self._meta / "usage"
        # Both made now: a drive out of inodes later must still take the ledger's updates
        # (they rewrite the ledger in place, needing no new file).
        for path in (self._lock_path, self._usage_path):
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o640))
        self._pending_bytes = 0
        self._object_bytes = 0  # the last committed object's size: inodes → bytes of room
        self._last_full = float("-inf")
        self._skipped: set[str] = set()  # unreadable directories already logged
        self._writers: weakref.WeakSet[ObjectWriter] = weakref.WeakSet()
        # GPU engines with GDS: sections move between drives and device memory through
        # this (io_gds.DeviceIO); None: host memory only.
        self.device_io: Any = None

    @property
    def io_mode(self) -> str:
        if all(self.o_direct):
            return "posix-odirect"
        if any(self.o_direct):
            return "posix-mixed"
        return "posix-buffered"

    # ---- naming -------------------------------------------------------------------
    def n_fragments(self, shape: ObjectShape) -> int:
        return min(len(self.drives), shape.n_sections)

    def _first_fragment(self, key: str, nfrag: int) -> int:
        return int(key[:8], 16) % nfrag

    def placement(self, key: str, shape: ObjectShape, section: int) -> tuple[int, int]:
        """(fragment index = drive index, byte offset in the fragment file) of a section."""
        nfrag = self.n_fragments(shape)
        frag = (section + self._first_fragment(key, nfrag)) % nfrag
        return frag, (section // nfrag) * shape.stride

    def fragment_bytes(self, key: str, shape: ObjectShape, frag: int) -> int:
        nfrag = self.n_fragments(shape)
        first = self._first_fragment(key, nfrag)
        return sum(1 for s in range(shape.n_sections) if (s + first) % nfrag == frag) * shape.stride

    def fragment_path(self, ns: str, key: str, shape: ObjectShape, frag: int) -> Path:
        check_name("namespace", ns)
        check_name("key", key)
        nfrag = self.n_fragments(shape)
        return self.drives[frag] / ns / key[:2] / f"{key}.{frag}-{nfrag}.{self.fragment_bytes(key, shape, frag)}"

    # ---- lookup ---------------------------------------------------------------------
    def exists(self, ns: str, key: str, shape: ObjectShape) -> bool:
        for f in range(self.n_fragments(shape)):
            try:
                os.stat(self.fragment_path(ns, key, shape, f))
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

    def _open_for(self, frag: int, path: Path, flags: int) -> int:
        if self.o_direct[frag]:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o640)

    # ---- read -----------------------------------------------------------------------
    def open_object(self, ns: str, key: str, shape: ObjectShape) -> OpenObject | None:
        """File descriptors of the object's fragments, or None if any is missing."""
        fds = OpenObject()
        try:
            for f in range(self.n_fragments(shape)):
                fds.append(self._open_for(f, self.fragment_path(ns, key, shape, f), os.O_RDONLY))
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
        checked = _check_trailer(bytes(buf[pay:pay + TRAILER_BYTES]), ns, key, shape, section, tag)
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
        for f in range(self.n_fragments(shape)):
            self.fragment_path(ns, key, shape, f)  # a malformed name is the caller's error, not a miss
        try:
            for f in range(self.n_fragments(shape)):
                handles.append(self.device_io.open(self.fragment_path(ns, key, shape, f), "r"))
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
        checked = _check_trailer(trailer, ns, key, shape, section, tag)
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

    # ---- capacity -------------------------------------------------------------------
    def _with_lock(self, fn: Callable[[], object], shared: bool = False) -> object:
        with open(self._lock_path, "a+") as lf:
            fcntl.flock(lf, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                return fn()
            finally:
                fcntl.flock(lf, fcntl.LOCK_UN)

    def _read_usage(self) -> int:
        try:
            return int(self._usage_path.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _write_usage(self, n: int) -> None:
        """Under the exclusive lock; in place and fixed-width, so that no update needs a new
        inode (readers take the lock shared)."""
        fd = os.open(self._usage_path, os.O_WRONLY | os.O_CREAT, 0o640)
        try:
            os.pwrite(fd, f"{max(0, n):>20}\n".encode(), 0)
        finally:
            os.close(fd)

    def usage_bytes(self) -> int:
        return self._with_lock(self._read_usage, shared=True)  # type: ignore[return-value]

    def _account(self, nbytes: int) -> None:
        # The shared ledger is updated under an flock; small commits are batched up to
        # 1% of the capacity (at most 256 MiB), the slack by which processes may overrun it.
        with self._lock:
            self._pending_bytes += nbytes
            self._object_bytes = nbytes
            if self._pending_bytes < min(self.capacity_bytes // 100, 256 << 20):
                return
            pending, self._pending_bytes = self._pending_bytes, 0

        def update() -> None:
            used = self._read_usage() + pending
            if self.capacity_bytes < self.capacity_limit:
                self._grow_back(used)
            if used > self.capacity_bytes:
                used = self._evict_locked(int(self.capacity_bytes * LOW_WATER))
            self._write_usage(used)

        self._with_lock(update)

    def _on_full(self) -> None:
        """A write found a drive full below the bound: the bound comes down to LOW_WATER of
        what the drives hold now (the rest is headroom for writes in flight and the
        ledger's slack), and eviction frees down to LOW_WATER of that, so that saves fit
        (other processes sharing the store do the same when their writes fail). Runs on an
        I/O thread; a burst of failed writes makes one eviction, not one each."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_full < 1.0:
                return
            self._last_full = now
            self.stats.out_of_space += 1
        metrics.inc("out_of_space")

        def shrink() -> None:
            scan = self._scan(clean=False, with_mtime=True)  # one walk: what is held, and its ages
            with self._lock:
                self._pending_bytes = 0  # counted by the walk: added again, the ledger would run ahead
            held = scan.bytes
            before = self.capacity_bytes
            self.capacity_bytes = min(self.capacity_bytes, int(held * LOW_WATER))
            self._write_usage(self._evict_locked(int(self.capacity_bytes * LOW_WATER), scan))
            # The evicted files' blocks are free only once the filesystem commits: now,
            # or the next writes would still find the drive full and lower the bound again.
            for drive in self.drives:
                syncfs(drive)
            log.warning(
                "kvlab store: a drive is full at %.2f GiB held (capacity_bytes %.2f GiB): the bound is now "
                "%.2f GiB until room returns; free space on the drives or lower capacity_bytes",
                held / 2**30, before / 2**30, self.capacity_bytes / 2**30,
            )

        try:
            self._with_lock(shrink)
        except OSError:
            pass  # the first drive itself refuses (its lock or ledger): the next failed write tries again

    def _grow_back(self, used: int) -> None:
        """Raise a lowered bound towards capacity_bytes once the drives have room again
        (the foreign data that filled one was deleted, say). By the rule that lowered it,
        LOW_WATER of what the drives could hold: held plus free. It moves only when that is
        well above the bound, so that the bound does not creep up into the next full drive."""
        room = self._room_bytes()
        grown = min(self.capacity_limit, int((used + room) * LOW_WATER))
        if grown * LOW_WATER <= self.capacity_bytes:
            return
        log.warning(
            "kvlab store: the drives have room again: the bound grows from %.2f GiB back to %.2f GiB "
            "(capacity_bytes %.2f GiB)", self.capacity_bytes / 2**30, grown / 2**30, self.capacity_limit / 2**30,
        )
        self.capacity_bytes = grown

    def _room_bytes(self) -> int:
        """Bytes more the store could put on its drives now: fragments spread evenly, so the
        drive with the least room sets it, in bytes and in inodes (one file per object a
        drive, and as many key directories at most). Drives that share a filesystem share
        its room."""
        stats = []
        for d in self.drives:
            try:
                stats.append((os.stat(d).st_dev, os.statvfs(d)))
            except OSError:
                return 0  # a drive that cannot say has no room to offer
        sharing = {dev: sum(1 for other, _ in stats if other == dev) for dev, _ in stats}
        per_drive = min(fs.f_bavail * fs.f_frsize // sharing[dev] for dev, fs in stats)
        room = per_drive * len(self.drives)
        inodes = [fs.f_favail // sharing[dev] for dev, fs in stats if fs.f_files]
        if inodes and self._object_bytes:
            room = min(room, min(inodes) // 2 * self._object_bytes)
        return room

    def flush_usage(self) -> None:
        with self._lock:
            pending, self._pending_bytes = self._pending_bytes, 0
        if pending:
            self._with_lock(lambda: self._write_usage(self._read_usage() + pending))

    def _evict_locked(self, target: int, scan: ScanResult | None = None) -> int:
        """Evict least-recently-used objects until at most `target` bytes stay; returns the
        bytes left. `scan` (with mtimes) spares the walk when the caller has just made it."""
        if scan is None:
            scan = self._scan(clean=False, with_mtime=True)
        used = scan.bytes
        for _mtime, size, obj in sorted(scan.entries):
            if used <= target:
                break
            _remove_files(scan.paths[obj])
            used -= size
            with self._lock:
                self.stats.evictions += 1
                self.stats.evicted_bytes += size
            metrics.inc("evictions")
        return used

    def scan(self) -> ScanResult:
        """What the drives hold now (committed objects and bytes), changing nothing."""
        return self._scan(clean=False)

    def rebuild(self) -> ScanResult:
        """Rebuild the index from the drives alone: count committed objects and bytes,
        remove partial objects and temporary files of dead writers, reset the ledger."""

        def run() -> ScanResult:
            scan = self._scan(clean=True)
            self._write_usage(scan.bytes)
            return scan

        return self._with_lock(run)  # type: ignore[return-value]

    def _scan(self, clean: bool, with_mtime: bool = False) -> ScanResult:
        """Walk the drives. Usage comes from the names alone; mtimes (for eviction order)
        cost a stat per object and are read only when asked for."""
        t0 = time.perf_counter()
        # object -> [fragment indices seen, bytes, paths]
        seen: dict[ObjectId, tuple[set[int], list[int], list[str]]] = {}
        removed = 0
        now = time.time()
        for drive in self.drives:
            for ns_entry in self._listdir(drive):
                if ns_entry.name.startswith(".") or not ns_entry.is_dir():
                    continue
                for sub in self._listdir(ns_entry.path):
                    entries = self._listdir(sub.path)
                    if clean and not entries:
                        _rmdir(sub.path)  # left by an older version, which kept empty key directories
                    for e in entries:
                        name = e.name
                        m = _FRAGMENT_RE.match(name)
                        if m:
                            frags, size, files = seen.setdefault((ns_entry.name, m.group(1), int(m.group(3))),
                                                                 (set(), [0], []))
                            frags.add(int(m.group(2)))
                            size[0] += int(m.group(4))
                            files.append(e.path)
                        elif clean and name.endswith(".tmp"):
                            t = _TMP_RE.match(name)
                            if t is None or not pid_alive(int(t.group(5))) or now - _mtime(e.path) > 600:
                                _unlink(e.path)
                                removed += 1
        entries_out = []
        paths = {}
        total = 0
        for obj, (frags, (size,), files) in seen.items():
            _ns, key, nfrag = obj
            if len(frags) == nfrag:
                mtime = 0.0
                if with_mtime:
                    first = next((p for p in files if p.rsplit("/", 1)[-1].startswith(f"{key}.0-")), files[0])
                    mtime = _mtime(first)
                entries_out.append((mtime, size, obj))
                paths[obj] = files
                total += size
            elif clean and now - max(_mtime(p) for p in files) > 60:
                # A writer died between renames: the object was never complete.
                _remove_files(files)
                removed += 1
        return ScanResult(len(entries_out), total, removed, time.perf_counter() - t0, entries_out, paths)

    def _listdir(self, path: str | os.PathLike) -> list[os.DirEntry]:
        """A directory's entries; one that cannot be read (its mode, a failing drive) is
        logged once and skipped: the rest of the drives still count and evict."""
        try:
            with os.scandir(path) as it:
                return list(it)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            if str(path) not in self._skipped:
                self._skipped.add(str(path))
                log.warning("kvlab store: skipping %s, which cannot be read (%s): its objects are not counted, "
                            "evicted or removed until it can", path, e.strerror or e)
            return []

    # ---- by key alone, whatever the shape (the LMCache L2 adapter: LMCache looks up and
    # deletes by key, and learns an object's size only when it hands over a buffer) ------
    def exists_any_shape(self, ns: str, key: str) -> bool:
        """Whether a committed object has this key. Its fragment 0 sits on the first drive
        and is renamed into place last at commit."""
        check_name("namespace", ns)
        prefix = f"{check_name('key', key)}.0-"
        return any(e.name.startswith(prefix) for e in self._listdir(self.drives[0] / ns / key[:2]))

    def remove(self, ns: str, key: str) -> int:
        """Delete the object with this key, whatever its shape, from every drive; returns
        the bytes freed."""
        check_name("namespace", ns)
        check_name("key", key)
        freed = 0
        files = []
        for drive in self.drives:
            for e in self._listdir(drive / ns / key[:2]):
                m = _FRAGMENT_RE.match(e.name)
                if m and m.group(1) == key:
                    files.append(e.path)
                    freed += int(m.group(4))
        _remove_files(files)
        if freed:
            self._with_lock(lambda: self._write_usage(self._read_usage() - freed))
        return freed

    def close(self) -> None:
        # A writer still waiting for sections would wait forever: it fails now. Writers
        # with every section submitted finish (the engine's shutdown waits for them).
        with self._lock:
            writers = list(self._writers)
        for w in writers:
            w.abort_unfinished()
        self.engine.shutdown()
        self.flush_usage()


def _unlink(path: str) -> None:
    """Best effort: a drive that fails here (gone, read-only, EIO) must not stop a writer from
    finishing; what stays behind is a .tmp the start-up rebuild removes."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _rmdir(path: str) -> None:
    """Remove a directory if it is empty: an evicted object's key directory would otherwise
    hold an inode for ever (at most 256 per namespace and drive, each one an inode that a
    drive low on them needs for its files)."""
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty (the usual case), or gone


def _remove_files(paths: Sequence[str]) -> None:
    """Delete an object's files, then the key directories they leave empty."""
    for p in paths:
        _unlink(p)
    for parent in {p.rsplit("/", 1)[0] for p in paths}:
        _rmdir(parent)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


TRAILER_BYTES = _TRAILER.size + _TRAILER_CHECK.size


def pack_trailer(
    ns: str, key: str, shape: ObjectShape, section: int, num_tokens: int, tag: int, write_id: int, magic: bytes,
    checksum: int,
) -> bytes:
    head = _TRAILER.pack(
        magic, bytes.fromhex(ns), bytes.fromhex(key), section, shape.n_sections,
        shape.section_bytes, num_tokens, tag, write_id, checksum,
    )
    return head + _TRAILER_CHECK.pack(xxhash.xxh3_64_intdigest(head))


def _check_trailer(
    trailer: bytes, ns: str, key: str, shape: ObjectShape, section: int, tag: int
) -> tuple[bytes, int, int] | None:
    """(magic, write id, payload checksum) of a trailer that is intact and names this very
    section of this object in this layout; None otherwise."""
    try:
        fields = _TRAILER.unpack_from(trailer)
        (check,) = _TRAILER_CHECK.unpack_from(trailer, _TRAILER.size)
    except struct.error:
        return None
    magic, t_ns, t_key, t_sec, t_n, t_len, _tokens, t_tag, t_write, t_sum = fields
    if (
        magic not in (MAGIC_XXH3, MAGIC_WSUM)
        or check != xxhash.xxh3_64_intdigest(trailer[:_TRAILER.size])
        or t_ns != bytes.fromhex(ns)
        or t_key != bytes.fromhex(key)
        or t_sec != section
        or t_n != shape.n_sections
        or t_len != shape.section_bytes
        or t_tag != tag
    ):
        return None
    return magic, t_write, t_sum


class ObjectWriter:
    """Writes one object's sections as they come; commits when all are on the drives.

    Sections may arrive in any order from any thread, each exactly once. `abort()` (or a
    failed or refused section) discards everything written; nothing becomes visible until
    `commit`. `done` always resolves: once every section came and was written (True, or
    False if any failed), or once a failed writer's writes in flight are over (False).
    Nothing here touches a drive on the caller's thread (the engine's forward pass): each
    fragment file is created by the I/O thread that first writes to it."""

    def __init__(self, store: Store, ns: str, key: str, shape: ObjectShape, num_tokens: int, tag: int):
        self.store, self.ns, self.key, self.shape = store, ns, key, shape
        self.num_tokens, self.tag = num_tokens, tag
        self.nfrag = store.n_fragments(shape)
        ident = uuid.uuid4()
        # In every section's trailer: a reader takes sections of one write only.
        self.write_id = ident.int & (2**64 - 1)
        suffix = f"{os.getpid()}.{ident.hex[:8]}.tmp"
        self.final = [store.fragment_path(ns, key, shape, f) for f in range(self.nfrag)]
        self.tmp = [p.with_name(f".{p.name}.{suffix}") for p in self.final]
        self._fds: list[int | None] = [None] * self.nfrag  # opened at the first write (_open)
        self._device_files: list[Any] = [None] * self.nfrag  # opened at the first device write
        self._submitted = [False] * shape.n_sections
        self._n_submitted = 0
        self._in_flight = 0
        self._finished = False  # commit or discard has begun: exactly once
        self._queued: list[list[_QueuedWrite]] = [[] for _ in range(self.nfrag)]
        self._draining = [False] * self.nfrag
        self._failed = False
        self._out_of_space = False
        self._closed = False
        self._lock = threading.Lock()
        self.done: Future[bool] = Future()

    def _open(self, frag: int) -> int:
        """The fragment's temporary file, created at its first write (on an I/O thread; one
        drain per file at a time, so never twice)."""
        fd = self._fds[frag]
        if fd is not None:
            return fd
        if self._closed:
            raise OSError(errno.EBADF, "the writer is closed")
        p = self.tmp[frag]
        for attempt in range(3):
            p.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = self.store._open_for(frag, p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise  # an eviction removed the key directory, empty, between the two: again
        # Allocate the fragment up front: direct writes inside the file's size run in
        # parallel, while writes that extend a file are serialized by the filesystem.
        try:
            os.posix_fallocate(fd, 0, self.store.fragment_bytes(self.key, self.shape, frag))
        except OSError as e:
            if e.errno in _NO_SPACE:
                os.close(fd)
                raise
            # a filesystem without fallocate still takes the writes
        with self._lock:
            if self._closed:  # closed meanwhile (a failed section elsewhere): not ours to keep
                os.close(fd)
                raise OSError(errno.EBADF, "the writer is closed")
            self._fds[frag] = fd
        return fd

    def fill_trailer(self, section: int, buf: memoryview) -> None:
        """Write the section's trailer into its slot after the payload."""
        shape = self.shape
        pay = align_up(shape.section_bytes)
        checksum = xxhash.xxh3_64_intdigest(buf[:shape.section_bytes])
        buf[pay:pay + TRAILER_BYTES] = pack_trailer(
            self.ns, self.key, shape, section, self.num_tokens, self.tag, self.write_id, MAGIC_XXH3, checksum
        )

    def submit_section(self, section: int, buf: memoryview, on_done: Callable[[bool], None]) -> None:
        """Checksum and queue a section whose payload is in buf[:section_bytes] (a writable
        buffer of at least shape.stride bytes); on_done(ok) runs when the slot may be reused,
        also when the section is refused (ValueError: the writer then fails)."""
        try:
            view = memoryview(buf).cast("B")
        except (TypeError, ValueError):
            view = None
        problem = None
        if view is None:
            problem = f"section {section!r}: {type(buf).__name__} is not a contiguous buffer"
        elif view.readonly:
            problem = f"section {section!r}: the buffer is read-only"
        if not self._admit(section, view.nbytes if view is not None else 0, problem, on_done):
            return
        try:
            self.fill_trailer(section, view)  # type: ignore[arg-type]
        except Exception:
            self._unadmit(on_done)
            raise
        self._queue(section, view[:self.shape.stride], on_done)  # type: ignore[index]

    def submit_device_section(self, section: int, slot: Any, on_done: Callable[[bool], None]) -> None:
        """The same for a section in device memory (a uint8 tensor of shape.stride bytes,
        its payload ready): checksummed on the device, written by the store's device_io."""
        if not self._admit(section, int(slot.numel()), None, on_done):
            return
        import torch

        shape = self.shape
        pay = align_up(shape.section_bytes)
        try:
            with side_stream(slot.device):
                checksum = wsum64_tensor(slot[:shape.section_bytes])
                trailer = pack_trailer(self.ns, self.key, shape, section, self.num_tokens, self.tag, self.write_id,
                                       MAGIC_WSUM, checksum)
                slot[pay:pay + TRAILER_BYTES].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
                if slot.is_cuda:
                    torch.cuda.current_stream().synchronize()  # kvikio writes from its own stream
        except Exception:
            self._unadmit(on_done)
            raise
        self._queue(section, slot[:shape.stride], on_done)

    def _admit(self, section: object, nbytes: int, problem: str | None, on_done: Callable[[bool], None]) -> bool:
        """Whether a section goes to the drives. A misused one (an index outside the shape
        or given twice, a buffer too short or read-only) fails the writer and raises; one
        that comes after a failure is given back. Either way on_done(False) runs first."""
        n = self.shape.n_sections
        if problem is None:
            if not isinstance(section, int) or isinstance(section, bool) or not 0 <= section < n:
                problem = f"section {section!r} is not one of 0..{n - 1} (the shape has {n} sections)"
            elif nbytes < self.shape.stride:
                problem = f"section {section}: the buffer holds {nbytes} bytes, fewer than shape.stride {self.shape.stride}"
        with self._lock:
            if problem is None and self._submitted[section]:  # type: ignore[index]
                problem = f"section {section} was submitted twice"
            if problem is None:
                self._submitted[section] = True  # type: ignore[index]
                self._n_submitted += 1
                if not self._failed:
                    self._in_flight += 1
                    return True
            self._failed = True
            finish = self._finishing()
        on_done(False)
        if finish:
            self._fail()
        if problem is not None:
            raise ValueError(f"kvlab store: object {self.key}: {problem}; the object is not written")
        return False

    def _unadmit(self, on_done: Callable[[bool], None]) -> None:
        """A section admitted but never queued (its checksum or trailer failed)."""
        on_done(False)
        self._section_done(False)

    def _finishing(self) -> bool:
        """Under the lock: whether the writer is over now, and this caller is the one to
        commit or discard it (exactly one is)."""
        if self._finished or self._in_flight:
            return False
        if self._failed or self._n_submitted == self.shape.n_sections:
            self._finished = True
            return True
        return False

    def _queue(self, section: int, buf: Any, on_done: Callable[[bool], None]) -> None:
        frag, offset = self.store.placement(self.key, self.shape, section)
        with self._lock:
            self._queued[frag].append((offset, buf, on_done))
            start = not self._draining[frag]
            self._draining[frag] = True
        if start:
            self.store.engine.submit(self._drain, frag)

    def _drain(self, frag: int) -> None:
        """Write out whatever is queued for one fragment file, on an I/O thread.

        One drain per file at a time: sections that arrive while it writes queue up and
        go out together, adjacent ones as one vectored write. Fewer, larger requests are
        what lets a drive reach its sequential write speed (one write per section
        reached ~0.6 of fio's limit here; whole objects per write, fio's)."""
        while True:
            with self._lock:
                items, self._queued[frag] = self._queued[frag], []
                if not items:
                    self._draining[frag] = False
                    return
            items.sort(key=lambda it: it[0])
            for run in _contiguous_runs(items):
                self._write_run(frag, run)

    def _write_run(self, frag: int, run: list[_QueuedWrite]) -> None:
        store = self.store
        nbytes = sum(_nbytes(buf) for _, buf, _ in run)
        ok = False
        t0 = time.perf_counter()
        if not self._failed:
            try:
                fd = self._open(frag)
                if isinstance(run[0][1], memoryview):
                    ok = pwritev_full(fd, [buf for _, buf, _ in run], run[0][0]) == nbytes
                else:  # device memory: one section per run
                    (offset, slot, _), = run
                    if self._device_files[frag] is None:
                        self._device_files[frag] = store.device_io.open(self.tmp[frag], "r+")
                    ok = store.device_io.pwrite(self._device_files[frag], slot, nbytes, offset) == nbytes
            except Exception as e:  # an I/O error (or a device error): the object is not written
                ok = False
                if isinstance(e, OSError) and e.errno in _NO_SPACE:
                    self._out_of_space = True
            dt = time.perf_counter() - t0
            with store._lock:
                store.stats.note_latency(dt)
                if ok:
                    store.stats.bytes_written += nbytes
                    store.stats.write_s += dt
            metrics.observe_io(dt, written_bytes=nbytes if ok else 0)
        for _, _, on_done in run:
            on_done(ok)
            self._section_done(ok)

    def _section_done(self, ok: bool) -> None:
        with self._lock:
            self._in_flight -= 1
            if not ok:
                self._failed = True
            finish = self._finishing()
        if finish:
            if self._failed:
                self._fail()
            else:
                self._commit()

    def abort(self, unsubmitted: int = 0) -> None:
        """Give up on this object (no ring slot for a section, say): the sections not
        submitted will never come (`unsubmitted`, their count, is kept for callers that
        pass it; the writer knows which). Sections in flight finish first; the last one
        discards it all."""
        with self._lock:
            self._failed = True
            finish = self._finishing()
        if finish:
            self._fail()

    def abort_unfinished(self) -> None:
        """Abort if some section has not come yet (the store is closing)."""
        with self._lock:
            waiting = self._n_submitted < self.shape.n_sections
        if waiting:
            self.abort()

    def _close_fds(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for h in self._device_files:
            if h is not None:
                try:
                    h.close()
                except Exception:
                    pass
        for fd in self._fds:
            if fd is None:
                continue
            try:
                os.close(fd)
            except OSError:
                pass

    def _fail(self) -> None:
        if self.done.done():
            return  # already discarded (an open that failed, then the sections that came anyway)
        self._close_fds()
        for p in self.tmp:
            _unlink(str(p))
        with self.store._lock:
            self.store.stats.writes_aborted += 1
        if self._out_of_space:
            # After this object's files are gone (they are not the store's), and on an I/O
            # thread: an abort() can bring us here on the engine's own thread.
            try:
                self.store.engine.submit(self.store._on_full)
            except RuntimeError:
                pass  # the store is closing: its bound no longer matters
        if not self.done.done():
            self.done.set_result(False)

    def _commit(self) -> None:
        self._close_fds()
        try:
            # Fragment 0 last: its mtime orders eviction, and an object is complete only
            # once every fragment is in place.
            for f in range(self.nfrag - 1, -1, -1):
                os.replace(self.tmp[f], self.final[f])
        except OSError:
            for p in self.tmp + self.final:
                _unlink(str(p))
            with self.store._lock:
                self.store.stats.writes_aborted += 1
            self.done.set_result(False)
            return
        with self.store._lock:
            self.store.stats.objects_written += 1
        try:
            self.store._account(self.shape.object_bytes)
        except OSError:
            # The ledger could not be updated (a full or failing first drive): the object
            # stands, and the next eviction's scan counts usage from the drives again.
            pass
        finally:
            self.done.set_result(True)


def _nbytes(buf: Any) -> int:
    return len(buf) if isinstance(buf, memoryview) else int(buf.numel())


def _contiguous_runs(items: list[_QueuedWrite]) -> Iterator[list[_QueuedWrite]]:
    """Split offset-sorted writes into runs that are adjacent on the drive and fit one
    request. Host buffers merge into one vectored write; a device section goes alone
    (kvikio splits a request over its own threads)."""
    run = [items[0]]
    size = _nbytes(items[0][1])
    for it in items[1:]:
        adjacent = run[-1][0] + _nbytes(run[-1][1]) == it[0]
        host = isinstance(it[1], memoryview) and isinstance(run[-1][1], memoryview)
        if host and adjacent and size + len(it[1]) <= MAX_WRITE_BYTES and len(run) < MAX_WRITE_BUFFERS:
            run.append(it)
            size += len(it[1])
        else:
            yield run
            run, size = [it], _nbytes(it[1])
    yield run
