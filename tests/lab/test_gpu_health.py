"""GPU nodes, what an HGX lab checks first: each GPU beside its storage NIC (PCIe switch and NUMA
node, `nvidia-smi topo -m`), ECC on, no pending or failed row remap, no hardware Xid in this
boot's kernel log, every PCIe link at its generation and width. The judgements are
kvlab.verify_checks' (unit-tested with a NIC across the CPU, ECC off, a pending remap, Xid 79, a
Gen4 x8 link)."""

from __future__ import annotations

import pytest
from labhelpers import host_name

from kvlab import verify_checks as vc

pytestmark = pytest.mark.lab


def health_rows(gpu) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    out = gpu.check_output(
        f"nvidia-smi --query-gpu={','.join(vc.GPU_HEALTH_FIELDS)} --format=csv,noheader,nounits"
    )
    rows = vc.parse_csv_rows(out, vc.GPU_HEALTH_FIELDS)
    assert rows, f"{host_name(gpu)}: nvidia-smi reported no GPU:\n{out}"
    return rows


def rdma_devices(gpu) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The RDMA devices of the node's storage netdevs, with each one's NUMA node."""
    out = gpu.check_output(
        "for d in /sys/class/infiniband/*; do n=${d##*/}; for nd in $d/device/net/*; do "
        'echo "$n ${nd##*/} $(cat $d/device/numa_node 2>/dev/null || echo -1)"; done; done; true'
    )
    return {
        line.split()[1]: (line.split()[0], line.split()[2])
        for line in out.splitlines()
        if len(line.split()) == 3
    }


def test_topo_numa_each_gpu_beside_its_storage_nic(gpu, lab):
    """GPUDirect Storage and RDMA stay off the CPU only where each GPU's nearest NIC is one of the
    inventory's storage NICs, on the GPU's PCIe switch (PIX/PXB) and NUMA node."""
    netdevs = [nd["name"] for nd in lab["storage_netdevs"]]
    by_netdev = rdma_devices(gpu)
    missing = [nd for nd in netdevs if nd not in by_netdev]
    if not netdevs or missing:
        pytest.skip(
            f"{host_name(gpu)}: no RDMA NIC behind the inventory's storage netdevs {missing or netdevs}"
        )
    devices = {by_netdev[nd][0]: by_netdev[nd][1] for nd in netdevs}
    topo = vc.parse_topo(gpu.check_output("nvidia-smi topo -m"))
    problems = vc.topo_problems(topo, list(devices), devices)
    assert not problems, "\n".join(problems)


def test_gpu_health_ecc_enabled_and_no_uncorrected_errors(gpu, lab):
    problems = vc.ecc_problems(health_rows(gpu))
    assert not problems, "\n".join(problems)


def test_gpu_health_no_pending_or_failed_remap(gpu, lab):
    problems = vc.remap_problems(health_rows(gpu))
    assert not problems, "\n".join(problems)


def test_gpu_health_no_xid_in_the_journal(gpu, lab):
    with gpu.sudo():
        journal = gpu.check_output("journalctl -k -b --no-pager -o cat | grep 'NVRM: Xid' || true")
    problems = vc.xid_problems(journal)
    assert not problems, "\n".join(problems)


def test_gpu_health_pcie_link_generation_and_width(gpu, lab):
    expected = int(lab["pcie_gen"]) if lab.get("pcie_gen") else None
    problems = vc.pcie_link_problems(health_rows(gpu), expected)
    assert not problems, "\n".join(problems)
