"""The setup registry renders each setup's processes once, for engine control and Ansible."""

from __future__ import annotations

import json

import pytest

from kvlab.setups import registry as setups
from kvlab.setups.cli import params_from_mapping


def params(**kw) -> setups.EngineParams:  # type: ignore[no-untyped-def]
    base = {"model": "/models/tiny", "kv_store_paths": ("/mnt/a", "/mnt/b"), "example_storage_path": "/tmp/ex"}
    return setups.EngineParams(**(base | kw))


def kv_config(d: setups.Deployment) -> dict | None:
    argv = list(d.engine.argv)
    if "--kv-transfer-config" not in argv:
        return None
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("name", ["baseline", "kvlab", "kvlab-reused", "vllm-example"])
def test_every_setup_renders_on_cpu(name: str) -> None:
    d = setups.render(name, params())
    assert d.engine.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
    assert d.engine.env["VLLM_CPU_OMP_THREADS_BIND"] == setups.compute_cores(), "every setup computes on the same cores"
    assert kv_config(d) == d.kv_transfer_config


def test_kvlab_setup_passes_its_drives_and_recompute_policy() -> None:
    kv = kv_config(setups.render("kvlab", params(kv_ring_bytes=1 << 30)))
    assert kv is not None
    assert kv["kv_connector_module_path"] == "kvlab_connector.vllm_connector"
    assert kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_extra_config"]["paths"] == ["/mnt/a", "/mnt/b"]
    assert kv["kv_connector_extra_config"]["ring_bytes"] == 1 << 30


def test_kvlab_reused_differs_from_kvlab_only_in_its_admission() -> None:
    extra = {n: kv_config(setups.render(n, params()))["kv_connector_extra_config"] for n in ("kvlab", "kvlab-reused")}
    assert "admission" not in extra["kvlab"], "kvlab leaves admission to the connector's default (always)"
    assert extra["kvlab-reused"] == extra["kvlab"] | {"admission": "reused"}
    assert setups.get("kvlab-reused").drive_tier == "kvlab", "its writes are counted from the connector's counters"


def test_setups_differ_only_in_their_kv_transfer() -> None:
    def without_kv(d: setups.Deployment) -> list[str]:
        argv = list(d.engine.argv)
        if "--kv-transfer-config" in argv:
            i = argv.index("--kv-transfer-config")
            del argv[i:i + 2]
        return argv

    rendered = [setups.render(n, params()) for n in ("baseline", "kvlab", "vllm-example")]
    assert len({tuple(without_kv(d)) for d in rendered}) == 1
    assert len({json.dumps(d.engine.env, sort_keys=True) for d in rendered}) == 1


def test_unknown_setup_and_missing_drives_are_user_errors() -> None:
    with pytest.raises(setups.SetupError, match="choose one of"):
        setups.render("nvme-magic", params())
    with pytest.raises(setups.SetupError, match="kv_store_paths"):
        setups.render("kvlab", params(kv_store_paths=()))
    with pytest.raises(setups.SetupError, match="unknown engine parameter"):
        params_from_mapping({"model": "/m", "tp": 8})


def test_dram_peer_is_lab_only_and_needs_its_size() -> None:
    with pytest.raises(setups.SetupError, match="runs on cuda"):
        setups.render("vllm-offload", params())
    with pytest.raises(setups.SetupError, match="offload_cpu_bytes"):
        setups.render("vllm-offload", params(device="cuda"))
    d = setups.render("vllm-offload", params(device="cuda", tensor_parallel_size=8, offload_cpu_bytes=400 << 30))
    assert d.kv_transfer_config is not None
    assert d.kv_transfer_config["kv_connector_extra_config"]["cpu_bytes_to_use"] == (400 << 30) // 8


# ---- dtype: the checkpoint's own on CUDA, the tiny model's on the CPU engine --------------
def test_dtype_is_auto_on_cuda_unless_set() -> None:
    """The lab serves FP8 checkpoints: the old float32 default crash-looped every lab unit."""
    argv = setups.render("baseline", params(model="/models/GLM-5.3-FP8", device="cuda")).engine.argv
    assert argv[argv.index("--dtype") + 1] == "auto"
    argv = setups.render("baseline", params(device="cuda", dtype="bfloat16")).engine.argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16"


def test_cpu_engine_keeps_the_tiny_models_float32() -> None:
    from kvlab.model import TinyGeometry

    argv = setups.render("baseline", params()).engine.argv
    assert argv[argv.index("--dtype") + 1] == TinyGeometry().dtype == setups.DEVICE_DTYPE["cpu"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_float32_with_an_fp8_checkpoint_is_refused_naming_the_field(device: str) -> None:
    with pytest.raises(setups.SetupError, match=r"dtype float32 with the FP8 checkpoint .*dtype: bfloat16"):
        setups.render("baseline", params(model="/models/GLM-5.3-FP8", device=device, dtype="float32"))


def test_fp8_is_read_from_the_checkpoints_config_where_it_is_here(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek-R1-0528 says FP8 only in its config.json, not in its name."""
    model = tmp_path / "DeepSeek-R1-0528"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(setups.SetupError, match="FP8 checkpoint"):
        setups.render("baseline", params(model=str(model), device="cuda", dtype="float32"))
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    setups.render("baseline", params(model=str(model), device="cuda", dtype="float32"))


# ---- dev mode: only on an engine bound to loopback, explicitly ----------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_dev_mode_only_with_an_explicit_loopback_host(host: str) -> None:
    d = setups.render("kvlab", params(host=host))
    argv = list(d.engine.argv)
    assert argv[argv.index("--host") + 1] == host
    assert d.engine.env["VLLM_SERVER_DEV_MODE"] == "1" and d.serves_dev_routes


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.10.0.11", "localhost", "node.example"])
def test_an_engine_on_the_network_runs_without_dev_mode(host: str) -> None:
    """vLLM's API key guards only /v1 routes: dev mode there would open /collective_rpc to anyone."""
    d = setups.render("kvlab", params(host=host))
    assert "VLLM_SERVER_DEV_MODE" not in d.engine.env and not d.serves_dev_routes


# ---- the connector owns its defaults: the registry sends only what was set ---------------
def kvlab_extra(p: setups.EngineParams) -> dict:
    kv = kv_config(setups.render("kvlab", p))
    assert kv is not None
    return kv["kv_connector_extra_config"]


def test_a_deployment_that_sets_no_connector_setting_sends_none() -> None:
    """EngineParams used to restate five connector defaults and always send them, so the
    connector's own (io_threads: 8 per drive) never applied."""
    from kvlab_connector.config import CAPACITY_BYTES, RING_BYTES, ConnectorConfig

    extra = kvlab_extra(params())
    assert extra == {"paths": ["/mnt/a", "/mnt/b"]}
    config = ConnectorConfig.from_extra(extra)
    assert config == ConnectorConfig(paths=("/mnt/a", "/mnt/b"))
    assert (config.capacity_bytes, config.ring_bytes, config.io_threads) == (CAPACITY_BYTES, RING_BYTES, None)


SET_VALUES = {"kv_store_capacity_bytes": 1 << 40, "kv_ring_bytes": 1 << 30, "kv_chunk_tokens": 256,
              "kv_io_threads": 5, "kv_load_timeout_s": 2.5, "kv_metrics_port": 9100,
              "kv_admission": "reused", "kv_write_budget_bytes_per_day": 10**12}


@pytest.mark.parametrize("field", sorted(setups.CONNECTOR_KEYS))
def test_a_connector_setting_is_sent_under_the_connectors_key(field: str) -> None:
    from kvlab_connector.config import ConnectorConfig

    key = setups.CONNECTOR_KEYS[field]
    extra = kvlab_extra(params(**{field: SET_VALUES[field]}))
    assert extra == {"paths": ["/mnt/a", "/mnt/b"], key: SET_VALUES[field]}
    assert getattr(ConnectorConfig.from_extra(extra), key) == SET_VALUES[field]


def test_every_connector_setting_of_the_registry_is_a_connector_key() -> None:
    import dataclasses

    from kvlab_connector.config import ConnectorConfig

    kv_fields = {f.name for f in dataclasses.fields(setups.EngineParams) if f.name.startswith("kv_")}
    assert kv_fields - {"kv_store_paths"} == set(setups.CONNECTOR_KEYS) == set(SET_VALUES)
    assert set(setups.CONNECTOR_KEYS.values()) <= {f.name for f in dataclasses.fields(ConnectorConfig)}


def test_the_l2_under_lmcache_gets_only_what_was_set() -> None:
    from kvlab.setups.lmcache import kvlab_l2_spec
    from kvlab_connector.config import CAPACITY_BYTES
    from kvlab_connector.lmcache_l2.adapter import KvlabL2AdapterConfig

    spec = kvlab_l2_spec(params())["adapter_params"]
    assert spec == {"paths": ["/mnt/a", "/mnt/b"]}
    assert KvlabL2AdapterConfig.from_dict(spec).capacity_bytes == CAPACITY_BYTES
    spec = kvlab_l2_spec(params(kv_store_capacity_bytes=1 << 40, kv_ring_bytes=10 << 30, kv_io_threads=4))
    assert spec["adapter_params"] == {"paths": ["/mnt/a", "/mnt/b"], "capacity_bytes": 1 << 40,
                                      "ring_bytes": 256 << 20, "io_threads": 4}


@pytest.mark.parametrize("group", ["h200", "h20"])
def test_the_lab_leaves_io_threads_to_the_connector(group: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The lab inventories hand-wrote io_threads: 32 for 4 drives (8 per drive, restated)."""
    from pathlib import Path

    import yaml

    from kvlab_connector.config import ConnectorConfig
    from kvlab_connector.store.store import Store

    root = Path(__file__).resolve().parents[3]
    values = yaml.safe_load((root / f"inventories/lab/group_vars/{group}/main.yml").read_text())
    drives = tuple(str(tmp_path / f"nvmeof{i}") for i in range(4))
    mapping = {"model": "/m", "device": "cuda", "kv_store_paths": drives} | values["vllm_server_engine_params"]
    extra = kvlab_extra(params_from_mapping(mapping))
    assert "io_threads" not in extra
    config = ConnectorConfig.from_extra(extra)
    # the store the connector starts from this config (vllm_connector.py), on 4 drives
    store = Store(config.paths, 1 << 30, config.io_threads, config.o_direct_flag())
    try:
        assert store.engine.threads == 32
    finally:
        store.close()


def test_the_forward_pass_leaves_the_first_core_to_the_engines_other_processes() -> None:
    assert setups.compute_cores({0, 1}) == "1"
    assert setups.compute_cores({0, 1, 2, 3}) == "1,2,3"
    assert setups.compute_cores({4, 6, 5}) == "5,6"
    assert setups.compute_cores({0}) is None  # one core: nothing to leave, vLLM binds as it will
    assert "VLLM_CPU_OMP_THREADS_BIND" not in setups.render("kvlab", params(cpu_cores=None)).engine.env
    assert setups.omp_binding("all", {0, 1}) == "0,1" and setups.omp_binding("2-3") == "2-3"
    assert setups.render("kvlab", params(cpu_cores="all")).engine.env["VLLM_CPU_OMP_THREADS_BIND"] == setups.omp_binding("all")
