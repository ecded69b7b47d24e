"""The class vLLM loads (`kv_connector_module_path: kvlab_connector.vllm_connector`).

A thin shell: every call goes to the scheduler side or the worker side.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvlab_connector import metrics
from kvlab_connector.config import ConnectorConfig, check_load_failure_policy
from kvlab_connector.keys import model_fingerprint
from kvlab_connector.layout import layout_from_vllm
from kvlab_connector.scheduler import SchedulerSide, StepMetadata
from kvlab_connector.scrub import Scrubber
from kvlab_connector.store.store import Store
from kvlab_connector.vllm_stats import Intervals, KvlabStats

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.kvlab_connector")


@dataclass
class KvlabMetadata(KVConnectorMetadata):
    step: StepMetadata


class KvlabConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = vllm_config.kv_transfer_config
        check_load_failure_policy(kvt)
        self.config = ConnectorConfig.from_extra(dict(kvt.kv_connector_extra_config or {}))
        fingerprint = self.config.model_fingerprint or model_fingerprint(vllm_config.model_config.model)
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, self.config.chunk_tokens, fingerprint)
        self.store = Store(
            self.config.paths, self.config.capacity_bytes, self.config.io_threads, self.config.o_direct_flag(),
            require_mount=self.config.require_mount,
        )
        self.num_blocks = int(kv_cache_config.num_blocks)
        self._scheduler: SchedulerSide | None = None
        self._scrubber: Scrubber | None = None
        self._worker = None
        self._intervals = Intervals()
        if role == KVConnectorRole.SCHEDULER:
            scan = self.store.rebuild()
            log.info(
                "kvlab connector: %d objects (%.1f GiB) on %d drive(s), index rebuilt in %.2f s",
                scan.objects, scan.bytes / 2**30, len(self.store.drives), scan.seconds,
            )
            self._scheduler = SchedulerSide(self.config, self.layout, self.store, self.layout.ranks())
            if self.config.scrub_bytes_per_s:
                self._scrubber = Scrubber(self.store.drives, self.store.ledger, self.config.scrub_bytes_per_s)
                self._scrubber.start()
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from kvlab_connector.worker.worker import WorkerSide

            try:
                rank = get_tensor_model_parallel_rank()
            except Exception:  # no parallel group in single-process tests
                rank = 0
            self._worker = WorkerSide(self.config, self.layout, self.store, rank)
            if self.config.metrics_port is not None:
                metrics.serve(self.config.metrics_port + rank)

    # ---- worker ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches, self.num_blocks)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KvlabMetadata)
        if kv_connector_metadata.step.finish_saves:
            self._worker.save_finished(kv_connector_metadata.step.finish_saves)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvlabMetadata)
        self._worker.start_load(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvlabMetadata)
        if meta.step.saves:  # called for every layer of every step; most steps save nothing
            self._worker.save_layer(layer_name, kv_layer, meta.step)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvlabMetadata)
        self._worker.end_step(meta.step)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Requests whose blocks request_finished held: copied out by handle_preemptions.
        return self._worker.get_finished(finished_req_ids) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._scrubber is not None:
            self._scrubber.stop()
        self.store.close()

    def get_kv_connector_stats(self) -> Any:
        if self._worker is None:
            return None
        data = self._intervals.next(self._worker.counters())
        return None if data is None else KvlabStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        stats = KvlabStats()
        stats.reset()
        if data:
            stats.data.update(data)
        return stats

    # ---- scheduler ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvlabMetadata(self._scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(set(connector_output.invalid_block_ids or ()))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # True: vLLM holds the blocks until get_finished reports the request's last saves.
        return self._scheduler.request_finished(request, block_ids), None

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a save lost to a preemption is a later miss, nothing more.
        return False
