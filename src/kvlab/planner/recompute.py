"""Recompute (prefill) time: a measured curve where a run gives one, else FLOPs at a stated
utilisation of the node's GPUs.

t(n) = fixed + per_token * n + FLOPs(n) / rate, FLOPs = 2 x active params x n + attention's
(each token against those before it). The per-token term is what an engine spends per
token outside arithmetic (input handling, scheduling, sampling buffers): negligible on a
GPU with a large model, most of a tiny model's cost on a CPU. A fit gives all three; the
FLOPs model states its utilisation. A prefill's tail past a restored prefix costs the same
arithmetic over the tokens it computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.planner.geometry import Geometry
from kvlab.planner.node import Node

DEFAULT_UTILISATION = 0.35  # of the GPUs' dense peak: a long prefill's usual share on Hopper


@dataclass(frozen=True)
class PrefillCurve:
    flops_s: float  # effective FLOP/s of the arithmetic
    per_token_s: float
    fixed_s: float
    source: str  # "FLOPs model: ..." or "fitted on RUN"

    def compute_s(self, g: Geometry, n: int, start: int = 0) -> float:
        """Seconds of work for tokens start..n (start: a restored prefix), without the fixed cost."""
        if n <= start:
            return 0.0
        return self.per_token_s * (n - start) + g.prefill_flops(n, start) / self.flops_s

    def time(self, g: Geometry, n: int, start: int = 0) -> float:
        return self.fixed_s + self.compute_s(g, n, start) if n > start else 0.0

    def to_dict(self) -> dict:
        return {
            "flops_s": self.flops_s,
            "per_token_s": self.per_token_s,
            "fixed_s": self.fixed_s,
            "source": self.source,
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
