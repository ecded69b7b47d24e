"""The seeds' metrics, as pure functions over per-request records (unit-tested by hand).

- frozen answers: answers whose longest gap between streamed tokens exceeds a threshold
- rounds averaging: the mean of rounds first..last (1-based, inclusive; the seed: 2-9 of 10)
- hit shares of returning turns: of turns (the seed's count), of prompt tokens, and of the
  reusable tokens a block-granular cache could return at best
- percentiles: linear interpolation between closest ranks (numpy's default)
- improvement factors: baseline / setup for times, setup / baseline for rates
"""

from __future__ import annotations

import math
import re
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


def quartiles(values: Sequence[float]) -> list[float]:
    """[first quartile, third quartile] (inclusive method); a single value stands for both."""
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def midmean(values: Sequence[float]) -> float:
    """The mean of the middle half (the interquartile mean): a quarter of the values at either
    end can be anything without moving it far, and two modes average instead of one winning."""
    xs = sorted(values)
    cut = len(xs) // 4
    return statistics.fmean(xs[cut:len(xs) - cut])


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


def block_aligned_reusable(turn: Turn, block_size: int) -> int:
    """The most a block-granular cache can return for this turn: its reusable prefix, less
    the prompt's last token (vLLM always computes that one), rounded down to whole blocks."""
    return min(turn.reusable_tokens, turn.prompt_tokens - 1) // block_size * block_size


def reusable_hit_share(turns: Iterable[Turn], block_size: int | None) -> float | None:
    """Tokens restored / block-aligned reusable tokens, over returning turns (each turn's
    restored tokens capped at its own bound, so 1.0 is the best any block-granular cache does)."""
    if not block_size or block_size <= 0:
        return None
    bounds = [(t, block_aligned_reusable(t, block_size)) for t in returning(turns)]
    total = sum(b for _, b in bounds)
    if total == 0:
        return None
    return sum(min(t.cached_tokens, b) for t, b in bounds) / total


def decode_rate(output_tokens: int, ttft_s: float, total_s: float) -> float | None:
    """Tokens per second after the first one (the first token's time is the prefill's)."""
    span = total_s - ttft_s
    if output_tokens < 2 or span <= 0:
        return None
    return (output_tokens - 1) / span


def pooled_decode_rate(requests: Iterable[tuple[int, float, float]]) -> float | None:
    """Tokens decoded after the first over the time spent decoding them, over all `requests`
    ((output_tokens, ttft_s, total_s) each): each request weighs by its decoding time."""
    toks = span = 0.0
    for n, ttft, total in requests:
        if n >= 2:
            toks += n - 1
            span += total - ttft
    return toks / span if span > 0 else None


def decode_rate_per_agent(per_agent: Iterable[Sequence[tuple[int, float, float]]]) -> float | None:
    """Mean over agents of each agent's decoded tokens / decoding time, over all its turns.

    Each agent is a list of (output_tokens, ttft_s, total_s) of its turns.
    """
    rates = [r for r in (pooled_decode_rate(turns) for turns in per_agent) if r is not None]
    return sum(rates) / len(rates) if rates else None


def throughput(prompt_tokens: int, output_tokens: int, total_s: float) -> float:
    """Total token throughput of one round: all tokens / wall time of the round."""
    return (prompt_tokens + output_tokens) / total_s


# ---- LMCache MP: its restore, phase by phase --------------------------------------------
# What LMCache and vLLM expose on the CPU engine (engine-driven transfer, KV pickled over
# ZMQ), each read as its change over one request; nothing here is estimated.
LOOKUP_HISTOGRAM = "vllm:lmcache_mp_lookup_duration_seconds"  # scheduler: lookup submitted .. answered
# vLLM's own request timers: WAITING (queue: lookup, async KV load, waits between steps)
# and PREFILL (first scheduled .. first token: compute of the tokens not restored).
ENGINE_HISTOGRAMS = {
    "engine_ttft_s": "vllm:time_to_first_token_seconds",
    "engine_queue_s": "vllm:request_queue_time_seconds",
    "engine_prefill_s": "vllm:request_prefill_time_seconds",
}
# The cache server's counters (its Prometheus text on its HTTP port's /metrics).
SERVER_COUNTERS = {
    "lookup_requested_tokens": "lmcache_mp_lookup_requested_tokens_total",
    "lookup_hit_tokens": "lmcache_mp_lookup_hit_tokens_total",
    "lookup_hit_l1_tokens": "lmcache_mp_lookup_hit_l1_tokens_total",
    "lookup_hit_l2_tokens": "lmcache_mp_lookup_hit_l2_tokens_total",
    "l1_read_chunks": "lmcache_mp_l1_read_chunks_total",  # chunks read out of L1 for the engine
    "l2_load_chunks": "lmcache_mp_l2_prefetch_load_completed_chunks_total",  # chunks brought up from L2
}
# L2 -> L1 loads: bytes / (completed - submitted) per load, in GB/s (its only L2 timer).
L2_LOAD_HISTOGRAM = "lmcache_mp_l2_load_throughput_GB_per_second"
# The cache server's INFO lines that carry times (engine_driven_transfer.commit_retrieve and
# storage_manager's prefetch result); no Prometheus metric times the engine-driven retrieve.
_RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([0-9.]+) seconds")
_PREFETCHED = re.compile(r"Prefetch request completed \(L1\+L2\): (\d+)/(\d+) retained keys "
                         r"\((\d+) L1, (\d+) L2\) in ([0-9.]+) ms")


def _family(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def histogram_delta(after: dict[str, float], before: dict[str, float], name: str) -> tuple[float, int] | None:
    """(sum, count) a Prometheus histogram gained between two scrapes; None if it is absent."""
    if not any(k.startswith(name + "_count") for k in after):
        return None
    s = _family(after, name + "_sum") - _family(before, name + "_sum")
    n = _family(after, name + "_count") - _family(before, name + "_count")
    return s, round(n)


@dataclass(frozen=True)
class ServerLog:
    """What the cache server's log says about the requests between two offsets."""

    retrieve_s: float  # server answered prepare_retrieve .. the worker's commit_retrieve arrived
    retrieved_tokens: int
    retrieves: int
    prefetch_s: float  # lookup submitted on the server .. its L1/L2 prefetch result collected
    prefetch_l1_keys: int
    prefetch_l2_keys: int
    prefetches: int


def parse_server_log(text: str) -> ServerLog:
    """Sum the cache server's retrieve and prefetch lines in a slice of its log."""
    ret = [(int(m[1]), float(m[2])) for m in _RETRIEVED.finditer(text)]
    pre = [(int(m[3]), int(m[4]), float(m[5]) / 1000) for m in _PREFETCHED.finditer(text)]
    return ServerLog(
        retrieve_s=sum(s for _, s in ret), retrieved_tokens=sum(n for n, _ in ret), retrieves=len(ret),
        prefetch_s=sum(s for _, _, s in pre), prefetch_l1_keys=sum(a for a, _, _ in pre),
        prefetch_l2_keys=sum(b for _, b, _ in pre), prefetches=len(pre),
    )


def lmcache_breakdown(ttft_s: float, engine_after: dict[str, float], engine_before: dict[str, float],
                      server_after: dict[str, float], server_before: dict[str, float],
                      log: ServerLog | None) -> dict[str, float | int | None]:
    """One LMCache request's phases, from the scrapes around it and its slice of the server log.

    rest_s is what the measured phases leave of the client's TTFT: the server's gather and
    pickle before its answer, the scheduler's steps between lookup, load and compute, HTTP.
    It is only given where vLLM's own timers show lookup and retrieve inside the WAITING
    phase and the prefill after it (they do on the CPU engine, whose load is asynchronous);
    otherwise the phases could overlap and a difference would mean nothing.
    """
    out: dict[str, float | int | None] = {}
    lookup = histogram_delta(engine_after, engine_before, LOOKUP_HISTOGRAM)
    out["lookup_s"], out["lookups"] = (lookup if lookup else (None, None))
    for key, name in ENGINE_HISTOGRAMS.items():
        d = histogram_delta(engine_after, engine_before, name)
        out[key] = d[0] if d and d[1] == 1 else None  # one request, one observation
    if log is not None:
        # No line is no measurement (no retrieve, a GPU path that logs none, a quieter log
        # level), never a zero time: the counts say how many lines there were.
        out.update(retrieves=log.retrieves, prefetches=log.prefetches,
                   retrieve_s=log.retrieve_s if log.retrieves else None,
                   retrieved_tokens=log.retrieved_tokens if log.retrieves else None,
                   server_prefetch_s=log.prefetch_s if log.prefetches else None,
                   prefetch_l1_keys=log.prefetch_l1_keys if log.prefetches else None,
                   prefetch_l2_keys=log.prefetch_l2_keys if log.prefetches else None)
    for key, name in SERVER_COUNTERS.items():
        if any(k == name or k.startswith(name + "{") for k in server_after):
            out["server_" + key] = _family(server_after, name) - _family(server_before, name)
    l2 = histogram_delta(server_after, server_before, L2_LOAD_HISTOGRAM)
    if l2 and l2[1] > 0:
        out["server_l2_load_gb_s"] = l2[0] / l2[1]  # mean of the request's loads
    out["rest_s"] = lmcache_rest(ttft_s, out.get("lookup_s"), out.get("retrieve_s"),  # type: ignore[arg-type]
                                 out.get("engine_queue_s"), out.get("engine_prefill_s"))  # type: ignore[arg-type]
    return out


def lmcache_rest(ttft_s: float, lookup_s: float | None, retrieve_s: float | None,
                 queue_s: float | None, prefill_s: float | None) -> float | None:
    """TTFT less lookup, retrieve and prefill, where they are disjoint parts of it (see above)."""
    if None in (lookup_s, retrieve_s, queue_s, prefill_s):
        return None
    assert lookup_s is not None and retrieve_s is not None and queue_s is not None and prefill_s is not None
    if lookup_s + retrieve_s > queue_s + 1e-3:  # the load ran (partly) inside the prefill
        return None
    return ttft_s - lookup_s - retrieve_s - prefill_s
