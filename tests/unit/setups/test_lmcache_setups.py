"""LMCache's setups in the registry: what each renders, and the guard against silent recompute."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvlab.setups.lmcache import CPU_MEASURABLE, GUARD_EXIT, LMCACHE_SETUPS, guard
from kvlab.setups.registry import REGISTRY, EngineParams, SetupError, render


def params(**kw: object) -> EngineParams:
    base: dict = dict(model="/m", python="/py", kv_store_paths=("/d0", "/d1"), cache_server_l2_path="/l2",
                      cache_server_port=6000)
    return EngineParams(**(base | kw))


def kv_config(argv: tuple[str, ...]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_every_lmcache_setup_is_registered() -> None:
    assert set(LMCACHE_SETUPS) <= set(REGISTRY)
    assert set(CPU_MEASURABLE) <= set(LMCACHE_SETUPS)


def test_gds_is_cuda_only_and_says_so() -> None:
    assert REGISTRY["lmcache-gds"].devices == ("cuda",)
    with pytest.raises(SetupError, match="runs on cuda"):
        render("lmcache-gds", params())
    d = render("lmcache-gds", params(device="cuda"))
    assert d.engine.env["LMCACHE_GDS_PATH"] == "/l2"


@pytest.mark.parametrize("setup", ["lmcache-cpu", "lmcache-disk"])
def test_inprocess_setups_run_under_the_guard_on_cpu_only(setup: str) -> None:
    cpu = render(setup, params()).engine.argv
    assert cpu[1] == "-c" and "kvlab.setups.lmcache" in cpu[2] and cpu[3] == "guard"
    assert cpu[cpu.index("--") + 1:][:3] == ("/py", "-m", "vllm.entrypoints.openai.api_server")
    assert kv_config(cpu)["kv_connector"] == "LMCacheConnectorV1"
    cuda = render(setup, params(device="cuda")).engine.argv
    assert cuda[:3] == ("/py", "-m", "vllm.entrypoints.openai.api_server")


def test_disk_setup_points_lmcache_at_its_folder() -> None:
    env = render("lmcache-disk", params()).engine.env
    assert env["LMCACHE_LOCAL_DISK"] == "file:///l2/" and float(env["LMCACHE_MAX_LOCAL_DISK_SIZE"]) > 0
    with pytest.raises(SetupError, match="cache_server_l2_path"):
        render("lmcache-disk", params(cache_server_l2_path=""))


@pytest.mark.parametrize("setup", CPU_MEASURABLE)
def test_mp_setups_pair_an_engine_driven_engine_with_its_cache_server(setup: str) -> None:
    d = render(setup, params())
    kv = kv_config(d.engine.argv)
    assert kv["kv_connector"] == "LMCacheMPConnector"
    assert kv["kv_connector_extra_config"] == {
        "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 6000, "lmcache.mp.mp_transfer_mode": "engine_driven"}
    c = d.companion
    assert c is not None and c.ready_port == 6000
    a = list(c.argv)
    assert a[:4] == ["/py", "-m", "lmcache.cli.main", "server"]
    assert a[a.index("--supported-transfer-mode") + 1] == "engine_driven"
    assert a[a.index("--l2-prefetch-policy") + 1] == "retain"
    assert d.companion_survives_engine_restart == setup.endswith("-detached")


def test_the_l2_under_each_mp_setup() -> None:
    def l2(setup: str) -> dict | None:
        a = list(render(setup, params()).companion.argv)  # type: ignore[union-attr]
        return json.loads(a[a.index("--l2-adapter") + 1]) if "--l2-adapter" in a else None

    assert l2("lmcache-mp") is None
    assert l2("lmcache-mp+fs") == {"type": "fs", "base_path": "/l2"}
    spec = l2("lmcache-mp+kvlab")
    assert spec == l2("lmcache-mp+kvlab-detached")
    assert spec["type"] == "plugin" and spec["adapter_params"]["paths"] == ["/d0", "/d1"]
    import importlib

    cls = getattr(importlib.import_module(spec["module_path"]), spec["class_name"])
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

    assert issubclass(cls, L2AdapterInterface)
    with pytest.raises(SetupError, match="kv_store_paths"):
        render("lmcache-mp+kvlab", params(kv_store_paths=()))


def test_mp_on_gpus_leaves_the_transfer_mode_to_lmcache() -> None:
    d = render("lmcache-mp", params(device="cuda"))
    assert "lmcache.mp.mp_transfer_mode" not in kv_config(d.engine.argv)["kv_connector_extra_config"]


def test_the_guard_stops_an_engine_that_degrades_to_recompute(capfd: pytest.CaptureFixture[str]) -> None:
    child = [sys.executable, "-c",
             "import time; print('starting', flush=True); "
             "print('RuntimeError: No supported cpu connector found.', flush=True); time.sleep(120)"]
    t0 = time.monotonic()
    assert guard("lmcache-cpu", child) == GUARD_EXIT
    assert time.monotonic() - t0 < 30
    out = capfd.readouterr()
    assert "starting" in out.out and "cannot run here" in out.out and "cannot run here" in out.err


def test_the_guard_passes_a_healthy_engine_through() -> None:
    code = "import sys; print('serving'); sys.exit(3)"
    assert guard("lmcache-cpu", [sys.executable, "-c", code]) == 3


def test_the_guard_entry_point_runs_as_rendered() -> None:
    argv = list(render("lmcache-cpu", params(python=sys.executable)).engine.argv)
    cut = argv.index("--")
    argv = argv[:cut + 1] + [sys.executable, "-c", "print('No supported cpu connector found.')"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == GUARD_EXIT, r.stdout + r.stderr


def test_the_guard_kills_what_the_engine_started(capfd: pytest.CaptureFixture[str]) -> None:
    """vLLM defers SIGTERM while it starts: a degraded engine must die at once, workers too."""
    import psutil

    child = [sys.executable, "-c",
             "import subprocess, sys, time; "
             "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
             "print('worker', w.pid, flush=True); "
             "print('No supported cpu connector found.', flush=True); time.sleep(120)"]
    assert guard("lmcache-cpu", child) == GUARD_EXIT
    worker = int(next(line.split()[1] for line in capfd.readouterr().out.splitlines() if line.startswith("worker")))

    def gone() -> bool:
        try:
            return psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not gone():
        time.sleep(0.1)
    assert gone(), "the engine's worker outlived the guard"
