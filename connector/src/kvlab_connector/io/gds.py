"""GPUDirect Storage through kvikio: detection that never hangs, and the mode in use.

libcufile can spin forever in cuFileDriverOpen where /proc/modules is missing, and kvikio
falls back to its compat mode silently when nvidia-fs is absent. So the probe runs in a
subprocess with a timeout, only after an NVIDIA GPU was found, and every result records
which mode the bytes actually moved in: "gds" (nvidia-fs, DMA straight to the GPU),
"gds-compat" (kvikio's POSIX bounce), or why neither is available.

`DeviceIO` is what the store calls to move a section between a drive and GPU memory:
kvikio's CuFile (pread/pwrite of a device tensor at a file offset). Where kvikio cannot
run (no GPU: this project's CPU tests, `make gpu-check --cpu-dry-run`), `PosixFile` makes
the same calls with POSIX I/O into CPU tensors, so the store's and the worker's GDS logic
runs everywhere; only the DMA itself needs the lab.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

_streams = threading.local()


def side_stream(device: Any) -> contextlib.AbstractContextManager:
    """The calling thread's own CUDA stream on `device` (a no-op context elsewhere).

    I/O threads verify and copy sections on it: on the default stream that work would
    queue behind (and hold up) the forward pass's kernels."""
    if getattr(device, "type", device) != "cuda":
        return contextlib.nullcontext()
    import torch

    key = str(device)
    streams = getattr(_streams, "by_device", None)
    if streams is None:
        streams = _streams.by_device = {}
    if key not in streams:
        streams[key] = torch.cuda.Stream(device=device)
    return torch.cuda.stream(streams[key])

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


class DeviceIO:
    """Section reads and writes between a drive and device memory, in one mode."""

    def __init__(self, cufile: Any, mode: str):
        self._cufile = cufile  # kvikio.CuFile, or PosixFile
        self.mode = mode

    @classmethod
    def kvikio(cls, probe: GdsProbe, threads: int = 8) -> DeviceIO:
        """kvikio in the mode the probe found. Without nvidia-fs, compat mode is switched on
        before kvikio loads, so it never opens the cuFile driver (which can hang).

        kvikio runs every request of 1 MiB or more on its own thread pool, one thread
        unless told otherwise: the store's I/O threads would all wait on that one. The pool
        gets at least `threads` (the connector's io_threads)."""
        if probe.mode is None:
            raise RuntimeError(f"no GDS engine: {probe.reason}")
        if probe.mode != "gds":
            os.environ["KVIKIO_COMPAT_MODE"] = "ON"
        os.environ.setdefault("KVIKIO_NTHREADS", str(threads))
        import kvikio
        import kvikio.defaults

        try:
            if int(kvikio.defaults.get("num_threads")) < threads:  # loaded earlier, with fewer
                kvikio.defaults.set("num_threads", threads)
        except (AttributeError, KeyError, TypeError, ValueError):
            pass  # a kvikio without this setting keeps its own; KVIKIO_NTHREADS was set above
        return cls(kvikio.CuFile, probe.mode)

    def open(self, path: str | os.PathLike, flags: str) -> Any:
        """flags: "r" to read, "r+" to write into a file that exists (the store's .tmp)."""
        return self._cufile(str(path), flags)

    def pread(self, handle: Any, t: Any, nbytes: int, offset: int) -> int:
        """Fill t[:nbytes] from the file at offset; returns the bytes read (short: truncated)."""
        return int(handle.pread(t, size=nbytes, file_offset=offset).get())

    def pwrite(self, handle: Any, t: Any, nbytes: int, offset: int) -> int:
        return int(handle.pwrite(t, size=nbytes, file_offset=offset).get())

    def self_test(self, device: Any, drives: list[Any], nbytes: int = 1 << 20, timeout_s: float = 30.0) -> str | None:
        """Move nbytes from device memory to a scratch file on each drive and back, byte for
        byte, and set the section checksum computed on the device against the host's. None
        when all of it passed, else why not. The probe only shows that kvikio loads; a
        filesystem cuFile cannot open (GDS mode on an overlay, say) or a broken driver
        shows here, at start, instead of failing every load. It also pays the first-call
        costs (kvikio's buffers and threads, the checksum's kernels) before the first
        request does. A call that hangs costs timeout_s, never the engine."""
        result: list[str | None] = [f"timed out after {timeout_s:g} s"]

        def run() -> None:
            result[0] = self._round_trips(device, drives, nbytes)

        t = threading.Thread(target=run, name="kvlab-gds-selftest", daemon=True)
        t.start()
        t.join(timeout_s)
        return result[0]

    def _round_trips(self, device: Any, drives: list[Any], nbytes: int) -> str | None:
        import torch

        from kvlab_connector import checksum

        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        # Sections written from device memory carry a checksum computed there and may be
        # verified on the host: both must agree on this device (this also loads the
        # checksum's kernels before the first save needs them).
        if checksum.wsum64_tensor(src) != checksum.wsum64(src.cpu().numpy()):
            return f"wsum64 on {device} differs from wsum64 on the host: sections written here would not verify"
        for drive in drives:
            path = os.path.join(os.fspath(drive), f".gds-selftest.{os.getpid()}")
            try:
                os.makedirs(os.fspath(drive), exist_ok=True)
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
                if src.is_cuda:
                    torch.cuda.synchronize(device)  # kvikio reads src from its own streams
                h = self.open(path, "r+")
                try:
                    wrote = self.pwrite(h, src, nbytes, 0)
                    dst.zero_()
                    if dst.is_cuda:
                        torch.cuda.synchronize(device)
                    got = self.pread(h, dst, nbytes, 0)
                finally:
                    h.close()
                if wrote != nbytes or got != nbytes:
                    return f"{drive}: wrote {wrote} and read {got} of {nbytes} bytes"
                if not torch.equal(src, dst):
                    return f"{drive}: the bytes read back differ from those written"
            except Exception as e:  # cuFile's own errors included
                return f"{drive}: {type(e).__name__}: {e}"
            finally:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        return None


class PosixFile:
    """kvikio.CuFile's calls (open by path and flags; pread/pwrite of a contiguous tensor
    returning a future with .get()) done with POSIX I/O on CPU tensors: the stand-in where
    no GPU is present."""

    class _Done:
        def __init__(self, n: int):
            self.n = n

        def get(self) -> int:
            return self.n

    _FLAGS = {"r": os.O_RDONLY, "r+": os.O_RDWR}

    def __init__(self, path: str, flags: str = "r"):
        if flags not in self._FLAGS:
            raise ValueError(f"PosixFile flags must be one of {sorted(self._FLAGS)}, got {flags!r}")
        self.fd = os.open(path, self._FLAGS[flags] | os.O_CLOEXEC)

    @staticmethod
    def _view(t: Any, size: int) -> memoryview:
        import torch

        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("PosixFile moves contiguous CPU tensors only")
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())[:size]

    def pread(self, t: Any, size: int, file_offset: int = 0) -> PosixFile._Done:
        view, done = self._view(t, size), 0
        while done < size:
            got = os.preadv(self.fd, [view[done:]], file_offset + done)
            if got == 0:
                break
            done += got
        return self._Done(done)

    def pwrite(self, t: Any, size: int, file_offset: int = 0) -> PosixFile._Done:
        view, done = self._view(t, size), 0
        while done < size:
            done += os.pwritev(self.fd, [view[done:]], file_offset + done)
        return self._Done(done)

    def close(self) -> None:
        os.close(self.fd)
