"""Run a plan (kvlab.harness.plan, compiled from a campaign by kvlab.harness.compiler): per
setup, its engine lives and each life's steps in order; append-only records; progress."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from kvlab.bench import cachebw
from kvlab.engines.local import EngineError, EngineServer
from kvlab.harness import results, scenarios
from kvlab.harness.errors import InputError
from kvlab.harness.memory import MemorySampler
from kvlab.harness.plan import EngineSpec, Life, ModelPlan, Plan, RestoreSpec, SetupPlan, fmt_s, plan_json
from kvlab.harness.progress import Progress, note
from kvlab.harness.sessions import sha256_file
from kvlab.harness.wear import WearSampler, drives_record
from kvlab.net import free_port
from kvlab.paths import state_dir
from kvlab.setups import registry as setups


class Engines(Protocol):
    """How a setup's engine is rendered and controlled: LocalEngines here, or
    kvlab.engines.systemd.SystemdEngines on a lab node (`--engine systemd`)."""

    def deployment(self, setup: str, params: setups.EngineParams) -> setups.Deployment: ...

    def server(self, deployment: setups.Deployment, log_dir: Path) -> EngineServer: ...

    def describe(self) -> dict[str, Any]: ...


class LocalEngines:
    """Engines started by the harness as its own processes (the embedded default)."""

    def deployment(self, setup: str, params: setups.EngineParams) -> setups.Deployment:
        return setups.render(setup, params)

    def server(self, deployment: setups.Deployment, log_dir: Path) -> EngineServer:
        return EngineServer(deployment, log_dir)

    def describe(self) -> dict[str, Any]:
        return {"kind": "local"}


def engine_params(e: EngineSpec, model: Path, served: str, work: Path) -> setups.EngineParams:
    """A life's engine parameters on this host: the plan's, with the model, ports and work folders here."""
    values = dict(e.values)
    stores = tuple(values.pop("kv_store_paths", ())) or (str(work / "kvlab-store"),)
    return setups.EngineParams(
        model=str(model), python=sys.executable, served_model_name=served, device=e.device,
        port=free_port(), kv_metrics_port=free_port(), cache_server_port=free_port(),
        example_storage_path=str(work / "example-store"), cache_server_l2_path=str(work / "l2"),
        enable_prefix_caching=e.prefix_caching, **values, kv_store_paths=stores,
    )


def resolve_model(m: ModelPlan) -> tuple[Path, str, dict[str, Any]]:
    if m.kind == "tiny":
        from kvlab.model import TinyGeometry, ensure_tiny, tree_sha256

        assert m.seed is not None
        geometry = TinyGeometry(**(m.geometry or {}))
        path = ensure_tiny(seed=m.seed, geometry=geometry)
        # the geometry is the planner's physical input (kv bytes per token, FLOPs per token)
        return path, "tiny", {"kind": "tiny", "seed": m.seed, "path": str(path),
                              "sha256": tree_sha256(path), "geometry": dataclasses.asdict(geometry),
                              "kv_bytes_per_token": geometry.kv_bytes_per_token}
    assert m.path is not None
    path = Path(m.path)
    if not path.exists():
        raise InputError(f"model.path {path}: no such folder on this host")
    return path, m.served_name, {"kind": "path", "path": str(path)}


def check_device(p: Plan) -> None:
    if p.device == "cuda":
        gpus = results.gpus()
        if not gpus:
            raise InputError(f"campaign {p.campaign!r} runs on device 'cuda' and this host has no GPU: "
                             "run it in the lab (inventory) or use `kvlab campaign plan` / `run --dry-run`")


def run_plan(plan: Plan, campaign_path: Path, campaign_sha: str, runs_dir: Path,
             keep_stores: bool = False, engines: Engines | None = None) -> Path:
    """Execute a compiled plan; the campaign file (its bytes and sha256) is only recorded."""
    engines = engines or LocalEngines()
    check_device(plan)
    model, served, model_prov = resolve_model(plan.model)
    run_id = results.new_run_id(plan.campaign)
    writer = results.RunWriter(runs_dir, run_id)
    writer.write_once(results.CAMPAIGN, campaign_path.read_bytes())
    writer.write_once(results.PLAN, json.dumps(plan_json(plan), indent=2))
    work_root = state_dir() / "campaigns" / run_id
    traces = {str(f): sha256_file(f) for f in plan.files}  # every file it refers to
    engine_flags = {}
    for p in plan.setups:
        if not p.runs:
            continue
        try:
            d = engines.deployment(p.setup, engine_params(p.lives[0].engine, model, served, work_root / p.setup))
        except setups.SetupError as e:
            engine_flags[p.setup] = {"error": str(e)}
        else:
            engine_flags[p.setup] = {"argv": list(d.engine.argv), "env": d.engine.env,
                                     "kv_transfer_config": d.kv_transfer_config,
                                     "companion": list(d.companion.argv) if d.companion else None}
            if hasattr(engines, "image"):  # engines run from an image: the digest each ran from
                engine_flags[p.setup]["image"] = engines.image()
    prov = {
        "schema": "kvlab.provenance/1", "run_id": run_id, "campaign": plan.campaign,
        "campaign_sha256": campaign_sha, "campaign_path": str(campaign_path),
        **results.provenance(),
        "model": model_prov, "seed": plan.seed, "trace_sha256": traces, "engine": engine_flags,
        "engine_control": engines.describe(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "note": "engine ports are chosen free per engine life; argv shows the first life's",
    }
    writer.write_once(results.PROVENANCE, json.dumps(prov, indent=2, sort_keys=True))
    results.point_latest(runs_dir, run_id)
    writer.append(drive_limit(work_root))
    writer.append(cachebw.cache_limit())  # the host's LLC and its read rates: the planner's CPU input
    drives = drives_record(plan.drives)
    if drives:
        writer.append(drives)
    progress = Progress(plan.steps)
    note(f"run {run_id}: {len(plan.steps)} steps, estimate ~{fmt_s(progress.total_est)}; results in {writer.dir}")
    try:
        for p in plan.setups:
            if not p.runs:
                writer.append({"kind": "skip", "setup": p.setup, "reason": p.reason})
                note(f"{p.setup}: skipped: {p.reason}")
                continue
            run_setup(plan, p, model, served, work_root / p.setup, writer, progress, engines)
            if not keep_stores:
                shutil.rmtree(work_root / p.setup, ignore_errors=True)
    finally:
        writer.append({"kind": "event", "event": "campaign_end", "t": time.time()})
        writer.close()
        if not keep_stores:
            shutil.rmtree(work_root, ignore_errors=True)
    return writer.dir


def drive_limit(work_root: Path, size_mib: int = 256) -> dict[str, Any]:
    """fio's O_DIRECT read and write limit on the stores' filesystem, once per run: the
    planner's physical input for a restore from the drive (measured, never fitted)."""
    from kvlab.bench import fio

    where = work_root / "fio"
    rec: dict[str, Any] = {"kind": "drive_limit", "directory": str(where)}
    try:
        for rw in ("read", "write"):
            gbps, jobs = fio.fio_limit(where, rw, size_mib=size_mib)
            rec[f"{rw}_gbps"] = gbps
            rec.setdefault("jobs", []).extend(j.to_dict() for j in jobs)
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[-500:]
    finally:
        fio.cleanup(where)
    return rec


def run_setup(plan: Plan, p: SetupPlan, model: Path, served: str, work: Path, writer: results.RunWriter,
              progress: Progress, engines: Engines) -> None:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for life in p.lives:
        if not run_life(plan, life, model, served, work, writer, progress, engines):
            progress.skip_setup(p.setup)
            return


def run_life(plan: Plan, life: Life, model: Path, served: str, work: Path, writer: results.RunWriter,
             progress: Progress, engines: Engines) -> bool:
    """A life's steps in order, on one engine configuration; False when the setup cannot go on."""
    setup = life.setup
    try:
        deployment = engines.deployment(setup, engine_params(life.engine, model, served, work))
    except setups.SetupError as e:
        writer.append({"kind": "skip", "setup": setup, "reason": str(e)})
        note(f"{setup}: skipped: {e}")
        return False
    server = engines.server(deployment, writer.dir / "logs")
    extra = (deployment.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
    cm_url = f"http://127.0.0.1:{extra['metrics_port']}/metrics" if "metrics_port" in extra else None
    sampler = MemorySampler(server.memory, plan.memory_interval_s, writer.append, setup)
    prefix_caching = life.engine.prefix_caching

    def restart() -> float:
        s = server.start(progress=True)
        writer.append({"kind": "event", "event": "engine_start", "setup": setup, "seconds": s,
                       "prefix_caching": prefix_caching, "pids": server.pids(), "t": time.time()})
        return s

    target = scenarios.Target(setup, server, served, cm_url, writer.append, note,
                              lambda ph: setattr(sampler, "phase", ph))
    # Bytes written to drives, sampled at each scenario's start and end and around restarts.
    wear = WearSampler(setup, setups.get(setup).drive_tier, plan.model.kv_bytes_per_token, server.pids,
                       target.counters, target.connector_metrics, writer.append)
    target.before_stop = wear.pause

    def restart_counted() -> float:
        s = restart()
        wear.resume()
        return s
    start, *steps, stop = life.steps
    assert start.kind == "engine-start" and stop.kind == "engine-stop", "a life starts and stops its engine"
    try:
        progress.advance(start)
        restore = life.spec("restore")
        if isinstance(restore, RestoreSpec) and restore.drop_page_cache:  # a cold first start too
            target.drop_page_cache("the first engine start")
        with sampler:
            restart()
            mode = target.io_mode()
            writer.append({"kind": "io_mode", "setup": setup, "io_mode": mode})
            # What the block-aligned hit shares round to (vLLM's CacheConfig, as served).
            writer.append({"kind": "engine_config", "setup": setup, "block_size": target.block_size()})
            unit: tuple[str | None, int | None] | None = None  # what wear counts apart: a scenario, each agents N
            for step in steps:
                progress.advance(step)
                if (key := (step.scenario, step.arg if step.kind == "agents" else None)) != unit:
                    if unit is not None:
                        wear.close()
                    wear.open(step.scenario or "", **({"concurrency": step.arg} if step.kind == "agents" else {}))
                    unit = key
                scenarios.run_step(target, step, plan.seed, restart_counted)
            if unit is not None:
                wear.close()
            if mode is None:  # a connector may serve its metrics only once it has done I/O
                mode = target.io_mode()
                if mode is not None:
                    writer.append({"kind": "io_mode", "setup": setup, "io_mode": mode})
            sampler.phase = "stop"
            progress.advance(stop)
    except (EngineError, OSError) as e:
        writer.append({"kind": "error", "setup": setup, "scenarios": list(life.scenarios),
                       "message": f"{type(e).__name__}: {e}"[-4000:]})
        note(f"{setup}: failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        return False
    finally:
        server.stop()
    return True
