"""Keys, configuration and the staging ring of kvlab's connector."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvlab_connector.config import ConfigError, ConnectorConfig, check_load_failure_policy
from kvlab_connector.keys import chunk_keys, model_fingerprint, namespace
from kvlab_connector.ring import RingFull, StagingRing


def test_keys_are_deterministic_across_processes() -> None:
    tokens = list(range(1000, 3100))
    here = chunk_keys(tokens, 512)
    code = "from kvlab_connector.keys import chunk_keys; print(chunk_keys(list(range(1000, 3100)), 512))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "random"}).stdout.strip()
    assert str(here) == there
    assert len(here) == 4  # 2100 tokens: 4 full chunks, the tail has no key


def test_a_key_covers_the_whole_prefix() -> None:
    a = list(range(2048))
    b = a.copy()
    b[10] += 1  # a change in chunk 0 changes every later key
    ka, kb = chunk_keys(a, 512), chunk_keys(b, 512)
    assert all(x != y for x, y in zip(ka, kb, strict=True))
    c = a.copy()
    c[1500] += 1  # a change in chunk 2 leaves chunks 0 and 1 alone
    kc = chunk_keys(c, 512)
    assert kc[:2] == ka[:2] and kc[2:] != ka[2:]


def test_salts_and_namespaces_separate() -> None:
    t = list(range(1024))
    assert chunk_keys(t, 512, "tenant-a") != chunk_keys(t, 512, "tenant-b")
    assert chunk_keys(t, 512, None) == chunk_keys(t, 512, "")
    assert namespace(model="m", rank=0) != namespace(model="m", rank=1)
    assert namespace(model="m", rank=0) == namespace(rank=0, model="m")


def test_fingerprint_follows_the_weights_not_the_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name, weights in (("a", b"\x01" * 5000), ("b", b"\x01" * 5000), ("c", b"\x02" * 5000)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"layers": 2}')
        (d / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}" + weights)
    fp = {n: model_fingerprint(tmp_path / n) for n in "abc"}
    assert fp["a"] == fp["b"] and fp["a"] != fp["c"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({}, "paths"),
        ({"paths": "/mnt/a"}, "paths"),
        ({"paths": ["/a"], "ring_byte": 1}, "ring_byte"),
        ({"paths": ["/a"], "ring_bytes": -1}, "ring_bytes"),
        ({"paths": ["/a"], "chunk_tokens": "512"}, "chunk_tokens"),
        ({"paths": ["/a"], "load_timeout_s": -2}, "load_timeout_s"),
        ({"paths": ["/a"], "io_engine": "spdk"}, "io_engine"),
        ({"paths": ["/a"], "metrics_port": 70000}, "metrics_port"),
        ({"paths": ["/a"], "io_threads": 0}, "io_threads"),
    ],
)
def test_bad_config_names_the_field(extra: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ConnectorConfig.from_extra(extra)


def test_good_config() -> None:
    c = ConnectorConfig.from_extra({"paths": ["/a", "/b"], "ring_bytes": 1 << 30, "load_timeout_s": 5})
    assert c.paths == ("/a", "/b") and c.ring_bytes == 1 << 30 and c.o_direct_flag() is None


def test_ring_is_bounded_and_page_aligned() -> None:
    ring = StagingRing(4 * 8192, 5000)  # slots round up to pages
    assert ring.slot_bytes == 8192 and ring.num_slots == 4
    slots = [ring.acquire() for _ in range(4)]
    with pytest.raises(RingFull):
        ring.acquire(timeout_s=0.01)
    ring.release(slots[0])
    assert ring.acquire(timeout_s=0) == slots[0]
    with pytest.raises(ValueError, match="ring_bytes"):
        StagingRing(4096, 8192)


@pytest.mark.parametrize("policy", ["fail", None])
def test_the_connector_refuses_a_load_failure_policy_other_than_recompute(policy: str | None) -> None:
    # The engine tier shows once that a connector's ConfigError stops a real engine with its
    # reason (tests/engine/test_engine_control.py); which settings are refused is checked here.
    kvt = SimpleNamespace() if policy is None else SimpleNamespace(kv_load_failure_policy=policy)
    with pytest.raises(ConfigError, match=r'kv_load_failure_policy = "recompute" \(it is '):
        check_load_failure_policy(kvt)
    check_load_failure_policy(SimpleNamespace(kv_load_failure_policy="recompute"))
