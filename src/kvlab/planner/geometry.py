"""A model's KV geometry: bytes per token (one stored copy) and per GPU under tensor parallelism.

Attention layers only, plus a sparse-attention indexer where the model has one; an MTP
(multi-token prediction) layer's KV only when asked for. Three layouts:
- GQA: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes;
- MLA: layers x (kv_lora_rank + rope dim) x dtype bytes (the compressed latent);
- MLA with vLLM's FP8 sparse-MLA layout (`fp8_ds_mla`): 656 bytes per layer (512 fp8 latent,
  4 fp32 scales, 64 bf16 rope), not 576.
Under TP, vLLM keeps MLA's latent whole on every rank (one stored copy serves them all), and a
GQA rank holds max(1, kv_heads / tp) heads: fewer KV heads than ranks replicates heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
FP8_DS_MLA_LAYER_BYTES = 656  # 512 fp8 + 4 x fp32 scales + 64 x bf16 rope


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"KV dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class Geometry:
    """What a KV restore moves and a prefill computes, per token."""

    name: str
    attention: Literal["gqa", "mla"]
    layers: int  # attention layers holding KV (MTP layers apart)
    kv_heads: int = 0  # GQA
    head_dim: int = 0  # GQA
    kv_lora_rank: int = 0  # MLA latent
    rope_dim: int = 0  # MLA decoupled rope key
    indexer_layers: int = 0  # sparse-attention indexer keys: layers holding their own
    indexer_dim: int = 128  # fp8 values per token per indexer layer
    indexer_scale_bytes: int = 4
    mtp_layers: int = 0
    native_dtype: str = "bf16"  # the checkpoint's KV dtype where none is asked for
    # compute (prefill FLOPs): active parameters per token, query heads x (qk + v) dims per layer
    active_params: float = 0.0
    attn_heads: int = 0
    attn_qk_dim: int = 0
    attn_v_dim: int = 0
    sparse_topk: int = 0  # a sparse-attention model attends to at most this many tokens
    indexer_heads: int = 64  # the indexer scores every earlier token (dense, fp8): its own n^2

    def layer_bytes(self, dtype: str) -> int:
        """KV bytes per token of one attention layer."""
        if self.attention == "gqa":
            return 2 * self.kv_heads * self.head_dim * dtype_bytes(dtype)
        if dtype == "fp8" and self.indexer_layers:
            return FP8_DS_MLA_LAYER_BYTES  # vLLM's sparse-MLA FP8 layout
        return (self.kv_lora_rank + self.rope_dim) * dtype_bytes(dtype)

    @property
    def indexer_bytes(self) -> int:
        return self.indexer_dim + self.indexer_scale_bytes

    def kv_bytes_per_token(self, dtype: str | None = None, with_mtp: bool = False) -> int:
        """One stored copy's bytes per token."""
        d = dtype or self.native_dtype
        layers = self.layers + (self.mtp_layers if with_mtp else 0)
        indexers = self.indexer_layers + (self.mtp_layers if with_mtp and self.indexer_layers else 0)
        return layers * self.layer_bytes(d) + indexers * self.indexer_bytes

    def heads_per_rank(self, tp: int) -> int:
        """KV heads a GQA rank holds: its share, at least one (replicated below that)."""
        return max(1, self.kv_heads // tp) if self.attention == "gqa" else 0

    def kv_bytes_per_token_per_gpu(self, tp: int, dtype: str | None = None, with_mtp: bool = False) -> int:
        """What one GPU holds per token: MLA's latent whole on every rank; a GQA rank its heads."""
        if tp < 1:
            raise ValueError(f"tensor parallelism {tp}: at least 1")
        whole = self.kv_bytes_per_token(dtype, with_mtp)
        if self.attention == "mla":
            return whole
        return whole * self.heads_per_rank(tp) // self.kv_heads

    def replication(self, tp: int) -> float:
        """Copies of each KV byte the TP ranks hold together (1 = split, tp = every rank whole)."""
        if self.attention == "mla":
            return float(tp)
        return self.heads_per_rank(tp) * tp / self.kv_heads

    def explain(self, dtype: str | None = None, with_mtp: bool = False, tp: int = 1) -> list[str]:
        d = dtype or self.native_dtype
        layers = self.layers + (self.mtp_layers if with_mtp else 0)
        lines = []
        if self.attention == "gqa":
            lines.append(
                f"GQA: 2 (K,V) x {layers} layers x {self.kv_heads} KV heads x {self.head_dim} head dim "
                f"x {dtype_bytes(d)} B ({d}) = {layers * self.layer_bytes(d):,} B/token"
            )
        elif d == "fp8" and self.indexer_layers:
            lines.append(
                f"MLA, vLLM fp8_ds_mla: {layers} layers x {FP8_DS_MLA_LAYER_BYTES} B (512 fp8 latent, "
                f"4 fp32 scales, 64 bf16 rope) = {layers * self.layer_bytes(d):,} B/token"
            )
        else:
            lines.append(
                f"MLA: {layers} layers x ({self.kv_lora_rank} latent + {self.rope_dim} rope) x "
                f"{dtype_bytes(d)} B ({d}) = {layers * self.layer_bytes(d):,} B/token"
            )
        if self.indexer_layers:
            n = self.indexer_layers + (self.mtp_layers if with_mtp else 0)
            lines.append(
                f"sparse-attention indexer: {n} layers x ({self.indexer_dim} fp8 + "
                f"{self.indexer_scale_bytes} B scale) = {n * self.indexer_bytes:,} B/token"
            )
        if self.mtp_layers and not with_mtp:
            lines.append(f"({self.mtp_layers} MTP layer(s) not counted: --with-mtp counts them)")
        lines.append(f"one stored copy: {self.kv_bytes_per_token(d, with_mtp):,} B/token")
        per_gpu = self.kv_bytes_per_token_per_gpu(tp, d, with_mtp)
        if self.attention == "mla":
            lines.append(
                f"TP {tp}: MLA's latent is whole on every rank: {per_gpu:,} B/token per GPU "
                f"(one stored copy serves all {tp})"
            )
        else:
            lines.append(
                f"TP {tp}: {self.heads_per_rank(tp)} of {self.kv_heads} KV heads per rank"
                + (" (replicated: fewer KV heads than ranks)" if self.kv_heads < tp else "")
                + f": {per_gpu:,} B/token per GPU"
            )
        return lines

    # ---- prefill FLOPs ------------------------------------------------------------------
    def linear_flops_per_token(self) -> float:
        """Matrix products: 2 x active parameters per token."""
        return 2.0 * self.active_params

    def attention_flops(self, n: int, start: int = 0) -> float:
        """Attention's FLOPs for tokens start..n (each attends to the tokens before it, or to
        `sparse_topk` of them): QK^T and PV, 2 FLOPs a multiply-add."""
        per_ctx = 2.0 * self.layers * self.attn_heads * (self.attn_qk_dim + self.attn_v_dim)
        if self.sparse_topk:
            k = self.sparse_topk
            dense_end = min(n, k)
            dense = max(0, dense_end - start)
            ctx = (dense_end * dense_end - min(start, k) ** 2) / 2 if dense else 0.0
            return per_ctx * (ctx + max(0, n - max(start, k)) * k)
        return per_ctx * (n * n - start * start) / 2

    def indexer_flops(self, n: int, start: int = 0) -> float:
        """A sparse-attention indexer's scores: every token against every earlier one."""
        if not self.indexer_layers:
            return 0.0
        return 2.0 * self.indexer_layers * self.indexer_heads * self.indexer_dim * (n * n - start * start) / 2

    def prefill_flops(self, n: int, start: int = 0) -> float:
        return (
            self.linear_flops_per_token() * (n - start)
            + self.attention_flops(n, start)
            + self.indexer_flops(n, start)
        )
