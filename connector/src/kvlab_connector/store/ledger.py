"""The store's capacity ledger: committed bytes counted under an flock that every process
sharing the drives takes, least-recently-used eviction to the bound, and the walk of the
drives that rebuilds it all at start.

A usage ledger beside the lock file of the first drive counts committed bytes; a commit
that crosses the capacity evicts least-recently-used objects (file mtime, which reads
refresh), so several processes share one bound. A drive that fills up before the bound
(other data on it, or a bound set too high) lowers the bound below what the drives hold,
and evicts below that: saves go on, at the size the drives allow; the bound grows back (up
to capacity_bytes) when room returns.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvlab_connector import metrics
from kvlab_connector.osutil import pid_alive, syncfs
from kvlab_connector.store.format import FRAGMENT_RE, TMP_RE, check_name
from kvlab_connector.store.stats import StoreStats

log = logging.getLogger("vllm.kvlab_connector")

LOW_WATER = 0.9  # eviction frees down to this share of the capacity
# What the walk counts and evicts as one: (namespace, key, fragments). TP ranks write the
# same keys into a namespace each. One key may also be stored in several shapes (a whole
# chunk, a tail); those with as many fragments are counted as objects but evicted together:
# their files' names alone cannot say which fragments belong to which.
ObjectId = tuple[str, str, int]


@dataclass(frozen=True)
class ScanResult:
    objects: int
    bytes: int
    removed_partial: int
    seconds: float
    entries: list[tuple[float, int, ObjectId]]  # (mtime or 0, bytes, object)
    paths: dict[ObjectId, list[str]]  # object -> its fragment files


class Ledger:
    """The bound and the usage of one store's drives, shared with every process that opens
    them. `stats` and `stats_lock` are the store's."""

    def __init__(self, drives: list[Path], capacity_bytes: int, stats: StoreStats, stats_lock: threading.Lock):
        self.drives = drives
        self.capacity_limit = capacity_bytes  # as configured; the bound comes back up to it
        self.capacity_bytes = capacity_bytes  # the bound now: lower while the drives are full
        self.stats = stats
        self._lock = stats_lock
        self._meta = drives[0] / ".meta"
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

    def account(self, nbytes: int) -> None:
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

    def on_full(self) -> None:
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

    def flush(self) -> None:
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
        # object -> (files seen of each fragment index, [bytes], paths)
        seen: dict[ObjectId, tuple[dict[int, int], list[int], list[str]]] = {}
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
                        m = FRAGMENT_RE.match(name)
                        if m:
                            frags, size, files = seen.setdefault((ns_entry.name, m.group(1), int(m.group(3))),
                                                                 ({}, [0], []))
                            frag = int(m.group(2))
                            frags[frag] = frags.get(frag, 0) + 1
                            size[0] += int(m.group(4))
                            files.append(e.path)
                        elif clean and name.endswith(".tmp"):
                            t = TMP_RE.match(name)
                            if t is None or not pid_alive(int(t.group(5))) or now - _mtime(e.path) > 600:
                                unlink_quietly(e.path)
                                removed += 1
        entries_out = []
        paths = {}
        total = objects = 0
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
                objects += min(frags.values())  # shapes whose every fragment is there
            elif clean and now - max(_mtime(p) for p in files) > 60:
                # A writer died between renames: the object was never complete.
                _remove_files(files)
                removed += 1
        return ScanResult(objects, total, removed, time.perf_counter() - t0, entries_out, paths)

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
                m = FRAGMENT_RE.match(e.name)
                if m and m.group(1) == key:
                    files.append(e.path)
                    freed += int(m.group(4))
        _remove_files(files)
        if freed:
            self._with_lock(lambda: self._write_usage(self._read_usage() - freed))
        return freed


def unlink_quietly(path: str) -> None:
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
        unlink_quietly(p)
    for parent in {p.rsplit("/", 1)[0] for p in paths}:
        _rmdir(parent)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
