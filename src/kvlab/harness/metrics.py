"""The seeds' metrics, as pure functions over per-request records (unit-tested by hand).

- frozen answers: answers whose longest gap between streamed tokens exceeds a threshold
- rounds averaging: the mean of rounds first..last (1-based, inclusive; the seed: 2-9 of 10)
- hit shares of returning turns: of turns (the seed's count) and of prompt tokens
- percentiles: linear interpolation between closest ranks (numpy's default)
- improvement factors: baseline / setup for times, setup / baseline for rates
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def frozen_answers(max_gaps_s: Iterable[float], threshold_s: float) -> int:
    """Answers whose longest pause between two streamed tokens is above the threshold."""
    return sum(1 for g in max_gaps_s if g > threshold_s)


def mean_of_rounds(values_by_round: Sequence[float], first: int, last: int) -> float:
    """Mean of rounds first..last, 1-based and inclusive: (2, 9) drops the cold first round and the last."""
    if not 1 <= first <= last <= len(values_by_round):
        raise ValueError(f"rounds {first}..{last} outside the {len(values_by_round)} measured")
    chosen = values_by_round[first - 1:last]
    return sum(chosen) / len(chosen)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} outside 0..100")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def improvement(baseline: float | None, value: float | None, higher_is_better: bool) -> float | None:
    """How many times better than the baseline: baseline/value for times, value/baseline for rates."""
    if baseline is None or value is None:
        return None
    num, den = (value, baseline) if higher_is_better else (baseline, value)
    return num / den if den > 0 else None


@dataclass(frozen=True)
class Turn:
    """What the hit shares need of one answered turn."""

    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int  # prefix already sent earlier (by this session or another)


def is_hit(turn: Turn, min_fraction: float) -> bool:
    """A returning turn is found in the cache when at least min_fraction of its reusable prefix was cached."""
    return turn.reusable_tokens > 0 and turn.cached_tokens >= min_fraction * turn.reusable_tokens


def returning(turns: Iterable[Turn]) -> list[Turn]:
    return [t for t in turns if t.reusable_tokens > 0]


def turn_hit_share(turns: Iterable[Turn], min_fraction: float) -> float | None:
    """Share of returning turns found in the cache (the first seed's 72/88/90%)."""
    ret = returning(turns)
    if not ret:
        return None
    return sum(1 for t in ret if is_hit(t, min_fraction)) / len(ret)


def token_hit_share(turns: Iterable[Turn]) -> float | None:
    """Share of the prompt tokens of returning turns that came from the cache."""
    ret = returning(turns)
    total = sum(t.prompt_tokens for t in ret)
    if total == 0:
        return None
    return sum(min(t.cached_tokens, t.prompt_tokens) for t in ret) / total


def decode_rate(output_tokens: int, ttft_s: float, total_s: float) -> float | None:
    """Tokens per second after the first one (the first token's time is the prefill's)."""
    span = total_s - ttft_s
    if output_tokens < 2 or span <= 0:
        return None
    return (output_tokens - 1) / span


def decode_rate_per_agent(per_agent: Iterable[Sequence[tuple[int, float, float]]]) -> float | None:
    """Mean over agents of each agent's decoded tokens / decoding time, over all its turns.

    Each agent is a list of (output_tokens, ttft_s, total_s) of its turns.
    """
    rates = []
    for turns in per_agent:
        toks = sum(n - 1 for n, _, _ in turns if n >= 2)
        span = sum(total - ttft for n, ttft, total in turns if n >= 2)
        if span > 0:
            rates.append(toks / span)
    return sum(rates) / len(rates) if rates else None


def throughput(prompt_tokens: int, output_tokens: int, total_s: float) -> float:
    """Total token throughput of one round: all tokens / wall time of the round."""
    return (prompt_tokens + output_tokens) / total_s
