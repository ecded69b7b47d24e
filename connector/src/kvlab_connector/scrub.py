"""Scrub: the connector re-verifies its objects at rest in the background, coldest first, at a
bounded rate (`scrub_bytes_per_s`, off by default), and removes what fails, counted.

A read verifies what it reads, but an object nobody asks for is never read: a drive that
rots in a cold region is found only by the request that finally hits it, as a miss. Scrub
reads those regions first (least recently used first, as eviction orders them), with fsck's
checks (fsck.check_object), so a damaged object is gone, and counted, before it is asked for.
One thread in the scheduler's process (one per store, not per rank).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from kvlab_connector import metrics
from kvlab_connector.fsck import IN_FLIGHT_S, SectionReader, Throttle, check_object, walk
from kvlab_connector.osutil import name_os_thread
from kvlab_connector.store.ledger import Ledger

log = logging.getLogger("vllm.kvlab_connector")
PAUSE_S = 60.0  # between passes: a pass over a small store would otherwise spin on directory walks


class Scrubber:
    def __init__(self, roots: list[Path], ledger: Ledger, bytes_per_s: int):
        self.roots = roots  # each drive's store root
        self.ledger = ledger
        self.reader = SectionReader(Throttle(bytes_per_s))
        self.objects_checked = 0
        self.removed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pass_once(self) -> int:
        """Verify every object once, coldest first; returns how many failed and were removed."""
        removed = 0
        now = time.time()
        for obj, frags in sorted(walk(self.roots).objects.items(), key=lambda item: _last_use(item[1])):
            if self._stop.is_set():
                break
            ns, key, nfrag = obj
            if set(frags) != set(range(nfrag)) and now - _newest(frags) < IN_FLIGHT_S:
                continue  # being committed or evicted now
            before = self.reader.bytes_read
            try:
                kind = check_object(self.reader, obj, frags)
            except OSError:
                continue  # evicted meanwhile, or a drive that fails: the reads will say so
            self.objects_checked += 1
            metrics.inc("scrubbed_bytes", self.reader.bytes_read - before)
            if kind is not None:
                self.ledger.remove(ns, key)
                removed += 1
                metrics.inc("scrub_removed")
                log.warning("kvlab scrub: object %s/%s failed verification at rest (%s): removed", ns, key, kind)
        self.removed += removed
        return removed

    def _run(self) -> None:
        name_os_thread()
        while not self._stop.is_set():
            try:
                self.pass_once()
            except Exception as e:  # scrub must never take the engine down
                log.warning("kvlab scrub: pass failed (%s); next in %.0f s", e, PAUSE_S)
            self._stop.wait(PAUSE_S)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvlab-scrub", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _last_use(frags: dict[int, list[str]]) -> float:
    """An object's last use: its first fragment's mtime, which reads refresh."""
    return _mtime((frags.get(0) or next(iter(frags.values())))[0])


def _newest(frags: dict[int, list[str]]) -> float:
    return max(_mtime(f) for files in frags.values() for f in files)
