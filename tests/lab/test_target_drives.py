"""Storage targets: the drives behind every exported namespace healthy and not worn out
(`nvme smart-log`: critical warning, media errors, spare, percentage used — a KV cache writes a
lot), and each on the NUMA node of the fabric NICs that export it. Run on nvmeof_targets
(`scripts/verify`: --hosts=ansible://nvmeof_targets). The judgements are kvlab.verify_checks'
(unit-tested with media errors, spare under threshold, 91 % worn, a drive across the socket link)."""

from __future__ import annotations

import json
import re

import pytest
from labhelpers import host_name

from kvlab import verify_checks as vc

pytestmark = pytest.mark.lab

TARGET_EXPR = (
    "{{ {'subsystems': nvmeof_target_subsystems | default([]), 'netdevs': rdma_netdevs | default([]),"
    " 'wear_max': kvlab_drive_wear_max_percent | default(80)} | to_json }}"
)


@pytest.fixture
def target(host) -> dict:  # type: ignore[no-untyped-def]
    if host.backend.NAME != "ansible":
        pytest.skip(f"{host_name(host)} is not an inventory host: run with --hosts=ansible://nvmeof_targets")
    msg = host.ansible("debug", f"msg={TARGET_EXPR}", check=False)["msg"]
    values = msg if isinstance(msg, dict) else json.loads(msg)
    if not values["subsystems"]:
        pytest.skip(f"{host_name(host)} exports no subsystem (not an NVMe-oF target)")
    return values


def nvme_drives(host, target) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """{namespace device as configured: the NVMe controller holding it (/dev/nvmeX)}; a device that
    is no NVMe drive (a virtio disk, a file) is left out."""
    out = {}
    for sub in target["subsystems"]:
        for ns in sub["namespaces"]:
            real = host.check_output(f"readlink -f {ns['device']}")
            m = re.fullmatch(r"/dev/(nvme\d+)(c\d+)?n\d+(p\d+)?", real)
            if m:
                out[ns["device"]] = f"/dev/{m.group(1)}"
    return out


def test_drive_health_smart_log_and_wear(host, target):
    drives = nvme_drives(host, target)
    if not drives:
        pytest.skip(f"{host_name(host)}: no NVMe drive behind its namespaces (no SMART log to read)")
    problems = []
    with host.sudo():
        for dev in sorted(set(drives.values())):
            smart = vc.parse_smart(host.check_output(f"nvme smart-log {dev} -o json"))
            problems += vc.smart_problems(dev, smart, int(target["wear_max"]))
    assert not problems, "\n".join(problems)


def test_drive_numa_node_is_its_fabric_nics(host, target):
    drives = nvme_drives(host, target)
    if not drives:
        pytest.skip(f"{host_name(host)}: no NVMe drive behind its namespaces (no PCIe placement to check)")
    numa = {}
    for dev in set(drives.values()):
        name = dev.removeprefix("/dev/")
        numa[name] = host.check_output(f"cat /sys/class/nvme/{name}/device/numa_node 2>/dev/null || echo -1")
    nics = {
        nd["name"]: host.check_output(
            f"cat /sys/class/net/{nd['name']}/device/numa_node 2>/dev/null || echo -1"
        )
        for nd in target["netdevs"]
    }
    problems = vc.numa_problems(numa, nics)
    assert not problems, "\n".join(problems)
