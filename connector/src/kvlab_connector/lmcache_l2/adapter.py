"""kvlab's on-drive store as an LMCache L2 adapter (LMCache MP mode).

LMCache's cache server loads it as a plugin:

    --l2-adapter '{"type":"plugin","module_path":"kvlab_connector.lmcache_l2.adapter",
                   "class_name":"KvlabL2Adapter",
                   "adapter_params":{"paths":["/mnt/nvme0","/mnt/nvme1"],"capacity_bytes":...}}'

The objects land in the same store the vLLM connector uses: striped over the drives,
checksummed per section, committed atomically, bounded with LRU eviction. Mapping:

- an LMCache `ObjectKey` becomes a 32-hex store key: blake2b over every field of the key
  (model, KV rank, object group, cache salt, chunk hash), so every process, after any
  restart, finds the same object; the namespace is derived from the model name.
- an object of B bytes is cut into n = ceil(B / section_bytes) sections of ceil(B / n)
  bytes (the last one zero-padded), a deterministic function of B: a load, which knows
  its buffer's size, reads exactly what a store wrote.

Lookups ask the drives (the persistent index), so hits survive a cache-server restart.
Every section read is verified (checksum, key, section); anything that fails is a miss.
Host memory for KV is the staging ring only. The calls LMCache makes return at once:
the work runs on the adapter's own threads (stores, lookups and loads each on their
own, so a restore never queues behind a store), the I/O on the store's I/O threads,
and completion is signalled through three event fds as the interface requires.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from kvlab_connector.lmcache_l2.config import KvlabL2AdapterConfig
from kvlab_connector.lmcache_l2.keys import namespace_of, shape_for, store_key
from kvlab_connector.osutil import name_os_thread
from kvlab_connector.ring import PAGE, RingFull, StagingRing, align_up
from kvlab_connector.store import ObjectShape, Store

# LMCache finds the config class by its name in this module (class_name + "Config").
__all__ = ["KvlabL2Adapter", "KvlabL2AdapterConfig", "namespace_of", "shape_for", "store_key"]


@dataclass
class AdapterStats:
    """What the adapter did, for a restore's breakdown (`report_status`)."""

    store_tasks: int = 0
    objects_stored: int = 0
    objects_already_there: int = 0
    store_failures: int = 0
    bytes_stored: int = 0
    lookup_tasks: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0
    lookup_s: float = 0.0
    load_tasks: int = 0
    objects_loaded: int = 0
    load_misses: int = 0
    load_failures: int = 0  # present but unreadable or failing verification
    bytes_loaded: int = 0
    load_s: float = 0.0
    deletes: int = 0
    bytes_deleted: int = 0
    load_task_s: list[float] = field(default_factory=list)


class _ObjectLoad:
    """One object's sections in flight; `done` fires with True when all verified."""

    def __init__(self, pending: int, fds: list[int]):
        self.pending = pending
        self.ok = True
        self.fds = fds
        self.lock = threading.Lock()
        self.done: Future[bool] = Future()

    def section_done(self, ok: bool, count: int = 1) -> None:
        with self.lock:
            self.pending -= count
            self.ok = self.ok and ok
            last = self.pending == 0
        if last:
            self.done.set_result(self.ok)


def _writable_bytes(obj: Any) -> np.ndarray | None:
    try:
        arr = np.frombuffer(obj.byte_array, dtype=np.uint8)
    except (TypeError, ValueError):
        return None
    return arr if arr.flags.writeable else None


class KvlabL2Adapter(L2AdapterInterface):
    """kvlab's store behind LMCache's L2AdapterInterface; thread-safe, non-blocking."""

    def __init__(self, config: KvlabL2AdapterConfig | dict, l1_memory_desc: Any = None):
        if isinstance(config, dict):
            config = KvlabL2AdapterConfig.from_dict(config)
        super().__init__(max_capacity_bytes=config.capacity_bytes)
        self.config = config
        self.store = Store(config.paths, config.capacity_bytes, io_threads=config.io_threads,
                           o_direct=config.o_direct, require_mount=config.require_mount)
        # The index is the drives: the rebuild clears what dead writers left and resets
        # the usage ledger; lookups then stat the drives directly.
        scan = self.store.rebuild()
        self.objects_at_start = scan.objects
        self.section_bytes = config.section_bytes
        self.ring = StagingRing(config.ring_bytes, align_up(config.section_bytes) + PAGE)
        self.stats = AdapterStats()
        self._lock = threading.Lock()
        self._ns: dict[str, str] = {}
        self._next_id: L2TaskId = 0
        self._store_done: dict[L2TaskId, Any] = {}
        self._lookup_done: dict[L2TaskId, Bitmap] = {}
        self._load_done: dict[L2TaskId, Bitmap] = {}
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._stores = ThreadPoolExecutor(2, thread_name_prefix="kvlab-l2-store", initializer=name_os_thread)
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvlab-l2-lookup", initializer=name_os_thread)
        self._loads = ThreadPoolExecutor(2, thread_name_prefix="kvlab-l2-load", initializer=name_os_thread)
        self._closed = False

    # ---- event fds --------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ---- helpers ------------------------------------------------------------------------
    def _task_id(self) -> L2TaskId:
        with self._lock:
            tid = self._next_id
            self._next_id += 1
            return tid

    def _where(self, key: Any) -> tuple[str, str]:
        ns = self._ns.get(key.model_name)
        if ns is None:
            ns = self._ns.setdefault(key.model_name, namespace_of(key.model_name))
        return ns, store_key(key)

    def _acquire(self) -> int | None:
        try:
            return self.ring.acquire(timeout_s=self.config.slot_timeout_s)
        except RingFull:
            return None

    # ---- store --------------------------------------------------------------------------
    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        tid = self._task_id()
        self._stores.submit(self._guarded, self._run_store, tid, list(keys), list(objects))
        return tid

    def _guarded(self, fn: Any, tid: L2TaskId, *args: Any) -> None:
        # A task must always complete: an exception here would leave LMCache waiting.
        try:
            fn(tid, *args)
        except Exception:  # noqa: BLE001
            from lmcache.v1.distributed.internal_api import L2StoreResult

            if fn == self._run_store:
                self._finish(self._store_done, self._store_efd, tid, L2StoreResult(False, 0))
            elif fn == self._run_lookup:
                self._finish(self._lookup_done, self._lookup_efd, tid, Bitmap(len(args[0])))
            else:
                self._finish(self._load_done, self._load_efd, tid, Bitmap(len(args[0])))

    def _finish(self, table: dict, efd: Any, tid: L2TaskId, result: Any) -> None:
        with self._lock:
            table[tid] = result
        efd.notify()

    def _run_store(self, tid: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        from lmcache.v1.distributed.internal_api import L2StoreResult

        writers = []
        ok_all = True
        skipped = 0
        for key, obj in zip(keys, objects, strict=True):
            ns, skey = self._where(key)
            data = np.frombuffer(obj.byte_array, dtype=np.uint8)
            shape = shape_for(len(data), self.section_bytes)
            if self.store.exists(ns, skey, shape):
                skipped += 1
                continue
            w = self.store.begin_write(ns, skey, shape, num_tokens=0)
            for s in range(shape.n_sections):
                slot = self._acquire()
                if slot is None:
                    w.abort(shape.n_sections - s)
                    break
                buf = self.ring.buffer(slot, shape.stride)
                dst = np.frombuffer(buf, dtype=np.uint8)
                lo = s * shape.section_bytes
                hi = min(len(data), lo + shape.section_bytes)
                np.copyto(dst[:hi - lo], data[lo:hi])
                if hi - lo < shape.section_bytes:
                    dst[hi - lo:shape.section_bytes] = 0
                w.submit_section(s, buf, lambda _ok, slot=slot: self.ring.release(slot))
            writers.append((w, key, len(data)))
        stored, sizes, nbytes = [], [], 0
        for w, key, size in writers:
            if w.done.result():
                stored.append(key)
                sizes.append(size)
                nbytes += size
            else:
                ok_all = False
        with self._lock:
            st = self.stats
            st.store_tasks += 1
            st.objects_stored += len(stored)
            st.objects_already_there += skipped
            st.store_failures += len(writers) - len(stored)
            st.bytes_stored += nbytes
        if stored:
            self._notify_keys_stored(stored, sizes)
        self._finish(self._store_done, self._store_efd, tid, L2StoreResult(ok_all, nbytes))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, Any]:
        with self._lock:
            done, self._store_done = self._store_done, {}
        return done

    # ---- lookup and lock ----------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> L2TaskId:
        tid = self._task_id()
        self._lookups.submit(self._guarded, self._run_lookup, tid, list(keys))
        return tid

    def _run_lookup(self, tid: L2TaskId, keys: list[Any]) -> None:
        t0 = time.perf_counter()
        bitmap = Bitmap(len(keys))
        hits = 0
        for i, key in enumerate(keys):
            ns, skey = self._where(key)
            if self.store.exists_any_shape(ns, skey):
                bitmap.set(i)
                hits += 1
        with self._lock:
            self.stats.lookup_tasks += 1
            self.stats.lookup_keys += len(keys)
            self.stats.lookup_hits += hits
            self.stats.lookup_s += time.perf_counter() - t0
        self._finish(self._lookup_done, self._lookup_efd, tid, bitmap)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookup_done.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        # Nothing to release: the store keeps no pins. A hit is protected between lookup
        # and load by LRU order (a load refreshes it); an object evicted in that window
        # turns the load into a miss, which LMCache handles.
        return None

    # ---- load ---------------------------------------------------------------------------
    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        tid = self._task_id()
        self._loads.submit(self._guarded, self._run_load, tid, list(keys), list(objects))
        return tid

    def _run_load(self, tid: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        t0 = time.perf_counter()
        bitmap = Bitmap(len(keys))
        loads: list[tuple[int, str, str, ObjectShape, _ObjectLoad, int]] = []
        misses = 0
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            ns, skey = self._where(key)
            dst = _writable_bytes(obj)
            if dst is None:
                misses += 1
                continue
            shape = shape_for(len(dst), self.section_bytes)
            fds = self.store.open_object(ns, skey, shape)
            if fds is None:
                misses += 1
                continue
            state = _ObjectLoad(shape.n_sections, fds)
            for s in range(shape.n_sections):
                slot = self._acquire()
                if slot is None:
                    state.section_done(False, shape.n_sections - s)
                    break
                buf = self.ring.buffer(slot, shape.stride)
                fut = self.store.submit_read_section(fds, ns, skey, shape, s, buf)
                fut.add_done_callback(
                    lambda f, s=s, slot=slot, buf=buf, dst=dst, shape=shape, state=state:
                    self._section_read(f, s, slot, buf, dst, shape, state)
                )
            loads.append((i, ns, skey, shape, state, len(dst)))
        loaded = failed = nbytes = 0
        hit_keys = []
        for i, ns, skey, shape, state, size in loads:
            ok = state.done.result()
            for fd in state.fds:
                _close(fd)
            if ok:
                bitmap.set(i)
                self.store.touch(ns, skey, shape)
                loaded += 1
                nbytes += size
                hit_keys.append(keys[i])
            else:
                failed += 1
        dt = time.perf_counter() - t0
        with self._lock:
            st = self.stats
            st.load_tasks += 1
            st.objects_loaded += loaded
            st.load_misses += misses
            st.load_failures += failed
            st.bytes_loaded += nbytes
            st.load_s += dt
            if len(st.load_task_s) < 10_000:
                st.load_task_s.append(dt)
        if hit_keys:
            self._notify_keys_accessed(hit_keys)
        self._finish(self._load_done, self._load_efd, tid, bitmap)

    def _section_read(self, fut: Future[bool], s: int, slot: int, buf: memoryview, dst: np.ndarray,
                      shape: ObjectShape, state: _ObjectLoad) -> None:
        ok = False
        try:
            ok = fut.result()
            if ok:
                lo = s * shape.section_bytes
                hi = min(len(dst), lo + shape.section_bytes)
                np.copyto(dst[lo:hi], np.frombuffer(buf, dtype=np.uint8, count=hi - lo))
        except Exception:  # noqa: BLE001
            ok = False
        finally:
            self.ring.release(slot)
            state.section_done(ok)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._load_done.pop(task_id, None)

    # ---- eviction and usage -------------------------------------------------------------
    def delete(self, keys: list[Any]) -> None:
        gone, sizes = [], []
        for key in keys:
            ns, skey = self._where(key)
            freed = self.store.remove(ns, skey)
            if freed:
                gone.append(key)
                sizes.append(freed)
        with self._lock:
            self.stats.deletes += len(gone)
            self.stats.bytes_deleted += sum(sizes)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def get_usage(self) -> AdapterUsage:
        # The store's ledger is the truth: it counts objects from earlier lives of the
        # server too, and its own LRU eviction keeps it under the capacity.
        base = super().get_usage()
        return AdapterUsage(
            total_bytes_used=self.store.usage_bytes(),
            total_capacity_bytes=self.config.capacity_bytes,
            bytes_by_cache_salt=MappingProxyType(dict(base.bytes_by_cache_salt)),
        )

    def report_status(self) -> dict:
        with self._lock:
            counters = {k: v for k, v in vars(self.stats).items() if k != "load_task_s"}
        s = self.store.stats
        return {
            "is_healthy": not self._closed,
            "type": "KvlabL2Adapter",
            "paths": list(self.config.paths),
            "io_mode": self.store.io_mode,
            "capacity_bytes": self.config.capacity_bytes,
            "usage_bytes": self.store.usage_bytes(),
            "ring_bytes": self.ring.ring_bytes,
            "ring_high_water_slots": self.ring.high_water,
            "objects_at_start": self.objects_at_start,
            "evictions": s.evictions,
            "checksum_failures": s.checksum_failures,
            "bytes_written": s.bytes_written,
            "drive_bytes_written": dict(zip(self.config.paths, s.drive_bytes_written, strict=True)),
            **counters,
        }

    # ---- cleanup ------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pool in (self._stores, self._lookups, self._loads):
            pool.shutdown(wait=True)
        self.store.close()
        self.ring.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
