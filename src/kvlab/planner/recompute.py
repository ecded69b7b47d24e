"""Recompute (prefill) time: a measured curve where a run gives one, else FLOPs at a stated
utilisation of the node's GPUs.

t(n) = fixed + per_token * n + FLOPs(n) / rate, FLOPs = 2 x active params x n + attention's
(each token against those before it). The per-token term is what an engine spends per
token outside arithmetic (input handling, scheduling, sampling buffers): negligible on a
GPU with a large model, most of a tiny model's cost on a CPU. A fit gives all three; the
FLOPs model states its utilisation. A prefill's tail past a restored prefix costs the same
arithmetic over the tokens it computes.

On a CPU node (a run with a `cache_limit` record) the curve also knows where attention's
reads come from. vLLM's CPU attention (CPU_ATTN) tiles the queries by half the L2: a tile of
T query tokens (`q_tile_tokens`, ~960 here) reads one KV head's prefix once, from the LLC
while that prefix fits in it, from DRAM beyond. Those bytes cost the measured DRAM rate
instead of the LLC rate: `memory_s`, added without credit for overlap with the arithmetic (an
upper bound). At T ~ 1,000 queries per key read, this is ~1% of a 100K prefill: measured,
the kernel's CPU time per (query, key) pair stays 1.72-1.80 ns from 10K to 100K tokens.
The fitted constants stay what short prompts determine (their prefixes fit in the LLC).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlab.planner.geometry import Geometry
from kvlab.planner.node import Node

DEFAULT_UTILISATION = 0.35  # of the GPUs' dense peak: a long prefill's usual share on Hopper


VLLM_CPU_Q_PER_ITER = 8  # vLLM CPU_ATTN (VEC ISA): query heads held in registers per iteration
VLLM_CPU_MAX_Q_TILE = 128 * VLLM_CPU_Q_PER_ITER


@dataclass(frozen=True)
class CacheLimit:
    """A CPU node's caches as a run measured them (the `cache_limit` record)."""

    llc_bytes: int  # what the LLC holds for one reader (measured: effective_llc_bytes)
    llc_gbps: float  # single-thread read rate of a buffer in the LLC
    dram_gbps: float  # ... of one far beyond it
    l2_bytes: int = 1 << 20

    def q_tile_tokens(self, g: Geometry) -> int:
        """vLLM CPU_ATTN's query tile: half the L2 holds the tile's fp32 Q, K, V and output rows
        plus 8 rows of logits per token (`calcu_default_tile_size`), at most 1,024 heads."""
        elem = 4  # the buffers are fp32; the KV cache the model's dtype
        kv_elem = g.layer_bytes(g.native_dtype) // max(1, 2 * g.kv_heads * g.head_dim)
        per = g.head_dim * (4 + 2 * kv_elem + elem) + VLLM_CPU_Q_PER_ITER * 4
        tile = min((self.l2_bytes // 2) // per, VLLM_CPU_MAX_Q_TILE)
        tile = max(tile // VLLM_CPU_Q_PER_ITER * VLLM_CPU_Q_PER_ITER, VLLM_CPU_Q_PER_ITER)
        return max(1, tile // max(1, g.attn_heads // max(1, g.kv_heads)))

    def beyond_llc_bytes(self, g: Geometry, n: int, start: int = 0) -> float:
        """KV bytes attention reads from DRAM for tokens start..n: each query tile reads each KV
        head's prefix once; a prefix larger than the LLC is read from DRAM."""
        if g.attention != "gqa" or n <= start:
            return 0.0
        head = g.layer_bytes(g.native_dtype) / max(1, g.kv_heads)  # K+V of one head, per token
        fits = self.llc_bytes / head  # prefix tokens the LLC holds
        t = self.q_tile_tokens(g)
        total = 0.0
        for s in range(start, n, t):  # the tile s..e reads keys 0..e
            e = min(n, s + t)
            if e > fits:
                total += e * head
        return total * g.layers * g.kv_heads

    def memory_s(self, g: Geometry, n: int, start: int = 0) -> float:
        """Seconds the DRAM reads cost beyond the same reads from the LLC (no overlap credit)."""
        extra = 1 / self.dram_gbps - 1 / self.llc_gbps if self.dram_gbps < self.llc_gbps else 0.0
        return self.beyond_llc_bytes(g, n, start) * extra / 1e9

    def describe(self, g: Geometry, n: int) -> str:
        t = self.q_tile_tokens(g)
        head = g.layer_bytes(g.native_dtype) / max(1, g.kv_heads)
        return (
            f"CPU node: LLC holds {self.llc_bytes / 2**20:.0f} MiB ({self.llc_bytes / head:,.0f} tokens of one KV head), "
            f"read {self.llc_gbps:.1f} GB/s there, {self.dram_gbps:.1f} GB/s from DRAM; vLLM CPU_ATTN query tile "
            f"{t} tokens (half the {self.l2_bytes >> 10} KiB L2): at {n:,} tokens "
            f"{self.beyond_llc_bytes(g, n) / 1e9:.2f} GB from DRAM, +{self.memory_s(g, n):.3f} s"
        )


@dataclass(frozen=True)
class PrefillCurve:
    flops_s: float  # effective FLOP/s of the arithmetic
    per_token_s: float
    fixed_s: float
    source: str  # "FLOPs model: ..." or "fitted on RUN"
    memory: CacheLimit | None = None  # a CPU node's caches (None: a GPU node, arithmetic only)

    def compute_s(self, g: Geometry, n: int, start: int = 0) -> float:
        """Seconds of work for tokens start..n (start: a restored prefix), without the fixed cost."""
        if n <= start:
            return 0.0
        arith = g.prefill_flops(n, start) / self.flops_s
        return self.per_token_s * (n - start) + arith + self.memory_s(g, n, start)

    def memory_s(self, g: Geometry, n: int, start: int = 0) -> float:
        return self.memory.memory_s(g, n, start) if self.memory else 0.0

    def regime(self) -> str:
        if self.memory:
            return "cpu: arithmetic + the KV reads beyond the measured LLC at the measured DRAM rate"
        return "arithmetic only (FLOPs; no cache_limit record: a GPU node or an older run)"

    def time(self, g: Geometry, n: int, start: int = 0) -> float:
        return self.fixed_s + self.compute_s(g, n, start) if n > start else 0.0

    def to_dict(self) -> dict:
        return {
            "flops_s": self.flops_s,
            "per_token_s": self.per_token_s,
            "fixed_s": self.fixed_s,
            "source": self.source,
            "regime": self.regime(),
            "cache_limit": dataclasses.asdict(self.memory) if self.memory else None,
        }


def flops_model(
    node: Node, utilisation: float = DEFAULT_UTILISATION, fixed_s: float = 0.05, fp8: bool = False
) -> PrefillCurve:
    peak = node.gpus * node.gpu_tflops * 1e12 * (2 if fp8 else 1)
    return PrefillCurve(
        peak * utilisation,
        0.0,
        fixed_s,
        f"FLOPs model: {utilisation:.0%} of {node.gpus}x {node.gpu_tflops:g} TFLOP/s"
        + (" x2 (fp8)" if fp8 else "")
        + " (stated, not measured)",
    )
