"""The one registry of setups: what each KV setup starts, with which flags and environment.

A setup turns deployment parameters (model, port, drives, cores, ...) into the exact
processes to run: the vLLM engine and, for some setups, a companion cache server.
kvlab's engine control and the Ansible serving role both render from here
(`kvlab setup render`), so the embedded default and the lab start identical command lines.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

# Every engine gets the same kv_load_failure_policy: a missing or corrupt object must be
# recomputed, never fail the request (and kvlab's connector refuses to start otherwise).
LOAD_FAILURE_POLICY = "recompute"
# vLLM's dev routes (/reset_prefix_cache, /collective_rpc, /sleep, /update_weights) check no
# API key: dev mode is on only for an engine bound to one of these addresses, explicitly.
LOOPBACK_HOSTS = ("127.0.0.1", "::1")
# The dtype an engine gets where EngineParams.dtype is None: on CUDA the checkpoint's own
# ("auto": bfloat16, FP8 weights with their scales); on the CPU engine the embedded
# default's tiny model's (kvlab.model.TinyGeometry.dtype), which "auto" would downcast.
DEVICE_DTYPE = {"cuda": "auto", "cpu": "float32"}


def compute_cores(allowed: set[int] | None = None) -> str | None:
    """The cores a CPU engine's forward pass is bound to: every core this process may use but
    the first, which is left to the engine's scheduler and API processes, as vLLM's own CPU
    binding reserves one for them (vllm/utils/ompmultiprocessing.py). kvlab's I/O threads stay
    in the worker, on the forward pass's cores, at a lower priority (kvlab_connector.io.posix).
    Bound to both of two cores, the OpenMP threads waited at each barrier for whichever one the
    API server had preempted: one life's decode requests ran at 60-160 tokens/s, in streaks. On
    one core (one 7-repeat run) a life's requests stayed within ~15% of its median, and the
    decode ratio's quartiles over the repeats were 1.01-1.04, against 1.02-1.15 on both."""
    cpus = _usable_cores(allowed)
    return ",".join(map(str, cpus[1:])) if len(cpus) > 1 else None


def omp_binding(cpu_cores: str, allowed: set[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `cpu_cores`: a core list as vLLM reads it ("1", "0-3",
    "2,3"), or "all", every core this process may use. A load campaign of many concurrent
    agents is bound by compute, and on two cores the forward pass needs both: on one it ran the
    same agents ~2x slower (campaigns/embedded-agents.yml)."""
    return ",".join(map(str, _usable_cores(allowed))) if cpu_cores == "all" else cpu_cores


def _usable_cores(allowed: set[int] | None) -> list[int]:
    return sorted(os.sched_getaffinity(0) if allowed is None else allowed)


@dataclass(frozen=True)
class EngineParams:
    """What a deployment supplies; the setup decides everything else."""

    model: str
    python: str = "python3"
    served_model_name: str = "kvlab-model"
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int = 65536
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    dtype: str | None = None  # None: DEVICE_DTYPE of the device
    device: str = "cpu"  # "cpu" (embedded default) or "cuda" (lab)
    # CPU engine only: the cores every setup's forward pass is pinned to, and its KV cache size.
    cpu_cores: str | None = field(default_factory=compute_cores)
    cpu_kv_cache_gib: int = 2
    gpu_memory_utilization: float = 0.9
    # kvlab's store: one path per drive. The other kv_* fields are the connector's keys of
    # the same name (CONNECTOR_KEYS), sent only where a user or a campaign set them (None:
    # not set): the connector owns their defaults (kvlab_connector.config).
    kv_store_paths: tuple[str, ...] = ()
    kv_store_capacity_bytes: int | None = None
    kv_ring_bytes: int | None = None
    kv_chunk_tokens: int | None = None
    kv_io_threads: int | None = None  # requests in flight over ALL drives (default: 8 per drive)
    kv_load_timeout_s: float | None = None
    kv_metrics_port: int | None = None
    kv_admission: str | None = None  # always | reused (kvlab_connector.admission)
    kv_write_budget_bytes_per_day: int | None = None
    # vLLM's ExampleConnector keeps one folder of safetensors files.
    example_storage_path: str = ""
    # Companion cache servers (LMCache MP) listen here.
    cache_server_host: str = "127.0.0.1"
    cache_server_port: int = 5555
    cache_server_l1_gib: int = 4
    cache_server_l2_path: str = ""
    # The API key, where one is used, reaches vLLM as VLLM_API_KEY from the service's
    # environment file: it never appears on a command line or in this registry.
    extra_engine_args: tuple[str, ...] = ()
    # vLLM's OffloadingConnector (the lab's DRAM peer): host DRAM for KV, bytes per node.
    offload_cpu_bytes: int = 0

    def with_(self, **changes: Any) -> EngineParams:
        return replace(self, **changes)

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or DEVICE_DTYPE[self.device]

    @property
    def dev_mode(self) -> bool:
        """Whether the engine serves vLLM's unauthenticated dev routes (loopback only)."""
        return self.host in LOOPBACK_HOSTS


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: argv and the environment added to the caller's."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str | None = None  # HTTP endpoint answering 200 once it serves
    ready_port: int | None = None  # or a TCP port that accepts connections


@dataclass(frozen=True)
class Deployment:
    setup: str
    engine: ProcessSpec
    kv_transfer_config: dict[str, Any] | None
    companion: ProcessSpec | None = None
    # The companion outlives engine restarts (a cache server in its own service).
    companion_survives_engine_restart: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @property
    def serves_dev_routes(self) -> bool:
        """Whether its engine answers /reset_prefix_cache (dev mode, loopback only)."""
        return self.engine.env.get("VLLM_SERVER_DEV_MODE") == "1"


@dataclass(frozen=True)
class Setup:
    name: str
    description: str
    # Where it can run: "cpu" setups run on the embedded default, "cuda" only in the lab.
    devices: tuple[str, ...]
    kv_transfer: Callable[[EngineParams], dict[str, Any] | None]
    companion: Callable[[EngineParams], ProcessSpec | None] = lambda p: None
    companion_survives_engine_restart: bool = False
    extra_env: Callable[[EngineParams], dict[str, str]] = lambda p: {}
    # Setups whose connector needs the whole prompt in one step (ExampleConnector).
    needs_full_prompt_batch: bool = False
    # What its KV tier writes to drives, and how a campaign counts it (kvlab.harness.wear):
    # "none" (no drive tier: recompute or DRAM), "kvlab" (kvlab's connector counters),
    # "files" (files its engine or cache server writes: their processes' /proc/PID/io).
    drive_tier: Literal["none", "kvlab", "files"] = "none"

    def render(self, params: EngineParams) -> Deployment:
        if params.device not in self.devices:
            raise SetupError(
                f"setup {self.name!r} does not run on device {params.device!r}: "
                f"it runs on {', '.join(self.devices)}"
            )
        _check_dtype(params)
        kv = self.kv_transfer(params)
        env = _engine_env(params) | self.extra_env(params)
        argv = _engine_argv(params, kv)
        engine = ProcessSpec(
            argv=tuple(argv),
            env=env,
            ready_url=f"http://{params.host}:{params.port}/health",
        )
        return Deployment(
            setup=self.name,
            engine=engine,
            kv_transfer_config=kv,
            companion=self.companion(params),
            companion_survives_engine_restart=self.companion_survives_engine_restart,
        )


class SetupError(ValueError):
    """A setup name or parameter a user gave that cannot be rendered."""


def fp8_checkpoint(model: str) -> bool:
    """Whether `model` holds FP8 weights: its config.json's quantization_config where the
    folder is readable here (a campaign on the node), else its folder name (a render on the
    Ansible controller, where the model is not)."""
    path = Path(model)
    try:
        quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return re.search(r"fp8", path.name, re.IGNORECASE) is not None
    return "fp8" in json.dumps(quant or {}).lower()


def _check_dtype(p: EngineParams) -> None:
    if p.resolved_dtype == "float32" and fp8_checkpoint(p.model):
        raise SetupError(
            f"dtype float32 with the FP8 checkpoint {p.model}: vLLM refuses float32 activations for FP8 "
            "weights (the engine would crash-loop). Leave dtype unset (on CUDA: auto, the checkpoint's "
            "own) or set dtype: bfloat16 (vllm_server_engine_params.dtype, or the campaign's engine.dtype)"
        )


def _engine_env(p: EngineParams) -> dict[str, str]:
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONHASHSEED": "0",
    }
    if p.dev_mode:
        # /reset_prefix_cache (the restore scenario's warm phase) is a dev route, and dev
        # routes check no API key: only on an engine nothing off the node can reach.
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if p.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(p.cpu_kv_cache_gib)
        # One 30K-token prefill step takes minutes on two cores: past vLLM's default 300 s
        # the executor declares the engine dead.
        env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "3600"
        if p.cpu_cores:
            # vLLM CPU binds its worker to one core without a connector and to all with
            # one: pin explicitly so that every setup computes on the same cores.
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_binding(p.cpu_cores)
    return env


def _engine_argv(p: EngineParams, kv: dict[str, Any] | None) -> list[str]:
    argv = [
        p.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", p.model,
        "--served-model-name", p.served_model_name,
        "--host", p.host,
        "--port", str(p.port),
        "--dtype", p.resolved_dtype,
        "--max-model-len", str(p.max_model_len),
        "--tensor-parallel-size", str(p.tensor_parallel_size),
        "--seed", "0",
        "--uvicorn-log-level", "warning",
        # cached_tokens in every response's usage: where a prompt's KV came from.
        "--enable-prompt-tokens-details",
    ]
    argv.append("--enable-prefix-caching" if p.enable_prefix_caching else "--no-enable-prefix-caching")
    if p.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(p.max_num_batched_tokens)]
    if p.max_num_seqs:
        argv += ["--max-num-seqs", str(p.max_num_seqs)]
    if p.enforce_eager:
        argv.append("--enforce-eager")
    if p.device == "cuda":
        argv += ["--gpu-memory-utilization", str(p.gpu_memory_utilization)]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv, sort_keys=True, separators=(",", ":"))]
    argv += list(p.extra_engine_args)
    return argv


# EngineParams field -> kvlab connector key (kv_connector_extra_config).
CONNECTOR_KEYS = {
    "kv_store_capacity_bytes": "capacity_bytes",
    "kv_ring_bytes": "ring_bytes",
    "kv_chunk_tokens": "chunk_tokens",
    "kv_io_threads": "io_threads",
    "kv_load_timeout_s": "load_timeout_s",
    "kv_metrics_port": "metrics_port",
    "kv_admission": "admission",
    "kv_write_budget_bytes_per_day": "write_budget_bytes_per_day",
}


def connector_settings(p: EngineParams) -> dict[str, Any]:
    """The connector keys that `p` sets: nothing for a field left at None."""
    return {key: getattr(p, name) for name, key in CONNECTOR_KEYS.items() if getattr(p, name) is not None}


def _kvlab_kv(p: EngineParams) -> dict[str, Any]:
    if not p.kv_store_paths:
        raise SetupError("setup 'kvlab' needs kv_store_paths: give one directory per drive")
    extra: dict[str, Any] = {"paths": list(p.kv_store_paths)} | connector_settings(p)
    return {
        "kv_connector": "KvlabConnector",
        "kv_connector_module_path": "kvlab_connector.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": LOAD_FAILURE_POLICY,
        "kv_connector_extra_config": extra,
    }


def _example_kv(p: EngineParams) -> dict[str, Any]:
    if not p.example_storage_path:
        raise SetupError("setup 'vllm-example' needs example_storage_path: a folder for its files")
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": LOAD_FAILURE_POLICY,
        "kv_connector_extra_config": {"shared_storage_path": p.example_storage_path},
    }


class Registry(MutableMapping[str, Setup]):
    """Setup name -> Setup, in the order declared.

    A setup defined in another module is declared here by name and module path, and that
    module is imported on first use, as vLLM's KVConnectorFactory.register_connector does:
    the module imports this one for the types, and nothing imports back."""

    def __init__(self) -> None:
        self._setups: dict[str, Setup] = {}
        self._declared_in: dict[str, str] = {}  # name -> module path, for each declared name
        self._modules: dict[str, str] = {}  # the same, for those not loaded yet
        self._order: list[str] = []

    def register(self, setup: Setup) -> Setup:
        self._declare(setup.name)
        self._setups[setup.name] = setup
        return setup

    def register_module(self, module_path: str, names: tuple[str, ...]) -> None:
        """Declare `names`, the setups that `module_path` defines in its SETUPS."""
        for name in names:
            self._declare(name)
            self._declared_in[name] = self._modules[name] = module_path

    def _declare(self, name: str) -> None:
        if name in self._order:
            raise ValueError(f"setup {name!r} registered twice")
        self._order.append(name)

    def _load(self, module_path: str) -> None:
        declared = {n for n, m in self._declared_in.items() if m == module_path}
        defined = {s.name: s for s in importlib.import_module(module_path).SETUPS}
        if set(defined) != declared:
            raise RuntimeError(
                f"{module_path}.SETUPS defines {sorted(defined)}, the registry declares {sorted(declared)} for it"
            )
        for name in [n for n, m in self._modules.items() if m == module_path]:
            self._setups[name] = defined[name]
            del self._modules[name]

    def __getitem__(self, name: str) -> Setup:
        if name in self._modules:
            self._load(self._modules[name])
        return self._setups[name]

    def __setitem__(self, name: str, setup: Setup) -> None:
        if setup.name != name:
            raise ValueError(f"setup {setup.name!r} registered as {name!r}")
        if name not in self._order:
            self._order.append(name)
        self._modules.pop(name, None)
        self._setups[name] = setup

    def __delitem__(self, name: str) -> None:
        if name not in self._order:
            raise KeyError(name)
        self._order.remove(name)
        self._setups.pop(name, None)
        self._modules.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)


REGISTRY = Registry()
register = REGISTRY.register


register(Setup(
    name="baseline",
    description="recompute every prompt; vLLM's own prefix cache only",
    devices=("cpu", "cuda"),
    kv_transfer=lambda p: None,
))
register(Setup(
    name="kvlab",
    description="kvlab's connector alone: KV on the drives, no DRAM tier",
    devices=("cpu", "cuda"),
    kv_transfer=_kvlab_kv,
    drive_tier="kvlab",
))
register(Setup(
    name="kvlab-reused",
    description="kvlab's connector saving only what returns: an object is written the second time its key "
                "comes (admission: reused), so a prompt seen once never reaches the drives",
    devices=("cpu", "cuda"),
    kv_transfer=lambda p: _kvlab_kv(p.with_(kv_admission="reused")),
    drive_tier="kvlab",
))
register(Setup(
    name="vllm-example",
    description="vLLM's ExampleConnector (safetensors files on disk), a peer that runs everywhere",
    devices=("cpu", "cuda"),
    kv_transfer=_example_kv,
    needs_full_prompt_batch=True,
    drive_tier="files",
))



def _offload_kv(p: EngineParams) -> dict[str, Any]:
    if p.offload_cpu_bytes <= 0:
        raise SetupError("setup 'vllm-offload' needs offload_cpu_bytes: host DRAM for the KV tier, bytes per node")
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": LOAD_FAILURE_POLICY,
        # Per rank, as vLLM's own --kv-offloading-size divides it.
        "kv_connector_extra_config": {"cpu_bytes_to_use": p.offload_cpu_bytes // p.tensor_parallel_size},
    }


register(Setup(
    name="vllm-offload",
    description="vLLM's OffloadingConnector: KV in host DRAM, the lab's DRAM peer (refuses the CPU engine)",
    devices=("cuda",),
    kv_transfer=_offload_kv,
))


# LMCache's tiers (in-process and MP mode): kvlab/setups/lmcache.py.
REGISTRY.register_module("kvlab.setups.lmcache", (
    "lmcache-cpu", "lmcache-disk", "lmcache-gds", "lmcache-mp", "lmcache-mp+fs",
    "lmcache-mp+kvlab", "lmcache-mp+kvlab-detached",
))


def get(name: str) -> Setup:
    try:
        return REGISTRY[name]
    except KeyError:
        raise SetupError(
            f"unknown setup {name!r}: choose one of {', '.join(sorted(REGISTRY))}"
        ) from None


def render(name: str, params: EngineParams) -> Deployment:
    return get(name).render(params)
