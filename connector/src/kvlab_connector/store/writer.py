"""The store's writer: one object's sections, queued as they come, checksummed and written
by the I/O threads as few large requests per fragment file, committed by renames once every
section is on the drives.

Fragment files are written under temporary names and renamed into place once every section
of the object is on the drives; an object exists only when all of its fragment files do.
Two writers of one key can interleave their renames (or a crash can stop one halfway) and
leave fragments of both: each section's trailer names its write, and a reader takes one.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from kvlab_connector.io.posix import PosixEngine
from kvlab_connector.store.format import ObjectShape, WriteFields
from kvlab_connector.store.fragments import Fragments
from kvlab_connector.store.ledger import Ledger, make_key_dir, unlink_quietly
from kvlab_connector.store.memory import HOST, FragmentFile, QueuedWrite, SectionMemory
from kvlab_connector.store.stats import Recorder

log = logging.getLogger("vllm.kvlab_connector")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full drive, or the store's user's quota
# One write request carries at most this much (and fewer buffers than IOV_MAX, 1024).
MAX_WRITE_BYTES = 8 << 20
MAX_WRITE_BUFFERS = 256
# Opens of a fragment's file that find its key directory gone (removed again by an eviction
# elsewhere each time) before the write fails.
_OPEN_ATTEMPTS = 8


class ObjectWriter:
    """Writes one object's sections as they come; commits when all are on the drives.

    Sections may arrive in any order from any thread, each exactly once. `abort()` (or a
    failed or refused section) discards everything written; nothing becomes visible until
    `commit`. `done` always resolves: once every section came and was written (True, or
    False if any failed), or once a failed writer's writes in flight are over (False).
    Nothing here touches a drive on the caller's thread (the engine's forward pass): each
    fragment file is created by the I/O thread that first writes to it.

    It takes what it needs of the store: where the fragments go, the I/O threads, the stats
    it counts in, and the ledger that a commit (or a full drive) reports to."""

    def __init__(
        self, fragments: Fragments, engine: PosixEngine, stats: Recorder, ledger: Ledger,
        ns: str, key: str, shape: ObjectShape, num_tokens: int, tag: int,
    ):  # fmt: skip
        self.fragments, self.engine, self.stats, self.ledger = fragments, engine, stats, ledger
        self.ns, self.key, self.shape = ns, key, shape
        self.num_tokens, self.tag = num_tokens, tag
        self.nfrag = fragments.n_fragments(shape)
        ident = uuid.uuid4()
        # In every section's trailer: a reader takes sections of one write only.
        self.write_id = ident.int & (2**64 - 1)
        self.fields = WriteFields(ns, key, shape, num_tokens, tag, self.write_id)
        suffix = f"{os.getpid()}.{ident.hex[:8]}.tmp"
        self.final = fragments.fragment_paths(ns, key, shape)
        self.tmp = [p.with_name(f".{p.name}.{suffix}") for p in self.final]
        self._files: list[FragmentFile | None] = [None] * self.nfrag  # made at the first write (_open)
        self._submitted = [False] * shape.n_sections
        self._n_submitted = 0
        self._in_flight = 0
        self._finished = False  # commit or discard has begun: exactly once
        self._queued: list[list[QueuedWrite]] = [[] for _ in range(self.nfrag)]
        self._draining = [False] * self.nfrag
        self._failed = False
        self._out_of_space = False
        self._closed = False
        self._lock = threading.Lock()
        self.done: Future[bool] = Future()

    def _open(self, frag: int) -> FragmentFile:
        """The fragment's temporary file, created at its first write (on an I/O thread; one
        drain per file at a time, so never twice)."""
        file = self._files[frag]
        if file is not None:
            return file
        if self._closed:
            raise OSError(errno.EBADF, "the writer is closed")
        p = self.tmp[frag]
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                fd = self.fragments.open_for(frag, p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                break
            except FileNotFoundError:
                # The key directory is not there yet, or an eviction in another process
                # removed it, empty, since: make it (never the drive's own directory) and again.
                if attempt == _OPEN_ATTEMPTS - 1:
                    raise
                make_key_dir(p.parent)
        # Allocate the fragment up front: direct writes inside the file's size run in
        # parallel, while writes that extend a file are serialized by the filesystem.
        try:
            os.posix_fallocate(fd, 0, self.fragments.fragment_bytes(self.key, self.shape, frag))
        except OSError as e:
            if e.errno in _NO_SPACE:
                os.close(fd)
                raise
            # a filesystem without fallocate still takes the writes
        with self._lock:
            if self._closed:  # closed meanwhile (a failed section elsewhere): not ours to keep
                os.close(fd)
                raise OSError(errno.EBADF, "the writer is closed")
            file = self._files[frag] = FragmentFile(p, fd)
        return file

    def submit_section(
        self, section: int, buf: Any, on_done: Callable[[bool], None], memory: SectionMemory = HOST
    ) -> None:
        """Queue a section whose payload is in buf[:section_bytes] (at least shape.stride
        bytes of `memory`, writable); on_done(ok) runs when the buffer may be reused, also
        when the section is refused (ValueError: the writer then fails). The checksum and
        trailer are written by the I/O thread that writes the section, not here: on a CPU
        engine the caller is the forward pass."""
        view, nbytes, problem = memory.section(section, buf)
        if not self._admit(section, nbytes, problem, on_done):
            return
        self._queue(section, view[:self.shape.stride], on_done, memory)

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

    def _finishing(self) -> bool:
        """Under the lock: whether the writer is over now, and this caller is the one to
        commit or discard it (exactly one is)."""
        if self._finished or self._in_flight:
            return False
        if self._failed or self._n_submitted == self.shape.n_sections:
            self._finished = True
            return True
        return False

    def _queue(self, section: int, buf: Any, on_done: Callable[[bool], None], memory: SectionMemory) -> None:
        frag, offset = self.fragments.placement(self.key, self.shape, section)
        with self._lock:
            self._queued[frag].append(QueuedWrite(offset, section, buf, self.shape.stride, on_done, memory))
            start = not self._draining[frag]
            self._draining[frag] = True
        if start:
            self.engine.submit(self._drain, frag)

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
            items.sort(key=lambda it: it.offset)
            for run in _contiguous_runs(items):
                self._write_run(frag, run)

    def _write_run(self, frag: int, run: list[QueuedWrite]) -> None:
        ok = False
        t0 = time.perf_counter()
        if not self._failed:
            try:
                for q in run:
                    q.memory.seal(self.fields, q.section, q.buf)
                t0 = time.perf_counter()  # the write's own time
                ok = run[0].memory.write(self._open(frag), run)
            except Exception as e:  # a seal, an I/O or a device error: the object is not written
                ok = False
                if isinstance(e, OSError):
                    if e.errno in _NO_SPACE:
                        self._out_of_space = True
                else:
                    log.exception("kvlab store: object %s: sealing or writing a section failed", self.key)
            try:
                self.stats.note_write(t0, sum(q.nbytes for q in run), ok, drive=frag)  # fragment f is on drive f
            except Exception:  # counting failed: the sections must still come back to their owners
                log.exception("kvlab store: counting a write failed")
        for q in run:
            q.on_done(ok)
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
        for file in self._files:
            if file is not None:
                file.close()

    def _fail(self) -> None:
        if self.done.done():
            return  # already discarded (an open that failed, then the sections that came anyway)
        self._close_fds()
        for p in self.tmp:
            unlink_quietly(str(p))
        self.stats.add(writes_aborted=1)
        if self._out_of_space:
            # After this object's files are gone (they are not the store's), and on an I/O
            # thread: an abort() can bring us here on the engine's own thread.
            try:
                self.engine.submit(self.ledger.on_full)
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
                unlink_quietly(str(p))
            self.stats.add(writes_aborted=1)
            self.done.set_result(False)
            return
        self.stats.add(objects_written=1)
        try:
            self.ledger.account(self.shape.object_bytes)
        except OSError:
            # The ledger could not be updated (a full or failing first drive): the object
            # stands, and the next eviction's scan counts usage from the drives again.
            pass
        finally:
            self.done.set_result(True)


def _contiguous_runs(items: list[QueuedWrite]) -> Iterator[list[QueuedWrite]]:
    """Split offset-sorted writes into runs that are adjacent on the drive and fit one
    request. Host buffers merge into one vectored write; a device section goes alone
    (kvikio splits a request over its own threads)."""
    run = [items[0]]
    size = items[0].nbytes
    for it in items[1:]:
        prev = run[-1]
        joins = (it.memory is prev.memory and it.memory.merges_writes and prev.offset + prev.nbytes == it.offset
                 and size + it.nbytes <= MAX_WRITE_BYTES and len(run) < MAX_WRITE_BUFFERS)
        if joins:
            run.append(it)
            size += it.nbytes
        else:
            yield run
            run, size = [it], it.nbytes
    yield run
