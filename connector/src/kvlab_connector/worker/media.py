"""Where a section waits between the drives and vLLM's paged KV cache: a medium.

Two media, chosen once when the KV cache is registered (worker.WorkerSide), as vLLM's
kv_offload picks one transfer handler per (source, destination) medium pair:
- HostMedium: the host staging ring (CPU engines; GPU engines without GDS, page-locked);
- DeviceMedium: a ring in device memory that drives and GPU exchange sections with
  directly (GDS through kvikio), checksummed on the device.
The load and save pipelines (worker/load.py, worker/save.py) call only this interface.

How copies between a slot and the paged cache are ordered with the engine's forward pass is
chosen once too, from the device the KV cache is on: CacheCopies (HostCopies for CPU
engines, CudaCopies for GPU engines).
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvlab_connector.config import ConnectorConfig
from kvlab_connector.io.gds import side_stream
from kvlab_connector.layout import Layout
from kvlab_connector.ring import DeviceRing, StagingRing
from kvlab_connector.store.store import (
    HOST,
    DeviceMemory,
    ObjectShape,
    ObjectWriter,
    OpenObject,
    SectionMemory,
    Store,
)

log = logging.getLogger("vllm.kvlab_connector")


class Medium(ABC):
    """Ring slots in one kind of memory, and the store's memory (store/memory.py) that
    fills and drains them."""

    ring: StagingRing | DeviceRing
    memory: SectionMemory

    def __init__(self, store: Store):
        self.store = store

    @abstractmethod
    def handle(self, slot: int) -> Any:
        """A slot as the store's memory takes it."""

    @abstractmethod
    def slot_bytes(self, slot: int, nbytes: int) -> torch.Tensor:
        """A slot's first `nbytes` as a uint8 tensor (a view, no copy)."""

    @abstractmethod
    def sections_per_read(self, shape: ObjectShape, n_layers: int) -> int:
        """Adjacent sections one read request may fill."""

    def open(self, ns: str, key: str, shape: ObjectShape) -> OpenObject | None:
        """An object's fragment files, opened for reads into this medium; None: a miss."""
        return self.store.open_object(ns, key, shape, self.memory)

    def close(self, files: OpenObject) -> None:
        self.memory.close(files)

    def submit_reads(
        self,
        files: OpenObject,
        ns: str,
        key: str,
        shape: ObjectShape,
        run: list[int],
        slots: list[int],
        tag: int,
    ) -> Future[list[bool]]:
        """Read the adjacent sections `run` into `slots`, one request; each verified."""
        return self.store.submit_read_sections(files, ns, key, shape, run, [self.handle(s) for s in slots], tag,
                                               self.memory)  # fmt: skip

    def submit_section(
        self, writer: ObjectWriter, section: int, slot: int, on_done: Callable[[bool], None]
    ) -> None:
        """Hand a filled slot to an object's writer."""
        writer.submit_section(section, self.handle(slot), on_done, self.memory)

    def host_address(self, slot: int) -> int:
        """A slot's host address, for the CPU engine's memmove copies (PagedCache.direct_copy)."""
        raise TypeError(f"{type(self).__name__}'s slots are not host memory")

    def close_ring(self) -> None:
        self.ring.close()


class HostMedium(Medium):
    def __init__(self, store: Store, ring: StagingRing):
        super().__init__(store)
        self.ring: StagingRing = ring
        self.memory = HOST

    def handle(self, slot: int) -> memoryview:
        return self.ring.buffer(slot)

    def slot_bytes(self, slot: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(self.ring.buffer(slot, nbytes), dtype=torch.uint8)

    def host_address(self, slot: int) -> int:
        return self.ring.address(slot)

    def sections_per_read(self, shape: ObjectShape, n_layers: int) -> int:
        # Never more than the ring can lend at once.
        return self.store.sections_per_read(shape, min(n_layers, self.ring.num_slots // 2))


class DeviceMedium(Medium):
    def __init__(self, store: Store, ring: DeviceRing, device_io: Any):
        super().__init__(store)
        self.ring: DeviceRing = ring
        self.memory = DeviceMemory(device_io)

    def handle(self, slot: int) -> Any:
        return self.ring.tensor(slot)

    def slot_bytes(self, slot: int, nbytes: int) -> torch.Tensor:
        return self.ring.tensor(slot, nbytes)

    def sections_per_read(self, shape: ObjectShape, n_layers: int) -> int:
        return 1  # device slots are not adjacent; kvikio splits each request itself


class CacheCopies(ABC):
    """How copies between ring slots and vLLM's paged KV cache are ordered with the forward
    pass."""

    # Whether the sections a step copies out go to the I/O threads at the step's end rather
    # than layer by layer: where the forward pass and the I/O threads share the host's cores.
    writes_after_step = False

    def forward_mark(self) -> Any:
        """Taken at start_load_kv: what copies into the cache wait for (None: nothing)."""
        return None

    @abstractmethod
    def into_cache(self, device: torch.device, after: Any) -> contextlib.AbstractContextManager[None]:
        """Around a copy from a slot into the cache: it runs after `after` (forward_mark's),
        and the slot may be reused once the block exits."""

    @abstractmethod
    def copy_out(
        self,
        kv_layer: torch.Tensor,
        blocks_dim: int,
        block_ids: list[int],
        dst: torch.Tensor,
        submit: Callable[[], None],
        fail: Callable[[], None],
    ) -> Callable[[], None]:
        """Start copying the blocks `block_ids` of one layer into `dst` (a slot). The callable
        returned hands the slot on with `submit` once the copy is done (`fail` if it failed)."""

    @abstractmethod
    def forward_waits(self) -> None:
        """Before vLLM may reuse saved blocks: the forward pass waits for this step's copies out."""


class HostCopies(CacheCopies):
    """A CPU engine: every copy runs in the thread that asks for it, done when it returns.

    A section's write waits for the end of the step that copied it. Its system time (the
    file's creation, the seal, the direct write and its completion) and the I/O thread's
    turns at the GIL would otherwise fall inside the step's remaining layers, on the cores
    the forward pass computes on, where every parallel region waits for its slowest thread:
    measured within engine lives on two cores, a fresh 4K-token prompt computed and saved
    took 1.04-1.05x the TTFT of the same prompt computed and not saved when its writes were
    handed on layer by layer, 1.02-1.03x when they were handed on at the step's end.
    Only while the ring is at most half used (SavePipeline._save_section): a longer step's
    sections would otherwise take every slot and drop its objects."""

    writes_after_step = True

    def into_cache(self, device: torch.device, after: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def copy_out(self, kv_layer, blocks_dim, block_ids, dst, submit, fail):  # type: ignore[no-untyped-def]
        ids = torch.tensor(block_ids, dtype=torch.long)
        if blocks_dim == 0:
            torch.index_select(kv_layer, 0, ids, out=dst)  # one copy, paged cache → slot
        else:
            dst.copy_(kv_layer.index_select(blocks_dim, ids).movedim(blocks_dim, 0))
        return submit

    def forward_waits(self) -> None:
        pass  # every copy out was done when copy_out returned


class CudaCopies(CacheCopies):
    """A GPU engine. Copies into the cache run on the I/O thread's side stream after the
    forward stream's mark; copies out run on a save stream once the layer's kernels are
    done, and the forward stream (not the host) waits for them at the end of the step, so
    the forward pass never waits for a save."""

    def __init__(self, device: torch.device, engine: Any):
        self.save_stream = torch.cuda.Stream(device=device)
        self.engine = engine  # the store's I/O threads: they wait for a copy out, then write
        self._copies_out: list[Any] = []  # this step's, as CUDA events

    def forward_mark(self) -> Any:
        # No kernel queued before the load (one still writing those blocks) may run after a
        # restored block has landed.
        mark = torch.cuda.Event()
        mark.record()
        return mark

    @contextlib.contextmanager
    def into_cache(self, device: torch.device, after: Any) -> Iterator[None]:
        with side_stream(device):
            if after is not None:
                torch.cuda.current_stream().wait_event(after)
            yield
            # The slot is reused once this returns, and the layer is declared ready.
            torch.cuda.current_stream().synchronize()

    def copy_out(self, kv_layer, blocks_dim, block_ids, dst, submit, fail):  # type: ignore[no-untyped-def]
        forward = torch.cuda.current_stream()
        with torch.cuda.stream(self.save_stream):
            self.save_stream.wait_stream(forward)  # the layer's KV is written
            ids = torch.tensor(block_ids, dtype=torch.long).to(kv_layer.device, non_blocking=True)
            dst.copy_(kv_layer.index_select(blocks_dim, ids).movedim(blocks_dim, 0), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._copies_out.append(copied)

        def when_copied() -> None:
            try:
                copied.synchronize()
            except Exception:
                log.exception("kvlab connector: a save's copy failed")
                fail()
                return
            submit()

        return lambda: self.engine.submit(when_copied)

    def forward_waits(self) -> None:
        if self._copies_out:
            forward = torch.cuda.current_stream()
            for copied in self._copies_out:
                forward.wait_event(copied)
            self._copies_out.clear()


def copies_for(device: torch.device, store: Store) -> CacheCopies:
    return CudaCopies(device, store.engine) if device.type == "cuda" else HostCopies()


@dataclass
class PagedCache:
    """vLLM's paged KV cache as the connector found it at register_kv_caches."""

    kv: list[torch.Tensor]
    layer_index: dict[str, int]
    blocks_dim: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    num_blocks: int
    tag: int  # the physical layout's checksum: tags every section
    copies: CacheCopies
    # CPU engine with each block one contiguous run of bytes: copies are plain memmoves
    # between the paged cache and the host ring (load.copy_in).
    direct_copy: bool


@dataclass
class Transfers:
    """What the load and save pipelines share: the store, where the KV is, and the medium
    sections wait in (swapped once, by WorkerSide.use_device_io)."""

    config: ConnectorConfig
    layout: Layout
    store: Store
    ns: str
    cache: PagedCache
    medium: Medium

    @property
    def n_layers(self) -> int:
        return len(self.cache.kv)

    def shape(self, block_ids: Sequence[int]) -> ObjectShape:
        """A whole chunk's shape, or a tail object's (fewer blocks)."""
        return self.layout.shape_of(len(block_ids))

    def slot_tensor(self, slot: int, blocks: int) -> torch.Tensor:
        """A slot's payload (an object of `blocks` blocks) as blocks of the paged cache's
        shape and dtype."""
        nbytes = self.layout.shape_of(blocks).section_bytes
        t = self.medium.slot_bytes(slot, nbytes).view(self.cache.dtype)
        return t.view(blocks, *self.cache.block_shape)
