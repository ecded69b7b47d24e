"""One GPU, no vLLM: the connector's store restores objects into GPU memory through kvikio.

Writes objects with kvlab's store (striped, checksummed, committed), then restores every
section straight into GPU memory with kvikio: GDS where nvidia-fs is loaded, its compat mode
otherwise (reported from the connector's own probe, io_gds.probe_gds, never hidden). Proves
every byte equal to what was written and compares the GB/s with a pinned-host -> device
copy of the same bytes; the store's own POSIX read path (host memory, checksums verified)
runs over the same objects for a third number. Prints a summary and one JSON line; writes
the JSON to --out (or $OUT/gpu-check.json).

The restore calls kvikio.CuFile.pread at the store's own placement (Store.placement,
Store.fragment_path). When kvlab_connector.io_gds grows its engine, `restore_gpu` is the
place to call it instead (expected: the io_posix interface with a device buffer,
submit_read(fd, cuda_buffer, offset) -> Future[int]).

Exit status: 0 verified, 1 a byte or checksum differs, 2 no usable GPU or store folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path


def fail(code: int, msg: str) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr)
    sys.exit(code)


def fstype(path: Path) -> str:
    best, kind = "", "?"
    target = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mnt, typ = line.split()[:3]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, typ
    return kind


def key_of(i: int) -> str:
    return hashlib.blake2b(f"gpu-check-{i}".encode(), digest_size=16).hexdigest()


def write_objects(
    store, shape, ns: str, n_objects: int, expected, torch, seed: int
) -> tuple[list[str], float]:  # type: ignore[no-untyped-def]
    """Write n_objects through the store; `expected` (on the GPU) gets every slot's bytes."""
    device = expected.device
    from kvlab_connector.ring import PAGE, align_up

    n, stride, pay = shape.n_sections, shape.stride, align_up(shape.section_bytes)
    ring = mmap.mmap(-1, n * stride)  # page-aligned: O_DIRECT writes from it
    slots = [memoryview(ring)[s * stride : (s + 1) * stride] for s in range(n)]
    gen = torch.Generator(device=device).manual_seed(seed)
    keys, t0 = [], time.perf_counter()
    for i in range(n_objects):
        key = key_of(i)
        payload = torch.randint(
            0, 256, (n, shape.section_bytes), dtype=torch.uint8, device=device, generator=gen
        )
        host = payload.cpu().numpy()
        writer = store.begin_write(ns, key, shape, num_tokens=4096, tag=0)
        trailers = bytearray(n * PAGE)
        for s in range(n):
            slots[s][: shape.section_bytes] = host[s].tobytes()
            writer.submit_section(s, slots[s], lambda ok: None)
            trailers[s * PAGE : (s + 1) * PAGE] = slots[s][pay : pay + PAGE]  # fill_trailer ran in submit
        if not writer.done.result(timeout=120):
            fail(2, f"the store could not commit object {i} in {store.drives}: is the folder writable?")
        obj = expected[i * n * stride : (i + 1) * n * stride].view(n, stride)
        obj.zero_()
        obj[:, : shape.section_bytes] = payload
        obj[:, pay : pay + PAGE] = torch.frombuffer(trailers, dtype=torch.uint8).view(n, PAGE).to(device)
        keys.append(key)
    return keys, time.perf_counter() - t0


def restore_gpu(store, shape, ns: str, keys: list[str], dst, cufile) -> float:  # type: ignore[no-untyped-def]
    """Every section of every object straight into GPU memory, at the store's placement.
    `cufile` is kvikio.CuFile (or, for --cpu-dry-run, a POSIX stand-in with its call)."""
    n, stride = shape.n_sections, shape.stride
    nfrag = store.n_fragments(shape)
    handles, futures = [], []
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        files = [cufile(store.fragment_path(ns, key, shape, f), "r") for f in range(nfrag)]
        handles += files
        for s in range(n):
            frag, offset = store.placement(key, shape, s)
            at = (i * n + s) * stride
            futures.append((files[frag].pread(dst[at : at + stride], size=stride, file_offset=offset), i, s))
    short = [(i, s, got) for fut, i, s in futures if (got := fut.get()) != stride]
    sync()
    seconds = time.perf_counter() - t0
    for h in handles:
        h.close()
    if short:
        fail(1, f"kvikio read short sections (object, section, bytes): {short[:5]}")
    return seconds


def restore_posix(store, shape, ns: str, keys: list[str]) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """The store's own read path into host memory, every section's checksum verified."""
    n, stride = shape.n_sections, shape.stride
    ring = mmap.mmap(-1, n * stride)
    slots = [memoryview(ring)[s * stride : (s + 1) * stride] for s in range(n)]
    bad, t0 = 0, time.perf_counter()
    for key in keys:
        fds = store.open_object(ns, key, shape)
        if fds is None:
            fail(1, f"object {key} vanished from {store.drives}")
        futs = [store.submit_read_section(fds, ns, key, shape, s, slots[s]) for s in range(n)]
        bad += sum(not f.result() for f in futs)
        for fd in fds:
            os.close(fd)
    return time.perf_counter() - t0, bad


def pinned_copy(src, torch, repeats: int = 3) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    """Best of `repeats` pinned-host -> device copies of src's bytes."""
    pinned = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=src.is_cuda)
    pinned.copy_(src)
    out = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out.copy_(pinned, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best, out


class PosixCuFile:
    """--cpu-dry-run's stand-in for kvikio.CuFile: the same pread call into a CPU tensor."""

    class _Done:
        def __init__(self, n: int):
            self.n = n

        def get(self) -> int:
            return self.n

    def __init__(self, path: Path, flags: str = "r"):
        self.fd = os.open(path, os.O_RDONLY)

    def pread(self, buf, size: int, file_offset: int = 0):  # type: ignore[no-untyped-def]
        return self._Done(os.preadv(self.fd, [memoryview(buf.numpy())[:size]], file_offset))

    def close(self) -> None:
        os.close(self.fd)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dir",
        action="append",
        type=Path,
        help="store folder on a disk (repeat per drive); default a temp folder in /var/tmp",
    )
    ap.add_argument("--size-gib", type=float, default=4.0, help="bytes restored in all (default 4 GiB)")
    ap.add_argument(
        "--section-mib", type=int, default=4, help="payload of one section (a layer's share of an object)"
    )
    ap.add_argument("--sections", type=int, default=16, help="sections per object")
    ap.add_argument("--threads", type=int, default=16, help="kvikio and store I/O threads")
    ap.add_argument(
        "--out", type=Path, help="write the JSON report here (default $OUT/gpu-check.json when $OUT is set)"
    )
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="no GPU: CPU tensors and a POSIX stand-in for kvikio (tests the check itself)",
    )
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    try:
        import torch
    except ImportError:
        fail(2, f"no torch in {sys.executable}: run with the machine's Python 3.12 that has torch and CUDA")
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        fail(2, "torch sees no CUDA GPU (driver or CUDA_VISIBLE_DEVICES)")
    device = "cpu" if dry else "cuda"
    report: dict = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": "none (--cpu-dry-run)" if dry else torch.cuda.get_device_name(0),
        "nvidia_fs_loaded": "nvidia_fs" in Path("/proc/modules").read_text()
        if Path("/proc/modules").exists()
        else False,
    }
    from kvlab_connector.store import ObjectShape, Store

    if dry:
        report |= {
            "cufile": {"probe": "skipped (--cpu-dry-run)"},
            "kvikio": "none",
            "io_mode": "posix (dry run)",
        }
        cufile_cls = PosixCuFile
    else:
        from kvlab_connector.io_gds import probe_gds

        os.environ.setdefault("KVIKIO_NTHREADS", str(args.threads))
        probe = probe_gds(60)  # the connector's own probe: a subprocess, so a cuFile hang costs a timeout
        if probe.mode != "gds":
            # No GDS here: say so, and keep kvikio from opening the cuFile driver at all.
            os.environ["KVIKIO_COMPAT_MODE"] = "ON"
        import kvikio
        import kvikio.defaults

        report |= {
            "cufile": probe.detail | {"reason": probe.reason},
            "kvikio": kvikio.__version__,
            "compat_mode_setting": str(kvikio.defaults.get("compat_mode")),
            "io_mode": probe.mode or "gds-compat",
        }
        cufile_cls = kvikio.CuFile

    tmp = None
    dirs = args.dir
    if not dirs:
        tmp = tempfile.TemporaryDirectory(prefix="kvlab-gpu-check-", dir="/var/tmp")
        dirs = [Path(tmp.name)]
    report["store_dirs"] = [f"{d} ({fstype(d)})" for d in dirs]
    shape = ObjectShape(n_sections=args.sections, section_bytes=args.section_mib << 20)
    n_objects = max(1, int(args.size_gib * (1 << 30)) // shape.object_bytes)
    total = n_objects * shape.object_bytes
    ns = hashlib.blake2b(b"gpu-check", digest_size=16).hexdigest()
    store = Store(dirs, capacity_bytes=2 * total + (1 << 30), io_threads=args.threads)
    report["store_io_mode"] = store.io_mode
    try:
        expected = torch.empty(total, dtype=torch.uint8, device=device)
        keys, write_s = write_objects(store, shape, ns, n_objects, expected, torch, seed=20261129)
        from kvlab_connector.osutil import drop_page_cache

        report["page_cache_dropped"] = drop_page_cache()
        dst = torch.zeros(total, dtype=torch.uint8, device=device)
        gpu_s = restore_gpu(store, shape, ns, keys, dst, cufile_cls)
        same = bool(torch.equal(dst, expected))
        if not same:
            report["first_differing_byte"] = int(torch.argmax((dst != expected).to(torch.uint8)))
        drop_page_cache()
        posix_s, posix_bad = restore_posix(store, shape, ns, keys)
        h2d_s, copied = pinned_copy(dst, torch)
        same_copy = bool(torch.equal(copied, expected))
    finally:
        store.close()
        if tmp:
            tmp.cleanup()

    gb = total / 1e9
    report |= {
        "objects": n_objects,
        "bytes": total,
        "object_bytes": shape.object_bytes,
        "write_gbps": round(gb / write_s, 3),
        "gpu_restore_gbps": round(gb / gpu_s, 3),
        "posix_restore_gbps": round(gb / posix_s, 3),
        "pinned_h2d_gbps": round(gb / h2d_s, 3),
        "gpu_restore_vs_pinned_h2d": round(h2d_s / gpu_s, 4),
        "verified_bytes": total if same else 0,
        "byte_for_byte": same,
        "posix_sections_failed": posix_bad,
        "pinned_copy_byte_for_byte": same_copy,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(
        f"gpu-check on {report['gpu']}: {n_objects} objects, {total / 2**30:.2f} GiB, kvikio {report['kvikio']} "
        f"in {report['io_mode']} mode (nvidia-fs {'loaded' if report['nvidia_fs_loaded'] else 'absent'}; "
        f"store {report['store_io_mode']} on {', '.join(report['store_dirs'])})\n"
        f"  restore into {device} memory ({report['io_mode']}) {report['gpu_restore_gbps']} GB/s, "
        f"pinned host -> device {report['pinned_h2d_gbps']} GB/s "
        f"(ratio {report['gpu_restore_vs_pinned_h2d']}), store POSIX read {report['posix_restore_gbps']} GB/s, "
        f"write {report['write_gbps']} GB/s\n"
        f"  byte for byte: {'yes' if same else 'NO'}; store checksums failed: {posix_bad}; "
        f"page cache dropped: {report['page_cache_dropped']}; {report['seconds']} s"
    )
    line = json.dumps(report, sort_keys=True)
    print(line)
    out = args.out or (Path(os.environ["OUT"]) / "gpu-check.json" if os.environ.get("OUT") else None)
    if out:
        out.write_text(line + "\n")
    return 0 if same and same_copy and posix_bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
