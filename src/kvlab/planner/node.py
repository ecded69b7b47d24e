"""A node as the planner sees it: GPUs, PCIe and NVLink, host copies, NICs and drives.

From a preset (`--node h200`), a small YAML of the same fields (`--node node.yml`), or a lab
inventory host's variables (`--inventory inventories/lab --host h200-01`), with flags on top.
Bandwidths are GB/s (1e9 B/s) per device: one GPU's PCIe link, one drive, all NICs together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Drive:
    model: str = "generic NVMe Gen5"
    read_gbps: float = 12.0
    write_gbps: float = 5.0
    capacity_tb: float = 7.68
    dwpd: float = 1.0  # rated drive writes per day


@dataclass(frozen=True)
class Node:
    name: str = "custom"
    gpus: int = 8
    gpu: str = "H200"
    gpu_mem_gb: float = 141.0
    gpu_tflops: float = 989.0  # dense bf16 per GPU (fp8: twice)
    pcie_gbps: float = 55.0  # one GPU's host link as copies reach it (Gen5 x16: 64 raw)
    nvlink_gbps: float = 450.0  # one direction per GPU
    host_copy_gbps: float = 100.0  # memcpy across the host's memory (staging ring, DRAM tier)
    dram_gb: float = 2048.0
    nic_gbps: float = 100.0  # storage NICs together (800 Gb/s = 100 GB/s)
    drives: int = 4
    drive: Drive = field(default_factory=Drive)
    remote_drives: bool = True  # NVMe-oF: the drives sit behind the NICs
    gds: bool = True

    def with_overrides(self, **kw: Any) -> Node:
        drive_kw = {
            k.removeprefix("drive_"): v for k, v in kw.items() if k.startswith("drive_") and v is not None
        }
        node_kw = {k: v for k, v in kw.items() if not k.startswith("drive_") and v is not None}
        return dataclasses.replace(self, drive=dataclasses.replace(self.drive, **drive_kw), **node_kw)


# Drives the lab inventories name, by model number: rated sequential read/write, GB/s.
DRIVE_MODELS = {
    "MZWLO7T6HBLA": Drive("Samsung PM1743 7.68 TB", 14.0, 6.0, 7.68, 1.0),
    "MZWLO15THBLA": Drive("Samsung PM1743 15.36 TB", 14.0, 6.0, 15.36, 1.0),
}
# GPUs by PCI device id (lspci -n): name, memory GB, dense bf16 TFLOP/s, PCIe GB/s
GPU_IDS = {
    "2335": ("H200", 141.0, 989.0, 55.0),
    "2330": ("H100", 80.0, 989.0, 55.0),
    "2329": ("H20", 96.0, 148.0, 55.0),
}

PRESETS: dict[str, Node] = {
    # the first seed's node: HGX H200, NVMe-oF over two 400 Gb/s ports, four PM1743 namespaces
    "h200": Node("h200", drive=DRIVE_MODELS["MZWLO7T6HBLA"]),
    "h20": Node("h20", gpu="H20", gpu_mem_gb=96.0, gpu_tflops=148.0, drive=DRIVE_MODELS["MZWLO7T6HBLA"]),
    # this kind of machine: the vLLM CPU engine on two cores, a local virtio disk
    "cpu": Node(
        "cpu",
        gpus=1,
        gpu="CPU (2 cores)",
        gpu_mem_gb=2.0,
        gpu_tflops=0.12,
        pcie_gbps=20.0,
        nvlink_gbps=0.0,
        host_copy_gbps=20.0,
        dram_gb=24.0,
        nic_gbps=0.0,
        drives=1,
        drive=Drive("virtio disk (fio ~1-3 GB/s)", 1.5, 1.2, 0.1, 1.0),
        remote_drives=False,
        gds=False,
    ),
}


class NodeError(ValueError):
    """A node description that cannot be read; the message names the input."""


def from_mapping(d: dict[str, Any], source: str) -> Node:
    names = {f.name for f in dataclasses.fields(Node)}
    base = PRESETS.get(str(d.get("preset", "")), Node())
    drive = d.get("drive") or {}
    unknown = sorted(set(d) - names - {"preset"}) + sorted(
        f"drive.{k}" for k in set(drive) - {f.name for f in dataclasses.fields(Drive)}
    )
    if unknown:
        raise NodeError(
            f"{source}: unknown field(s) {', '.join(unknown)} (fields: {', '.join(sorted(names))})"
        )
    rest = {k: v for k, v in d.items() if k not in ("drive", "preset")}
    return dataclasses.replace(base, **rest, drive=dataclasses.replace(base.drive, **drive))


def resolve(spec: str | None) -> Node:
    """A preset's name or a YAML file's path (default: the first seed's H200 node)."""
    if not spec:
        return PRESETS["h200"]
    if spec in PRESETS:
        return PRESETS[spec]
    p = Path(spec)
    if not p.is_file():
        raise NodeError(f"--node {spec}: neither a preset ({', '.join(PRESETS)}) nor a YAML file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise NodeError(f"--node {spec}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise NodeError(f"--node {spec}: a mapping of node fields")
    return from_mapping(data, spec)


def from_host_vars(host: str, v: dict[str, Any]) -> Node:
    """A lab inventory host's variables: its GPUs from the lspci listing the driver role plans
    with, its storage link from the wired variant, its drives from the store's exports."""
    gpus = [
        line.split()[3].strip('"')
        for line in str(v.get("nvidia_driver_plan_lspci", "")).splitlines()
        if len(line.split()) > 3 and line.split()[1].strip('"') in ("0300", "0302")
    ]
    node = PRESETS["h200"]
    kw: dict[str, Any] = {"name": host}
    if gpus:
        name, mem, tflops, pcie = GPU_IDS.get(
            gpus[0], (f"GPU 10de:{gpus[0]}", node.gpu_mem_gb, node.gpu_tflops, node.pcie_gbps)
        )
        kw.update(gpus=len(gpus), gpu=name, gpu_mem_gb=mem, gpu_tflops=tflops, pcie_gbps=pcie)
    variants = v.get("kvlab_storage_link_variants") or {}
    wired = variants.get(v.get("kvlab_storage_link_variant")) or {}
    if wired.get("gbit_s"):
        kw["nic_gbps"] = float(wired["gbit_s"]) / 8
    for export in v.get("kvlab_store_exports") or []:
        if export.get("node") == host:
            namespaces = export.get("namespaces") or []
            kw["drives"] = len(namespaces) or node.drives
            for ns in namespaces:
                model = next((m for m in DRIVE_MODELS if m in str(ns.get("device", ""))), None)
                if model:
                    kw["drive"] = DRIVE_MODELS[model]
                    break
    return dataclasses.replace(node, **kw)


def from_inventory(inventory: str, host: str) -> Node:
    from kvlab.inventory import InventoryError, load

    try:
        path = Path(inventory)
        inv = load(path / "hosts.yml" if path.is_dir() else path)
        if host not in inv.hosts("all"):
            raise NodeError(f"--host {host}: not in {inventory} (hosts: {', '.join(inv.hosts('all'))})")
        names = [
            "nvidia_driver_plan_lspci",
            "kvlab_storage_link_variant",
            "kvlab_storage_link_variants",
            "kvlab_store_exports",
        ]
        return from_host_vars(host, inv.render(host, [n for n in names if n in inv.vars(host)]))
    except InventoryError as e:
        raise NodeError(str(e)) from None


def describe(n: Node) -> str:
    where = "NVMe-oF" if n.remote_drives else "local"
    return (
        f"{n.name}: {n.gpus}x {n.gpu} ({n.gpu_mem_gb:g} GB), PCIe {n.pcie_gbps:g} GB/s per GPU, "
        f"host copies {n.host_copy_gbps:g} GB/s, NICs {n.nic_gbps:g} GB/s, {n.drives}x {n.drive.model} "
        f"({where}, {n.drive.read_gbps:g}/{n.drive.write_gbps:g} GB/s read/write)"
    )
