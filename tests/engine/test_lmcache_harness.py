"""LMCache's own harnesses against kvlab's L2 adapter, on CPU: `lmcache bench l2` with
round-trip verification, and `lmcache bench server --mode cpu` against a real cache server
whose only tier is kvlab's store (L1 a write buffer: every warm retrieve comes from the
drives). About two minutes together, most of it LMCache's start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlab.engines.local import ManagedProcess
from kvlab.net import free_port
from kvlab.setups.lmcache import cache_server, http_port, kvlab_l2_spec
from kvlab.setups.registry import EngineParams, ProcessSpec

ENV = os.environ | {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}


def lmcache(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmcache.cli.main", *args], env=ENV, text=True,
                          capture_output=True, timeout=timeout)


def plugin_json(paths: list[Path]) -> str:
    p = EngineParams(model="unused", kv_store_paths=tuple(map(str, paths)), kv_store_capacity_bytes=4 << 30,
                     kv_ring_bytes=64 << 20)
    return json.dumps(kvlab_l2_spec(p))


def test_lmcache_bench_l2_round_trip_verified(tmp_path: Path) -> None:
    out = tmp_path / "l2.json"
    r = lmcache("bench", "l2", "--l2-adapter", plugin_json([tmp_path / "d0", tmp_path / "d1"]),
                "--no-skip-verify", "--num-keys", "16", "--in-flight", "2", "--rounds", "2",
                "--data-size-kb", "1024", "--lookup-max-hit-rate", "1.0", "--format", "json", "--output", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "data verified OK" in r.stdout, r.stdout[-3000:]
    ops = {v["operation"]: v for k, v in json.loads(out.read_text())["metrics"].items() if k.startswith("op_")}
    assert set(ops) == {"Store", "Lookup", "Load"}
    for name, op in ops.items():
        assert op["rounds_timed_out"] == 0, name
        assert op["total_success"] == op["total_keys"], f"{name}: {op['total_success']}/{op['total_keys']}"
    assert ops["Lookup"]["actual_hit_rate"] == 1.0


@pytest.fixture(scope="module")
def only_tier_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagedProcess, EngineParams]]:
    d = tmp_path_factory.mktemp("bench-server")
    p = EngineParams(model="unused", python=sys.executable, cache_server_port=free_port(), cache_server_l1_gib=1,
                     kv_store_paths=(str(d / "d0"),), kv_store_capacity_bytes=4 << 30, kv_ring_bytes=64 << 20)
    spec = cache_server(p, kvlab_l2_spec(p))
    # L1 as a write buffer only: every object goes to the adapter and leaves L1 at once.
    argv = (*spec.argv, "--l2-store-policy", "skip_l1", "--eviction-policy", "noop")
    proc = ManagedProcess("cache-server", ProcessSpec(argv, spec.env, spec.ready_url, spec.ready_port),
                          d / "cache-server.log")
    proc.start()
    try:
        proc.wait_ready(300)
        yield proc, p
    finally:
        proc.stop()


def adapter_status(p: EngineParams) -> dict:
    """The kvlab adapter's report_status() from the cache server's /status."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port(p)}/status", timeout=30) as r:
        found = list(_dicts_of_type(json.loads(r.read()), "KvlabL2Adapter"))
    assert len(found) == 1, f"the cache server reports {len(found)} kvlab adapters"
    return found[0]


def _dicts_of_type(obj: object, name: str) -> Iterator[dict]:
    if isinstance(obj, dict):
        if obj.get("type") == name:
            yield obj
        for v in obj.values():
            yield from _dicts_of_type(v, name)
    elif isinstance(obj, list):
        for v in obj:
            yield from _dicts_of_type(v, name)


def test_lmcache_bench_server_cpu_with_kvlab_as_the_only_tier(
    only_tier_server: tuple[ManagedProcess, EngineParams], tmp_path: Path,
) -> None:
    proc, p = only_tier_server
    out = tmp_path / "server.json"
    r = lmcache("bench", "server", "--mode", "cpu", "--rpc-url", f"tcp://127.0.0.1:{p.cache_server_port}",
                "--url", f"http://127.0.0.1:{http_port(p)}", "--num-tokens", "512", "--num-blocks", "256",
                "--kvcache-shape-spec", "(2,256,16,8,64):float16:4", "--start", "0", "--end", "3",
                "--interval", "0.2", "--format", "json", "--output", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())["metrics"]["results"]
    assert res["total_requests"] == 3 and res["checksum_ok"] == 3 and res["checksum_fail"] == 0, res
    adapter = adapter_status(p)
    # 3 requests x 512 tokens in chunks of 256: 6 objects stored, and every warm retrieve
    # read them back from the drives, verified.
    assert adapter["objects_stored"] == 6, adapter
    assert adapter["objects_loaded"] == 6 and adapter["load_failures"] == 0, adapter
    assert adapter["io_mode"].startswith("posix")
