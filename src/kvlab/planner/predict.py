"""`kvlab predict`'s answer: per prompt length, KV bytes, recompute, restore per tier; the
bill; with --calibrate, the fitted constants and the cells of a run. Schema
`kvlab.predict/1` (docs/planner.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvlab.planner import restore as restore_mod
from kvlab.planner.bill import BillInputs, bill
from kvlab.planner.geometry import Geometry
from kvlab.planner.node import Node
from kvlab.planner.recompute import PrefillCurve

SCHEMA = "kvlab.predict/1"


@dataclass(frozen=True)
class Ask:
    geometry: Geometry
    dtype: str | None
    tp: int
    node: Node
    tokens: tuple[int, ...]
    prefill: PrefillCurve
    tiers: tuple[str, ...] = restore_mod.TIERS
    fixed_s: float = 0.0  # per restore, where no calibration gives one
    in_flight: int = 1
    with_mtp: bool = False
    tail_tokens: int = 0  # tokens past the last stored chunk (recomputed after a restore)
    bill: BillInputs | None = None


def kv_bytes(a: Ask, n: int) -> tuple[int, int]:
    """One stored copy of n tokens, and what each GPU holds of it."""
    return (
        n * a.geometry.kv_bytes_per_token(a.dtype, a.with_mtp),
        n * a.geometry.kv_bytes_per_token_per_gpu(a.tp, a.dtype, a.with_mtp),
    )


def point(a: Ask, n: int) -> dict[str, Any]:
    g = a.geometry
    copy, per_gpu = kv_bytes(a, n)
    stored = max(0, n - a.tail_tokens)
    tail = a.prefill.compute_s(g, n, stored)
    tiers = {}
    for tier in a.tiers:
        r = restore_mod.restore(
            tier,
            a.node,
            stored * g.kv_bytes_per_token(a.dtype, a.with_mtp),
            a.tp,
            g.replication(a.tp),
            tail,
            g.layers,
            a.fixed_s,
            a.in_flight,
        )
        tiers[tier] = {
            "ttft_s": r.total_s,
            "transfer_s": r.transfer_s,
            "tail_compute_s": r.compute_s,
            "fixed_s": r.fixed_s,
            "limit": r.limit,
            "stages": [{"name": s.name, "gbps": s.gbps, "seconds": s.seconds(a.in_flight)} for s in r.stages],
        }
    return {
        "tokens": n,
        "kv_bytes": copy,
        "kv_bytes_per_gpu": per_gpu,
        "recompute_s": a.prefill.time(g, n),
        "restore": tiers,
    }


def answer(a: Ask) -> dict[str, Any]:
    g = a.geometry
    pts = [point(a, n) for n in a.tokens]
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "model": {
            "name": g.name,
            "attention": g.attention,
            "kv_dtype": a.dtype or g.native_dtype,
            "with_mtp": a.with_mtp,
            "layers": g.layers,
        },
        "tp": a.tp,
        "node": {**asdict(a.node)},
        "kv_bytes_per_token": g.kv_bytes_per_token(a.dtype, a.with_mtp),
        "kv_bytes_per_token_per_gpu": g.kv_bytes_per_token_per_gpu(a.tp, a.dtype, a.with_mtp),
        "replication": g.replication(a.tp),
        "recompute": a.prefill.to_dict(),
        "restore_fixed_s": a.fixed_s,
        "in_flight": a.in_flight,
        "tail_tokens": a.tail_tokens,
        "points": pts,
        "explain": g.explain(a.dtype, a.with_mtp, a.tp),
    }
    if len(pts) == 1:  # one length: its figures are top-level scalars too
        out["tokens"] = pts[0]["tokens"]
        out["kv_bytes"] = pts[0]["kv_bytes"]
        out["kv_bytes_per_gpu"] = pts[0]["kv_bytes_per_gpu"]
    if a.bill is not None:
        out["bill"] = bill(g, a.node, a.dtype, a.tp, a.bill, a.with_mtp)
    return out
