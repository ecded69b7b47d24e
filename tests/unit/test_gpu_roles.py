"""The GPU roles' decisions, run for real by ansible-playbook on this machine (connection
local, nothing installed): each task file or variable table is run with what a node would
report, given where the role reads it from (extra vars outrank a task's registered result)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def play(tmp: Path, tasks: list[dict], extra: dict | None = None, vars_files: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    pb = tmp / "play.yml"
    pb.write_text(yaml.safe_dump([{
        "name": "Test", "hosts": "localhost", "gather_facts": False, "connection": "local",
        "vars_files": [str(ROOT / f) for f in vars_files], "tasks": tasks,
    }]))
    env = os.environ | {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
                        "ANSIBLE_ROLES_PATH": str(ROOT / "roles")}
    return subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", str(pb),
         "-e", json.dumps({"ansible_python_interpreter": sys.executable, **(extra or {})})],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )


def msg_of(proc: subprocess.CompletedProcess) -> str:
    """Ansible's output with its line wrapping undone."""
    return " ".join((proc.stdout + proc.stderr).split())


# ---- fabric manager: its package follows the driver's branch and exact version -------------
FM_CASES = [
    ("580", "580.95.05", "nvidia-fabricmanager"),  # from 580 on: one package (-580 is only virtual)
    ("590", "590.44.01", "nvidia-fabricmanager"),
    ("570", "570.195.03", "nvidia-fabricmanager-570"),
]


def test_fabric_manager_package_is_the_drivers(tmp_path: Path) -> None:
    proc = play(tmp_path, [{
        "name": "Show", "loop": [list(c[:2]) for c in FM_CASES],
        "vars": {"nvidia_driver_branch": "{{ item[0] }}", "nvidia_driver_version": "{{ item[1] }}"},
        "ansible.builtin.debug": {"msg": "PKG {{ item[0] }} {{ __fabric_manager_packages | first }}={{ fabric_manager_package_version }}"},
    }], vars_files=("roles/fabric_manager/defaults/main.yml", "roles/fabric_manager/vars/main.yml"))
    assert proc.returncode == 0, msg_of(proc)
    for branch, version, package in FM_CASES:
        assert f"PKG {branch} {package}={version}-1" in proc.stdout


# ---- nvidia_driver: a reboot only when allowed; otherwise a stop that says what to do ------
def reboot_check(tmp: Path, loaded: str) -> subprocess.CompletedProcess:
    # nvidia_driver_allow_reboot stays false: a test that reboots this machine is not one.
    return play(tmp, [{"name": "Reboot step", "ansible.builtin.include_tasks": str(ROOT / "roles/nvidia_driver/tasks/reboot.yml")}],
                {"__nvidia_driver_loaded": {"stdout": loaded}, "nvidia_driver_version": "580.95.05",
                 "__nvidia_driver_reboot_timeout_s": 1800},
                ("roles/nvidia_driver/defaults/main.yml",))


@pytest.mark.parametrize(("loaded", "why"), [
    ("1 none", "nouveau holds the GPUs"),
    ("0 550.163.01", "driver 550.163.01 loaded, not 580.95.05"),
])
def test_a_driver_that_needs_a_reboot_stops_saying_so(tmp_path: Path, loaded: str, why: str) -> None:
    proc = reboot_check(tmp_path, loaded)
    assert proc.returncode != 0
    assert why in msg_of(proc) and "nvidia_driver_allow_reboot: true" in msg_of(proc)


def test_no_reboot_where_the_pinned_driver_loads(tmp_path: Path) -> None:
    proc = reboot_check(tmp_path, "0 580.95.05")
    assert proc.returncode == 0, msg_of(proc)
    assert "skipping: [localhost]" in proc.stdout  # neither the reboot nor the stop ran


# ---- gds measure: gdsio writes only into a mount of the store's namespace ------------------
def measure(tmp: Path, script_exists: bool, gpus_expected: bool) -> tuple[subprocess.CompletedProcess, Path]:
    marker = tmp / "gdsio-ran"
    script = tmp / "gdsio-limit"
    if script_exists:
        script.write_text(f"#!/bin/sh\ntouch {marker}\n")
        script.chmod(0o755)
    folder = tmp / "store"
    folder.mkdir()
    proc = play(tmp, [{"name": "Measure", "ansible.builtin.include_role": {"name": "gds", "tasks_from": "measure"}}],
                {"__gds_gdsio_script": str(script), "__gds_gdsio_dir": str(tmp / "out"),
                 "gds_gdsio_mounts": [{"path": str(folder), "namespace_uuid": "5d0e4b1c-1a2b-4c3d-8e4f-0b200011a001"}],
                 "kvlab_gpus_expected": gpus_expected})
    return proc, marker


def test_gdsio_refuses_a_folder_that_is_not_the_namespaces_mount(tmp_path: Path) -> None:
    """The old task measured whatever held the folder (the root disk) and kept that figure."""
    proc, marker = measure(tmp_path, script_exists=True, gpus_expected=True)
    assert proc.returncode != 0
    assert "is not a mount of namespace 5d0e4b1c-1a2b-4c3d-8e4f-0b200011a001" in msg_of(proc)
    assert not marker.exists(), "gdsio ran on a folder of the root disk"


def test_no_gds_here_says_what_is_not_measured(tmp_path: Path) -> None:
    proc, marker = measure(tmp_path, script_exists=False, gpus_expected=False)
    assert proc.returncode == 0, msg_of(proc)
    assert "is not measured" in proc.stdout and not marker.exists()


def test_no_gds_where_gpus_are_expected_fails(tmp_path: Path) -> None:
    proc, _ = measure(tmp_path, script_exists=False, gpus_expected=True)
    assert proc.returncode != 0 and "run playbooks/gpu_nodes.yml" in msg_of(proc)


# ---- the GPUs the inventory expects, decided from what the node's PCI bus reports ----------
H200_LSPCI = yaml.safe_load((ROOT / "inventories/lab/group_vars/h200/main.yml").read_text())["nvidia_driver_plan_lspci"]
NO_NVIDIA = '00:02.0 "0300" "1234" "1111" -r02 "1af4" "1100"\n'


def plan(tmp: Path, **host: object) -> subprocess.CompletedProcess:
    """scripts/plan for one GPU node named `node` (no host contacted); the GPU roles only."""
    inv = tmp / "inventory"
    inv.mkdir()
    node = {"kvlab_plan_facts": {"distribution": "Ubuntu", "distribution_major_version": "24",
                                 "distribution_version": "24.04", "kernel": "6.8.0-85-generic"},
            "vllm_server_model_path": "/models/m", "vllm_server_setups": ["baseline"],
            "vllm_server_setup": "baseline", **host}
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"gpu_nodes": {"hosts": {"node": node}}}}}))
    return subprocess.run([str(ROOT / "scripts/plan"), str(inv), str(tmp / "plan")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_expected_gpus_missing_fails_the_play(tmp_path: Path) -> None:
    proc = plan(tmp_path, kvlab_gpus_expected=True, nvidia_driver_plan_lspci=NO_NVIDIA)
    assert proc.returncode != 0
    assert "reports 0 NVIDIA GPU(s)" in msg_of(proc) and "seat or power the GPUs" in msg_of(proc)


def test_gpus_where_none_are_expected_fail_too(tmp_path: Path) -> None:
    proc = plan(tmp_path, kvlab_gpus_expected=False, nvidia_driver_plan_lspci=H200_LSPCI)
    assert proc.returncode != 0 and "reports 8 NVIDIA GPU(s)" in msg_of(proc)


@pytest.fixture(scope="module")
def no_gpu_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """A GPU-less node the inventory expects so (the testbed's), its engine on the network."""
    tmp = tmp_path_factory.mktemp("no-gpu")
    proc = plan(tmp, kvlab_gpus_expected=False, nvidia_driver_plan_lspci=NO_NVIDIA,
                vllm_server_host="0.0.0.0", vllm_server_api_key="k")
    assert proc.returncode == 0, msg_of(proc)[-3000:]
    return proc, tmp / "plan" / "node"


def test_no_gpu_expected_says_what_is_not_done(no_gpu_plan: tuple[subprocess.CompletedProcess, Path]) -> None:
    out = msg_of(no_gpu_plan[0])  # the callback wraps long messages
    assert "install nothing here (no driver, fabric manager, CUDA, nvidia-fs, cufile.json or peer memory)" in out
    for role_says in ("fabric manager not installed", "CUDA not installed", "GDS not installed",
                      "nvidia-peermem not loaded", "render only"):
        assert role_says in out, role_says


@pytest.mark.parametrize(("extra", "missing"), [
    ({"gds_required_backends": ["NVMeOF"], "nvidia_peermem_enabled": False}, "GDS over NVMe-oF (or NFS over RDMA) needs NVIDIA's DOCA-OFED"),
    ({"gds_required_backends": ["NVMe"]}, "peer-memory API that only NVIDIA's DOCA-OFED"),
])
def test_gds_and_peermem_on_the_inbox_rdma_stack_stop_naming_doca(tmp_path: Path, extra: dict, missing: str) -> None:
    proc = plan(tmp_path, kvlab_gpus_expected=True, nvidia_driver_plan_lspci=H200_LSPCI, rdma_stack="inbox", **extra)
    assert proc.returncode != 0 and missing in msg_of(proc), msg_of(proc)[-3000:]


def test_an_engine_on_the_network_needs_the_api_key(tmp_path: Path) -> None:
    proc = plan(tmp_path, nvidia_driver_plan_lspci=NO_NVIDIA, vllm_server_host="0.0.0.0")
    assert proc.returncode != 0 and "vllm_server_api_key is empty" in msg_of(proc), msg_of(proc)[-3000:]


def test_an_engine_on_the_network_runs_without_dev_mode(no_gpu_plan: tuple[subprocess.CompletedProcess, Path]) -> None:
    unit = (no_gpu_plan[1] / "etc/systemd/system/kvlab-vllm-baseline.service").read_text()
    assert "--host 0.0.0.0" in unit and "VLLM_SERVER_DEV_MODE" not in unit
    assert "EnvironmentFile=/etc/kvlab/vllm-api.env" in unit


def test_float32_on_an_fp8_checkpoint_stops_the_render(tmp_path: Path) -> None:
    proc = plan(tmp_path, nvidia_driver_plan_lspci=NO_NVIDIA, vllm_server_model_path="/models/GLM-5.3-FP8",
                vllm_server_engine_params={"dtype": "float32"})
    assert proc.returncode != 0
    assert "dtype float32 with the FP8 checkpoint /models/GLM-5.3-FP8" in msg_of(proc), msg_of(proc)[-3000:]
