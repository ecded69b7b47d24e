"""GPUDirect Storage through kvikio: detection that never hangs, and the mode in use.

libcufile can spin forever in cuFileDriverOpen where /proc/modules is missing, and kvikio
falls back to its compat mode silently when nvidia-fs is absent. So the probe runs in a
subprocess with a timeout, only after an NVIDIA GPU was found, and every result records
which mode the bytes actually moved in: "gds" (nvidia-fs, DMA straight to the GPU),
"gds-compat" (kvikio's POSIX bounce), or why neither is available.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

_PROBE = r"""
import json
out = {}
try:
    import pynvml
    pynvml.nvmlInit()
    n = pynvml.nvmlDeviceGetCount()
    out["gpus"] = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
    out["gpus"] = [g.decode() if isinstance(g, bytes) else g for g in out["gpus"]]
except Exception as e:  # NVMLError_LibraryNotFound without a driver
    out["gpus"] = []
    out["gpu_error"] = f"{type(e).__name__}: {e}"
if out["gpus"]:
    try:
        import kvikio, kvikio.defaults
        out["kvikio"] = kvikio.__version__
        out["compat_mode"] = str(kvikio.defaults.get("compat_mode"))
        try:
            import kvikio.cufile_driver as d
            out["gds_available"] = bool(d.properties.is_gds_available)
        except Exception as e:
            out["gds_available"] = False
            out["gds_error"] = f"{type(e).__name__}: {e}"
    except Exception as e:
        out["kvikio_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class GdsProbe:
    mode: str | None  # "gds", "gds-compat" or None (not usable)
    reason: str
    detail: dict

    @property
    def usable(self) -> bool:
        return self.mode is not None


def probe_gds(timeout_s: float = 20.0) -> GdsProbe:
    """What kvikio can do on this host, asked in a subprocess that cannot hang us."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return GdsProbe(None, f"the GDS probe hung for {timeout_s:.0f} s (libcufile driver open): POSIX I/O", {})
    try:
        detail = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return GdsProbe(None, f"the GDS probe failed: {proc.stderr.strip()[-300:]}", {})
    if not detail.get("gpus"):
        return GdsProbe(None, f"no NVIDIA GPU found ({detail.get('gpu_error', 'none listed')}): POSIX I/O", detail)
    if "kvikio" not in detail:
        return GdsProbe(None, f"kvikio is not installed ({detail.get('kvikio_error')}): "
                              "install kvlab-connector[gds-cu12] or [gds-cu13]", detail)
    if detail.get("gds_available"):
        return GdsProbe("gds", "nvidia-fs loaded: GDS", detail)
    return GdsProbe("gds-compat", "kvikio in compat mode (no nvidia-fs): POSIX bounce buffers", detail)
