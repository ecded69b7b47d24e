"""The worker's save pipeline: vLLM's paged KV cache to the drives, never waiting for one.

`save_layer` copies the layer's blocks of each object planned this step into a ring slot
of the medium and queues the write (on a CPU engine at the step's end while the ring is
at most half used: see media.HostCopies). No free slot: the object is dropped and counted.
A finished request's last objects are copied out at the start of the next step
(`save_finished`) and vLLM holds their blocks only until the end of that step.

On a GPU every copy runs on a side stream (media.CudaCopies), so the forward pass
never waits for a save: a save's copy starts after the layer's KV is written and the forward
stream waits for it only at the end of the step, before vLLM may reuse those blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from kvlab_connector import metrics
from kvlab_connector.ring import RingFull
from kvlab_connector.scheduler import ChunkIO, StepMetadata
from kvlab_connector.store.store import ObjectWriter
from kvlab_connector.worker.media import Transfers

log = logging.getLogger("vllm.kvlab_connector")


class SavePipeline:
    """`poisoned` and `removing`: the load pipeline's (load.LoadPipeline)."""

    def __init__(self, t: Transfers, poisoned: dict[str, int], removing: dict[str, Future[int]]):
        self.t = t
        self.poisoned = poisoned
        self.removing = removing
        self._writers: dict[str, tuple[ObjectWriter, int]] = {}
        # This step's last sections of saves by requests that also load this step: handed
        # to their writers at end_step, once the loads have verified (else aborted).
        self._held: list[tuple[ChunkIO, ObjectWriter, Callable[[bool], None], Callable[[], Any]]] = []
        # This step's other copied sections, handed to their writers at end_step where the
        # cache's copies ask for it (CacheCopies.writes_after_step: a CPU engine).
        self._step_writes: list[Callable[[], Any]] = []
        # Finished requests whose blocks vLLM holds: the writes of their last objects.
        self._finished: set[str] = set()  # finished requests whose last objects are copied out
        self.saves_dropped = 0

    def _poisoned_save(self, chunk: ChunkIO) -> bool:
        return self.poisoned.get(chunk.req_id, -1) >= chunk.epoch

    def _removed(self, key: str) -> bool:
        """Whether a save of this key may begin: a removal of its failed object (handed to
        the I/O threads a step or more ago) must not land after the replacement."""
        removal = self.removing.pop(key, None)
        if removal is None:
            return True
        try:
            removal.result(timeout=1.0)
        except TimeoutError:
            self.removing[key] = removal  # a hung drive: no replacement on it for now
            return False
        except Exception:
            pass  # the removal failed: the replacement overwrites the object
        return True

    def _begin(self, chunk: ChunkIO) -> ObjectWriter:
        t = self.t
        return t.store.begin_write(
            t.ns, chunk.key, t.shape(chunk.block_ids), len(chunk.block_ids) * t.layout.block_size, t.cache.tag
        )

    def _drop(self) -> None:
        self.saves_dropped += 1
        metrics.inc("saves_dropped")

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: StepMetadata) -> None:
        layer = self.t.cache.layer_index.get(layer_name)
        if layer is None:
            return
        n_layers = self.t.n_layers
        ring = self.t.medium.ring
        loading = {c.req_id for c in meta.loads}
        this_layer: set[str] = set()
        for chunk in meta.saves:
            if chunk.key in this_layer:
                continue  # planned twice (the scheduler plans each once): one writer, each section once
            this_layer.add(chunk.key)
            if self._poisoned_save(chunk):
                continue  # computed over blocks that failed to load (end_step aborts it)
            entry = self._writers.get(chunk.key)
            if entry is None:
                if layer != 0 or not self._removed(chunk.key):
                    continue  # the step began before this chunk was planned
                entry = (self._begin(chunk), 0)
                self._writers[chunk.key] = entry
            writer, submitted = entry
            if submitted < 0:
                continue  # dropped at an earlier layer
            try:
                slot = ring.acquire(timeout_s=self.t.config.save_slot_wait_s)
            except RingFull:
                writer.abort(n_layers - submitted)
                self._writers[chunk.key] = (writer, -1)
                self._drop()
                continue
            # The KV this step computed for a request that also loads this step is only
            # right if the load verifies: its last section waits for end_step.
            hold = chunk if layer == n_layers - 1 and chunk.req_id in loading else None
            self._save_section(writer, layer, kv_layer, chunk.block_ids, slot, hold)
            self._writers[chunk.key] = (writer, submitted + 1)

    def _save_section(
        self,
        writer: ObjectWriter,
        layer: int,
        kv_layer: torch.Tensor,
        block_ids: list[int],
        slot: int,
        hold: ChunkIO | None = None,
    ) -> None:
        """Copy an object's blocks of one layer into a slot and hand the slot to the writer
        (with `hold`, the object being saved: at end_step, see _release_held). The cache's
        CacheCopies order the copy with the forward pass (worker/media.py)."""
        medium = self.t.medium
        blocks_dim = self.t.cache.blocks_dim

        def release(ok: bool, slot: int = slot) -> None:
            medium.ring.release(slot)

        def submit() -> None:
            medium.submit_section(writer, layer, slot, release)

        def fail() -> None:
            writer.abort(1)
            release(False)

        dst = self.t.slot_tensor(slot, len(block_ids))
        go = self.t.cache.copies.copy_out(kv_layer, blocks_dim, block_ids, dst, submit, fail)
        if hold is not None:
            self._held.append((hold, writer, release, go))
        elif self.t.cache.copies.writes_after_step and 2 * medium.ring.in_use <= medium.ring.num_slots:
            self._step_writes.append(go)
        else:
            # Past half the ring a step that waited for its end would run out of slots (a
            # long prompt in one step: 480 sections against 256 slots) and drop its objects:
            # its sections go to the I/O threads now, and the next layer's forward gives
            # them the time to give their slots back.
            self._hand_on_step_writes()
            go()

    def _hand_on_step_writes(self) -> None:
        if self._step_writes:
            writes, self._step_writes = self._step_writes, []
            for go in writes:
                go()

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

    def save_finished(self, finish_saves: dict[str, list[ChunkIO]], enabled: bool) -> None:
        """Finished requests' last objects (their answers' whole blocks), copied from the
        paged cache into ring slots at the start of the next step (vLLM's
        handle_preemptions: before anything may zero or overwrite the blocks), then written
        like any save. vLLM holds the blocks until get_finished, at the end of this same
        step, reports them: one step, not the time a drive takes."""
        kv = self.t.cache.kv
        ring = self.t.medium.ring
        for req_id, chunks in finish_saves.items():
            for chunk in chunks:
                if not enabled or self._poisoned_save(chunk) or not self._removed(chunk.key):
                    continue
                writer = self._begin(chunk)
                for layer, kv_layer in enumerate(kv):
                    try:
                        slot = ring.acquire(timeout_s=self.t.config.save_slot_wait_s)
                    except RingFull:
                        writer.abort(len(kv) - layer)
                        self._drop()
                        break
                    self._save_section(writer, layer, kv_layer, chunk.block_ids, slot)
            self._finished.add(req_id)
        # GPU: the step's first kernels (zeroing new blocks, the forward) wait for the copies.
        self.t.cache.copies.forward_waits()

    def take_finished(self) -> set[str]:
        done, self._finished = self._finished, set()
        return done

    def end_step(self) -> None:
        """After the forward and the loads' accounting: saves are queued, not waited for."""
        if self._held:
            self._release_held()
        self._hand_on_step_writes()
        # vLLM may reuse the saved blocks from the next step on: the forward stream
        # waits (on the GPU, not the host) for this step's save copies.
        self.t.cache.copies.forward_waits()
        n_layers = self.t.n_layers
        for writer, submitted in self._writers.values():
            if 0 <= submitted < n_layers:
                writer.abort(n_layers - submitted)  # a layer never came: not an object
        self._writers.clear()
