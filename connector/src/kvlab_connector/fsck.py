"""`kvlab-store fsck`: every object on a store's drives verified at rest, as a read would
verify it, and what is damaged named; `--repair` removes exactly the damaged objects.

Objects are verified when read, so a drive that rots in a cold region, or a store left by an
older format, is otherwise found only by the requests that hit it. fsck walks the drives,
reads every section of every object (at a bounded rate, through O_DIRECT where the drive
takes it, so that it can run beside engines that use the store), and checks its trailer
(format, namespace, key, section, shape, the write it belongs to) and its checksum.

Kinds of damage, per object: `corrupt` (a section's trailer or checksum fails, or the file's
name disagrees with its trailer), `partial` (a fragment file missing, or not of the size its
name says: truncated), `stale_format` (written by an older format), `mixed_writes` (sections
of two writes of one key); and per file: `orphaned` (the temporary file of a writer that is
gone) and `foreign` (a file the store did not write: counted, never touched).

An object is what the ledger counts and evicts as one: a namespace, a key and a fragment
count (store/ledger.py: ObjectId). A fragment missing for less than a minute is an object
being committed or evicted by a running engine: skipped, not damaged.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash

from kvlab_connector.checksum import wsum64
from kvlab_connector.osutil import pid_alive
from kvlab_connector.ring import PAGE, align_up
from kvlab_connector.store.format import (
    FRAGMENT_RE,
    MAGIC_XXH3,
    ROOT_NAME,
    STALE_MAGICS,
    TMP_RE,
    TRAILER_BYTES,
    ObjectShape,
    parse_trailer,
    sections_of,
)
from kvlab_connector.store.ledger import Ledger, ObjectId
from kvlab_connector.store.stats import StoreStats

DAMAGE = ("corrupt", "partial", "stale_format", "mixed_writes")
IN_FLIGHT_S = 60.0  # a fragment missing for less than this: an object being committed or evicted now
ORPHAN_S = 600.0  # a temporary file this old is orphaned even if its writer's PID runs (reused)
_HEX = "0123456789abcdef"


class CannotCheck(Exception):
    """A drive that fsck cannot read: exit status 2."""


@dataclass
class Report:
    paths: list[str]
    objects: int = 0
    bytes: int = 0
    damaged: int = 0
    damaged_keys: list[str] = field(default_factory=list)
    damage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DAMAGE, 0))
    orphaned_files: int = 0
    foreign_files: int = 0
    in_flight: int = 0  # objects skipped: being committed or evicted by a running engine
    namespaces: dict[str, dict[str, int]] = field(default_factory=dict)
    bytes_read: int = 0
    repaired: bool = False
    removed_objects: int = 0
    removed_files: int = 0
    usage_bytes: int | None = None  # the ledger's usage after a repair
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (self.damaged or self.orphaned_files or self.foreign_files)


class Throttle:
    """At most `bytes_per_s` on average: each read waits until its bytes are due."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self.t0 = time.monotonic()
        self.total = 0

    def take(self, nbytes: int) -> None:
        self.total += nbytes
        wait = self.total / self.rate - (time.monotonic() - self.t0)
        if wait > 0:
            time.sleep(wait)


@dataclass
class _Walk:
    objects: dict[ObjectId, dict[int, list[str]]] = field(default_factory=dict)
    orphaned: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


def _scandir(path: str | Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []  # removed meanwhile (an eviction takes empty key directories)
    except OSError as e:
        raise CannotCheck(f"{path} cannot be read ({e.strerror or e})") from e


def _is_name(s: str) -> bool:
    return len(s) == 32 and all(c in _HEX for c in s)


def walk(roots: list[Path]) -> _Walk:
    """Every file under the drives' store roots, sorted into objects, orphaned temporary
    files and foreign files; from names alone."""
    out = _Walk()
    now = time.time()
    for root in roots:
        for ns in _scandir(root):
            if ns.name == ".meta":
                continue  # the ledger's lock and usage
            if not ns.is_dir(follow_symlinks=False) or not _is_name(ns.name):
                out.foreign.append(ns.path)
                continue
            for sub in _scandir(ns.path):
                if not sub.is_dir(follow_symlinks=False):
                    out.foreign.append(sub.path)
                    continue
                for e in _scandir(sub.path):
                    m = FRAGMENT_RE.match(e.name)
                    t = TMP_RE.match(e.name)
                    if m and m.group(1)[:2] == sub.name and e.is_file(follow_symlinks=False):
                        frags = out.objects.setdefault((ns.name, m.group(1), int(m.group(3))), {})
                        frags.setdefault(int(m.group(2)), []).append(e.path)
                    elif t and e.is_file(follow_symlinks=False):
                        if not pid_alive(int(t.group(5))) or now - _mtime(e.path) > ORPHAN_S:
                            out.orphaned.append(e.path)
                    else:
                        out.foreign.append(e.path)
    return out


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _identity(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class SectionReader:
    """Sections read into one page-aligned buffer, O_DIRECT where the file takes it."""

    def __init__(self, throttle: Throttle):
        self.throttle = throttle
        self.buf = mmap.mmap(-1, PAGE)
        self.bytes_read = 0

    def open(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return os.open(path, os.O_RDONLY)

    def read(self, fd: int, offset: int, nbytes: int) -> memoryview:
        if len(self.buf) < nbytes:
            self.buf = mmap.mmap(-1, align_up(nbytes))  # the smaller one goes with its last view
        view = memoryview(self.buf)[:nbytes]
        got = os.preadv(fd, [view], offset)
        self.bytes_read += got
        self.throttle.take(got)
        return view[:got]


def _check_file(reader: SectionReader, ns: str, key: str, nfrag: int, frag: int, path: str,
                write_ids: set[int], tags: set[int]) -> str | None:  # fmt: skip
    """The kind of damage of one fragment file, or None if every section in it verifies."""
    m = FRAGMENT_RE.match(os.path.basename(path))
    assert m is not None
    named = int(m.group(4))
    fd = reader.open(path)
    try:
        size = os.fstat(fd).st_size
        if size != named or size < PAGE:
            return "partial"
        last = reader.read(fd, size - PAGE, PAGE)
        head = parse_trailer(bytes(last[:TRAILER_BYTES]))
        if head is None:
            return "stale_format" if bytes(last[:8]) in STALE_MAGICS else "corrupt"
        try:
            shape = ObjectShape(head.n_sections, head.section_bytes)
        except ValueError:
            return "corrupt"
        sections = sections_of(key, nfrag, shape, frag) if nfrag <= shape.n_sections else []
        if not sections or len(sections) * shape.stride != named:
            return "corrupt"  # the name and the trailers disagree on the object's shape
        pay = align_up(shape.section_bytes)
        for i, s in enumerate(sections):
            buf = reader.read(fd, i * shape.stride, shape.stride)
            if len(buf) < shape.stride:
                return "partial"
            raw = bytes(buf[pay:pay + TRAILER_BYTES])
            t = parse_trailer(raw)
            if t is None:
                return "stale_format" if raw[:8] in STALE_MAGICS else "corrupt"
            if (t.ns, t.key, t.section, t.n_sections, t.section_bytes) != (ns, key, s, *_shape(shape)):
                return "corrupt"
            payload = buf[:shape.section_bytes]
            actual = xxhash.xxh3_64_intdigest(payload) if t.magic == MAGIC_XXH3 else wsum64(payload)
            if actual != t.checksum:
                return "corrupt"
            write_ids.add(t.write_id)
            tags.add(t.tag)
        return None
    finally:
        os.close(fd)


def _shape(shape: ObjectShape) -> tuple[int, int]:
    return shape.n_sections, shape.section_bytes


def check_object(reader: SectionReader, obj: ObjectId, frags: dict[int, list[str]]) -> str | None:
    """The first kind of damage found in an object, or None if it is whole."""
    ns, key, nfrag = obj
    if set(frags) != set(range(nfrag)):
        return "partial"
    write_ids: set[int] = set()
    tags: set[int] = set()
    for frag in sorted(frags):
        for path in frags[frag]:
            kind = _check_file(reader, ns, key, nfrag, frag, path, write_ids, tags)
            if kind is not None:
                return kind
    if len(write_ids) > 1 or len(tags) > 1:
        return "mixed_writes"
    return None


def fsck(paths: list[Path], repair: bool = False, bytes_per_s: float = 256 << 20,
         progress: Callable[[int, int, Report], None] | None = None) -> Report:  # fmt: skip
    """Verify every object on the drives; with `repair`, remove the damaged ones (and
    orphaned temporary files) and set the ledger's usage to what stays."""
    t0 = time.perf_counter()
    roots = []
    for p in paths:
        root = Path(p) / ROOT_NAME
        if not root.is_dir():
            raise CannotCheck(f"{p} holds no store ({ROOT_NAME}/ is missing): is its drive mounted?")
        roots.append(root)
    found = walk(roots)
    report = Report(paths=[str(p) for p in paths])
    reader = SectionReader(Throttle(bytes_per_s))
    damaged: dict[ObjectId, tuple[str, list[tuple[str, tuple[int, int, int] | None]]]] = {}
    now = time.time()
    items = sorted(found.objects.items())
    for n, (obj, frags) in enumerate(items):
        ns, key, nfrag = obj
        files = [f for fs in frags.values() for f in fs]
        ident = [(f, _identity(f)) for f in files]
        if any(i is None for _, i in ident):
            report.in_flight += 1  # evicted under us
            continue
        if set(frags) != set(range(nfrag)) and now - max(_mtime(f) for f in files) < IN_FLIGHT_S:
            report.in_flight += 1  # a commit's renames, or an eviction's unlinks, under way
            continue
        try:
            kind = check_object(reader, obj, frags)
        except FileNotFoundError:
            report.in_flight += 1
            continue
        except OSError as e:
            raise CannotCheck(f"{files[0]} cannot be read ({e.strerror or e})") from e
        size = sum(int(FRAGMENT_RE.match(os.path.basename(f)).group(4)) for f in files)  # type: ignore[union-attr]
        per_ns = report.namespaces.setdefault(ns, {"objects": 0, "bytes": 0, "damaged": 0})
        report.objects += 1
        report.bytes += size
        per_ns["objects"] += 1
        per_ns["bytes"] += size
        if kind is not None:
            damaged[obj] = (kind, ident)
            report.damage[kind] += 1
            per_ns["damaged"] += 1
        if progress is not None:
            progress(n + 1, len(items), report)
    report.damaged = len(damaged)
    report.damaged_keys = sorted({key for _ns, key, _n in damaged})
    report.orphaned_files = len(found.orphaned)
    report.foreign_files = len(found.foreign)
    report.bytes_read = reader.bytes_read
    if repair:
        # Exactly what was found damaged, and only if it is still the file that was checked
        # (an engine may have written the key again since); foreign files never.
        doomed = [f for _kind, ident in damaged.values() for f, i in ident if _identity(f) == i]
        doomed += [f for f in found.orphaned if _identity(f) is not None]
        ledger = Ledger(roots, 1 << 62, StoreStats(), threading.Lock())
        report.usage_bytes = ledger.remove_files(doomed).bytes
        report.repaired = True
        report.removed_objects = len(damaged)
        report.removed_files = len(doomed)
    report.seconds = time.perf_counter() - t0
    return report


def as_json(report: Report) -> dict:
    return asdict(report) | {"clean": report.clean}


def terminal_progress(done: int, total: int, report: Report) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(
        f"\rfsck [{'#' * filled}{'.' * (width - filled)}] {done}/{total} objects, "
        f"{report.bytes / 2**20:.0f} MiB, {sum(report.damage.values())} damaged"
    )
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
