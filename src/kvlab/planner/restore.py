"""Restore time per tier: the KV's path as stages in a pipeline, each with its bandwidth.

A restore streams a stored copy through every stage of its tier's path at once (pipelined),
so the transfer takes as long as its slowest stage: that stage is the restore's named limit.
Restores in flight share the links (k at once: each moves k times the bytes through the
same stages). Loads run layer by layer, so layer n computes while n+1 arrives: of the
tail's compute (the tokens past the last stored chunk) only one layer's share is left
over when the load is the longer, and vice versa. A fixed cost per restore (lookup, chunk
handling, scheduler steps, the first token) sits on top: physics does not give it, a
calibration does (`calibrate.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.planner.node import Node

TIERS = ("nvme-gds", "nvme-host", "dram", "dram-l2")
TIER_TEXT = {
    "nvme-gds": "NVMe through GDS (drives -> NICs -> PCIe into GPU memory)",
    "nvme-host": "NVMe through the host ring (drives -> NICs -> host copy -> PCIe)",
    "dram": "LMCache DRAM (host copy -> PCIe)",
    "dram-l2": "DRAM over an L2 on a miss (drives -> NICs -> host DRAM, then host copy -> PCIe)",
}


@dataclass(frozen=True)
class Stage:
    name: str  # the limit it names: drives, NICs, PCIe, host copies, NVLink
    gbps: float  # GB/s it can carry, all its devices together
    bytes: float  # bytes it carries for one restore

    def seconds(self, in_flight: int = 1) -> float:
        return in_flight * self.bytes / (self.gbps * 1e9) if self.gbps > 0 else float("inf")


@dataclass(frozen=True)
class Restore:
    tier: str
    stages: tuple[Stage, ...]
    transfer_s: float
    compute_s: float
    fixed_s: float
    total_s: float
    limit: str  # the stage (or compute, or the fixed cost) that bounds the restore


def stages(tier: str, node: Node, copy_bytes: float, tp: int, replication: float) -> list[Stage]:
    """A tier's stages for one stored copy. Every GPU needs `replication / tp` of the copy
    (MLA: all of it); each copies its share over its own PCIe link and NVLink fans out the rest."""
    gpus = max(1, min(tp, node.gpus))
    pcie = Stage("PCIe", node.pcie_gbps * gpus, copy_bytes)
    fan = replication * copy_bytes - copy_bytes  # what NVLink moves between ranks
    nvlink = [Stage("NVLink", node.nvlink_gbps * gpus, fan)] if fan > 0 and node.nvlink_gbps > 0 else []
    drives = Stage("drives", node.drive.read_gbps * node.drives, copy_bytes)
    nics = [Stage("NICs", node.nic_gbps, copy_bytes)] if node.remote_drives and node.nic_gbps > 0 else []
    host = Stage("host copies", node.host_copy_gbps, copy_bytes)
    if tier == "nvme-gds":
        return [drives, *nics, pcie, *nvlink]
    if tier == "nvme-host":
        return [drives, *nics, host, pcie, *nvlink]
    if tier == "dram":
        return [host, pcie, *nvlink]
    if tier == "dram-l2":  # the L1 misses: the L2 read lands in DRAM first, then the L1 serves it
        return [drives, *nics, Stage("host copies", node.host_copy_gbps / 2, copy_bytes), pcie, *nvlink]
    raise ValueError(f"tier {tier!r}: one of {', '.join(TIERS)}")


def overlap(transfer_s: float, compute_s: float, layers: int) -> float:
    """Loads layer by layer under the tail's compute: of the shorter, one layer's share is left."""
    return max(transfer_s, compute_s) + min(transfer_s, compute_s) / max(1, layers)


def restore(
    tier: str,
    node: Node,
    copy_bytes: float,
    tp: int,
    replication: float,
    tail_compute_s: float,
    layers: int,
    fixed_s: float = 0.0,
    in_flight: int = 1,
    transfer_gbps: float | None = None,
) -> Restore:
    """One restore's time. `transfer_gbps`, where a calibration measured it, replaces the
    stages' bound with the effective rate the run delivered (the stages still name the limit)."""
    st = stages(tier, node, copy_bytes, tp, replication)
    slowest = max(st, key=lambda s: s.seconds(in_flight))
    transfer = slowest.seconds(in_flight)
    limit = slowest.name
    if transfer_gbps:
        transfer = in_flight * copy_bytes / (transfer_gbps * 1e9)
        limit = f"{slowest.name} (links' bound) / effective {transfer_gbps:.2f} GB/s (fitted)"
    overlapped = overlap(transfer, tail_compute_s, layers)
    if tail_compute_s > transfer:
        limit = "the tail's compute"
    total = fixed_s + overlapped
    if fixed_s > overlapped:
        limit = "fixed costs (lookup, chunk handling, scheduler steps)"
    return Restore(tier, tuple(st), transfer, tail_compute_s, fixed_s, total, limit)
