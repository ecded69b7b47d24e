"""Engine control over the real OpenAI server: kvlab's setup end to end, restarts, clean stops."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from kvlab.client import complete
from kvlab.engines.local import EngineError, EngineServer, group_alive
from kvlab.setups import registry as setups

PORT = 8131


def prompt(n: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 8000) for _ in range(n)]


def group_gone(pgid: int) -> bool:
    return not group_alive(pgid)


def params(model: Path, store: Path, **kw) -> setups.EngineParams:  # type: ignore[no-untyped-def]
    return setups.EngineParams(model=str(model), python=sys.executable, served_model_name="tiny", port=PORT,
                               max_model_len=4096, kv_store_paths=(str(store),), kv_ring_bytes=64 << 20, **kw)


def test_kvlab_setup_restores_across_a_restart_and_stops_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    server = EngineServer(setups.render("kvlab", params(tiny_model, tmp_path / "store")), tmp_path / "logs")
    p = prompt(1100)
    try:
        server.start()
        first = complete(server.base_url, "tiny", p, max_tokens=4)
        assert first.cached_tokens in (0, None)
        server.reset_prefix_cache()
        warm = complete(server.base_url, "tiny", p, max_tokens=4)
        assert warm.cached_tokens == 1024, "after a prefix-cache reset the two chunks come from the drives"
        assert warm.text == first.text
        pgid, ipc = server.engine.pid, server.engine.temp_dir
        assert ipc is not None and any(f.is_socket() for f in ipc.iterdir()), "vLLM's sockets are in the life's folder"
        assert any(f.name.startswith("vllm_dist_") for f in ipc.iterdir()), "and torch's rendezvous file"
        server.restart()
        assert group_gone(pgid), "the old engine's process group must be gone after a restart"
        assert not ipc.exists(), "and its files with it"
        cold = complete(server.base_url, "tiny", p, max_tokens=4)
        assert cold.cached_tokens == 1024
        assert cold.text == first.text
    finally:
        pgid, ipc = server.engine.pid, server.engine.temp_dir
        server.stop()
    assert pgid is None or group_gone(pgid)
    assert ipc is None or not ipc.exists()


def bad_kv_deployment(model: Path, store: Path, extra: dict) -> setups.Deployment:
    d = setups.render("kvlab", params(model, store))
    argv = list(d.engine.argv)
    i = argv.index("--kv-transfer-config") + 1
    kv = json.loads(argv[i])
    kv["kv_connector_extra_config"].update(extra)
    argv[i] = json.dumps(kv)
    return setups.Deployment(d.setup, setups.ProcessSpec(tuple(argv), d.engine.env, d.engine.ready_url), kv)


def test_bad_connector_config_stops_the_engine_with_a_named_reason(tiny_model: Path, tmp_path: Path) -> None:
    # One engine start shows a connector's ConfigError reaching the user; which settings are
    # refused is the unit tier's (tests/unit/test_connector_parts.py).
    server = EngineServer(bad_kv_deployment(tiny_model, tmp_path / "store", {"ring_byte": 1}),
                          tmp_path / "logs", ready_timeout_s=300)
    with pytest.raises(EngineError, match="ring_byte"):
        server.start()
    server.stop()
