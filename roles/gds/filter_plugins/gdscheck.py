"""Parse `gdscheck -p` into what decides whether GDS is really on."""

from __future__ import annotations

import re
from typing import Any

_KV = re.compile(r"^\s*(--)?\s*([A-Za-z][\w .()/-]*?)\s*:\s*(.*?)\s*$")
_GPU = re.compile(r"GPU index (\d+) (.+?) bar:\d+.*?(supports GDS|does not support GDS)", re.I)


def gdscheck(text: str) -> dict[str, Any]:
    """{backends: {NVMe: Supported, ...}, properties: {...}, gpus: [...], platform_verified}."""
    backends: dict[str, str] = {}
    properties: dict[str, str] = {}
    gpus: list[dict[str, Any]] = []
    section = ""
    for line in str(text or "").splitlines():
        stripped = line.strip()
        if stripped.endswith(":") and stripped.isupper():
            section = stripped.rstrip(":")
            continue
        gpu = _GPU.search(line)
        if gpu:
            gpus.append(
                {
                    "index": int(gpu.group(1)),
                    "name": gpu.group(2).strip(),
                    "supports_gds": gpu.group(3).lower() == "supports gds",
                }
            )
            continue
        m = _KV.match(line)
        if not m or stripped.startswith("="):
            continue
        key, value = m.group(2).strip(), m.group(3)
        if section == "DRIVER CONFIGURATION" and not m.group(1):
            backends[key] = value
        elif key.startswith(("properties.", "execution.", "fs.")):
            properties[key] = value
    return {
        "backends": backends,
        "properties": properties,
        "gpus": gpus,
        "platform_verified": "Platform verification succeeded" in str(text or ""),
        # Compat mode: allowed (allow_compat_mode, or use_compat_mode before CUDA 12.2) or forced.
        "compat_mode": any(
            properties.get(f"properties.{k}", "").lower() == "true"
            for k in ("allow_compat_mode", "use_compat_mode", "force_compat_mode")
        ),
    }


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"gdscheck": gdscheck}
