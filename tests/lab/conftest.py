"""The lab suite: real GPUs, GDS, RoCE. testinfra, with hosts from the Ansible inventory:

    pytest tests/lab --hosts=ansible://gpu_nodes --ansible-inventory=inventories/lab/hosts.yml

Anywhere else (no --hosts: this machine) every test skips with a reason that names what is
absent: no NVIDIA driver here, no inventory host, no NVSwitch on this board, and so on.
"""

from __future__ import annotations

import json

import pytest
from labhelpers import host_name

# Every value the suite checks against, rendered per host by Ansible from the inventory.
LAB_EXPR = (
    "{{ {'groups': group_names,"
    " 'driver_version': nvidia_driver_version | default(''),"
    " 'gpu_count': nvidia_driver_gpu_count | default(0),"
    " 'cuda_version': cuda_version | default(''),"
    " 'gds_required_backends': gds_required_backends | default(['NVMe']),"
    " 'gds_allow_compat_mode': gds_allow_compat_mode | default(false),"
    " 'gds_cuda_version': cuda_version | default(''),"
    " 'peermem': nvidia_peermem_enabled | default(true),"
    " 'persistenced': nvidia_driver_persistenced | default(true),"
    " 'store_mounts': kvlab_nvmeof_mounts | default([]),"
    " 'storage_netdevs': rdma_netdevs | default([]),"
    " 'pcie_gen': kvlab_gpu_pcie_gen | default(''),"
    " 'setup': vllm_server_setup | default(''),"
    " 'port': vllm_server_port | default(8000),"
    " 'venv': vllm_server_venv | default('/opt/kvlab/venv'),"
    " 'config_dir': vllm_server_config_dir | default('/etc/kvlab'),"
    " 'served_model_name': vllm_server_served_model_name | default('kvlab-model'),"
    " 'store_config': kvlab_connector_config_path | default('/etc/kvlab/store.json'),"
    " 'fstypes': kvlab_connector_fstypes | default(['xfs', 'ext4'])} | to_json }}"
)


@pytest.fixture
def gpu(host):  # type: ignore[no-untyped-def]
    """The host, if it has an NVIDIA driver; a skip naming what is absent otherwise."""
    if not host.exists("nvidia-smi"):
        pytest.skip(
            f"no NVIDIA driver on {host_name(host)}: nvidia-smi absent (the lab suite needs a GPU node)"
        )
    return host


_cache: dict[str, dict] = {}


@pytest.fixture
def lab(gpu) -> dict:  # type: ignore[no-untyped-def]
    """This GPU node's inventory values; a skip where the host is not an inventory host."""
    if gpu.backend.NAME != "ansible":
        pytest.skip(
            f"{host_name(gpu)} is not an inventory host: run with --hosts=ansible://gpu_nodes "
            "--ansible-inventory=inventories/<name>/hosts.yml"
        )
    name = host_name(gpu)
    if name not in _cache:
        msg = gpu.ansible("debug", f"msg={LAB_EXPR}", check=False)["msg"]
        _cache[name] = msg if isinstance(msg, dict) else json.loads(msg)
    return _cache[name]


@pytest.fixture
def deployment(gpu, lab) -> dict:  # type: ignore[no-untyped-def]
    """The deployment of the node's chosen setup, as vllm_server rendered it from the registry."""
    path = f"{lab['config_dir']}/setups/{lab['setup']}.json"
    with gpu.sudo():
        if not gpu.file(path).exists:
            pytest.skip(f"no {path} on {host_name(gpu)}: serving.yml has not deployed setup {lab['setup']!r}")
        return json.loads(gpu.file(path).content_string)


@pytest.fixture
def store_paths(gpu, lab) -> list[str]:  # type: ignore[no-untyped-def]
    with gpu.sudo():
        f = gpu.file(lab["store_config"])
        if not f.exists:
            pytest.skip(f"no {lab['store_config']} on {host_name(gpu)}: the kvlab_connector role has not run")
        paths = json.loads(f.content_string)["paths"]
    if not paths:
        pytest.skip(f"{host_name(gpu)} configures no store drive (kvlab_connector_store_paths is empty)")
    return paths
