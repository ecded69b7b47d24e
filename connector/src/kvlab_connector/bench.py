"""The store's own throughput, through the same path the connector uses: ring slots,
checksummed sections, striped fragments, O_DIRECT, many I/Os in flight.

Runs anywhere the connector runs (no vLLM, no fio): a lab node, the testbed's VM on an
NVMe-oF mount, this machine.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvlab_connector.config import is_positive_int
from kvlab_connector.ring import StagingRing
from kvlab_connector.store import ObjectShape, Store

NS = "be" * 16
# `kvlab-store bench --keep`: objects left on the drives, in a namespace of their own that
# neither an engine nor a plain bench (which clears NS) touches: a store filled for fsck,
# eviction or restart drills.
KEPT_NS = "beef" * 8


@dataclass
class StoreRun:
    write_gbps: float
    read_gbps: float
    bytes: int
    objects: int
    verified: bool | None
    io_mode: str
    paths: list[str]  # the drives it ran on: a report names what it measured
    io_threads: int


def _key(i: int, salt: int) -> str:
    return f"{salt:08x}{i:024x}"


def _pattern(i: int, s: int, n: int) -> np.ndarray:
    # Cheap and distinct per (object, section): a verify catches misplaced sections.
    base = np.arange(n // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (base ^ np.uint64(i * 1_000_003 + s)).view(np.uint8)


def run_store(
    paths: list[Path], size_mib: int = 1024, section_mib: int = 1, sections: int = 8,
    ring_mib: int = 256, threads: int | None = None, verify: bool = False, salt: int = 0, ns: str = NS,
) -> StoreRun:
    """Write then read `size_mib` of objects into namespace `ns`; GB/s of each phase (1e9 bytes)."""
    for name, value in (("size_mib", size_mib), ("section_mib", section_mib), ("sections", sections),
                        ("ring_mib", ring_mib)):
        if not is_positive_int(value):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    shape = ObjectShape(n_sections=sections, section_bytes=section_mib << 20)
    n_objects = max(1, (size_mib << 20) // (shape.section_bytes * sections))
    store = Store(paths, capacity_bytes=1 << 50, io_threads=threads)
    ring = StagingRing(ring_mib << 20, shape.stride)
    try:
        fill = _pattern(0, 0, shape.section_bytes)
        t0 = time.perf_counter()
        writers = []
        for i in range(n_objects):
            w = store.begin_write(ns, _key(i, salt), shape, num_tokens=0)
            for s in range(sections):
                slot = ring.acquire(timeout_s=None)
                buf = ring.buffer(slot)
                buf[:shape.section_bytes] = _pattern(i, s, shape.section_bytes) if verify else fill
                w.submit_section(s, buf, lambda ok, slot=slot: ring.release(slot))
            writers.append(w)
        ok = all(w.done.result() for w in writers)
        write_s = time.perf_counter() - t0
        if not ok:
            raise RuntimeError("a write failed: see the store's stats")
        total = n_objects * sections * shape.section_bytes

        # Reads go as the connector's loads do: adjacent sections of a fragment file in
        # one request (Store.sections_per_read).
        per_run = store.sections_per_read(shape, min(sections, ring.num_slots // 2))
        t0 = time.perf_counter()
        bad = 0
        futures = []
        opened = []
        for i in range(n_objects):
            key = _key(i, salt)
            fds = store.open_object(ns, key, shape)
            if fds is None:
                raise RuntimeError(f"object {i} vanished")
            opened.append(fds)
            for run in store.read_runs(key, shape, range(sections), per_run):
                # Verify and release the oldest reads while the ring keeps I/Os in flight.
                while ring.num_slots - ring.in_use < len(run) + 1:
                    bad += _retire(futures.pop(0), ring, shape, verify)
                slots = [ring.acquire(timeout_s=None) for _ in run]
                fut = store.submit_read_sections(fds, ns, key, shape, run, [ring.buffer(s) for s in slots])
                futures.append((i, run, slots, fut))
        while futures:
            bad += _retire(futures.pop(0), ring, shape, verify)
        read_s = time.perf_counter() - t0
        for fds in opened:
            for fd in fds:
                os.close(fd)
        if bad:
            raise RuntimeError(f"{bad} sections failed verification")
        return StoreRun(total / write_s / 1e9, total / read_s / 1e9, total, n_objects,
                        True if verify else None, store.io_mode, [str(p) for p in paths], store.engine.threads)
    finally:
        ring.close()
        store.close()


def _retire(item, ring: StagingRing, shape: ObjectShape, verify: bool) -> int:  # type: ignore[no-untyped-def]
    """Wait for one read request; the number of its sections that failed."""
    i, run, slots, fut = item
    bad = 0
    try:
        for s, slot, ok in zip(run, slots, fut.result(), strict=True):
            if ok and verify:
                got = np.frombuffer(ring.buffer(slot, shape.section_bytes), dtype=np.uint8)
                ok = bool(np.array_equal(got, _pattern(i, s, shape.section_bytes)))
            bad += not ok
        return bad
    finally:
        for slot in slots:
            ring.release(slot)


def clear(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(Path(p) / "kvlab-v1" / NS, ignore_errors=True)


def make_small_objects(paths: list[Path], count: int, threads: int = 8) -> float:
    """Fill the store with `count` one-page objects; returns seconds taken."""
    shape = ObjectShape(n_sections=1, section_bytes=4096)
    store = Store(paths, capacity_bytes=1 << 50, io_threads=threads)
    ring = StagingRing(256 * shape.stride, shape.stride)
    t0 = time.perf_counter()
    try:
        pending = []
        for i in range(count):
            slot = ring.acquire(timeout_s=None)
            buf = ring.buffer(slot)
            buf[:8] = i.to_bytes(8, "little")
            w = store.begin_write(NS, _key(i, 0xABC), shape, num_tokens=0)
            w.submit_section(0, buf, lambda ok, slot=slot: ring.release(slot))
            pending.append(w.done)
            if len(pending) > 1024:
                for f in pending:
                    f.result()
                pending.clear()
        for f in pending:
            f.result()
    finally:
        ring.close()
        store.close()
    return time.perf_counter() - t0


def rebuild_seconds(paths: list[Path]) -> tuple[float, int]:
    """Time a fresh store's start-up index rebuild; returns (seconds, objects found)."""
    store = Store(paths, capacity_bytes=1 << 50)
    try:
        scan = store.rebuild()
        return scan.seconds, scan.objects
    finally:
        store.close()
