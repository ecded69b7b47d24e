"""The setup registry renders each setup's processes once, for engine control and Ansible."""

from __future__ import annotations

import json

import pytest

from kvlab import setups
from kvlab.setup_cli import params_from_mapping


def params(**kw) -> setups.EngineParams:  # type: ignore[no-untyped-def]
    base = {"model": "/models/tiny", "kv_store_paths": ("/mnt/a", "/mnt/b"), "example_storage_path": "/tmp/ex"}
    return setups.EngineParams(**(base | kw))


def kv_config(d: setups.Deployment) -> dict | None:
    argv = list(d.engine.argv)
    if "--kv-transfer-config" not in argv:
        return None
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("name", ["baseline", "kvlab", "vllm-example"])
def test_every_setup_renders_on_cpu(name: str) -> None:
    d = setups.render(name, params())
    assert d.engine.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
    assert d.engine.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1", "every setup computes on the same cores"
    assert kv_config(d) == d.kv_transfer_config


def test_kvlab_setup_passes_its_drives_and_recompute_policy() -> None:
    kv = kv_config(setups.render("kvlab", params(kv_ring_bytes=1 << 30)))
    assert kv is not None
    assert kv["kv_connector_module_path"] == "kvlab_connector.vllm_connector"
    assert kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_extra_config"]["paths"] == ["/mnt/a", "/mnt/b"]
    assert kv["kv_connector_extra_config"]["ring_bytes"] == 1 << 30


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
