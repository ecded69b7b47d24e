"""Parse what a node reports on its PCI bus into the NVIDIA hardware the roles decide on."""

from __future__ import annotations

import shlex
from typing import Any

from ansible.errors import AnsibleFilterError

NVIDIA = "10de"
# PCI classes: VGA 0300 and 3D controller 0302 are GPUs; "other bridge" 0680 from NVIDIA is
# an NVSwitch (HGX boards). PCIe cards (H200 NVL, L40S) show GPUs and no NVSwitch.
GPU_CLASSES = {"0300", "0302"}
NVSWITCH_CLASS = "0680"


def nvidia_pci(text: str) -> dict[str, Any]:
    """`lspci -n -m -d 10de:` output -> {gpu_count, nvswitch_count, gpus, nvswitches}."""
    gpus: list[dict[str, str]] = []
    switches: list[dict[str, str]] = []
    for n, line in enumerate(str(text or "").splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = [f for f in shlex.split(line) if not f.startswith("-")]
            slot, cls, vendor, device = fields[:4]
        except ValueError as e:
            raise AnsibleFilterError(
                f"nvidia_pci: line {n} is not `lspci -n -m` output ({e}): {line!r}"
            ) from None
        if vendor.lower() != NVIDIA:
            continue
        entry = {"slot": slot, "class": cls, "device": device.lower()}
        if cls in GPU_CLASSES:
            gpus.append(entry)
        elif cls == NVSWITCH_CLASS:
            switches.append(entry)
    return {
        "gpu_count": len(gpus),
        "nvswitch_count": len(switches),
        "gpus": gpus,
        "nvswitches": switches,
        "gpu_device_ids": sorted({g["device"] for g in gpus}),
    }


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"nvidia_pci": nvidia_pci}
