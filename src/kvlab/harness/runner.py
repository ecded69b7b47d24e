"""Run a campaign: per setup, its engine lives and scenarios; append-only records; progress."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from kvlab.bench import cachebw
from kvlab.engines.local import EngineError, EngineServer
from kvlab.harness import results, scenarios
from kvlab.harness.campaign import Campaign, CampaignError
from kvlab.harness.memory import MemorySampler
from kvlab.harness.plan import SetupPlan, Step, fmt_s, kv_bytes_per_token, lives_of, plan
from kvlab.harness.sessions import sha256_file, workload
from kvlab.net import free_port
from kvlab.paths import state_dir
from kvlab.setups import registry as setups


def note(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Progress:
    """What runs now and how much is left: the plan's estimates, rescaled by the pace so far."""

    def __init__(self, steps: list[Step]):
        self.steps = list(steps)
        self.i = 0
        self.t0 = time.monotonic()
        self.done_est = 0.0
        self.total_est = sum(s.est_s for s in steps)

    def advance(self, setup: str, what: str) -> None:
        """The previous step is done; `what` (the plan's next step) runs now."""
        if 0 < self.i <= len(self.steps):
            self.done_est += self.steps[self.i - 1].est_s
        self.i += 1
        elapsed = time.monotonic() - self.t0
        left_est = max(0.0, self.total_est - self.done_est)
        pace = elapsed / self.done_est if self.done_est > 30 else 1.0
        note(f"[{min(self.i, len(self.steps))}/{len(self.steps)} · {fmt_s(elapsed)} elapsed · "
             f"~{fmt_s(left_est * pace)} left] {setup}: {what}")

    def skip_setup(self, setup: str) -> None:
        """A setup that failed: its remaining planned steps will not run."""
        keep = self.steps[:self.i] + [s for s in self.steps[self.i:] if s.setup != setup]
        self.total_est -= sum(s.est_s for s in self.steps[self.i:] if s.setup == setup)
        self.steps = keep


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


def engine_params(c: Campaign, model: Path, served: str, work: Path, prefix_caching: bool,
                  max_prompt: int) -> setups.EngineParams:
    kvb = kv_bytes_per_token(c)
    values: dict[str, Any] = {
        "max_model_len": int(math.ceil((max_prompt + 1024) / 1024) * 1024),
        "cpu_kv_cache_gib": max(2, math.ceil(max_prompt * kvb * 4 / (1 << 30))),
    }
    # A setup whose connector needs the whole prompt in one step (ExampleConnector) gets a
    # batch that holds it, and so does every other setup: the flags stay identical.
    if any(setups.get(s).needs_full_prompt_batch for s in c.setups):
        values["max_num_batched_tokens"] = max(values["max_model_len"], 8192)
    values.update(c.engine)
    values["kv_store_paths"] = tuple(values.get("kv_store_paths", ())) or (str(work / "kvlab-store"),)
    return setups.EngineParams(
        model=str(model), python=sys.executable, served_model_name=served, device=c.device,
        port=free_port(), kv_metrics_port=free_port(), cache_server_port=free_port(),
        example_storage_path=str(work / "example-store"), cache_server_l2_path=str(work / "l2"),
        enable_prefix_caching=prefix_caching, **{k: v for k, v in values.items() if k != "kv_store_paths"},
        kv_store_paths=values["kv_store_paths"],
    )


def resolve_model(c: Campaign) -> tuple[Path, str, dict[str, Any]]:
    if c.model.tiny is not None:
        from kvlab.model import ensure_tiny, tree_sha256

        geometry = c.model.tiny.tiny_geometry()
        path = ensure_tiny(seed=c.model.tiny.seed, geometry=geometry)
        # the geometry is the planner's physical input (kv bytes per token, FLOPs per token)
        return path, "tiny", {"kind": "tiny", "seed": c.model.tiny.seed, "path": str(path),
                              "sha256": tree_sha256(path), "geometry": dataclasses.asdict(geometry),
                              "kv_bytes_per_token": geometry.kv_bytes_per_token}
    assert c.model.path is not None
    path = Path(c.model.path)
    if not path.exists():
        raise CampaignError(f"model.path {path}: no such folder on this host")
    return path, c.model.served_name, {"kind": "path", "path": str(path)}


def check_device(c: Campaign) -> None:
    if c.device == "cuda":
        gpus = results.gpus()
        if not gpus:
            raise CampaignError(f"campaign {c.name!r} runs on device 'cuda' and this host has no GPU: "
                                "run it in the lab (inventory) or use `kvlab campaign plan` / `run --dry-run`")


def run_campaign(c: Campaign, campaign_path: Path, campaign_sha: str, runs_dir: Path,
                 keep_stores: bool = False, engines: Engines | None = None) -> Path:
    engines = engines or LocalEngines()
    check_device(c)
    base = campaign_path.parent
    plans = plan(c, base)
    model, served, model_prov = resolve_model(c)
    run_id = results.new_run_id(c.name)
    writer = results.RunWriter(runs_dir, run_id)
    writer.write_once(results.CAMPAIGN, campaign_path.read_bytes())
    max_prompt = c.max_prompt_tokens(base)
    work_root = state_dir() / "campaigns" / run_id
    traces = {str(f.path): sha256_file(f.path) for f in c.files(base)}  # every file it refers to
    engine_flags = {}
    for p in plans:
        if not p.runs:
            continue
        try:
            first_life = next((flag for flag, _ in lives_of(c, p.setup)), True)  # its prefix caching
            d = engines.deployment(p.setup, engine_params(c, model, served, work_root / p.setup, first_life,
                                                          max_prompt))
        except setups.SetupError as e:
            engine_flags[p.setup] = {"error": str(e)}
        else:
            engine_flags[p.setup] = {"argv": list(d.engine.argv), "env": d.engine.env,
                                     "kv_transfer_config": d.kv_transfer_config,
                                     "companion": list(d.companion.argv) if d.companion else None}
            if hasattr(engines, "image"):  # engines run from an image: the digest each ran from
                engine_flags[p.setup]["image"] = engines.image()
    prov = {
        "schema": "kvlab.provenance/1", "run_id": run_id, "campaign": c.name,
        "campaign_sha256": campaign_sha, "campaign_path": str(campaign_path),
        **results.provenance(),
        "model": model_prov, "seed": c.seed, "trace_sha256": traces, "engine": engine_flags,
        "engine_control": engines.describe(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "note": "engine ports are chosen free per engine life; argv shows the first life's",
    }
    writer.write_once(results.PROVENANCE, json.dumps(prov, indent=2, sort_keys=True))
    results.point_latest(runs_dir, run_id)
    writer.append(drive_limit(work_root))
    writer.append(cachebw.cache_limit())  # the host's LLC and its read rates: the planner's CPU input
    steps = [s for p in plans if p.runs for s in p.steps]
    progress = Progress(steps)
    note(f"run {run_id}: {len(steps)} steps, estimate ~{fmt_s(progress.total_est)}; results in {writer.dir}")
    try:
        for p in plans:
            if not p.runs:
                writer.append({"kind": "skip", "setup": p.setup, "reason": p.reason})
                note(f"{p.setup}: skipped: {p.reason}")
                continue
            run_setup(c, p, model, served, work_root / p.setup, max_prompt, writer, progress, base, engines)
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


def run_setup(c: Campaign, p: SetupPlan, model: Path, served: str, work: Path, max_prompt: int,
              writer: results.RunWriter, progress: Progress, base: Path, engines: Engines) -> None:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sc = c.scenarios
    for prefix_caching, names in lives_of(c, p.setup):
        params = engine_params(c, model, served, work, prefix_caching, max_prompt)
        try:
            deployment = engines.deployment(p.setup, params)
        except setups.SetupError as e:
            writer.append({"kind": "skip", "setup": p.setup, "reason": str(e)})
            note(f"{p.setup}: skipped: {e}")
            progress.skip_setup(p.setup)
            return
        server = engines.server(deployment, writer.dir / "logs")
        extra = (deployment.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
        cm_url = f"http://127.0.0.1:{extra['metrics_port']}/metrics" if "metrics_port" in extra else None
        sampler = MemorySampler(server.memory, c.memory.interval_s, writer.append, p.setup)

        def restart(server: EngineServer = server, prefix_caching: bool = prefix_caching) -> float:
            s = server.start(progress=True)
            writer.append({"kind": "event", "event": "engine_start", "setup": p.setup, "seconds": s,
                           "prefix_caching": prefix_caching, "pids": server.pids(), "t": time.time()})
            return s

        target = scenarios.Target(p.setup, server, served, cm_url, writer.append, note,
                                  lambda ph, s=sampler: setattr(s, "phase", ph))
        try:
            progress.advance(p.setup, f"engine start (prefix caching {'on' if prefix_caching else 'off'})")
            if sc.restore and "restore" in names and sc.restore.drop_page_cache:  # a cold first start too
                target.drop_page_cache("the first engine start")
            with sampler:
                restart()
                mode = target.io_mode()
                writer.append({"kind": "io_mode", "setup": p.setup, "io_mode": mode})
                # What the block-aligned hit shares round to (vLLM's CacheConfig, as served).
                writer.append({"kind": "engine_config", "setup": p.setup, "block_size": target.block_size()})
                for name in names:
                    if name == "restore":
                        assert sc.restore
                        scenarios.restore(target, sc.restore, c.seed, restart,
                                          lambda w: progress.advance(p.setup, w))
                    elif name == "sweep":
                        assert sc.sweep
                        scenarios.sweep(target, sc.sweep, c.seed, lambda w: progress.advance(p.setup, w))
                    elif name == "agents":
                        assert sc.agents
                        for n in sc.agents.concurrency:
                            progress.advance(p.setup, f"agents: N={n}")
                            wl = workload(sc.agents.source, n, c.seed, f"agents-{n}", base)
                            scenarios.agents(target, sc.agents, n, wl)
                if mode is None:  # a connector may serve its metrics only once it has done I/O
                    mode = target.io_mode()
                    if mode is not None:
                        writer.append({"kind": "io_mode", "setup": p.setup, "io_mode": mode})
                sampler.phase = "stop"
                progress.advance(p.setup, "engine stop")
        except (EngineError, OSError) as e:
            writer.append({"kind": "error", "setup": p.setup, "scenarios": names,
                           "message": f"{type(e).__name__}: {e}"[-4000:]})
            note(f"{p.setup}: failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            progress.skip_setup(p.setup)
            return
        finally:
            server.stop()

