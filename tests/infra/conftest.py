"""testinfra suites: run against the hosts of an Ansible inventory (`make verify inventory=NAME`).

They take every site value from the inventory, rendered by Ansible itself, so the same suites
verify the VM testbed and the lab. Each module names the inventory groups it checks
(`testinfra_hosts`); pytest must be given `--ansible-inventory` (and no `--hosts`, which would
override those groups). Without an inventory they have nothing to check and are not collected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Everything the suites read from the inventory, rendered per host by Ansible's debug module.
FACT_EXPR = (
    "{{ {'groups': group_names,"
    " 'target_subsystems': nvmeof_target_subsystems | default([]),"
    " 'target_ports': nvmeof_target_ports | default([]),"
    " 'initiator_transport': nvmeof_initiator_transport | default(''),"
    " 'initiator_targets': nvmeof_initiator_targets | default([]),"
    " 'initiator_filesystems': nvmeof_initiator_filesystems | default([]),"
    " 'initiator_hostnqn': nvmeof_initiator_hostnqn | default(''),"
    " 'ctrl_loss_tmo': nvmeof_initiator_ctrl_loss_tmo | default(60),"
    " 'fast_io_fail_tmo': nvmeof_initiator_fast_io_fail_tmo | default(5),"
    " 'reconnect_delay': nvmeof_initiator_reconnect_delay | default(2),"
    " 'multipath': nvmeof_initiator_multipath | default(true),"
    " 'iopolicy': nvmeof_initiator_iopolicy | default('auto'),"
    " 'roce_subnets': rdma_roce_subnets | default([]),"
    " 'peer_netdevs': (groups[('nvmeof_initiators' if 'nvmeof_targets' in group_names else 'nvmeof_targets')]"
    "   | default([]) | map('extract', hostvars, 'rdma_netdevs') | select('defined') | flatten | list),"
    " 'rxe_links': rdma_rxe_links | default([]),"
    " 'netdevs': rdma_netdevs | default([]),"
    " 'lossless': rdma_roce_lossless | default({'enabled': false}),"
    " 'lossless_apply': rdma_roce_lossless_apply | default(true),"
    " 'store_paths': kvlab_connector_store_paths | default([]),"
    " 'store_namespaces': kvlab_connector_store_namespaces | default({})} | to_json }}"
)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not config.getoption("ansible_inventory", default=None) and collection_path.suffix == ".py":
        return True
    return None


_cache: dict[str, dict] = {}


@pytest.fixture
def inv(host) -> dict:
    """This host's rendered inventory values (one Ansible call per host per session)."""
    name = host.backend.get_hostname()
    if name not in _cache:
        res = host.ansible("debug", f"msg={FACT_EXPR}", check=False)
        msg = res["msg"]
        _cache[name] = msg if isinstance(msg, dict) else json.loads(msg)
    return _cache[name]


@pytest.fixture
def record_dir() -> Path:
    """Where suites record what they read (RoCE counters): KVLAB_INFRA_RECORD or results/infra."""
    d = Path(os.environ.get("KVLAB_INFRA_RECORD", "results/infra"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def in_group(inv: dict, group: str) -> bool:
    return group in inv["groups"]
