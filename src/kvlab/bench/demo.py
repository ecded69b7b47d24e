"""`kvlab demo`: one long prompt restored by kvlab and by vLLM's ExampleConnector, side by side.

For each setup the first request computes the prompt (recompute, and the save). Then, in
interleaved repeats (the setups' order alternating), each setup's engine is started on a
dropped page cache: the first request is the restore after a restart; the second is
the engine's own prefix-cache hit (the floor); after a prefix-cache reset, the third is
the restore on a warm engine. Both setups run with identical engine flags on the same
cores. fio's O_DIRECT read limit is measured on the same filesystem in every repeat, just
before kvlab's restart, and each restore is set against the limit of its own repeat: a
shared virtual drive's speed drifts from minute to minute.

The prompt is a multiple of 512 tokens plus 2: kvlab restores whole 512-token chunks up
to the last token, and vLLM's ExampleConnector saves (n-1) but looks up (n-2) tokens, each
rounded down to the block size, so at a block multiple + 1 it never finds what it saved.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.bench.fio import FioResult, fio_limit
from kvlab.bench.fio import cleanup as fio_cleanup
from kvlab.client import complete
from kvlab.engines.local import EngineServer, drop_page_cache, parse_prometheus
from kvlab.harness import results
from kvlab.harness.scenarios import io_mode_of
from kvlab.model import TinyGeometry, ensure_tiny
from kvlab.net import free_port
from kvlab.paths import state_dir
from kvlab.setups import registry as setups

SETUPS = ("kvlab", "vllm-example")


def note(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, vocab) for _ in range(n)]


@dataclass
class Samples:
    recompute: list[float] = field(default_factory=list)
    prefix_hit: list[float] = field(default_factory=list)
    warm_restore: list[float] = field(default_factory=list)
    restart_restore: list[float] = field(default_factory=list)
    restart_cached_tokens: list[int] = field(default_factory=list)
    engine_start_s: list[float] = field(default_factory=list)

    def medians(self) -> dict[str, float | None]:
        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        return {
            "recompute_ttft_s": med(self.recompute),
            "prefix_hit_ttft_s": med(self.prefix_hit),
            "warm_restore_ttft_s": med(self.warm_restore),
            "restart_restore_ttft_s": med(self.restart_restore),
        }


def wait_for_objects(store: Path, expected: int, timeout_s: float = 600) -> None:
    """Saves are asynchronous: wait until the prompt's objects are committed on the drive."""
    from kvlab_connector.store.store import Store

    t0 = time.monotonic()
    view = Store([store], capacity_bytes=1 << 50, io_threads=1)
    try:
        while (found := view.scan().objects) < expected:
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"only {found} of {expected} objects reached {store} in {timeout_s:.0f} s")
            time.sleep(1)
    finally:
        view.close()
    note(f"kvlab: {found} objects committed {time.monotonic() - t0:.1f} s after the answer")


def engine_params(model: Path, tokens: int, work: Path, port: int) -> setups.EngineParams:
    # ExampleConnector saves and loads whole prompts only: every setup gets a batch that
    # holds the whole prompt, so that the flags stay identical.
    batch = max(tokens + 512, 8192)
    return setups.EngineParams(
        model=str(model),
        python=sys.executable,
        served_model_name="tiny",
        port=port,
        max_model_len=batch,
        max_num_batched_tokens=batch,
        cpu_kv_cache_gib=max(2, (tokens * TinyGeometry().kv_bytes_per_token * 2) // (1 << 30) + 1),
        kv_store_paths=(str(work / "kvlab-store"),),
        kv_metrics_port=free_port(),  # the connector's own metrics: the I/O mode it used
        example_storage_path=str(work / "example-store"),
    )


def connector_metrics(params: setups.EngineParams) -> dict[str, float]:
    """kvlab's connector's Prometheus text, parsed; empty where it serves none."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{params.kv_metrics_port}/metrics", timeout=5) as r:
            return parse_prometheus(r.read().decode())
    except OSError:
        return {}


REQUEST_BYTES = "kvlab_read_request_bytes"


def request_bytes_p50(m: dict[str, float]) -> tuple[float, float, float, int, float] | None:
    """The median read request's size from the connector's kvlab_read_request_bytes histogram:
    (estimate, bucket low, bucket high, requests, mean). The estimate interpolates within the
    median's power-of-two bucket, as Prometheus' histogram_quantile does; the median lies in
    (low, high]. Where every request has one size (a restore of whole chunks), the mean is it."""
    count = m.get(f"{REQUEST_BYTES}_count")
    if not count:
        return None
    mean = m.get(f"{REQUEST_BYTES}_sum", 0.0) / count
    prefix = f'{REQUEST_BYTES}_bucket{{le="'
    buckets = sorted((float(k[len(prefix):-2]), v) for k, v in m.items()
                     if k.startswith(prefix) and not k.endswith('+Inf"}'))
    low, below = 0.0, 0.0
    for high, cumulative in buckets:
        if cumulative >= count / 2:
            inside = cumulative - below
            return low + (high - low) * (count / 2 - below) / inside, low, high, int(count), mean
        low, below = high, cumulative
    return None  # the median is past the last bound (256 MiB): not a request size this store makes


def run_demo(tokens: int, repeats: int, work: Path, port: int) -> dict:
    model = ensure_tiny()
    geometry = TinyGeometry()
    work.mkdir(parents=True, exist_ok=True)
    for d in ("kvlab-store", "example-store"):
        shutil.rmtree(work / d, ignore_errors=True)
    params = engine_params(model, tokens, work, port)
    prompt = prompt_ids(tokens, seed=1234, vocab=geometry.vocab_size)
    samples = {s: Samples() for s in SETUPS}
    logs = work / "logs"

    fio_gbps: list[float] = []
    fio_runs: list[FioResult] = []
    io_modes: set[str] = set()
    request_p50: list[tuple[float, float, float, int, float]] = []  # per restart restore of kvlab

    def measure_drive() -> None:
        gbps, runs = fio_limit(work / "fio", "read")
        fio_gbps.append(gbps)
        fio_runs.extend(runs)
        note(f"fio O_DIRECT read limit on {work}: {gbps:.2f} GB/s")

    def life(setup: str, first: str) -> None:
        deployment = setups.render(setup, params)
        server = EngineServer(deployment, logs)
        try:
            if first == "restart":
                dropped = drop_page_cache()
                if not dropped:
                    note("cannot drop the page cache (not root?): restart restores may read from RAM")
            samples[setup].engine_start_s.append(server.start(progress=True))
            c = complete(server.base_url, "tiny", prompt)
            if first == "compute":
                samples[setup].recompute.append(c.ttft_s)
                note(f"{setup}: computed {tokens} tokens in {c.ttft_s:.2f} s (cached {c.cached_tokens})")
                if setup == "kvlab":
                    wait_for_objects(work / "kvlab-store", tokens // 512)
                return
            samples[setup].restart_restore.append(c.ttft_s)
            samples[setup].restart_cached_tokens.append(c.cached_tokens or 0)
            if setup == "kvlab":
                m = connector_metrics(params)  # this engine life's reads: the restart restore's only
                io_modes.add(io_mode_of(m) or "not reported")
                p50 = request_bytes_p50(m)
                if p50:
                    request_p50.append(p50)
            hit = complete(server.base_url, "tiny", prompt)
            samples[setup].prefix_hit.append(hit.ttft_s)
            server.reset_prefix_cache()
            warm = complete(server.base_url, "tiny", prompt)
            samples[setup].warm_restore.append(warm.ttft_s)
            note(f"{setup}: restart {c.ttft_s:.3f} s (cached {c.cached_tokens}), prefix hit {hit.ttft_s:.3f} s, "
                 f"warm restore {warm.ttft_s:.3f} s")
        finally:
            server.stop()

    total = len(SETUPS) * (1 + repeats)
    done = 0
    for setup in SETUPS:
        done += 1
        note(f"[{done}/{total}] {setup}: compute and save the {tokens}-token prompt")
        life(setup, "compute")
    for r in range(repeats):
        order = SETUPS if r % 2 == 0 else tuple(reversed(SETUPS))
        for setup in order:
            done += 1
            note(f"[{done}/{total}] repeat {r + 1}/{repeats}: {setup}")
            if setup == "kvlab":
                measure_drive()
            life(setup, "restart")
    fio_cleanup(work / "fio")

    kv_bytes = tokens // 512 * 512 * geometry.kv_bytes_per_token
    med = {s: samples[s].medians() for s in SETUPS}
    k, e = med["kvlab"], med["vllm-example"]
    recompute_all = samples["kvlab"].recompute + samples["vllm-example"].recompute
    recompute = statistics.median(recompute_all)
    read_gbps = statistics.median(fio_gbps)
    drive_time = kv_bytes / (read_gbps * 1e9)
    ks = samples["kvlab"]
    # Each restart's transfer time (its TTFT above the prefix-hit floor of the same engine
    # life) against the drive time at that repeat's fio limit; the median of the pairs.
    over_limit = [(t - hit) / (kv_bytes / (g * 1e9))
                  for t, hit, g in zip(ks.restart_restore, ks.prefix_hit, fio_gbps, strict=True)]
    return {
        "schema": "kvlab.demo/1",
        "tokens": tokens,
        "repeats": repeats,
        "kv_bytes_per_token": geometry.kv_bytes_per_token,
        "kv_bytes_restored": kv_bytes,
        "fio_read_gbps": read_gbps,
        "fio_read_gbps_per_repeat": fio_gbps,
        "fio_jobs": [r.to_dict() for r in fio_runs],
        "recompute_ttft_s": recompute,
        "recompute_samples": len(recompute_all),
        "setups": {s: {**med[s], "samples": len(samples[s].restart_restore),
                       "restart_cached_tokens": samples[s].restart_cached_tokens,
                       "raw": samples[s].__dict__} for s in SETUPS},
        "restart_over_recompute": k["restart_restore_ttft_s"] / recompute,
        "kvlab_over_example": k["restart_restore_ttft_s"] / e["restart_restore_ttft_s"],
        "warm_kvlab_over_example": k["warm_restore_ttft_s"] / e["warm_restore_ttft_s"],
        "restore_over_drive_limit": statistics.median(over_limit),
        "restore_over_drive_limit_per_repeat": over_limit,
        "drive_limit_s": drive_time,
        # As kvlab's connector reported it after each restart restore.
        "io_mode": ",".join(sorted(io_modes)),
        # The median read request of a restart restore (the median over the repeats), and the
        # power-of-two bucket it was in: large I/O is what reaches the drives' bandwidth.
        "read_request_bytes_p50": statistics.median(p[0] for p in request_p50) if request_p50 else None,
        "read_request_bytes_p50_bucket": (list(sorted(request_p50)[len(request_p50) // 2][1:3])
                                          if request_p50 else None),
        "read_requests_per_restore": statistics.median(p[3] for p in request_p50) if request_p50 else None,
        "read_request_bytes_mean": statistics.median(p[4] for p in request_p50) if request_p50 else None,
        "provenance": {**results.provenance(), "filesystem": results.filesystem(work),
                       "engine_argv": list(setups.render("kvlab", params).engine.argv)},
    }


def table(result: dict) -> str:
    rows = [
        "| setup | recompute s | prefix hit s (floor) | warm restore s | restore after restart s | samples |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in result["setups"].items():
        def f(v: float | None) -> str:
            return "—" if v is None else f"{v:.3f}"

        rows.append(f"| {name} | {f(s['recompute_ttft_s'])} | {f(s['prefix_hit_ttft_s'])} | "
                     f"{f(s['warm_restore_ttft_s'])} | {f(s['restart_restore_ttft_s'])} | {s['samples']} |")
    rows += [
        "",
        f"prompt {result['tokens']} tokens, {result['kv_bytes_restored'] / 2**20:.0f} MiB of KV restored; "
        f"fio O_DIRECT read limit {result['fio_read_gbps']:.2f} GB/s (median of the repeats) → "
        f"{result['drive_limit_s']:.3f} s for those bytes; kvlab's I/O mode: {result['io_mode']}",
        f"kvlab restart restore ÷ recompute        {result['restart_over_recompute']:.4f}  (goal ≤ 0.04)",
        f"kvlab ÷ ExampleConnector (after restart) {result['kvlab_over_example']:.3f}  (goal ≤ 0.9)",
        f"(kvlab restart − prefix hit) ÷ drive time {result['restore_over_drive_limit']:.3f}  (goal ≤ 1.25; "
        "median of the repeats, each at its own fio limit)",
    ]
    if result.get("read_request_bytes_p50"):
        lo, hi = result["read_request_bytes_p50_bucket"]
        rows.append(f"kvlab's median read request            {result['read_request_bytes_p50'] / 2**20:.2f} MiB "
                    f"(in ({lo / 2**20:g}, {hi / 2**20:g}] MiB, mean {result['read_request_bytes_mean'] / 2**20:.2f} MiB; "
                    f"{result['read_requests_per_restore']:.0f} requests a restore; goal ≥ 1 MiB)")
    return "\n".join(rows)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="restore one long prompt: kvlab vs vLLM's ExampleConnector, side by side")
    p.add_argument("--tokens", type=int, default=30722,
                   help="prompt length; a 512-token multiple + 2 lets both connectors restore all but 2 tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--workdir", type=Path, default=None, help="stores and logs (default: the user state folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    work = args.workdir or state_dir() / "demo"
    result = run_demo(args.tokens, args.repeats, work, args.port)
    (work / "demo-result.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result))
    return 0
