"""The worker side: moves sections between the drives and vLLM's paged KV cache.

Loads: `start_load_kv` hands every (layer, chunk) read to a feeder thread in layer
order; each read lands in a ring slot, is verified, copied into the paged cache and the
slot is given back. `wait_for_layer_load(layer)` waits for that layer only, so layer n
computes while n+1 arrives. A section that is missing, fails verification or misses the
deadline turns its chunk's blocks into load errors: vLLM recomputes them.

Saves: `save_kv_layer` copies the layer's blocks of each complete chunk into a ring slot
and queues the write; it never waits for a drive. No free slot: the chunk is dropped
and counted.

Where the slots live:
- CPU engines: the host ring; copies are memmoves (or index_copy_ for other layouts).
- GPU engines with GDS (kvikio; compat mode where nvidia-fs is absent): a ring in device
  memory. Drives and GPU exchange sections directly, checksummed on the device (wsum64).
- GPU engines without kvikio (or io_engine "posix"): the host ring, page-locked.
On a GPU every copy runs on a side stream, so the forward pass never waits for a save: a
save's copy starts after the layer's KV is written and the forward stream waits for it only
at the end of the step, before vLLM may reuse those blocks. A load's copy is synchronized
before its layer is declared ready.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import zlib
from concurrent.futures import Future
from typing import Any

import torch

from kvlab_connector import metrics
from kvlab_connector.config import ConnectorConfig
from kvlab_connector.io_gds import DeviceIO, GdsProbe, side_stream
from kvlab_connector.io_posix import spread_over_process_cpus
from kvlab_connector.layout import Layout
from kvlab_connector.ring import DeviceRing, RingFull, StagingRing
from kvlab_connector.scheduler import ChunkIO, StepMetadata
from kvlab_connector.store import ObjectShape, ObjectWriter, Store

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


def kvikio_wanted(io_engine: str, probe: GdsProbe) -> bool:
    """Whether a GPU engine moves KV through kvikio: where nvidia-fs is loaded (io_engine auto
    or gds), or in kvikio's compat mode when asked for (gds). WorkerSide._choose_gpu_io says
    why auto leaves compat mode alone."""
    return probe.usable and (probe.mode == "gds" or io_engine == "gds")


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


class WorkerSide:
    def __init__(self, config: ConnectorConfig, layout: Layout, store: Store, rank: int):
        self.config = config
        self.layout = layout
        self.store = store
        self.rank = rank
        self.ns = layout.namespace(rank)
        # MLA: every rank holds the same KV; rank 0 alone writes the one copy.
        self.saves_enabled = not (layout.mla and rank != 0)
        self.shape = layout.shape
        self.ring: StagingRing | DeviceRing | None = None
        self.io_mode = store.io_mode
        self.kv: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self.blocks_dim = 0
        self._num_blocks = 0
        self._direct_copy = False  # see _copy_in
        self.tag = 0
        self._load: _Load | None = None
        self._load_deadline = 0.0
        self._load_errors: set[int] = set()
        self._writers: dict[str, tuple[ObjectWriter, int]] = {}
        self._cuda = False
        self._save_stream: Any = None
        self._save_events: list[Any] = []  # this step's save copies, for end_step
        # Requests whose load failed, with the repair generation (ChunkIO.epoch) it failed
        # in: their saves of that generation hold KV computed over missing blocks.
        self._poisoned: dict[str, int] = {}
        # This step's last sections of saves by requests that also load this step: handed
        # to their writers at end_step, once the loads have verified (else aborted).
        self._held: list[tuple[ChunkIO, ObjectWriter, Any, Any]] = []
        # Finished requests whose blocks vLLM holds: the writes of their last objects.
        self._finished: set[str] = set()  # finished requests whose last objects are copied out
        self._removing: dict[str, Future[int]] = {}  # objects whose load failed, being removed
        self._ring_reported = 0  # ring slots in use, as the gauge last said
        self.saves_dropped = 0
        self.load_error_blocks = 0

    # ---- set-up ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        names = [n for n in self.layout.layer_names if n in kv_caches]
        if len(names) != len(self.layout.layer_names):
            missing = sorted(set(self.layout.layer_names) - set(kv_caches))
            raise RuntimeError(f"kvlab connector: no KV tensor for layer(s) {missing}")
        self.kv = [kv_caches[n] for n in names]
        self.layer_index = {n: i for i, n in enumerate(names)}
        first = self.kv[0]
        dims = [d for d, s in enumerate(first.shape) if s == num_blocks]
        if not dims:
            raise RuntimeError(f"kvlab connector: cannot find the block dimension in KV shape {tuple(first.shape)}")
        self.blocks_dim = dims[0]
        block_shape = list(first.shape)
        del block_shape[self.blocks_dim]
        block_bytes = first.element_size()
        for s in block_shape:
            block_bytes *= s
        if block_bytes != self.layout.block_bytes:
            raise RuntimeError(
                f"kvlab connector: a block of layer {names[0]} holds {block_bytes} bytes, the KV spec says "
                f"{self.layout.block_bytes}: unsupported KV layout"
            )
        self.block_shape = tuple(block_shape)
        self.dtype = first.dtype
        # The physical layout (shape, stride, dtype) tags every section: KV written in
        # one layout is never read into another.
        desc = f"{tuple(first.shape)}:{first.stride()}:{first.dtype}:{self.blocks_dim}".encode()
        self.tag = zlib.crc32(desc)
        self.ring = StagingRing(self.config.ring_bytes, self.shape.stride)
        self._num_blocks = num_blocks
        # CPU engine with each block one contiguous run of bytes (blocks may sit apart: a
        # backing shared by all layers can interleave them): copies are plain memmoves.
        self._direct_copy = self.blocks_dim == 0 and all(
            t.device.type == "cpu" and t.shape == first.shape and t.dtype == first.dtype
            and t[0].is_contiguous() and t.stride(0) * t.element_size() >= block_bytes
            for t in self.kv
        )
        self.io_mode = self.store.io_mode
        if first.device.type == "cuda":
            self._cuda = True
            self._save_stream = torch.cuda.Stream(device=first.device)
            self._choose_gpu_io(first.device)
        elif self.config.io_engine == "gds":
            raise RuntimeError(
                f"kvlab connector: io_engine 'gds' moves KV between drives and GPU memory, but this "
                f"engine's KV cache is on {first.device.type}: set io_engine 'auto' or 'posix'"
            )
        log.info(
            "kvlab connector: %d layers, %d B sections, %d ring slots (%d MiB), io %s, drives %s",
            len(self.kv), self.shape.section_bytes, self.ring.num_slots, self.ring.ring_bytes >> 20,
            self.io_mode, [str(d) for d in self.store.drives],
        )
        m = metrics.metrics()
        if m is not None:
            m["io_mode"].labels(mode=self.io_mode).set(1)

    def _choose_gpu_io(self, device: torch.device) -> None:
        """GPU engines: GDS through kvikio where nvidia-fs is loaded (io_engine auto or gds)
        or where asked for (gds: kvikio's compat mode without nvidia-fs), else the
        page-locked host ring.

        auto skips kvikio's compat mode: it bounces through page-locked host memory just as
        the host ring does, but copies on CUDA streams that kvikio creates blocking, which
        wait for the work queued on the default stream (the forward pass, unless the engine
        moved it): loads overlap compute less. On an H200 (make gpu-check) the host ring
        loaded and saved faster and overlapped more."""
        from kvlab_connector.io_gds import probe_gds

        if self.config.io_engine != "posix":
            gds = probe_gds()
            log.info("kvlab connector: GDS probe: %s", gds.reason)
            why = gds.reason
            if kvikio_wanted(self.config.io_engine, gds):
                device_io = DeviceIO.kvikio(gds, self.store.engine.threads)
                failed = device_io.self_test(device, self.store.drives)
                if failed is None:
                    self.use_device_io(device_io, device)
                    return
                why = f"the {gds.mode} self-test failed: {failed}"
                log.warning("kvlab connector: %s", why)
            elif gds.usable:
                log.info("kvlab connector: no nvidia-fs: KV goes through the page-locked host ring "
                         "(io_engine 'gds' takes kvikio's compat mode instead)")
            if self.config.io_engine == "gds":
                raise RuntimeError(
                    f"kvlab connector: io_engine 'gds' but kvikio cannot move KV here ({why}); "
                    "install kvlab-connector[gds-cu12] (or [gds-cu13]) into vLLM's environment and "
                    "check the drives' filesystem, or set io_engine 'auto' to use the host staging ring"
                )
        assert isinstance(self.ring, StagingRing)
        try:
            self.ring.pin()
        except RuntimeError as e:  # slower (copies wait for the host), never wrong
            log.warning("kvlab connector: %s: copies between the ring and the GPU run synchronously", e)
        self.io_mode = f"{self.store.io_mode}+h2d"

    def use_device_io(self, device_io: DeviceIO, device: torch.device) -> None:
        """Stage sections in device memory and move them with device_io (GDS). GPU engines
        come here from the probe; CPU tests come here with io_gds.PosixFile."""
        if self.ring is not None:
            self.ring.close()
        self.ring = DeviceRing(self.config.ring_bytes, self.shape.stride, device)
        self.store.device_io = device_io
        self._direct_copy = False
        self.io_mode = device_io.mode

    def _slot_tensor(self, slot: int, blocks: int) -> torch.Tensor:
        """A slot's payload (an object of `blocks` blocks) as blocks of the paged cache's
        shape and dtype."""
        assert self.ring is not None
        nbytes = self.layout.shape_of(blocks).section_bytes
        if isinstance(self.ring, DeviceRing):
            t = self.ring.tensor(slot, nbytes).view(self.dtype)
        else:
            t = torch.frombuffer(self.ring.buffer(slot, nbytes), dtype=torch.uint8).view(self.dtype)
        return t.view(blocks, *self.block_shape)

    def _shape(self, chunk: ChunkIO) -> ObjectShape:
        """A whole chunk's shape, or a tail object's (fewer blocks)."""
        return self.layout.shape_of(len(chunk.block_ids))

    # ---- load -----------------------------------------------------------------------
    def start_load(self, meta: StepMetadata) -> None:
        self._finish_load()
        if not meta.loads:
            return
        load = _Load(meta.loads, len(self.kv))
        if self._cuda:
            load.forward_mark = torch.cuda.Event()
            load.forward_mark.record()
        self._load = load
        self._load_deadline = time.monotonic() + self.config.load_timeout_s
        threading.Thread(target=self._feed, args=(load,), name="kvlab-load", daemon=True).start()

    def _feed(self, load: _Load) -> None:
        assert self.ring is not None
        spread_over_process_cpus()
        device = isinstance(self.ring, DeviceRing)
        fds: dict[int, list[Any] | None] = {}
        shapes = [self._shape(chunk) for chunk in load.chunks]
        for c, chunk in enumerate(load.chunks):
            if device:
                fds[c] = self.store.open_object_device(self.ns, chunk.key, shapes[c])
            else:
                fds[c] = self.store.open_object(self.ns, chunk.key, shapes[c])
            if fds[c] is None:
                for layer in range(len(self.kv)):
                    load.done_one(layer, c, False)
        pending = [0]
        pending_lock = threading.Condition()
        n_layers = len(self.kv)
        per_run = self._sections_per_read(self.shape)
        # Layers go in groups: a group is read before the next one starts, and within a
        # group each fragment file gives runs of up to `per_run` adjacent sections, one
        # request each. Layer n is ready once its group has landed.
        group = min(n_layers, per_run * self.store.n_fragments(self.shape))
        for g0 in range(0, n_layers, group):
            layers = range(g0, min(n_layers, g0 + group))
            for c, chunk in enumerate(load.chunks):
                if fds[c] is None:
                    continue
                shape = shapes[c]
                for run in self.store.read_runs(chunk.key, shape, layers, self._sections_per_read(shape)):
                    if load.cancelled or c in load.failed_chunks:
                        for layer in run:
                            load.done_one(layer, c, False)
                        continue
                    slots: list[int] = []
                    try:
                        for _ in run:
                            slots.append(self.ring.acquire(timeout_s=max(0.0, self._load_deadline - time.monotonic())))
                    except RingFull:
                        for slot in slots:
                            self.ring.release(slot)
                        for layer in run:
                            load.done_one(layer, c, False)
                        continue
                    with pending_lock:
                        pending[0] += len(run)
                    if device:
                        fut = self.store.submit_read_sections_device(
                            fds[c], self.ns, chunk.key, shape, run, [self.ring.tensor(s) for s in slots], self.tag
                        )
                    else:
                        fut = self.store.submit_read_sections(
                            fds[c], self.ns, chunk.key, shape, run, [self.ring.buffer(s) for s in slots],
                            self.tag,
                        )
                    fut.add_done_callback(
                        lambda f, run=run, c=c, slots=slots: [
                            self._landed(load, layer, c, slot, ok, pending, pending_lock)
                            for layer, slot, ok in zip(run, slots, f.result(), strict=True)
                        ]
                    )
        # Close the files once every read has landed.
        with pending_lock:
            while pending[0]:
                pending_lock.wait()
        for c, f in fds.items():
            if f is not None:
                for fd in f:
                    if device:
                        fd.close()
                    else:
                        os.close(fd)
                if c not in load.failed_chunks:
                    self.store.touch(self.ns, load.chunks[c].key, shapes[c])

    def _sections_per_read(self, shape: ObjectShape) -> int:
        """Adjacent sections of one fragment file read by one request (store.READ_REQUEST_BYTES),
        never more than the ring can lend at once."""
        assert self.ring is not None
        if isinstance(self.ring, DeviceRing):
            return 1  # device slots are not adjacent; kvikio splits each request itself
        return self.store.sections_per_read(shape, min(len(self.kv), self.ring.num_slots // 2))

    def _landed(self, load: _Load, layer: int, c: int, slot: int, ok: bool, pending: list[int], cv) -> None:  # type: ignore[no-untyped-def]
        assert self.ring is not None
        try:
            # After a timeout the blocks belong to vLLM's recompute: hands off.
            if ok and load.begin_copy():
                try:
                    self._copy_in(layer, slot, load.chunks[c].block_ids, load.forward_mark)
                finally:
                    load.end_copy()
            else:
                ok = False
        except Exception:  # a failed copy is a failed load, never a crashed engine
            log.exception("kvlab connector: copy into the KV cache failed")
            ok = False
        finally:
            self.ring.release(slot)
            load.done_one(layer, c, ok)
            with cv:
                pending[0] -= 1
                cv.notify()

    def _copy_in(self, layer: int, slot: int, block_ids: list[int], after: Any = None) -> None:
        """Copy a landed section from its ring slot into the layer's paged blocks (on a GPU,
        after the CUDA event `after`)."""
        assert self.ring is not None
        dst = self.kv[layer]
        if self._direct_copy:
            # CPU engine, blocks contiguous along dim 0: one memmove per run of adjacent
            # blocks. ctypes drops the GIL and no OpenMP team is started from an I/O thread
            # (index_copy_ from 8 threads ran at half this speed).
            bb = self.layout.block_bytes
            pitch = dst.stride(0) * dst.element_size()  # bytes from one block to the next
            base = dst.data_ptr()
            src = self.ring.address(slot)
            for j, b, n in _runs(block_ids):
                if b + n > self._num_blocks:
                    raise IndexError(f"block {b + n - 1} outside the KV cache ({self._num_blocks} blocks)")
                if pitch == bb:
                    ctypes.memmove(base + b * bb, src + j * bb, n * bb)
                else:
                    for k in range(n):
                        ctypes.memmove(base + (b + k) * pitch, src + (j + k) * bb, bb)
            return
        sel = [j for j, b in enumerate(block_ids) if b >= 0]
        ids = [block_ids[j] for j in sel]
        if any(b >= self._num_blocks for b in ids):
            raise IndexError(f"block {max(ids)} outside the KV cache ({self._num_blocks} blocks)")
        with side_stream(dst.device):
            if after is not None:
                torch.cuda.current_stream().wait_event(after)
            src_t = self._slot_tensor(slot, len(block_ids))
            if len(sel) != len(block_ids):
                src_t = src_t[sel]
            if dst.device != src_t.device:
                src_t = src_t.to(dst.device, non_blocking=True)  # GPU: page-locked host ring → device
            # One copy, slot → paged cache, whatever the block dimension.
            dst.index_copy_(
                self.blocks_dim, torch.tensor(ids, dtype=torch.long).to(dst.device, non_blocking=True),
                src_t.movedim(0, self.blocks_dim) if self.blocks_dim else src_t,
            )
            if self._cuda:
                # The slot is reused once this returns, and the layer is declared ready.
                torch.cuda.current_stream().synchronize()

    def wait_for_layer(self, layer_name: str) -> None:
        load = self._load
        if load is None:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        t = time.perf_counter()
        ready = load.events[layer].wait(max(0.0, self._load_deadline - time.monotonic()))
        load.waited_s[layer] = time.perf_counter() - t
        if not ready:
            log.warning("kvlab connector: layer %s not loaded within %.1f s: recomputing", layer_name, self.config.load_timeout_s)
            self._fail_load(load, all_chunks=True)

    def _fail_load(self, load: _Load, all_chunks: bool) -> None:
        load.cancel()
        with load.lock:
            failed = set(range(len(load.chunks))) if all_chunks else set(load.failed_chunks)
        for c in failed:
            chunk = load.chunks[c]
            self._load_errors.update(b for b in chunk.block_ids if b >= 0)
            self._poisoned[chunk.req_id] = max(chunk.epoch, self._poisoned.get(chunk.req_id, -1))
            # A load that failed (checksum, short or missing section, timeout) removes
            # its object, so that the recompute's save replaces it instead of every later
            # request failing on it again. On an I/O thread: a hung drive must not hang
            # the engine. Should it land after the replacement, that costs a miss, never
            # wrong KV.
            try:
                self._removing[chunk.key] = self.store.engine.submit(self.store.remove, self.ns, chunk.key)
            except RuntimeError:
                pass  # the store is closing

    def _finish_load(self) -> None:
        """At the end of a step: every layer accounted for, failures reported."""
        load = self._load
        if load is None:
            return
        self._load = None
        remaining = max(0.0, self._load_deadline - time.monotonic())
        timed_out = not all(ev.wait(remaining) for ev in load.events)
        self._fail_load(load, all_chunks=timed_out)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvlab connector: load of %d chunks x %d layers in %.3f s; layers ready at %s s; forward waited %s s",
                len(load.chunks), len(self.kv), time.perf_counter() - load.t0,
                " ".join(f"{x:.3f}" for x in load.ready_s), " ".join(f"{x:.3f}" for x in load.waited_s),
            )

    def take_load_errors(self) -> set[int]:
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        if errors:
            self.load_error_blocks += len(errors)
            metrics.inc("load_errors", len(errors))
            log.warning("kvlab connector: %d blocks failed to load; vLLM recomputes them", len(errors))
        return errors

    # ---- save -----------------------------------------------------------------------
    def _poisoned_save(self, chunk: ChunkIO) -> bool:
        return self._poisoned.get(chunk.req_id, -1) >= chunk.epoch

    def _removed(self, key: str) -> bool:
        """Whether a save of this key may begin: a removal of its failed object (handed to
        the I/O threads a step or more ago) must not land after the replacement."""
        removal = self._removing.pop(key, None)
        if removal is None:
            return True
        try:
            removal.result(timeout=1.0)
        except TimeoutError:
            self._removing[key] = removal  # a hung drive: no replacement on it for now
            return False
        except Exception:
            pass  # the removal failed: the replacement overwrites the object
        return True

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: StepMetadata) -> None:
        if not meta.saves or not self.saves_enabled:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None or self.ring is None:
            return
        n_layers = len(self.kv)
        loading = {c.req_id for c in meta.loads}
        for chunk in meta.saves:
            if self._poisoned_save(chunk):
                continue  # computed over blocks that failed to load (end_step aborts it)
            entry = self._writers.get(chunk.key)
            if entry is None:
                if layer != 0 or not self._removed(chunk.key):
                    continue  # the step began before this chunk was planned
                writer = self.store.begin_write(
                    self.ns, chunk.key, self._shape(chunk), len(chunk.block_ids) * self.layout.block_size, self.tag
                )
                entry = (writer, 0)
                self._writers[chunk.key] = entry
            writer, submitted = entry
            if submitted < 0:
                continue  # dropped at an earlier layer
            try:
                slot = self.ring.acquire(timeout_s=self.config.save_slot_wait_s)
            except RingFull:
                writer.abort(n_layers - submitted)
                self._writers[chunk.key] = (writer, -1)
                self.saves_dropped += 1
                metrics.inc("saves_dropped")
                continue
            # The KV this step computed for a request that also loads this step is only
            # right if the load verifies: its last section waits for end_step.
            hold = chunk if layer == n_layers - 1 and chunk.req_id in loading else None
            self._save_section(writer, layer, kv_layer, chunk.block_ids, slot, hold)
            self._writers[chunk.key] = (writer, submitted + 1)

    def _save_section(self, writer: ObjectWriter, layer: int, kv_layer: torch.Tensor, block_ids: list[int],
                      slot: int, hold: ChunkIO | None = None) -> None:
        """Copy an object's blocks of one layer into a slot and hand the slot to the writer
        (with `hold`, the object being saved: at end_step, see _release_held). On a GPU the copy runs
        on the save stream and the write is queued once it is done."""
        assert self.ring is not None
        device_slot = isinstance(self.ring, DeviceRing)

        def release(ok: bool, slot: int = slot) -> None:
            self.ring.release(slot)  # type: ignore[union-attr]

        def submit() -> None:
            if device_slot:
                writer.submit_device_section(layer, self.ring.tensor(slot), release)  # type: ignore[union-attr]
            else:
                writer.submit_section(layer, self.ring.buffer(slot), release)  # type: ignore[union-attr]

        dst = self._slot_tensor(slot, len(block_ids))
        if not self._cuda:
            ids = torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device)
            if kv_layer.device == dst.device and self.blocks_dim == 0:
                torch.index_select(kv_layer, 0, ids, out=dst)  # one copy, paged cache → slot
            else:
                dst.copy_(kv_layer.index_select(self.blocks_dim, ids).movedim(self.blocks_dim, 0))
            if hold is not None:
                self._held.append((hold, writer, release, submit))
                return
            submit()
            return
        forward = torch.cuda.current_stream()
        with torch.cuda.stream(self._save_stream):
            self._save_stream.wait_stream(forward)  # the layer's KV is written
            ids = torch.tensor(block_ids, dtype=torch.long).to(kv_layer.device, non_blocking=True)
            dst.copy_(kv_layer.index_select(self.blocks_dim, ids).movedim(self.blocks_dim, 0), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._save_events.append(copied)

        def submit_when_copied() -> None:
            try:
                copied.synchronize()
            except Exception:
                log.exception("kvlab connector: a save's copy failed")
                writer.abort(1)
                release(False)
                return
            submit()

        if hold is not None:
            self._held.append((hold, writer, release, lambda: self.store.engine.submit(submit_when_copied)))
            return
        self.store.engine.submit(submit_when_copied)

    def _release_held(self) -> None:
        """The held last sections: written where the request's loads verified, else their
        objects are given up."""
        held, self._held = self._held, []
        for chunk, writer, release, go in held:
            if self._poisoned_save(chunk):
                writer.abort(1)
                release(False)
            else:
                go()

    def save_finished(self, finish_saves: dict[str, list[ChunkIO]]) -> None:
        """Finished requests' last objects (their answers' whole blocks), copied from the
        paged cache into ring slots at the start of the next step (vLLM's
        handle_preemptions: before anything may zero or overwrite the blocks), then written
        like any save. vLLM holds the blocks until get_finished, at the end of this same
        step, reports them: one step, not the time a drive takes."""
        for req_id, chunks in finish_saves.items():
            for chunk in chunks:
                if not self.saves_enabled or self.ring is None or self._poisoned_save(chunk) \
                        or not self._removed(chunk.key):
                    continue
                writer = self.store.begin_write(
                    self.ns, chunk.key, self._shape(chunk), len(chunk.block_ids) * self.layout.block_size, self.tag
                )
                for layer, kv_layer in enumerate(self.kv):
                    try:
                        slot = self.ring.acquire(timeout_s=self.config.save_slot_wait_s)
                    except RingFull:
                        writer.abort(len(self.kv) - layer)
                        self.saves_dropped += 1
                        metrics.inc("saves_dropped")
                        break
                    self._save_section(writer, layer, kv_layer, chunk.block_ids, slot)
            self._finished.add(req_id)
        if self._save_events:
            # GPU: the step's first kernels (zeroing new blocks, the forward) wait for the copies.
            forward = torch.cuda.current_stream()
            for ev in self._save_events:
                forward.wait_event(ev)
            self._save_events.clear()

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose last objects are copied out: vLLM may free their blocks."""
        for req_id in finished_req_ids:
            self._poisoned.pop(req_id, None)
        done, self._finished = self._finished, set()
        return done

    def end_step(self, meta: StepMetadata | None = None) -> None:
        """After the forward: saves are queued (not waited for); loads accounted for."""
        self._finish_load()
        if self._held:
            self._release_held()
        if self._save_events:
            # vLLM may reuse the saved blocks from the next step on: the forward stream
            # waits (on the GPU, not the host) for this step's save copies.
            forward = torch.cuda.current_stream()
            for ev in self._save_events:
                forward.wait_event(ev)
            self._save_events.clear()
        for writer, submitted in self._writers.values():
            if 0 <= submitted < len(self.kv):
                writer.abort(len(self.kv) - submitted)  # a layer never came: not an object
        self._writers.clear()
        # A step with nothing to load or save takes no lock (the ring's, the gauge's): the
        # gauge is read after steps with I/O and until it is back at zero.
        had_io = meta is not None and bool(meta.loads or meta.saves or meta.finish_saves)
        if self.ring is not None and (had_io or self._ring_reported):
            m = metrics.metrics()
            if m is not None:
                self._ring_reported = self.ring.in_use
                m["ring_in_use"].set(self._ring_reported)

    def counters(self) -> dict[str, Any]:
        s = self.store.stats
        return {
            "bytes_read": s.bytes_read, "bytes_written": s.bytes_written, "read_s": s.read_s,
            "write_s": s.write_s, "objects_written": s.objects_written,
            "checksum_failures": s.checksum_failures, "sections_failed": s.sections_failed,
            "saves_dropped": self.saves_dropped, "load_error_blocks": self.load_error_blocks,
            "evictions": s.evictions, "out_of_space": s.out_of_space,
        }

    def stats(self) -> dict[str, Any]:
        s = self.store.stats
        return {
            "io_mode": self.io_mode,
            "bytes_read": s.bytes_read,
            "bytes_written": s.bytes_written,
            "objects_written": s.objects_written,
            "checksum_failures": s.checksum_failures,
            "sections_failed": s.sections_failed,
            "saves_dropped": self.saves_dropped,
            "writes_aborted": s.writes_aborted,
            "evictions": s.evictions,
            "out_of_space": s.out_of_space,
            "ring_bytes": self.ring.ring_bytes if self.ring else 0,
            "ring_high_water_slots": self.ring.high_water if self.ring else 0,
        }

