"""The seeds' scenarios against one running engine; each request becomes one raw record.

restore: one long prompt computed, then restored after prefix-cache resets and after engine
restarts (the first request after a restart is the measured one). sweep: context lengths x
rounds of the same input. agents: N concurrent agents replaying sessions while new turns
are written. The memory scenario is the sampler that runs through all of them.

Each scenario runs as the plan's steps (kvlab.harness.plan): `run_step` does one, with its spec.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.client import Completion, complete
from kvlab.engines.local import EngineServer, metric_sum, parse_prometheus
from kvlab.harness import metrics
from kvlab.harness.pagecache import drop_page_cache
from kvlab.harness.plan import AgentsSpec, RestoreSpec, Step, SweepSpec
from kvlab.harness.sessions import TurnSpec, Workload, token_ids, workload
from kvlab_connector.counters import COUNTERS

Sink = Callable[[dict[str, Any]], None]
Note = Callable[[str], None]

# vLLM's counters of prompt tokens looked up and found: its own prefix cache, and the connector's.
VLLM_COUNTERS = {
    "local_queries": "vllm:prefix_cache_queries",
    "local_hits": "vllm:prefix_cache_hits",
    "external_queries": "vllm:external_prefix_cache_queries",
    "external_hits": "vllm:external_prefix_cache_hits",
}
# kvlab's connector (metrics_port): every counter it serves, by the name counters.py declares
# (a record's `connector_<x>` is the served `kvlab_<x>`): bytes moved, where pages came from, and
# what the store refused or discarded on the way (a result shows it ran clean, or why not).
CONNECTOR_COUNTERS = {c.prometheus.removeprefix("kvlab_"): c.prometheus for c in COUNTERS if c.prometheus}


@dataclass(frozen=True)
class LMCacheScrape:
    """What an LMCache MP restore is measured against: both Prometheus texts and how far
    the cache server's log had got."""

    engine: dict[str, float]
    server: dict[str, float]
    log_offset: int | None


@dataclass
class Target:
    """A running engine as the scenarios see it."""

    setup: str
    server: EngineServer
    model: str
    connector_metrics_url: str | None
    sink: Sink
    note: Note
    set_phase: Callable[[str], None]
    _drop_refusals: set[str] = field(default_factory=set)
    # Called before a scenario stops the engine (restart): the last moment its counters and
    # processes can be read (the wear sampler's pause).
    before_stop: Callable[[], None] = lambda: None

    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            m = self.server.metrics()
            for k, name in VLLM_COUNTERS.items():
                out[k] = metric_sum(m, name + "_total") or metric_sum(m, name)
        except (OSError, urllib.error.URLError):
            pass
        c = self.connector_metrics()
        for k, name in CONNECTOR_COUNTERS.items():
            if c:
                out["connector_" + k] = metric_sum(c, name + "_total") or metric_sum(c, name)
        return out

    def connector_metrics(self) -> dict[str, float]:
        if not self.connector_metrics_url:
            return {}
        try:
            with urllib.request.urlopen(self.connector_metrics_url, timeout=5) as r:
                return parse_prometheus(r.read().decode())
        except (OSError, urllib.error.URLError):
            return {}

    def uses_lmcache_mp(self) -> bool:
        kv = self.server.deployment.kv_transfer_config or {}
        return kv.get("kv_connector") == "LMCacheMPConnector" and self.server.companion is not None

    def lmcache_scrape(self) -> LMCacheScrape:
        # The cache server serves its Prometheus text on its HTTP port (the one its readiness
        # is checked on); --prometheus-port is only used when it runs without that server.
        companion = self.server.companion
        assert companion is not None
        url = urllib.parse.urlparse(companion.spec.ready_url or "")
        server: dict[str, float] = {}
        if url.netloc:
            try:
                with urllib.request.urlopen(f"{url.scheme}://{url.netloc}/metrics", timeout=10) as r:
                    server = parse_prometheus(r.read().decode())
            except (OSError, urllib.error.URLError):
                pass
        try:
            engine = self.server.metrics()
        except (OSError, urllib.error.URLError):
            engine = {}
        try:
            offset: int | None = companion.log_path.stat().st_size
        except OSError:
            offset = None
        return LMCacheScrape(engine, server, offset)

    def lmcache_phases(self, before: LMCacheScrape, ttft_s: float) -> dict[str, Any]:
        """The request's LMCache phases: the scrapes' change and the server log written since."""
        after = self.lmcache_scrape()
        log = None
        if before.log_offset is not None:
            assert self.server.companion is not None
            try:
                with open(self.server.companion.log_path, "rb") as f:
                    f.seek(before.log_offset)
                    log = metrics.parse_server_log(f.read().decode(errors="replace"))
            except OSError:
                pass
        return metrics.lmcache_breakdown(ttft_s, after.engine, before.engine, after.server, before.server, log)

    def io_mode(self) -> str | None:
        """The I/O mode the connector reports; None if it reports none."""
        return io_mode_of(self.connector_metrics())

    def block_size(self) -> int | None:
        """The engine's KV block size in tokens, from its cache config; None if not served."""
        try:
            return block_size_of(self.server.metrics())
        except (OSError, urllib.error.URLError):
            return None

    def engine_cache_tokens(self) -> int | None:
        """Tokens the engine's own KV cache holds (blocks × block size, vLLM's cache config as
        served, num_gpu_blocks_override included); None if not served."""
        try:
            return engine_cache_tokens_of(self.server.metrics())
        except (OSError, urllib.error.URLError):
            return None

    def drop_page_cache(self, why: str) -> str | None:
        """Drop the page cache; None when dropped, else the reason (noted once per reason)."""
        refused = drop_page_cache()
        if refused is not None and refused not in self._drop_refusals:
            self._drop_refusals.add(refused)
            self.note(f"{self.setup}: page cache not dropped ({why} may read from RAM): {refused}")
        return refused


def io_mode_of(connector_metrics: dict[str, float]) -> str | None:
    """The mode in kvlab's kvlab_io_mode_info{mode=...} gauge (posix-odirect, gds, gds-compat, ...)."""
    for key, value in connector_metrics.items():
        if key.startswith("kvlab_io_mode_info{") and value >= 1:
            label = key.split('mode="', 1)[-1].split('"', 1)[0]
            return label or None
    return None


def block_size_of(engine_metrics: dict[str, float]) -> int | None:
    """The block_size label of vLLM's vllm:cache_config_info gauge (its CacheConfig)."""
    for key in engine_metrics:
        if key.startswith("vllm:cache_config_info{"):
            m = re.search(r'[{,]block_size="(\d+)"', key)
            if m:
                return int(m[1])
    return None


def engine_cache_tokens_of(engine_metrics: dict[str, float]) -> int | None:
    """num_gpu_blocks × block_size from vLLM's vllm:cache_config_info gauge."""
    for key in engine_metrics:
        if key.startswith("vllm:cache_config_info{"):
            blocks = re.search(r'[{,]num_gpu_blocks="(\d+)"', key)
            size = re.search(r'[{,]block_size="(\d+)"', key)
            if blocks and size:
                return int(blocks[1]) * int(size[1])
    return None


def working_set_tokens(prompts: Iterable[Sequence[int]], block_size: int) -> int:
    """The distinct prompt tokens of `prompts` (each agent's latest), counted as a prefix cache
    holds them: whole blocks of `block_size` tokens keyed by everything before them, so a
    prefix the agents share (their system prompt) counts once; a partial last block counts its
    tokens."""
    seen: set[tuple[int, ...]] = set()
    tokens = 0
    for prompt in prompts:
        prompt = tuple(prompt)
        for start in range(0, len(prompt), block_size):
            key = prompt[:start + block_size]
            if key not in seen:
                seen.add(key)
                tokens += len(key) - start
    return tokens


def page_cache_fields(refused: str | None) -> dict[str, Any]:
    """A measured request's record of the drop before it: dropped, and if not, why not."""
    return {"page_cache_dropped": refused is None, **({"page_cache_drop_error": refused} if refused else {})}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def output_digest(token_ids: Sequence[int]) -> str:
    """What an answer was, in a record: two answers agree exactly when their digests do."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


def completion_fields(c: Completion) -> dict[str, Any]:
    out = {"ttft_s": c.ttft_s, "total_s": c.total_s, "output_tokens": c.output_tokens,
           "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens, "max_gap_s": c.max_gap_s}
    if c.token_ids is not None:
        out["output_digest"] = output_digest(c.token_ids)
    return out


def measured(t: Target, prompt: list[int] | tuple[int, ...], max_tokens: int, base: dict[str, Any],
             with_counters: bool = True, phases: bool = False, token_ids: bool = False) -> Completion | None:
    """One request, recorded with the counters' change over it (when nothing else runs);
    with phases, an LMCache MP setup's restore phases too (`lmcache`); with token_ids, the
    Completion carries the generated token ids and the record their digest (`output_digest`)."""
    before = t.counters() if with_counters else {}
    lm = t.lmcache_scrape() if phases and t.uses_lmcache_mp() else None
    t0 = time.time()
    try:
        c = complete(t.server.base_url, t.model, list(prompt), max_tokens, return_token_ids=token_ids)
    except Exception as e:  # a failed request is a result too: recorded, never hidden
        t.sink({**base, "kind": "request", "setup": t.setup, "t_start": t0, "t_end": time.time(),
                "error": f"{type(e).__name__}: {e}"[:500]})
        return None
    rec = {**base, "kind": "request", "setup": t.setup, "t_start": t0, "t_end": time.time(), **completion_fields(c)}
    if with_counters:
        rec["counters"] = delta(t.counters(), before)
    if lm is not None:
        rec["lmcache"] = t.lmcache_phases(lm, c.ttft_s)
    t.sink(rec)
    return c


# ---- restore ---------------------------------------------------------------------------
def restore_prompt(sc: RestoreSpec, seed: int) -> list[int]:
    return token_ids(f"{seed}:restore", sc.tokens)


def restore_compute(t: Target, sc: RestoreSpec, seed: int) -> None:
    t.set_phase("restore:compute")
    warm_up(t, sc, seed, 0)
    c = measured(t, restore_prompt(sc, seed), sc.output_tokens,
                 {"scenario": "restore", "tokens": sc.tokens, "phase": "compute"}, phases=True, token_ids=True)
    if c:
        t.note(f"{t.setup}: computed {sc.tokens} tokens in {c.ttft_s:.2f} s (cached {c.cached_tokens})")
    time.sleep(sc.settle_s)  # saves are asynchronous: let the last writes land


def restore_recompute(t: Target, sc: RestoreSpec, seed: int) -> None:
    """The one recompute every setup's restores are set against: fresh prompts of the same
    length on a warm engine without a cache (on recompute_setup only)."""
    for i in range(sc.recompute_prompts):
        fresh = token_ids(f"{seed}:restore:recompute{i}", sc.tokens)
        c = measured(t, fresh, sc.output_tokens, {"scenario": "restore", "tokens": sc.tokens, "phase": "recompute",
                                                  "repeat": i}, token_ids=True)
        if c:
            t.note(f"{t.setup}: recompute reference {i + 1}/{sc.recompute_prompts}: {c.ttft_s:.3f} s "
                   f"(cached {c.cached_tokens})")


def restore_warm(t: Target, sc: RestoreSpec, seed: int, i: int) -> None:
    if sc.prefix_caching and not t.server.deployment.serves_dev_routes:
        if i == 0:  # said once, before the first warm restore
            # Never through an open port: dev routes check no API key, so a network-bound engine has none.
            why = (f"restore: the warm phase needs /reset_prefix_cache, which {t.setup}'s engine does not serve "
                   "(it binds a network address, so it runs without vLLM's dev mode): warm restores not measured; "
                   "bind the engine to 127.0.0.1 (vllm_server_host) to measure them")
            t.sink({"kind": "error", "setup": t.setup, "scenarios": ["restore"], "message": why})
            t.note(f"{t.setup}: {why}")
        return
    t.set_phase("restore:warm")
    if sc.prefix_caching:  # without a prefix cache the running engine already has to restore
        t.server.reset_prefix_cache()
    c = measured(t, restore_prompt(sc, seed), sc.output_tokens,
                 {"scenario": "restore", "tokens": sc.tokens, "phase": "warm", "repeat": i}, phases=True, token_ids=True)
    if c:
        t.note(f"{t.setup}: warm restore {c.ttft_s:.3f} s (cached {c.cached_tokens})")


def restore_restart(t: Target, sc: RestoreSpec, seed: int, i: int, restart: Callable[[], float]) -> None:
    t.set_phase("restore:restart")
    start_s, refused = restart_with_drop(t, restart, sc.drop_page_cache)
    warm_up(t, sc, seed, i + 1)  # its prompt shares nothing with the restored one
    drop = page_cache_fields(refused) if sc.drop_page_cache else {"page_cache_dropped": None}
    c = measured(t, restore_prompt(sc, seed), sc.output_tokens,
                 {"scenario": "restore", "tokens": sc.tokens, "phase": "restart", "repeat": i,
                  "engine_start_s": start_s, **drop}, phases=True, token_ids=True)
    if c:
        t.note(f"{t.setup}: restore after restart {c.ttft_s:.3f} s (cached {c.cached_tokens})")
    time.sleep(sc.settle_s)


def warm_up(t: Target, sc: RestoreSpec, seed: int, life: int) -> None:
    """An engine life's first request, unrelated to the restored prompt (recorded as `warmup`),
    so that no measured request pays for the engine's first one."""
    measured(t, token_ids(f"{seed}:restore:warmup{life}", sc.warmup_tokens), 1,
             {"scenario": "restore", "phase": "warmup", "repeat": life, "tokens": sc.warmup_tokens},
             with_counters=False)


def restart_with_drop(t: Target, restart: Callable[[], float], drop: bool) -> tuple[float, str | None]:
    """Restart the engine; with drop, the page cache is dropped while it is down. The start's
    seconds, and why the drop was refused (None: dropped, or not asked)."""
    server = t.server
    t.before_stop()
    server.engine.stop()
    if server.companion and not server.deployment.companion_survives_engine_restart:
        server.companion.stop()
    refused = t.drop_page_cache("restores after restart") if drop else None
    return restart(), refused


# ---- sweep -----------------------------------------------------------------------------
def sweep_length(t: Target, sc: SweepSpec, seed: int, length: int) -> None:
    prompt = token_ids(f"{seed}:sweep:{length}", length)
    t.set_phase(f"sweep:{length}")
    ttfts = []
    for r in range(1, sc.rounds + 1):
        drop = page_cache_fields(t.drop_page_cache("sweep rounds")) if sc.drop_page_cache else {}
        c = measured(t, prompt, sc.output_tokens, {"scenario": "sweep", "length": length, "round": r, **drop})
        if c:
            ttfts.append(c.ttft_s)
        time.sleep(sc.settle_s)
    if ttfts:
        t.note(f"{t.setup}: sweep {length}: first {ttfts[0]:.3f} s, last {ttfts[-1]:.3f} s")


# ---- agents ----------------------------------------------------------------------------
def agents(t: Target, sc: AgentsSpec, n: int, wl: Workload) -> None:
    """N agents, each sending its turns in order (after its think time, or at its trace time)."""
    t.set_phase(f"agents:{n}")
    before = t.counters()
    t0 = time.perf_counter()
    t0_wall = time.time()

    latest: dict[int, tuple[int, ...]] = {}  # each agent's latest prompt sent: the working set
    first_answered: dict[int, float] = {}  # when each agent's first turn was answered (wall clock)

    def run_agent(a: int, turns: tuple[TurnSpec, ...]) -> None:
        carries = any(turn.after_answer for turn in turns)
        previous: tuple[int, ...] | None = None  # the session's last prompt, while its answer is known
        answer: tuple[int, ...] = ()
        for turn in turns:
            if turn.at_s is not None:
                wait = t0 + turn.at_s - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            elif turn.think_s:
                time.sleep(turn.think_s)
            base = {"scenario": "agents", "concurrency": n, "agent": a, "session": turn.session,
                    "turn": turn.index, "frozen_threshold_s": sc.frozen_threshold_s}
            if turn.after_answer and previous is None:
                t.sink({**base, "kind": "request", "setup": t.setup, "t_start": time.time(), "t_end": time.time(),
                        "error": "not sent: the session's previous turn has no answer to carry"})
                continue
            prompt, reusable = turn.sent(previous, answer)
            carried = {"carried_answer_tokens": len(answer)} if turn.after_answer else {}
            latest[a] = tuple(prompt)
            c = measured(t, prompt, turn.max_tokens, {**base, "reusable_tokens": reusable, **carried},
                         with_counters=False, token_ids=carries)
            if c is not None:
                first_answered.setdefault(a, time.time())
            previous, answer = None, ()
            if c is not None and carries:
                if c.token_ids is None:
                    t.note(f"{t.setup}: agent {a}: the engine sent no token ids back (return_token_ids): "
                           "its next turn cannot carry the answer")
                else:
                    previous, answer = tuple(prompt), tuple(c.token_ids)

    threads = [threading.Thread(target=run_agent, args=(a, turns), name=f"agent{a}", daemon=True)
               for a, turns in enumerate(wl.agents)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    block = t.block_size()
    t.sink({"kind": "step", "scenario": "agents", "setup": t.setup, "concurrency": n, "wall_s": wall,
            "all_active_t": all_active_t(wl, first_answered),
            "working_set_tokens": working_set_tokens(latest.values(), block) if block else None,
            "engine_cache_tokens": t.engine_cache_tokens(),
            "t_start": t0_wall, "turns": len(wl.turns), "frozen_threshold_s": sc.frozen_threshold_s,
            "hit_min_fraction": sc.hit_min_fraction, "counters": delta(t.counters(), before),
            "answers": sc.answers})
    t.note(f"{t.setup}: {n} agents, {len(wl.turns)} turns in {wall:.1f} s")


def all_active_t(wl: Workload, first_answered: dict[int, float]) -> float | None:
    """When every agent had its first turn answered, where all of them start together (a
    generator's sessions): the end of the step's ramp, in which the agents' first turns (work no
    tier can save: nothing of them was seen before) queue in front of the earliest returning
    turns. None where sessions start at their own times (a trace) or some first turn failed."""
    together = all(not turns[0].think_s and turns[0].at_s is None for turns in wl.agents if turns)
    if not together or len(first_answered) < sum(1 for turns in wl.agents if turns):
        return None
    return max(first_answered.values())


# ---- one step of the plan --------------------------------------------------------------
def run_step(t: Target, step: Step, seed: int, restart: Callable[[], float]) -> None:
    """A scenario's step of the plan, with its spec (engine start and stop are the runner's)."""
    sc, i = step.spec, step.arg
    if step.kind == "restore-compute":
        assert isinstance(sc, RestoreSpec)
        restore_compute(t, sc, seed)
    elif step.kind == "restore-recompute":
        assert isinstance(sc, RestoreSpec)
        restore_recompute(t, sc, seed)
    elif step.kind == "restore-warm":
        assert isinstance(sc, RestoreSpec) and i is not None
        restore_warm(t, sc, seed, i)
    elif step.kind == "restore-restart":
        assert isinstance(sc, RestoreSpec) and i is not None
        restore_restart(t, sc, seed, i, restart)
    elif step.kind == "sweep":
        assert isinstance(sc, SweepSpec) and i is not None
        sweep_length(t, sc, seed, i)
    elif step.kind == "agents":
        assert isinstance(sc, AgentsSpec) and i is not None and step.workload is not None
        agents(t, sc, i, workload(step.workload))
    else:
        raise ValueError(f"step {step.kind!r} is not a scenario's: the runner starts and stops engines")
