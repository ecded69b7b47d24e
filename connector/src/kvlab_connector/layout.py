"""KV geometry both sides agree on, from vLLM's KVCacheConfig, and the namespace it implies."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab_connector.config import ConfigError
from kvlab_connector.keys import namespace
from kvlab_connector.store.store import ObjectShape


@dataclass(frozen=True)
class Layout:
    layer_names: tuple[str, ...]
    block_size: int
    block_bytes: int  # one layer's bytes of one block
    chunk_tokens: int
    spec: str  # the KV spec as text: kind, heads, head size, dtype
    device: str
    model_fingerprint: str
    tp_size: int
    mla: bool  # every rank holds the same KV: one copy serves all ranks

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def shape(self) -> ObjectShape:
        return self.shape_of(self.blocks_per_chunk)

    def shape_of(self, blocks: int) -> ObjectShape:
        """An object of `blocks` blocks: a whole chunk, or a tail (scheduler.py)."""
        return ObjectShape(len(self.layer_names), blocks * self.block_bytes)

    def namespace(self, rank: int) -> str:
        return namespace(
            model=self.model_fingerprint, spec=self.spec, device=self.device,
            block_size=self.block_size, chunk_tokens=self.chunk_tokens, layers=len(self.layer_names),
            tp=1 if self.mla else self.tp_size, rank=0 if self.mla else rank,
        )

    def ranks(self) -> list[int]:
        return [0] if self.mla else list(range(self.tp_size))


def layout_from_vllm(vllm_config, kv_cache_config, chunk_tokens: int, fingerprint: str) -> Layout:  # type: ignore[no-untyped-def]
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"kvlab's connector supports models with one KV cache group; this model has {len(groups)} "
            "(hybrid or sliding-window layers): use another setup for it"
        )
    spec = groups[0].kv_cache_spec
    block_size = spec.block_size
    if chunk_tokens % block_size:
        raise ConfigError(
            f"kv_connector_extra_config.chunk_tokens ({chunk_tokens}) must be a multiple of the engine's "
            f"block size ({block_size})"
        )
    spec_text = (
        f"{type(spec).__name__}:heads={getattr(spec, 'num_kv_heads', '')}:head={getattr(spec, 'head_size', '')}"
        f":head_v={getattr(spec, 'head_size_v', '')}:dtype={getattr(spec, 'dtype', '')}"
    )
    parallel = vllm_config.parallel_config
    return Layout(
        layer_names=tuple(groups[0].layer_names),
        block_size=block_size,
        block_bytes=int(spec.page_size_bytes),
        chunk_tokens=chunk_tokens,
        spec=spec_text,
        device=str(vllm_config.device_config.device_type),
        model_fingerprint=fingerprint,
        tp_size=int(parallel.tensor_parallel_size),
        mla=bool(vllm_config.model_config.use_mla),
    )
