"""Where a section waits between the drives and vLLM's paged KV cache: a medium.

Two media, chosen once when the KV cache is registered (worker.WorkerSide), as vLLM's
kv_offload picks one transfer handler per (source, destination) medium pair:
- HostMedium: the host staging ring (CPU engines; GPU engines without GDS, page-locked);
- DeviceMedium: a ring in device memory that drives and GPU exchange sections with
  directly (GDS through kvikio), checksummed on the device.
The load and save pipelines (worker_load.py, worker_save.py) call only this interface.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvlab_connector.config import ConnectorConfig
from kvlab_connector.layout import Layout
from kvlab_connector.ring import DeviceRing, StagingRing
from kvlab_connector.store import ObjectShape, ObjectWriter, Store


class Medium(ABC):
    """Ring slots in one kind of memory, and the store's calls that fill and drain them.

    Each medium binds the store's calls for its memory (`_open_object`, `_read_sections`,
    `_write_section`) and says what a slot is to them (`handle`)."""

    ring: StagingRing | DeviceRing
    _open_object: Callable[[str, str, ObjectShape], Any]
    _read_sections: Callable[..., Future[list[bool]]]
    _write_section: Callable[[ObjectWriter, int, Any, Callable[[bool], None]], None]

    def __init__(self, store: Store):
        self.store = store

    @abstractmethod
    def handle(self, slot: int) -> Any:
        """A slot as the store's calls for this medium take it."""

    @abstractmethod
    def slot_bytes(self, slot: int, nbytes: int) -> torch.Tensor:
        """A slot's first `nbytes` as a uint8 tensor (a view, no copy)."""

    @abstractmethod
    def close(self, files: list[Any]) -> None: ...

    @abstractmethod
    def sections_per_read(self, shape: ObjectShape, n_layers: int) -> int:
        """Adjacent sections one read request may fill."""

    def open(self, ns: str, key: str, shape: ObjectShape) -> list[Any] | None:
        """An object's fragment files, opened for reads into this medium; None: a miss."""
        return self._open_object(ns, key, shape)

    def submit_reads(
        self,
        files: list[Any],
        ns: str,
        key: str,
        shape: ObjectShape,
        run: list[int],
        slots: list[int],
        tag: int,
    ) -> Future[list[bool]]:
        """Read the adjacent sections `run` into `slots`, one request; each verified."""
        return self._read_sections(files, ns, key, shape, run, [self.handle(s) for s in slots], tag)

    def submit_section(
        self, writer: ObjectWriter, section: int, slot: int, on_done: Callable[[bool], None]
    ) -> None:
        """Hand a filled slot to an object's writer."""
        self._write_section(writer, section, self.handle(slot), on_done)

    def host_address(self, slot: int) -> int:
        """A slot's host address, for the CPU engine's memmove copies (PagedCache.direct_copy)."""
        raise TypeError(f"{type(self).__name__}'s slots are not host memory")

    def close_ring(self) -> None:
        self.ring.close()


class HostMedium(Medium):
    def __init__(self, store: Store, ring: StagingRing):
        super().__init__(store)
        self.ring: StagingRing = ring
        self._open_object = store.open_object
        self._read_sections = store.submit_read_sections
        self._write_section = ObjectWriter.submit_section

    def handle(self, slot: int) -> memoryview:
        return self.ring.buffer(slot)

    def slot_bytes(self, slot: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(self.ring.buffer(slot, nbytes), dtype=torch.uint8)

    def host_address(self, slot: int) -> int:
        return self.ring.address(slot)

    def close(self, files: list[Any]) -> None:
        for fd in files:
            os.close(fd)

    def sections_per_read(self, shape: ObjectShape, n_layers: int) -> int:
        # Never more than the ring can lend at once.
        return self.store.sections_per_read(shape, min(n_layers, self.ring.num_slots // 2))


class DeviceMedium(Medium):
    def __init__(self, store: Store, ring: DeviceRing, device_io: Any):
        super().__init__(store)
        self.ring: DeviceRing = ring
        store.device_io = device_io
        self._open_object = store.open_object_device
        self._read_sections = store.submit_read_sections_device
        self._write_section = ObjectWriter.submit_device_section

    def handle(self, slot: int) -> Any:
        return self.ring.tensor(slot)

    def slot_bytes(self, slot: int, nbytes: int) -> torch.Tensor:
        return self.ring.tensor(slot, nbytes)

    def close(self, files: list[Any]) -> None:
        for f in files:
            f.close()

    def sections_per_read(self, shape: ObjectShape, n_layers: int) -> int:
        return 1  # device slots are not adjacent; kvikio splits each request itself


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
    cuda: bool
    # CPU engine with each block one contiguous run of bytes: copies are plain memmoves
    # between the paged cache and the host ring (worker_load.copy_in).
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
