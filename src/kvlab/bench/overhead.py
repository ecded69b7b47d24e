"""`kvlab bench overhead`: what kvlab's connector costs where it has nothing to restore.

Baseline (no connector) and kvlab engines are started from the same EngineParams (the same
flags, the forward pass bound to the same cores, `compute_cores`: all but the first, which the
engines' scheduler and API processes share; only kvlab's --kv-transfer-config differs). In each
repeat both engines live side by side, one idle while the other computes: the requests go in
rounds, a round to one engine and then the same round to the other, the order alternating
(ABBA), so that the machine's drift within the repeat falls on both alike. After an unrelated
warm-up request of the decode requests' shape, each engine gets:

- decode: fresh prompts of `decode_prompt_tokens`, each answered with `decode_tokens`;
  a request's rate is (output tokens - 1) / (total - TTFT); the life's is their midmean.
- misses: fresh short prompts (`miss_prompt_tokens`) that no cache has seen, so none can
  hit; their TTFT, the median over the life's requests.
- compute and save: fresh prompts of `save_prompt_tokens` (several chunks), computed and,
  by kvlab, saved while they are computed; their TTFT, the median over the life's requests.
- decode while saving: fresh prompts of `decode_save_prompt_tokens`, answered with
  `decode_save_tokens`, so that a chunk fills during decode and kvlab saves it while the
  request decodes; the rate as for decode.

Every prompt is new to every cache: it is keyed by the repeat, so both setups of one repeat
send the same prompts and kvlab's store never holds them beforehand. A ratio is kvlab over
baseline within a repeat; the repeats pair up (2k started baseline first and begins its rounds
with it, 2k+1 kvlab) and a pair's figure is the geometric mean of its two ratios, which cancels
what going first costs, whichever way (`pair_figures`). The medians and quartiles are over the
pairs.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvlab.client import complete
from kvlab.engines.local import EngineServer
from kvlab.harness import metrics, results
from kvlab.harness.sessions import token_ids
from kvlab.net import free_port
from kvlab.paths import state_dir
from kvlab.setups import registry as setups

SCHEMA = "kvlab.bench.overhead/6"
SETUPS = ("baseline", "kvlab")


def note(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Workload:
    decode_prompt_tokens: int = 576  # one 512-token chunk and a part: no save is due while it decodes
    decode_tokens: int = 128
    # With the forward pass bound to both of two cores, a request's decode rate swung with where
    # the kernel put the engine's other processes (one life: 62 to 169 tokens/s, in streaks of
    # ~8 or ~16 ms steps; lives 66-133): `compute_cores` now leaves them a core. A life's rate
    # is the midmean of its requests' (`rates_of`): now and then the API server streams a whole
    # answer at once (measured: 3 of one life's 5 requests at ~95,000 tokens/s), which carries a
    # pooled rate with it, and a median flips between step modes.
    # Fewer requests per life, more lives: each engine start draws its own speed (over four
    # 7-repeat runs, a life's misses sat within +-10% of its median while the lives' medians ran
    # from 21 to 30 ms, and decode from 88 to 141 tokens/s), so a life's twentieth request adds
    # less than another repeat's paired ratio. 10 decode, 10 miss, 3 save and 10 decode-while-
    # saving requests made a life ~75 s (~36 s of it the start) against ~95 s with 20/20/5/20;
    # side by side (`engine_measure`) a repeat takes ~150 s, ten (the default: five pairs,
    # `pair_figures`) ~26 min. Five of each (a ~50 s life) was measured too: one burst then
    # carried three of a life's five decode requests.
    decode_requests: int = 10
    miss_prompt_tokens: int = 100
    # A miss takes ~20 ms, so a streak covers several back to back: each follows a decode
    # request instead (`life_rounds`), and the life's median samples its streaks as decode does.
    miss_requests: int = 10
    save_prompt_tokens: int = 4096  # eight 512-token chunks, computed and saved
    save_requests: int = 3
    decode_save_prompt_tokens: int = 960  # the second chunk fills at the 64th decoded token
    decode_save_tokens: int = 128
    decode_save_requests: int = 10


@dataclass(frozen=True)
class LifeSample:
    """One engine life's measurements."""

    setup: str
    repeat: int
    decode_tok_s: float  # midmean over the life's decode requests of tokens after the first over decoding time
    miss_ttft_s: float  # median over the life's miss prompts
    engine_start_s: float
    decode_tok_s_all: tuple[float, ...] = ()
    miss_ttft_s_all: tuple[float, ...] = ()
    save_ttft_s: float | None = None  # median over the life's computed-and-saved prompts
    decode_save_tok_s: float | None = None  # the same, over the life's decodes that save a chunk
    save_ttft_s_all: tuple[float, ...] = ()
    decode_save_tok_s_all: tuple[float, ...] = ()


# One repeat: both setups' engines side by side, a LifeSample of each.
Measure = Callable[[int], list[LifeSample]]


def order_of(repeat: int) -> tuple[str, ...]:
    """Repeat 0 runs baseline first, repeat 1 kvlab first, and so on."""
    return SETUPS if repeat % 2 == 0 else tuple(reversed(SETUPS))


def run_overhead(repeats: int, measure: Measure, progress: Callable[[str], None] = note) -> list[LifeSample]:
    """Every repeat in turn, with progress and an estimate."""
    out: list[LifeSample] = []
    t0 = time.monotonic()
    for r in range(repeats):
        elapsed = time.monotonic() - t0
        left = f" · ~{elapsed / r * (repeats - r):.0f} s left" if r else ""
        progress(f"[{r + 1}/{repeats} · {elapsed:.0f} s elapsed{left}] repeat {r + 1}/{repeats}: "
                 f"{' and '.join(order_of(r))}, side by side")
        for s in measure(r):
            saving = (f", compute+save TTFT {s.save_ttft_s:.3f} s, decode while saving {s.decode_save_tok_s:.1f} "
                      "tokens/s" if s.save_ttft_s is not None and s.decode_save_tok_s is not None else "")
            progress(f"  {s.setup}: decode {s.decode_tok_s:.1f} tokens/s, miss TTFT {s.miss_ttft_s:.3f} s{saving} "
                     f"(engine start {s.engine_start_s:.0f} s)")
            out.append(s)
    return out


def pairs_of(repeats: list[int]) -> list[tuple[int, int]]:
    """The complete pairs among the repeats both setups ran: (2k, 2k+1), one with each setup first."""
    done = set(repeats)
    return [(r, r + 1) for r in sorted(done) if r % 2 == 0 and r + 1 in done]


def pair_figures(ratios: dict[int, float], pairs: list[tuple[int, int]]) -> list[float]:
    """Each pair's geometric mean of its two repeats' ratios. A life's place in its repeat can
    cost it: one 9-repeat run's second lives ran ~10% slower, whichever setup it was (decode
    0.74-1.00 with baseline first, 0.88-1.13 with kvlab first), and a run before it showed the
    opposite. If the second life runs p times the first, one ratio of a pair carries p and the
    other 1/p: their geometric mean carries neither."""
    return [math.sqrt(ratios[a] * ratios[b]) for a, b in pairs]


def _spread(name: str, ratios: list[float]) -> dict[str, float]:
    q1, q3 = metrics.quartiles(ratios)
    return {name: statistics.median(ratios), f"{name}_q1": q1, f"{name}_q3": q3}


# Each figure: kvlab's per-life median over baseline's, within a repeat; from which field.
FIGURES = {
    "decode_rate_over_baseline": "decode_tok_s",
    "miss_ttft_over_baseline": "miss_ttft_s",
    "compute_save_ttft_over_baseline": "save_ttft_s",
    "decode_save_rate_over_baseline": "decode_save_tok_s",
}


def _ratios(by: dict[tuple[str, int], LifeSample], repeats: list[int], field: str) -> dict[int, float] | None:
    """kvlab over baseline in each repeat; None where a life did not measure it."""
    both = {r: (getattr(by["kvlab", r], field), getattr(by["baseline", r], field)) for r in repeats}
    if any(k is None or b is None for k, b in both.values()):
        return None
    return {r: k / b for r, (k, b) in both.items()}


def summarize(samples: list[LifeSample], workload: Workload, provenance: dict[str, Any]) -> dict[str, Any]:
    """kvlab over baseline per repeat, a figure per pair of repeats; medians and quartiles over
    the pairs whose four lives all ran."""
    by = {(s.setup, s.repeat): s for s in samples}
    pairs = pairs_of([r for r in {s.repeat for s in samples} if all((x, r) in by for x in SETUPS)])
    if not pairs:
        raise ValueError("no pair of repeats (one with each setup first) in which both baseline and kvlab "
                         "were measured")
    repeats = [r for pair in pairs for r in pair]
    ratios = {name: _ratios(by, repeats, field) for name, field in FIGURES.items()}
    measured = {name: rs for name, rs in ratios.items() if rs is not None}
    per_pair = {name: pair_figures(rs, pairs) for name, rs in measured.items()}
    return {
        "schema": SCHEMA,
        "repeats": len(repeats),
        "pairs": len(pairs),
        **{k: v for name, figures in per_pair.items() for k, v in _spread(name, figures).items()},
        **{setup: {field: statistics.median(getattr(by[setup, r], field) for r in repeats)
                   for name, field in FIGURES.items() if name in measured} for setup in SETUPS},
        "per_repeat": {"order": [list(order_of(r)) for r in repeats],
                       **{name: list(rs.values()) for name, rs in measured.items()}},
        "per_pair": per_pair,
        "workload": asdict(workload),
        "raw": [asdict(s) for s in samples],
        "provenance": provenance,
    }


# ---- the engines --------------------------------------------------------------------------
def engine_params(model: Path, work: Path, w: Workload) -> setups.EngineParams:
    """One set of flags for both setups (kvlab's store and metrics port are unused by baseline)."""
    return setups.EngineParams(
        model=str(model), python=sys.executable, served_model_name="tiny", port=free_port(),
        max_model_len=max(2048, w.save_prompt_tokens + 64), max_num_batched_tokens=2048, cpu_kv_cache_gib=2,
        kv_store_paths=(str(work / "kvlab-store"),), kv_metrics_port=free_port(),
    )


def decode(url: str, key: str, prompt_tokens: int, tokens: int) -> tuple[int, float, float]:
    """A fresh prompt (keyed `key`) answered with `tokens`: its (output_tokens, ttft_s, total_s)."""
    c = complete(url, "tiny", token_ids(key, prompt_tokens), tokens)
    return c.output_tokens, c.ttft_s, c.total_s


def rates_of(requests: list[tuple[int, float, float]]) -> tuple[float | None, tuple[float, ...]]:
    """The midmean of the requests' decode rates, and each one's (the JSON's raw)."""
    each = tuple(r for r in (metrics.decode_rate(*q) for q in requests) if r is not None)
    return (metrics.midmean(each) if each else None), each


# After each round, before the other engine's: one engine's work in the background (kvlab's
# saves of the round's last request) must not land on the other's requests. A computed-and-saved
# prompt leaves up to 64 MiB to write (tens of ms here); the other rounds a block or a chunk.
SETTLE_S = {"save": 0.5}
SETTLE_DEFAULT_S = 0.1


def life_rounds(w: Workload) -> list[tuple[str, ...]]:
    """A life's requests in rounds, each sent to one engine and then the same to the other: a
    miss after each decode (the misses spread over the life), those of the larger count left
    over alone; then the computed-and-saved prompts, then the decodes while saving, one a round."""
    rounds = [tuple(kind for kind, n in (("decode", w.decode_requests), ("miss", w.miss_requests)) if i < n)
              for i in range(max(w.decode_requests, w.miss_requests))]
    return rounds + [("save",)] * w.save_requests + [("decode_save",)] * w.decode_save_requests


def engine_measure(params: setups.EngineParams, work: Path, w: Workload) -> Measure:
    """A Measure that starts both setups' engines, measures them side by side and stops them by
    their PIDs. The rounds of requests alternate between the engines (ABBA), so that the
    machine's drift within a repeat (one life's decode rates fell from 123 to 96 tokens/s over
    its ~40 s) falls on both alike."""
    sizes = {"decode": (w.decode_prompt_tokens, w.decode_tokens), "miss": (w.miss_prompt_tokens, 1),
             "save": (w.save_prompt_tokens, 1), "decode_save": (w.decode_save_prompt_tokens, w.decode_save_tokens)}

    def measure(repeat: int) -> list[LifeSample]:
        order = order_of(repeat)
        servers = {setup: EngineServer(setups.render(setup, params if i == 0 else replace(
            params, port=free_port(), kv_metrics_port=free_port())), work / "logs") for i, setup in enumerate(order)}
        got: dict[str, dict[str, list]] = {s: {kind: [] for kind in sizes} for s in order}
        try:
            # Both start at once (a start is ~30 s, most of it waiting on one core); the first shows progress.
            with ThreadPoolExecutor(len(order)) as pool:
                starting = {setup: pool.submit(servers[setup].start, i == 0) for i, setup in enumerate(order)}
            start_s = {setup: f.result() for setup, f in starting.items()}
            for setup in order:
                # The warm-up is a decode request too, so that one-time costs (kvlab's first save,
                # its threads' start) fall into it: measured, the first of 3 decodes ran at 22 tok/s
                # against 49 and 81 after it, when the warm-up was a short prompt.
                decode(servers[setup].base_url, f"overhead:{repeat}:warmup", *sizes["decode"])
            for k, kinds in enumerate(life_rounds(w)):
                for setup in order if k % 2 == 0 else reversed(order):
                    for kind in kinds:
                        key = f"overhead:{repeat}:{kind}{len(got[setup][kind])}"
                        got[setup][kind].append(decode(servers[setup].base_url, key, *sizes[kind]))
                    time.sleep(max(SETTLE_S.get(kind, SETTLE_DEFAULT_S) for kind in kinds))
        finally:
            for server in servers.values():
                server.stop()
        return [life_sample(setup, repeat, start_s[setup], got[setup]) for setup in order]

    return measure


def life_sample(setup: str, repeat: int, start_s: float, got: dict[str, list[tuple[int, float, float]]]) -> LifeSample:
    """One life's figures from its requests' (output_tokens, ttft_s, total_s)."""
    rate, rates = rates_of(got["decode"])
    save_rate, save_rates = rates_of(got["decode_save"])
    if rate is None or save_rate is None:
        raise RuntimeError(f"{setup}: no decode rate measured (answers of fewer than 2 tokens?)")
    misses = tuple(t for _, t, _ in got["miss"])
    saves = tuple(t for _, t, _ in got["save"])
    return LifeSample(setup, repeat, rate, statistics.median(misses), start_s, rates, misses,
                      statistics.median(saves), save_rate, saves, save_rates)


def argv_difference(params: setups.EngineParams) -> dict[str, list[str]]:
    """What sets the two setups' engine command lines apart (only the connector, by design)."""
    a, b = (list(setups.render(s, params).engine.argv) for s in SETUPS)
    return {"baseline_only": [x for x in a if x not in b], "kvlab_only": [x for x in b if x not in a]}


def bench_overhead(work: Path, repeats: int, w: Workload) -> dict[str, Any]:
    from kvlab.model import ensure_tiny

    model = ensure_tiny()
    shutil.rmtree(work / "kvlab-store", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    params = engine_params(model, work, w)
    t0 = time.monotonic()
    samples = run_overhead(repeats, engine_measure(params, work, w))
    shutil.rmtree(work / "kvlab-store", ignore_errors=True)
    prov = {**results.provenance(), "engine_argv": {s: list(setups.render(s, params).engine.argv) for s in SETUPS},
            "engine_argv_difference": argv_difference(params), "compute_cores": params.cpu_cores,
            "wall_s": time.monotonic() - t0}
    return summarize(samples, w, prov)


def register(sub: argparse._SubParsersAction) -> None:
    o = sub.add_parser("overhead", help="kvlab's decode rate and miss TTFT over baseline's: identical flags, "
                                        "interleaved engine lives")
    o.add_argument("--repeats", type=int, default=10,
                   help="engine lives per setup, an even number: the repeats pair up, one with each setup "
                        "first (>= 8 for the medians; the noise is between lives)")
    o.add_argument("--decode-requests", type=int, default=Workload.decode_requests,
                   help="decode requests per life, of each kind (with nothing to save; while a chunk is saved)")
    o.add_argument("--miss-requests", type=int, default=Workload.miss_requests,
                   help="fresh 100-token prompts per life, each after a decode request")
    o.add_argument("--save-requests", type=int, default=Workload.save_requests,
                   help="fresh prompts computed and saved per life")
    o.add_argument("--workdir", type=Path, default=None)
    o.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    o.set_defaults(func=_overhead)


def _overhead(args: argparse.Namespace) -> int:
    from kvlab.cli import UserError

    for name in ("repeats", "decode_requests", "miss_requests", "save_requests"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if args.repeats % 2:
        raise UserError(f"--repeats {args.repeats}: give an even number (e.g. {args.repeats + 1}): the repeats "
                        "pair up, one with each setup first, so that a life's place in its repeat cancels")
    w = Workload(decode_requests=args.decode_requests, miss_requests=args.miss_requests,
                 save_requests=args.save_requests, decode_save_requests=args.decode_requests)
    work = args.workdir or state_dir() / "bench-overhead"
    res = bench_overhead(work, args.repeats, w)
    (work / "overhead-result.json").write_text(json.dumps(res, indent=2))
    if args.json:
        print(json.dumps(res))
    else:
        print(f"kvlab ÷ baseline over {res['pairs']} pairs of repeats (medians, quartiles): "
              f"decode rate {res['decode_rate_over_baseline']:.3f} ({res['decode_rate_over_baseline_q1']:.3f}–"
              f"{res['decode_rate_over_baseline_q3']:.3f}; goal ≥ 0.95), miss TTFT "
              f"{res['miss_ttft_over_baseline']:.3f} ({res['miss_ttft_over_baseline_q1']:.3f}–"
              f"{res['miss_ttft_over_baseline_q3']:.3f}; goal ≤ 1.05), compute+save TTFT "
              f"{res['compute_save_ttft_over_baseline']:.3f} ({res['compute_save_ttft_over_baseline_q1']:.3f}–"
              f"{res['compute_save_ttft_over_baseline_q3']:.3f}; goal ≤ 1.05), decode while saving "
              f"{res['decode_save_rate_over_baseline']:.3f} ({res['decode_save_rate_over_baseline_q1']:.3f}–"
              f"{res['decode_save_rate_over_baseline_q3']:.3f}; goal ≥ 0.95)")
    return 0
