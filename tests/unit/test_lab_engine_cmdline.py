"""The lab and the embedded default start identical engine command lines for the same setup.

Both come from kvlab's setup registry: on the lab the vllm_server role renders a systemd unit
from it, here kvlab's engine control starts the rendered ProcessSpec. These tests render the
role's units (scripts/plan, no host contacted) and compare them with what engine control
would start, argument for argument and variable for variable.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvlab.bench import demo as demo
from kvlab.engines.local import EngineServer
from kvlab.setups import registry as setups

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit

# EngineParams fields the vllm_server role sets from its own variables (role var -> field).
ROLE_FIELDS = {
    "vllm_server_model_path": "model",
    "vllm_server_served_model_name": "served_model_name",
    "vllm_server_host": "host",
    "vllm_server_port": "port",
    "vllm_server_tensor_parallel_size": "tensor_parallel_size",
    "vllm_server_enable_prefix_caching": "enable_prefix_caching",
    "vllm_server_device": "device",
    "vllm_server_kv_store_paths": "kv_store_paths",
    "vllm_server_example_storage_path": "example_storage_path",
}


def unit_file(root: Path, kind: str, setup: str) -> Path:
    """The unit the role renders for a setup: kind "vllm" (engine) or "cache" (companion);
    systemd allows no "+" in a unit name, the role writes "_"."""
    return root / "etc/systemd/system" / f"kvlab-{kind}-{re.sub(r'[^A-Za-z0-9:_.-]', '_', setup)}.service"


def run_plan(inventory: Path | str, out: Path, *extra: str) -> Path:
    """scripts/plan into `out`; fails with ansible's output when it fails."""
    proc = subprocess.run(
        [str(ROOT / "scripts" / "plan"), str(inventory), str(out), *extra],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"scripts/plan {inventory} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    )
    return out


def shared_plan(tmp_path_factory: pytest.TempPathFactory, inventory: str) -> Path:
    """scripts/plan rendered once per test run, whichever pytest-xdist worker asks first: the
    workers share their base temp's parent, and a lock there makes the others wait for the first
    rendering (~35 s of a core each) instead of making their own. Read it, never write."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out, done = shared / f"plan-{inventory}", shared / f"plan-{inventory}.done"
    with (shared / f"plan-{inventory}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a rendering that failed half-way
            run_plan(inventory, out)
            done.touch()
    return out


def systemd_split(value: str) -> list[str]:
    """Split an ExecStart= value as systemd does for what the role writes (bare words and
    double-quoted C-escaped words), then undo %- and $-doubling."""
    words: list[str] = []
    i, n = 0, len(value)
    escapes = {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}
    while i < n:
        if value[i] == " ":
            i += 1
            continue
        word = []
        if value[i] == '"':
            i += 1
            while value[i] != '"':
                if value[i] == "\\":
                    word.append(escapes[value[i + 1]])
                    i += 2
                else:
                    word.append(value[i])
                    i += 1
            i += 1
        else:
            while i < n and value[i] != " ":
                word.append(value[i])
                i += 1
        words.append("".join(word).replace("%%", "%").replace("$$", "$"))
    return words


def read_unit(path: Path) -> dict[str, list[str]]:
    """A unit file as {Key: [values...]} over all sections (comments dropped)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if not line or line.startswith(("#", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value)
    return out


def unit_process(path: Path) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) a unit starts, as systemd reads them."""
    unit = read_unit(path)
    (exec_start,) = unit["ExecStart"]
    env = dict(systemd_split(e)[0].split("=", 1) for e in unit.get("Environment", []))
    return systemd_split(exec_start), env


def role_vars_for(params: setups.EngineParams) -> dict:
    """The vllm_server variables that make the role render `params` (the role's inverse)."""
    fields = dataclasses.asdict(params)
    role = {var: fields.pop(field) for var, field in ROLE_FIELDS.items()}
    role["vllm_server_kv_store_paths"] = list(role["vllm_server_kv_store_paths"])
    python = Path(fields.pop("python"))
    assert python.name == "python" and python.parent.name == "bin", python
    role["vllm_server_venv"] = str(python.parent.parent)
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(setups.EngineParams)
        if f.default is not dataclasses.MISSING
    }
    role["vllm_server_engine_params"] = {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in fields.items()
        if k != "model" and v != defaults.get(k)
    }
    return role


def embedded_params(tmp: Path) -> setups.EngineParams:
    """What `make demo` starts (kvlab.bench.demo.engine_params). The role names the environment's
    interpreter <venv>/bin/python; the demo names the one running it (sys.executable), the
    same interpreter under another spelling when started as python3: use the role's."""
    params = demo.engine_params(tmp / "models" / "tiny", tokens=30000, work=tmp / "work", port=8123)
    # LMCache's disk tiers need a folder for their own files; the demo's setups do not.
    return params.with_(
        python=str(Path(sys.prefix) / "bin" / "python"), cache_server_l2_path=str(tmp / "lmcache")
    )


def single_host_inventory(tmp: Path, params: setups.EngineParams, setups_: list[str]) -> Path:
    """A one-node inventory (no NVIDIA device: the GPU roles stop, vllm_server renders)."""
    inv = tmp / "inventory"
    inv.mkdir()
    host = {
        "kvlab_plan_facts": {
            "distribution": "Debian",
            "distribution_major_version": "13",
            "distribution_version": "13",
        },
        "nvidia_driver_plan_lspci": '00:02.0 "0300" "1234" "1111" -r02 "1af4" "1100"\n',
        "vllm_server_setups": setups_,
        "vllm_server_setup": setups_[0],
        **role_vars_for(params),
    }
    (inv / "hosts.yml").write_text(
        yaml.safe_dump({"all": {"children": {"gpu_nodes": {"hosts": {"embedded": host}}}}})
    )
    return inv


@pytest.fixture(scope="module")
def embedded_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, setups.EngineParams]:
    tmp = tmp_path_factory.mktemp("embedded")
    params = embedded_params(tmp)
    run_plan(single_host_inventory(tmp, params, list(COMPARED)), tmp / "plan")
    return tmp / "plan" / "embedded", params


# What `make demo` runs, the baseline, and the first CPU setup with a cache server (the
# companion's unit too); every setup of the lab's inventory is compared in test_roles_plan.
_WITH_COMPANION = [
    n
    for n, s in sorted(setups.REGISTRY.items())
    if "cpu" in s.devices
    and s.companion(setups.EngineParams(model="m", kv_store_paths=("d",), cache_server_l2_path="l2"))
    is not None
]
COMPARED = ("baseline", *demo.SETUPS, *_WITH_COMPANION[:1])


@pytest.mark.parametrize("name", COMPARED)
def test_unit_starts_what_engine_control_starts(embedded_plan, name: str, tmp_path: Path) -> None:
    """`make demo` (engine control) and the lab's unit: the same argv and environment."""
    root, params = embedded_plan
    argv, env = unit_process(unit_file(root, "vllm", name))
    server = EngineServer(setups.render(name, params), tmp_path)
    assert argv == list(server.engine.spec.argv)
    assert env == server.engine.spec.env
    if server.companion:
        c_argv, c_env = unit_process(unit_file(root, "cache", name))
        assert (c_argv, c_env) == (list(server.companion.spec.argv), server.companion.spec.env)


@pytest.mark.parametrize("name", COMPARED)
def test_rendered_deployment_is_the_registrys(embedded_plan, name: str) -> None:
    root, params = embedded_plan
    rendered = json.loads((root / f"etc/kvlab/setups/{name}.json").read_text())
    assert rendered == json.loads(setups.render(name, params).to_json())


def test_a_cpu_nodes_forward_pass_is_bound_to_the_nodes_cores_not_the_controllers(tmp_path: Path) -> None:
    """The unit binds the cores the node has (every one but the first, as a local engine does),
    counted from the node's facts: EngineParams' own default counts the controller's."""
    one = yaml.safe_load((single_host_inventory(tmp_path, embedded_params(tmp_path), ["kvlab"]) / "hosts.yml").read_text())
    node = one["all"]["children"]["gpu_nodes"]["hosts"]["embedded"]
    node["vllm_server_engine_params"].pop("cpu_cores")
    hosts = {}
    for name, nproc, given in (("eight", 8, None), ("two", 2, None), ("one", 1, None), ("given", 8, "2-3")):
        host = json.loads(json.dumps(node))
        host["kvlab_plan_facts"]["processor_nproc"] = nproc
        if given:
            host["vllm_server_engine_params"]["cpu_cores"] = given
        hosts[name] = host
    inv = tmp_path / "cores"
    inv.mkdir()
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"gpu_nodes": {"hosts": hosts}}}}))
    run_plan(inv, tmp_path / "plan")
    binds = {name: unit_process(unit_file(tmp_path / "plan" / name, "vllm", "kvlab"))[1].get("VLLM_CPU_OMP_THREADS_BIND")
             for name in hosts}
    assert binds == {"eight": "1-7", "two": "1", "one": None, "given": "2-3"}
