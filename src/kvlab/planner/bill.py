"""The bill: what the GPUs' own cache holds, DRAM to hold a working set against NVMe capacity,
the staging ring, the drive writes a save rate needs against the drives' endurance, and money
only from prices the user gives."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.planner.geometry import Geometry
from kvlab.planner.node import Node
from kvlab.wear import Drives, wear

BYTES_PER_PARAM = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class BillInputs:
    prompt_tokens: int
    prompts: int = 1  # the working set: prompts of prompt_tokens each (or working_set_tokens)
    working_set_tokens: int | None = None
    save_tokens_s: float = 0.0  # new tokens per second the cache saves
    gpu_mem_util: float = 0.9
    weights_bytes: float | None = None  # the model's weights (else active params are not enough: unknown)
    ring_bytes: float = 10 * 2**30
    price_dram_gb: float | None = None  # money per GB of DRAM
    price_nvme_tb: float | None = None  # money per TB of NVMe


def bill(g: Geometry, node: Node, dtype: str | None, tp: int, b: BillInputs, with_mtp: bool = False) -> dict:
    per_token = g.kv_bytes_per_token(dtype, with_mtp)
    per_gpu_token = g.kv_bytes_per_token_per_gpu(tp, dtype, with_mtp)
    ws_tokens = b.working_set_tokens if b.working_set_tokens is not None else b.prompts * b.prompt_tokens
    ws_bytes = ws_tokens * per_token
    gpus = max(1, min(tp, node.gpus))
    free = node.gpu_mem_gb * 1e9 * b.gpu_mem_util - (b.weights_bytes or 0) / gpus
    gpu_tokens = int(free // per_gpu_token) if free > 0 else 0
    nvme_bytes = node.drives * node.drive.capacity_tb * 1e12
    writes_day = b.save_tokens_s * per_token * 86400
    worn = (wear(writes_day, Drives(count=node.drives, capacity_tb=node.drive.capacity_tb, dwpd=node.drive.dwpd))
            if nvme_bytes else None)
    out = {
        "gpu_cache_tokens": gpu_tokens,
        "gpu_cache_note": (
            "GPU memory x utilisation"
            + (" - weights" if b.weights_bytes else " (weights not subtracted: --weights-gb)")
            + f" over {per_gpu_token:,} B/token per GPU"
        ),
        "gpu_cache_prompts": gpu_tokens // b.prompt_tokens if b.prompt_tokens else None,
        "working_set_tokens": ws_tokens,
        "working_set_bytes": ws_bytes,
        "dram_bytes_for_working_set": ws_bytes,
        "dram_share_of_node": ws_bytes / (node.dram_gb * 1e9) if node.dram_gb else None,
        "nvme_capacity_bytes": nvme_bytes,
        "nvme_share_for_working_set": ws_bytes / nvme_bytes if nvme_bytes else None,
        "staging_ring_bytes": b.ring_bytes,
        "save_tokens_s": b.save_tokens_s,
        "drive_write_bytes_per_day": writes_day,
        "drive_writes_per_day_needed": worn.drive_writes_per_day if worn else None,
        "drive_writes_per_day_rated": node.drive.dwpd,
        "drive_rated_life_years": worn.rated_life_years if worn else None,
        "drive_write_gbps_needed": b.save_tokens_s * per_token / 1e9,
        "drive_write_gbps_available": node.drives * node.drive.write_gbps,
    }
    if b.price_dram_gb is not None:
        out["dram_cost"] = ws_bytes / 1e9 * b.price_dram_gb
    if b.price_nvme_tb is not None:
        out["nvme_cost_for_working_set"] = ws_bytes / 1e12 * b.price_nvme_tb
    return out
