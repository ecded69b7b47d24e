"""The worker side: moves sections between the drives and vLLM's paged KV cache.

This class sets up and hands each of vLLM's calls to a pipeline: loads in worker/load.py,
saves in worker/save.py. Both move sections through a medium (worker/media.py), chosen
once here when the KV cache is registered:
- CPU engines: the host ring; copies are memmoves (or index_copy_ for other layouts).
- GPU engines with GDS (kvikio; compat mode where nvidia-fs is absent): a ring in device
  memory. Drives and GPU exchange sections directly, checksummed on the device (wsum64).
- GPU engines without kvikio (or io_engine "posix"): the host ring, page-locked.
"""

from __future__ import annotations

import logging
import operator
import zlib
from concurrent.futures import Future
from typing import Any

import torch

from kvlab_connector import metrics
from kvlab_connector.config import ConnectorConfig
from kvlab_connector.counters import STORE_REPORTED, WORKER_OWN, WORKER_REPORTED
from kvlab_connector.io.gds import DeviceIO, GdsProbe
from kvlab_connector.layout import Layout
from kvlab_connector.ring import DeviceRing, StagingRing
from kvlab_connector.scheduler import ChunkIO, StepMetadata
from kvlab_connector.store.store import Store
from kvlab_connector.worker.load import LoadPipeline, _runs
from kvlab_connector.worker.media import DeviceMedium, HostMedium, PagedCache, Transfers, copies_for
from kvlab_connector.worker.save import SavePipeline

__all__ = ["WorkerSide", "_runs", "kvikio_wanted"]

log = logging.getLogger("vllm.kvlab_connector")


def kvikio_wanted(io_engine: str, probe: GdsProbe) -> bool:
    """Whether a GPU engine moves KV through kvikio: where nvidia-fs is loaded (io_engine auto
    or gds), or in kvikio's compat mode when asked for (gds). WorkerSide._choose_gpu_io says
    why auto leaves compat mode alone."""
    return probe.usable and (probe.mode == "gds" or io_engine == "gds")


def _tuple_getter(names: tuple[str, ...]) -> Any:
    """operator.attrgetter that gives a tuple for one name too."""
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else (lambda o: (get(o),))


# vLLM asks for the counters after every step (vllm_stats.Intervals): read in C, not in a loop
# of getattr. Timed in the engine's worker on decode steps with nothing to move: 21 us a step
# before, 15 after, of the ~70 us that all of kvlab's hooks take a step.
_STORE_COUNTERS = _tuple_getter(STORE_REPORTED)
_OWN_COUNTERS = _tuple_getter(WORKER_OWN)


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
        self.io_mode = store.io_mode
        # Set at register_kv_caches: what both pipelines move KV between, and the pipelines.
        self.transfers: Transfers | None = None
        self._loads: LoadPipeline | None = None
        self._saves: SavePipeline | None = None
        # Requests whose load failed, with the repair generation (ChunkIO.epoch) it failed
        # in: their saves of that generation hold KV computed over missing blocks.
        self._poisoned: dict[str, int] = {}
        self._removing: dict[str, Future[int]] = {}  # objects whose load failed, being removed
        self._ring_reported = 0  # ring slots in use, as the gauge last said

    @property
    def ring(self) -> StagingRing | DeviceRing | None:
        return self.transfers.medium.ring if self.transfers else None

    @property
    def saves_dropped(self) -> int:
        return self._saves.saves_dropped if self._saves else 0

    @property
    def load_error_blocks(self) -> int:
        return self._loads.error_blocks if self._loads else 0

    # ---- set-up ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        names = [n for n in self.layout.layer_names if n in kv_caches]
        if len(names) != len(self.layout.layer_names):
            missing = sorted(set(self.layout.layer_names) - set(kv_caches))
            raise RuntimeError(f"kvlab connector: no KV tensor for layer(s) {missing}")
        kv = [kv_caches[n] for n in names]
        first = kv[0]
        dims = [d for d, s in enumerate(first.shape) if s == num_blocks]
        if not dims:
            raise RuntimeError(f"kvlab connector: cannot find the block dimension in KV shape {tuple(first.shape)}")
        blocks_dim = dims[0]
        block_shape = list(first.shape)
        del block_shape[blocks_dim]
        block_bytes = first.element_size()
        for s in block_shape:
            block_bytes *= s
        if block_bytes != self.layout.block_bytes:
            raise RuntimeError(
                f"kvlab connector: a block of layer {names[0]} holds {block_bytes} bytes, the KV spec says "
                f"{self.layout.block_bytes}: unsupported KV layout"
            )
        # The physical layout (shape, stride, dtype) tags every section: KV written in
        # one layout is never read into another.
        desc = f"{tuple(first.shape)}:{first.stride()}:{first.dtype}:{blocks_dim}".encode()
        cache = PagedCache(
            kv=kv, layer_index={n: i for i, n in enumerate(names)}, blocks_dim=blocks_dim,
            block_shape=tuple(block_shape), dtype=first.dtype, num_blocks=num_blocks, tag=zlib.crc32(desc),
            copies=copies_for(first.device, self.store),
            # CPU engine with each block one contiguous run of bytes (blocks may sit apart: a
            # backing shared by all layers can interleave them): copies are plain memmoves.
            direct_copy=blocks_dim == 0 and all(
                t.device.type == "cpu" and t.shape == first.shape and t.dtype == first.dtype
                and t[0].is_contiguous() and t.stride(0) * t.element_size() >= block_bytes
                for t in kv
            ),
        )
        medium = HostMedium(self.store, StagingRing(self.config.ring_bytes, self.shape.stride))
        self.transfers = Transfers(self.config, self.layout, self.store, self.ns, cache, medium)
        self._loads = LoadPipeline(self.transfers, self._poisoned, self._removing)
        self._saves = SavePipeline(self.transfers, self._poisoned, self._removing)
        self.io_mode = self.store.io_mode
        if first.device.type == "cuda":
            self._choose_gpu_io(first.device)
        elif self.config.io_engine == "gds":
            raise RuntimeError(
                f"kvlab connector: io_engine 'gds' moves KV between drives and GPU memory, but this "
                f"engine's KV cache is on {first.device.type}: set io_engine 'auto' or 'posix'"
            )
        ring = self.transfers.medium.ring
        log.info(
            "kvlab connector: %d layers, %d B sections, %d ring slots (%d MiB), io %s, drives %s",
            len(kv), self.shape.section_bytes, ring.num_slots, ring.ring_bytes >> 20,
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
        from kvlab_connector.io.gds import probe_gds

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
        assert self.transfers is not None
        try:
            self.transfers.medium.ring.pin()  # the host medium: nothing else was chosen
        except RuntimeError as e:  # slower (copies wait for the host), never wrong
            log.warning("kvlab connector: %s: copies between the ring and the GPU run synchronously", e)
        self.io_mode = f"{self.store.io_mode}+h2d"

    def use_device_io(self, device_io: DeviceIO, device: torch.device) -> None:
        """Stage sections in device memory and move them with device_io (GDS). GPU engines
        come here from the probe; CPU tests come here with gds.PosixFile."""
        t = self.transfers
        assert t is not None, "register_kv_caches first"
        t.medium.close_ring()
        t.medium = DeviceMedium(self.store, DeviceRing(self.config.ring_bytes, self.shape.stride, device), device_io)
        t.cache.direct_copy = False
        self.io_mode = device_io.mode

    # ---- vLLM's calls, handed to the pipelines ------------------------------------------
    def start_load(self, meta: StepMetadata) -> None:
        if self._loads is not None:
            self._loads.start(meta)

    def wait_for_layer(self, layer_name: str) -> None:
        if self._loads is not None:
            self._loads.wait_for_layer(layer_name)

    def take_load_errors(self) -> set[int]:
        return self._loads.take_errors() if self._loads is not None else set()

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: StepMetadata) -> None:
        # vLLM's save_kv_layer calls this only on steps that save (vllm_connector.py).
        if self.saves_enabled and self._saves is not None:
            self._saves.save_layer(layer_name, kv_layer, meta)

    def save_finished(self, finish_saves: dict[str, list[ChunkIO]]) -> None:
        if self._saves is not None:
            self._saves.save_finished(finish_saves, self.saves_enabled)

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose last objects are copied out: vLLM may free their blocks."""
        for req_id in finished_req_ids:
            self._poisoned.pop(req_id, None)
        return self._saves.take_finished() if self._saves is not None else set()

    def end_step(self, meta: StepMetadata | None = None) -> None:
        """After the forward: saves are queued (not waited for); loads accounted for."""
        if self._loads is None or self._saves is None:
            return
        self._loads.finish()
        self._saves.end_step()
        # A step with nothing to load or save takes no lock (the ring's, the gauge's): the
        # gauge is read after steps with I/O and until it is back at zero.
        had_io = meta is not None and bool(meta.loads or meta.saves or meta.finish_saves)
        if had_io or self._ring_reported:
            m = metrics.metrics()
            if m is not None:
                self._ring_reported = self.transfers.medium.ring.in_use  # type: ignore[union-attr]
                m["ring_in_use"].set(self._ring_reported)

    def counters(self) -> dict[str, Any]:
        """Every counter a worker reports (counters.WORKER_REPORTED), by its one name."""
        return dict(zip(WORKER_REPORTED, _STORE_COUNTERS(self.store.stats) + _OWN_COUNTERS(self), strict=True))

    def stats(self) -> dict[str, Any]:
        return {
            "io_mode": self.io_mode,
            **self.counters(),
            "ring_bytes": self.ring.ring_bytes if self.ring else 0,
            "ring_high_water_slots": self.ring.high_water if self.ring else 0,
        }
