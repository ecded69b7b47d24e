"""LMCache's tiers as setups of the one registry: kvlab.setups.registry declares their names and
loads SETUPS from here on first use (this module imports the registry's types, never back).

In-process (LMCache inside vLLM's worker): `lmcache-cpu` (DRAM), `lmcache-disk` (local
disk, non-GDS), `lmcache-gds` (GPUDirect Storage; CUDA only).
MP mode (a cache server beside the engine, KV over ZMQ): `lmcache-mp` (L1 in DRAM,
retain policy), `lmcache-mp+fs` (LMCache's own fs L2), `lmcache-mp+kvlab` (L1 in DRAM
over kvlab's store as L2), and `lmcache-mp+kvlab-detached`, the same tiers with a
cache server that lives in its own service and outlives engine restarts.

On the vLLM CPU engine LMCache's in-process connector finds no CPU path and keeps
serving as plain recompute ("No supported cpu connector found"). The in-process setups
therefore start vLLM under a guard on CPU (`kvlab.setups.lmcache.main guard`) that
stops the engine with a one-line error the moment that message appears: a recompute is
never reported as an LMCache number.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import psutil

from kvlab.setups.registry import (
    LOAD_FAILURE_POLICY,
    Deployment,
    EngineParams,
    ProcessSpec,
    Setup,
    SetupError,
)
from kvlab_connector.config import CAPACITY_BYTES

CHUNK_TOKENS = 256  # LMCache's chunk size, engine and cache server alike
# What LMCache prints when its in-process connector gives up at start and lets vLLM
# recompute: the connector factory's error on a device it has no path for, and its
# manager's "degraded mode" line, whatever the cause.
DEGRADED_MARKERS = ("No supported cpu connector found", "will operate in degraded mode (recompute)")
GUARD_EXIT = 78
# Not `-m kvlab.setups.lmcache`: that would run a second copy of this module, as __main__,
# beside the one the registry loads.
GUARD_ENTRY = "import sys; from kvlab.setups.lmcache import main; sys.exit(main())"  # EX_CONFIG: the setup cannot serve what it claims on this machine
KVLAB_L2_MODULE = "kvlab_connector.lmcache_l2.adapter"
KVLAB_L2_CLASS = "KvlabL2Adapter"
L2_RING_CAP_BYTES = 256 << 20


# ---- in-process LMCache (LMCacheConnectorV1) -----------------------------------------
def _inprocess_kv(p: EngineParams) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_load_failure_policy": LOAD_FAILURE_POLICY,
    }


def _lmcache_env(p: EngineParams, **tiers: str) -> dict[str, str]:
    env = {
        "LMCACHE_CHUNK_SIZE": str(CHUNK_TOKENS),
        "LMCACHE_DISABLE_BANNER": "1",
        "LMCACHE_TRACK_USAGE": "false",
        "LMCACHE_USE_EXPERIMENTAL": "True",
    }
    return env | {f"LMCACHE_{k.upper()}": v for k, v in tiers.items()}


def _need_l2_path(p: EngineParams, setup: str) -> str:
    if not p.cache_server_l2_path:
        raise SetupError(f"setup {setup!r} needs cache_server_l2_path: a directory for LMCache's own files")
    return p.cache_server_l2_path


def _cpu_env(p: EngineParams) -> dict[str, str]:
    return _lmcache_env(p, local_cpu="True", max_local_cpu_size=str(p.cache_server_l1_gib))


def _disk_env(p: EngineParams) -> dict[str, str]:
    path = _need_l2_path(p, "lmcache-disk").rstrip("/") + "/"
    # LMCache's disk gets the bound kvlab's store gets (LMCache's own default, 0 GiB, would
    # keep nothing on its disk).
    capacity = CAPACITY_BYTES if p.kv_store_capacity_bytes is None else p.kv_store_capacity_bytes
    return _lmcache_env(
        p, local_cpu="False", max_local_cpu_size=str(p.cache_server_l1_gib),
        local_disk=f"file://{path}", max_local_disk_size=str(capacity / (1 << 30)),
    )


def _gds_env(p: EngineParams) -> dict[str, str]:
    return _lmcache_env(
        p, local_cpu="False", max_local_cpu_size=str(p.cache_server_l1_gib),
        gds_path=_need_l2_path(p, "lmcache-gds"), cufile_buffer_size="8192",
    )


@dataclass(frozen=True)
class GuardedSetup(Setup):
    """A setup whose engine, on the devices in `guard_on`, runs under the degradation
    guard: it stops with an error instead of serving plain recompute."""

    guard_on: tuple[str, ...] = ("cpu",)

    def render(self, params: EngineParams) -> Deployment:
        d = super().render(params)
        if params.device not in self.guard_on:
            return d
        argv = (params.python, "-c", GUARD_ENTRY, "guard", "--setup", self.name, "--", *d.engine.argv)
        return replace(d, engine=replace(d.engine, argv=argv))


# ---- MP mode (LMCacheMPConnector + `lmcache server`) --------------------------------
def _transfer_mode(p: EngineParams) -> str:
    # On CPU only the engine-driven path exists (KV pickled over ZMQ); without it on both
    # sides vLLM waits 300 s at start. On GPUs the server also offers CUDA IPC.
    return "engine_driven" if p.device == "cpu" else "auto"


def _mp_kv(p: EngineParams) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "lmcache.mp.host": f"tcp://{p.cache_server_host}",
        "lmcache.mp.port": p.cache_server_port,
    }
    if p.device == "cpu":
        extra["lmcache.mp.mp_transfer_mode"] = "engine_driven"
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": LOAD_FAILURE_POLICY,
        "kv_connector_extra_config": extra,
    }


def http_port(p: EngineParams) -> int:
    """The cache server's HTTP API (status, adapters): next to its request port."""
    return p.cache_server_port + 1


def kvlab_l2_spec(p: EngineParams) -> dict[str, Any]:
    """The `--l2-adapter` JSON that puts kvlab's store under LMCache's L1."""
    if not p.kv_store_paths:
        raise SetupError("setup 'lmcache-mp+kvlab' needs kv_store_paths: give one directory per drive")
    params: dict[str, Any] = {"paths": list(p.kv_store_paths)}
    # Only what a user or a campaign set; the adapter owns its defaults.
    if p.kv_store_capacity_bytes is not None:
        params["capacity_bytes"] = p.kv_store_capacity_bytes
    if p.kv_ring_bytes is not None:
        # LMCache's L1 is the DRAM tier here: its L2's staging ring does not grow with the
        # connector's (the lab gives the connector 10 GiB).
        params["ring_bytes"] = min(p.kv_ring_bytes, L2_RING_CAP_BYTES)
    if p.kv_io_threads is not None:
        params["io_threads"] = p.kv_io_threads
    return {
        "type": "plugin",
        "module_path": KVLAB_L2_MODULE,
        "class_name": KVLAB_L2_CLASS,
        "adapter_params": params,
    }


def cache_server(p: EngineParams, l2: dict[str, Any] | None) -> ProcessSpec:
    port = p.cache_server_port
    argv = [
        p.python, "-m", "lmcache.cli.main", "server",
        "--host", p.cache_server_host,
        "--port", str(port),
        "--chunk-size", str(CHUNK_TOKENS),
        "--l1-size-gb", str(p.cache_server_l1_gib),
        "--eviction-policy", "LRU",
        "--supported-transfer-mode", _transfer_mode(p),
        "--l2-prefetch-policy", "retain",
        "--http-host", "127.0.0.1",
        # Its metrics are served at /metrics on this HTTP port (what the harness reads);
        # while the HTTP server runs, LMCache opens no separate Prometheus port.
        "--http-port", str(http_port(p)),
    ]
    if l2 is not None:
        argv += ["--l2-adapter", json.dumps(l2, sort_keys=True, separators=(",", ":"))]
    env = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}
    return ProcessSpec(
        argv=tuple(argv), env=env,
        ready_url=f"http://127.0.0.1:{http_port(p)}/healthcheck", ready_port=port,
    )


def _fs_l2(p: EngineParams) -> dict[str, Any]:
    return {"type": "fs", "base_path": _need_l2_path(p, "lmcache-mp+fs")}


# ---- the registry entries -----------------------------------------------------------
# In-process: (name, what LMCache keeps where); on CPU both run under the guard.
_INPROCESS_SETUPS = (
    ("lmcache-cpu", "KV offloaded to DRAM", _cpu_env, "none"),
    ("lmcache-disk", "local disk backend (non-GDS) under a DRAM buffer", _disk_env, "files"),
)
def _no_l2(p: EngineParams) -> None:
    return None


# MP mode: (name, description, the L2 under the L1, cache server outlives engine restarts)
_MP_SETUPS: tuple[tuple[str, str, Callable[[EngineParams], dict[str, Any] | None], bool], ...] = (
    ("lmcache-mp", "LMCache MP cache server, L1 in DRAM with the retain policy; restarts with the engine",
     _no_l2, False),
    ("lmcache-mp+fs", "LMCache MP cache server, L1 in DRAM over LMCache's own fs L2", _fs_l2, False),
    ("lmcache-mp+kvlab", "LMCache MP cache server, L1 in DRAM over kvlab's store as L2 (the two-tier setup)",
     kvlab_l2_spec, False),
    ("lmcache-mp+kvlab-detached",
     "lmcache-mp+kvlab with the cache server in its own service: it outlives engine restarts",
     kvlab_l2_spec, True),
)
# What kvlab.setups.registry declares under this module's path, in its order.
SETUPS: tuple[Setup, ...] = (
    *(
        GuardedSetup(
            name=name,
            description=f"LMCache in-process (LMCacheConnectorV1), {what}; "
            "on the CPU engine it refuses to start: LMCache has no CPU path there",
            devices=("cpu", "cuda"),
            kv_transfer=_inprocess_kv,
            extra_env=env,
            drive_tier=tier,
        )
        for name, what, env, tier in _INPROCESS_SETUPS
    ),
    Setup(
        name="lmcache-gds",
        description="LMCache in-process with its GDS backend (cuFile straight into GPU memory); needs CUDA",
        devices=("cuda",),
        kv_transfer=_inprocess_kv,
        extra_env=_gds_env,
        drive_tier="files",
    ),
    *(
        Setup(
            name=name,
            description=description,
            devices=("cpu", "cuda"),
            kv_transfer=_mp_kv,
            companion=lambda p, l2=l2: cache_server(p, l2(p)),
            companion_survives_engine_restart=survives,
            # an L2 under the L1 writes files inside the cache server (kvlab's store too)
            drive_tier="none" if l2 is _no_l2 else "files",
        )
        for name, description, l2, survives in _MP_SETUPS
    ),
)
LMCACHE_SETUPS = tuple(s.name for s in SETUPS)
# What the embedded default (vLLM CPU engine) can measure: the in-process setups are
# registered for CPU so that a campaign asking for them fails loudly, not silently.
CPU_MEASURABLE = ("lmcache-mp", "lmcache-mp+fs", "lmcache-mp+kvlab", "lmcache-mp+kvlab-detached")


# ---- the degradation guard ----------------------------------------------------------
def guard(setup: str, argv: list[str], markers: tuple[str, ...] = DEGRADED_MARKERS) -> int:
    """Run argv, copying its output; stop it and fail when LMCache reports that it fell
    back to recompute. Signals reach the child through the shared process group."""
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    assert child.stdout is not None
    out = sys.stdout.buffer
    for raw in child.stdout:
        out.write(raw)
        out.flush()
        line = raw.decode(errors="replace")
        if any(m in line for m in markers):
            msg = (
                f"kvlab: setup {setup!r} cannot run here: LMCache's in-process connector reported "
                f"{line.strip()[-120:]!r}, so vLLM would only recompute. Measure LMCache on this "
                f"engine with lmcache-mp, lmcache-mp+fs or lmcache-mp+kvlab, or run {setup} on a GPU node.\n"
            )
            out.write(msg.encode())
            out.flush()
            print(msg.strip(), file=sys.stderr)
            _stop(child)
            return GUARD_EXIT
    return child.wait()


def _stop(child: subprocess.Popen) -> None:
    """Kill the engine and every process it started, at once. A graceful stop would let
    vLLM finish starting (it defers SIGTERM during start-up) and answer /health: the
    caller would take the degraded engine for a ready one."""
    try:
        procs = [psutil.Process(child.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        procs = []
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    child.wait()


def main(args: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvlab.setups.lmcache")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("guard", help="run an engine, failing if LMCache degrades to recompute")
    g.add_argument("--setup", required=True)
    g.add_argument("argv", nargs=argparse.REMAINDER)
    ns = ap.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        ap.error("guard: give the engine's command after --")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return guard(ns.setup, argv)
