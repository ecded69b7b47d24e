"""Non-negative weighted least squares for a handful of constants (every subset of the free
constants solved, the best feasible kept: exact for the two or three a planner fits), and
intervals from the relative residuals."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float], weights: Sequence[float]) -> list[float]:
    a = np.asarray(rows, dtype=float)
    b = np.asarray(y, dtype=float)
    w = np.sqrt(np.asarray(weights, dtype=float))
    aw, bw = a * w[:, None], b * w
    k = a.shape[1]
    best: tuple[float, list[float]] | None = None
    for size in range(k, 0, -1):
        for cols in itertools.combinations(range(k), size):
            sol, *_ = np.linalg.lstsq(aw[:, cols], bw, rcond=None)
            if (sol < 0).any():
                continue
            x = np.zeros(k)
            x[list(cols)] = sol
            cost = float(((aw @ x - bw) ** 2).sum())
            if best is None or cost < best[0] - 1e-15:
                best = (cost, x.tolist())
    return best[1] if best else [0.0] * k


def relative_interval(predicted: Sequence[float], measured: Sequence[float]) -> tuple[float, float] | None:
    """The 5th and 95th percentiles of measured/predicted - 1 (None under three points)."""
    r = [m / p - 1 for p, m in zip(predicted, measured, strict=True) if p > 0]
    if len(r) < 3:
        return None
    return float(np.percentile(r, 5)), float(np.percentile(r, 95))
