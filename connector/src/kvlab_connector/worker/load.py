"""The worker's load pipeline: sections from the drives into vLLM's paged KV cache.

`start` hands every (layer, chunk) read to a feeder thread in layer order; each read lands
in a ring slot of the medium, is verified, copied into the paged cache and the slot is
given back. `wait_for_layer(layer)` waits for that layer only, so layer n computes while
n+1 arrives. A section that is missing, fails verification or misses the deadline turns
its chunk's blocks into load errors: vLLM recomputes them, and the object is removed so
that the recompute's save replaces it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch

from kvlab_connector import metrics
from kvlab_connector.io.posix import spread_over_process_cpus
from kvlab_connector.osutil import name_os_thread
from kvlab_connector.ring import RingFull
from kvlab_connector.scheduler import ChunkIO, StepMetadata
from kvlab_connector.worker.media import Transfers

log = logging.getLogger("vllm.kvlab_connector")


class _Load:
    """One step's loads: per-layer completion, errors, and a cancel switch."""

    def __init__(self, chunks: list[ChunkIO], n_layers: int):
        self.chunks = chunks
        self.remaining = [len(chunks)] * n_layers
        self.events = [threading.Event() for _ in range(n_layers)]
        self.failed_chunks: set[int] = set()
        self.cancelled = False
        self.copying = 0  # copies into the paged cache under way
        # GPU engines: recorded on the forward stream at start_load_kv; copies into the
        # paged cache wait for it, so that no kernel queued before the load (one still
        # writing those blocks) runs after a restored block has landed.
        self.forward_mark: Any = None
        self.lock = threading.Condition()
        # Where a load's time goes (the debug log): when it started, when each layer was
        # ready, how long the forward pass waited for each.
        self.t0 = time.perf_counter()
        self.ready_s = [0.0] * n_layers
        self.waited_s = [0.0] * n_layers
        for ev, n in zip(self.events, self.remaining, strict=True):
            if n == 0:
                ev.set()

    def begin_copy(self) -> bool:
        """May a landed section be copied into the paged cache? Copies run in parallel;
        none starts after a cancel."""
        with self.lock:
            if self.cancelled:
                return False
            self.copying += 1
            return True

    def end_copy(self) -> None:
        with self.lock:
            self.copying -= 1
            if self.copying == 0:
                self.lock.notify_all()

    def done_one(self, layer: int, chunk: int, ok: bool) -> None:
        with self.lock:
            if not ok:
                self.failed_chunks.add(chunk)
            self.remaining[layer] -= 1
            if self.remaining[layer] == 0:
                self.ready_s[layer] = time.perf_counter() - self.t0
                self.events[layer].set()

    def cancel(self) -> None:
        """After this returns no copy touches the paged cache: the blocks are vLLM's."""
        with self.lock:
            self.cancelled = True
            while self.copying:
                self.lock.wait()


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in the chunk, first block id, count) of each run of blocks that are
    adjacent both in the chunk and in the paged cache; -1 (a block vLLM holds) is skipped."""
    runs: list[tuple[int, int, int]] = []
    for j, b in enumerate(block_ids):
        if b < 0:
            continue
        if runs:
            j0, b0, n = runs[-1]
            if j0 + n == j and b0 + n == b:
                runs[-1] = (j0, b0, n + 1)
                continue
        runs.append((j, b, 1))
    return runs


class LoadPipeline:
    """`poisoned` and `removing` are shared with the save pipeline: requests whose load
    failed (with the repair generation, ChunkIO.epoch, it failed in), and removals of their
    objects under way."""

    def __init__(self, t: Transfers, poisoned: dict[str, int], removing: dict[str, Future[int]]):
        self.t = t
        self.poisoned = poisoned
        self.removing = removing
        self._load: _Load | None = None
        self._deadline = 0.0
        self._errors: set[int] = set()
        self.error_blocks = 0

    def start(self, meta: StepMetadata) -> None:
        self.finish()
        if not meta.loads:
            return
        load = _Load(meta.loads, self.t.n_layers)
        load.forward_mark = self.t.cache.copies.forward_mark()
        self._load = load
        self._deadline = time.monotonic() + self.t.config.load_timeout_s
        threading.Thread(target=self._feed, args=(load,), name="kvlab-load", daemon=True).start()

    def _feed(self, load: _Load) -> None:
        t = self.t
        medium, store = t.medium, t.store
        name_os_thread()
        spread_over_process_cpus()
        files: dict[int, list[Any] | None] = {}
        shapes = [t.shape(chunk.block_ids) for chunk in load.chunks]
        n_layers = t.n_layers
        for c, chunk in enumerate(load.chunks):
            files[c] = medium.open(t.ns, chunk.key, shapes[c])
            if files[c] is None:
                for layer in range(n_layers):
                    load.done_one(layer, c, False)
        pending = [0]
        pending_lock = threading.Condition()
        per_run = medium.sections_per_read(t.layout.shape, n_layers)
        # Layers go in groups: a group is read before the next one starts, and within a
        # group each fragment file gives runs of up to `per_run` adjacent sections, one
        # request each. Layer n is ready once its group has landed.
        group = min(n_layers, per_run * store.n_fragments(t.layout.shape))
        for g0 in range(0, n_layers, group):
            layers = range(g0, min(n_layers, g0 + group))
            for c, chunk in enumerate(load.chunks):
                f = files[c]
                if f is None:
                    continue
                shape = shapes[c]
                for run in store.read_runs(
                    chunk.key, shape, layers, medium.sections_per_read(shape, n_layers)
                ):
                    if load.cancelled or c in load.failed_chunks:
                        for layer in run:
                            load.done_one(layer, c, False)
                        continue
                    slots: list[int] = []
                    try:
                        for _ in run:
                            slots.append(
                                medium.ring.acquire(timeout_s=max(0.0, self._deadline - time.monotonic()))
                            )
                    except RingFull:
                        for slot in slots:
                            medium.ring.release(slot)
                        for layer in run:
                            load.done_one(layer, c, False)
                        continue
                    with pending_lock:
                        pending[0] += len(run)
                    fut = medium.submit_reads(f, t.ns, chunk.key, shape, run, slots, t.cache.tag)
                    fut.add_done_callback(
                        lambda fut, run=run, c=c, slots=slots: [
                            self._landed(load, layer, c, slot, ok, pending, pending_lock)
                            for layer, slot, ok in zip(run, slots, fut.result(), strict=True)
                        ]
                    )
        # Close the files once every read has landed.
        with pending_lock:
            while pending[0]:
                pending_lock.wait()
        for c, f in files.items():
            if f is not None:
                medium.close(f)
                if c not in load.failed_chunks:
                    store.touch(t.ns, load.chunks[c].key, shapes[c])

    def _landed(self, load: _Load, layer: int, c: int, slot: int, ok: bool, pending: list[int], cv) -> None:  # type: ignore[no-untyped-def]
        try:
            # After a timeout the blocks belong to vLLM's recompute: hands off.
            if ok and load.begin_copy():
                try:
                    self.copy_in(layer, slot, load.chunks[c].block_ids, load.forward_mark)
                finally:
                    load.end_copy()
            else:
                ok = False
        except Exception:  # a failed copy is a failed load, never a crashed engine
            log.exception("kvlab connector: copy into the KV cache failed")
            ok = False
        finally:
            self.t.medium.ring.release(slot)
            load.done_one(layer, c, ok)
            with cv:
                pending[0] -= 1
                cv.notify()

    def copy_in(self, layer: int, slot: int, block_ids: list[int], after: Any = None) -> None:
        """Copy a landed section from its ring slot into the layer's paged blocks (on a GPU,
        after the CUDA event `after`)."""
        cache = self.t.cache
        dst = cache.kv[layer]
        if cache.direct_copy:
            # CPU engine, blocks contiguous along dim 0: one memmove per run of adjacent
            # blocks. ctypes drops the GIL and no OpenMP team is started from an I/O thread
            # (index_copy_ from 8 threads ran at half this speed).
            bb = self.t.layout.block_bytes
            pitch = dst.stride(0) * dst.element_size()  # bytes from one block to the next
            base = dst.data_ptr()
            src = self.t.medium.host_address(slot)
            for j, b, n in _runs(block_ids):
                if b + n > cache.num_blocks:
                    raise IndexError(f"block {b + n - 1} outside the KV cache ({cache.num_blocks} blocks)")
                if pitch == bb:
                    ctypes.memmove(base + b * bb, src + j * bb, n * bb)
                else:
                    for k in range(n):
                        ctypes.memmove(base + (b + k) * pitch, src + (j + k) * bb, bb)
            return
        sel = [j for j, b in enumerate(block_ids) if b >= 0]
        ids = [block_ids[j] for j in sel]
        if any(b >= cache.num_blocks for b in ids):
            raise IndexError(f"block {max(ids)} outside the KV cache ({cache.num_blocks} blocks)")
        with cache.copies.into_cache(dst.device, after):
            src_t = self.t.slot_tensor(slot, len(block_ids))
            if len(sel) != len(block_ids):
                src_t = src_t[sel]
            src_t = src_t.to(dst.device, non_blocking=True)  # GPU: page-locked host ring → device
            # One copy, slot → paged cache, whatever the block dimension.
            dst.index_copy_(
                cache.blocks_dim,
                torch.tensor(ids, dtype=torch.long).to(dst.device, non_blocking=True),
                src_t.movedim(0, cache.blocks_dim) if cache.blocks_dim else src_t,
            )

    def wait_for_layer(self, layer_name: str) -> None:
        load = self._load
        if load is None:
            return
        layer = self.t.cache.layer_index.get(layer_name)
        if layer is None:
            # A layer the connector was never given the cache of: its blocks cannot be
            # waited for, so the whole load is handed back to recompute, never read early.
            log.error("kvlab connector: vLLM waits for layer %r, which is not among the registered "
                      "KV caches: this step's loads are recomputed", layer_name)
            self._fail(load, all_chunks=True)
            self._load = None
            return
        t = time.perf_counter()
        ready = load.events[layer].wait(max(0.0, self._deadline - time.monotonic()))
        load.waited_s[layer] = time.perf_counter() - t
        if not ready:
            log.warning(
                "kvlab connector: layer %s not loaded within %.1f s: recomputing",
                layer_name,
                self.t.config.load_timeout_s,
            )
            self._fail(load, all_chunks=True)

    def _fail(self, load: _Load, all_chunks: bool) -> None:
        load.cancel()
        with load.lock:
            failed = set(range(len(load.chunks))) if all_chunks else set(load.failed_chunks)
        store = self.t.store
        for c in failed:
            chunk = load.chunks[c]
            self._errors.update(b for b in chunk.block_ids if b >= 0)
            self.poisoned[chunk.req_id] = max(chunk.epoch, self.poisoned.get(chunk.req_id, -1))
            # A load that failed (checksum, short or missing section, timeout) removes
            # its object, so that the recompute's save replaces it instead of every later
            # request failing on it again. On an I/O thread: a hung drive must not hang
            # the engine. Should it land after the replacement, that costs a miss, never
            # wrong KV.
            try:
                self.removing[chunk.key] = store.engine.submit(store.remove, self.t.ns, chunk.key)
            except RuntimeError:
                pass  # the store is closing

    def finish(self) -> None:
        """At the end of a step: every layer accounted for, failures reported."""
        load = self._load
        if load is None:
            return
        self._load = None
        remaining = max(0.0, self._deadline - time.monotonic())
        timed_out = not all(ev.wait(remaining) for ev in load.events)
        self._fail(load, all_chunks=timed_out)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvlab connector: load of %d chunks x %d layers in %.3f s; layers ready at %s s; forward waited %s s",
                len(load.chunks),
                self.t.n_layers,
                time.perf_counter() - load.t0,
                " ".join(f"{x:.3f}" for x in load.ready_s),
                " ".join(f"{x:.3f}" for x in load.waited_s),
            )

    def take_errors(self) -> set[int]:
        self.finish()
        errors, self._errors = self._errors, set()
        if errors:
            self.error_blocks += len(errors)
            metrics.inc("load_error_blocks", len(errors))
            log.warning("kvlab connector: %d blocks failed to load; vLLM recomputes them", len(errors))
        return errors
