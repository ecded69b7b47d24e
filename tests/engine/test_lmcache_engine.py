"""LMCache's setups on the real vLLM CPU engine through the HTTP server, 16K-token prompt.

One engine life per MP setup: the prompt is computed once (a recompute that also stores),
restored on the running engine after a prefix-cache reset (warm), then the cache server
and the engine are both restarted and the prompt is sent again. For lmcache-mp+kvlab the
engine is also restarted alone under the running cache server first: the arrangement of
lmcache-mp+kvlab-detached. Every number is measured, none assumed: TTFT and vLLM's
cached_tokens per request, and for kvlab the adapter's own counters on the fresh server.

The three setups' lives run side by side (`lives`).
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest

from kvlab.engines.local import EngineError, EngineServer
from kvlab.harness.metrics import parse_server_log
from kvlab.net import free_port
from kvlab.setups.lmcache import http_port
from kvlab.setups.registry import EngineParams, render

TOKENS = 16384
CHUNK = 256
OUT_TOKENS = 8
SERVED = "tiny"


def prompt() -> list[int]:
    rng = random.Random(16)
    return [rng.randrange(16, 8000) for _ in range(TOKENS)]


def params(model: Path, work: Path) -> EngineParams:
    return EngineParams(
        model=str(model), python=sys.executable, served_model_name=SERVED, port=free_port(),
        max_model_len=TOKENS + 1024, cpu_kv_cache_gib=2, cache_server_port=free_port(), cache_server_l1_gib=1,
        kv_store_paths=(str(work / "kvlab-store"),), kv_store_capacity_bytes=8 << 30, kv_ring_bytes=64 << 20,
        cache_server_l2_path=str(work / "lmcache-fs"),
    )


def adapter_status(p: EngineParams) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port(p)}/status", timeout=30) as r:
        text = r.read().decode()
    found = [a for a in _walk(json.loads(text)) if a.get("type") == "KvlabL2Adapter"]
    assert len(found) == 1, text[:2000]
    return found[0]


def _walk(obj: object):  # type: ignore[no-untyped-def]
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def settle(count: Callable[[], int], timeout_s: float = 120) -> int:
    """Wait until an L2's object count is positive and stops moving (L2 writes are async)."""
    deadline = time.monotonic() + timeout_s
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count()
        if n != last:
            last, stable_since = n, time.monotonic()
        elif n > 0 and time.monotonic() - stable_since > 3:
            return n
        time.sleep(0.5)
    return last


def files_under(path: Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file() and not p.name.endswith(".tmp")) if path.exists() else 0


def generate(base_url: str, ids: list[int], n: int = OUT_TOKENS) -> dict:
    """One streamed greedy completion: TTFT at the client, vLLM's cached_tokens, and the
    output token ids with their logprobs (the tiny model's text can decode to nothing:
    ids are what can be compared)."""
    body = {"model": SERVED, "prompt": ids, "max_tokens": n, "min_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "logprobs": 1}
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, out, logprobs, usage = None, [], [], {}
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            for ch in event.get("choices", []):
                if ch.get("token_ids"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    out += ch["token_ids"]
                    logprobs += (ch.get("logprobs") or {}).get("token_logprobs") or []
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": round(ttft or 0.0, 3), "cached_tokens": details.get("cached_tokens"), "token_ids": out,
            "logprobs": logprobs}


def life(setup: str, model: Path, work: Path) -> dict:
    p = params(model, work)
    ids = prompt()
    out: dict = {"setup": setup}
    server = EngineServer(render(setup, p), work / "logs")
    try:
        server.start()
        out["first"] = generate(server.base_url, ids)
        if setup == "lmcache-mp+kvlab":
            out["l2_objects"] = settle(lambda: adapter_status(p)["objects_stored"])
        elif setup == "lmcache-mp+fs":
            out["l2_objects"] = settle(lambda: files_under(work / "lmcache-fs"))
        else:
            time.sleep(3)
        server.reset_prefix_cache()
        assert server.companion is not None
        mark = server.companion.log_path.stat().st_size
        out["warm"] = generate(server.base_url, ids)
        # What the cache server says about its retrieve (the harness's LMCache breakdown reads it).
        tail = server.companion.log_path.read_bytes()[mark:].decode(errors="replace")
        out["warm_server_log"] = asdict(parse_server_log(tail))
        if setup == "lmcache-mp+kvlab":
            # The detached arrangement: the engine restarts under the running cache server.
            server.restart(with_companion=False)
            out["engine_restart"] = generate(server.base_url, ids)
        mark = server.companion.log_path.stat().st_size
        server.restart(with_companion=True)
        out["restart"] = generate(server.base_url, ids)
        # The fresh cache server's log appends to the old one: its own slice says what it served.
        tail = server.companion.log_path.read_bytes()[mark:].decode(errors="replace")
        out["restart_server_log"] = asdict(parse_server_log(tail))
        if setup == "lmcache-mp+kvlab":
            out["adapter_after_restart"] = {k: adapter_status(p)[k] for k in
                                            ("objects_at_start", "objects_loaded", "load_failures", "io_mode")}
    finally:
        server.stop()
    first = out["first"]["logprobs"]
    for k in ("warm", "engine_restart", "restart"):
        if k in out and out[k]["logprobs"] and first:
            out[k]["max_logprob_delta"] = max(abs(a - b) for a, b in zip(first, out[k]["logprobs"], strict=False))
    print(f"\nlmcache engine life {setup}: {json.dumps(out)}", flush=True)
    return out


SETUPS = ("lmcache-mp+kvlab", "lmcache-mp+fs", "lmcache-mp")
LIVES: dict[str, Future[dict]] = {}


@pytest.fixture(scope="module")
def lives(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """Each setup's life; at the first ask all three start, side by side. A life is mostly
    engine and cache-server starts (two or three, ~40-50 s each, most of it one process
    importing on one core) around two 16K prefills: one after another the three took 553 s
    of a cold engine tier (213, 183 and 157 s)."""
    if not LIVES:
        work = {s: tmp_path_factory.mktemp(s.replace("+", "_")) for s in SETUPS}
        with ThreadPoolExecutor(len(SETUPS)) as pool:
            LIVES.update({s: pool.submit(life, s, tiny_model, work[s]) for s in SETUPS})

    def get(setup: str) -> dict:
        return LIVES[setup].result()  # a life that failed fails each test that reads it

    return get


FULL = TOKENS - CHUNK  # LMCache restores whole chunks; the last token is always computed


@pytest.mark.parametrize("setup", ["lmcache-mp+kvlab", "lmcache-mp+fs", "lmcache-mp"])
def test_warm_restore_of_16k_tokens_matches_the_recompute(lives: Callable[[str], dict], setup: str) -> None:
    r = lives(setup)
    assert not r["first"]["cached_tokens"], "the first request computes the prompt"
    assert len(r["first"]["token_ids"]) == OUT_TOKENS
    assert r["warm"]["cached_tokens"] >= FULL, f"{setup}: warm restore hit {r['warm']['cached_tokens']} tokens"
    assert r["warm"]["token_ids"] == r["first"]["token_ids"], f"{setup}: restored output differs from the recompute"
    # Where the pages came from: the cache server retrieved them (its TTFT against the
    # recompute's is a benchmark's finding: scripts/lmcache-ratio, the campaign report).
    log = r["warm_server_log"]
    assert log["retrieves"] >= 1 and log["retrieved_tokens"] >= FULL, f"{setup}: {log}"


@pytest.mark.parametrize("setup", ["lmcache-mp+kvlab", "lmcache-mp+fs"])
def test_after_a_restart_of_server_and_engine_the_l2_restores(lives: Callable[[str], dict], setup: str) -> None:
    r = lives(setup)
    assert r["l2_objects"] >= TOKENS // CHUNK - 1, f"{setup}: only {r['l2_objects']} objects reached the L2"
    assert r["restart"]["cached_tokens"] >= FULL, f"{setup}: after the restart only {r['restart']['cached_tokens']}"
    assert r["restart"]["token_ids"] == r["first"]["token_ids"]
    # The fresh server's L1 was empty: what it retrieved, it had first prefetched from its L2.
    log = r["restart_server_log"]
    assert log["retrieved_tokens"] >= FULL and log["prefetch_l2_keys"] >= 1, f"{setup}: {log}"


def test_after_a_restart_kvlab_hits_come_from_its_drives(lives: Callable[[str], dict]) -> None:
    r = lives("lmcache-mp+kvlab")
    a = r["adapter_after_restart"]
    assert a["objects_at_start"] >= TOKENS // CHUNK - 1, "the fresh server's adapter found the objects on the drives"
    assert a["objects_loaded"] >= TOKENS // CHUNK - 1 and a["load_failures"] == 0, a


def test_a_warm_restore_of_lmcache_mp_is_timed_by_its_cache_server(lives: Callable[[str], dict]) -> None:
    log = lives("lmcache-mp")["warm_server_log"]
    assert log["retrieves"] >= 1 and log["retrieved_tokens"] >= FULL and log["retrieve_s"] > 0, log


def test_after_a_restart_lmcache_mp_recomputes(lives: Callable[[str], dict]) -> None:
    r = lives("lmcache-mp")
    assert not r["restart"]["cached_tokens"], "an L1 in RAM cannot survive its server's restart"
    assert r["restart"]["token_ids"] == r["first"]["token_ids"]


def test_an_engine_restart_under_a_running_cache_server_keeps_its_hits(lives: Callable[[str], dict]) -> None:
    r = lives("lmcache-mp+kvlab")
    assert r["engine_restart"]["cached_tokens"] >= FULL, r["engine_restart"]
    assert r["engine_restart"]["token_ids"] == r["first"]["token_ids"]


def test_outputs_agree_across_setups(lives: Callable[[str], dict]) -> None:
    outs = {s: tuple(lives(s)["first"]["token_ids"]) for s in SETUPS}
    assert len(set(outs.values())) == 1 and len(outs["lmcache-mp"]) == OUT_TOKENS, outs


def test_inprocess_lmcache_refuses_to_pose_as_a_cache_on_the_cpu_engine(tiny_model: Path, tmp_path: Path) -> None:
    """lmcache-cpu on the real engine; lmcache-disk renders the same guard (unit tests)."""
    server = EngineServer(render("lmcache-cpu", params(tiny_model, tmp_path)), tmp_path / "logs",
                          ready_timeout_s=600)
    with pytest.raises(EngineError, match="cannot run here"):
        server.start()
    server.stop()
