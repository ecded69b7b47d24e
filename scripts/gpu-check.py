"""One GPU, no vLLM: the connector's GDS path moves objects between drives and GPU memory.

1. Store: objects are written from GPU memory through the store's GDS save path (sections
   checksummed on the device, written by kvikio) and restored straight into GPU memory
   through its GDS read path (verified on the device): GDS where nvidia-fs is loaded,
   kvikio's compat mode otherwise (from the connector's own probe, io.gds.probe_gds, never
   hidden). Every byte is compared with what was written, and the GB/s with a pinned-host
   -> device copy of the same bytes; the store's POSIX read path (host memory) reads the
   same objects for a third number.
2. Engine: the connector's worker side, as a GPU engine drives it (vLLM's GPU KV layout,
   copies on CUDA streams), saves chunks and loads them back into other blocks, byte for
   byte, once through kvikio (io_engine gds) and once through the page-locked host ring
   (io_engine posix); io_engine auto must choose GDS where nvidia-fs is loaded and the
   host ring where it is not.
Prints a summary and one JSON line; writes the JSON to --out (or $OUT/gpu-check.json).

Exit status: 0 verified, 1 a byte or checksum differs, 2 no usable GPU or store folder.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()


def step(msg: str) -> None:
    """Progress on stderr, so a slow or stuck stage is named in the log."""
    print(f"gpu-check: [{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def source_commit() -> str:
    """The checkout's commit (a '-dirty' suffix when files differ), for the report's provenance."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True
        )
        return head + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("KVLAB_SOURCE_COMMIT", "unknown (no git checkout)")


def kvikio_setting(kvikio, name: str) -> object:  # type: ignore[no-untyped-def]
    try:
        return kvikio.defaults.get(name)
    except Exception as e:  # a setting this kvikio does not have: say so, the check goes on
        return f"unknown ({type(e).__name__}: {e})"


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
    store, memory, shape, ns: str, n_objects: int, expected, torch, seed: int
) -> tuple[list[str], float]:  # type: ignore[no-untyped-def]
    """Write n_objects from device memory through the store's GDS save path (`memory`, a
    store.DeviceMemory: each section checksummed on the device, written by its device_io);
    `expected` gets every section's payload, on the device."""
    device = expected.device
    n, stride = shape.n_sections, shape.stride
    slots = torch.zeros(n, stride, dtype=torch.uint8, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    keys, t0 = [], time.perf_counter()
    for i in range(n_objects):
        key = key_of(i)
        payload = torch.randint(
            0, 256, (n, shape.section_bytes), dtype=torch.uint8, device=device, generator=gen
        )
        slots[:, : shape.section_bytes] = payload
        expected[i * n : (i + 1) * n] = payload
        sync()  # the store checksums and kvikio writes from streams of their own
        writer = store.begin_write(ns, key, shape, num_tokens=4096, tag=0)
        for s in range(n):
            writer.submit_section(s, slots[s], lambda ok: None, memory)
        if not writer.done.result(timeout=120):
            fail(2, f"the store could not commit object {i} in {store.drives}: is the folder writable?")
        keys.append(key)
    sync()
    return keys, time.perf_counter() - t0


def restore_device(store, memory, shape, ns: str, keys: list[str], dst) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Every section of every object straight into device memory through the store's GDS
    read path (store.submit_read_sections into `memory`: what the engine's loads call), each
    verified on the device. dst: one row of shape.stride bytes per section."""
    n = shape.n_sections
    t0 = time.perf_counter()
    waits, handles = [], []
    for i, key in enumerate(keys):
        h = store.open_object(ns, key, shape, memory)
        if h is None:
            fail(1, f"object {key} vanished from {store.drives}")
        handles.append(h)
        rows = [dst[i * n + s] for s in range(n)]
        waits.append(store.submit_read_sections(h, ns, key, shape, list(range(n)), rows, memory=memory))
    bad = sum(not ok for w in waits for ok in w.result(timeout=300))
    sync()
    seconds = time.perf_counter() - t0
    for h in handles:
        memory.close(h)
    return seconds, bad


# The paged KV cache gpu-check's engines use: vLLM's GPU layout, bf16, 16-token blocks of
# 8 KV heads x head dim 128, 256-token chunks.
BLOCK_TOKENS, KV_HEADS, HEAD_DIM, CHUNK_TOKENS = 16, 8, 128, 256
BLOCK_BYTES = 2 * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2  # K and V, bf16


def gpu_worker(
    dirs: list[Path], device: str, io_engine: str, layers: int, blocks: int, ring_bytes: int, torch
):  # type: ignore[no-untyped-def]
    """The connector's worker side as a GPU engine sets it up, without vLLM: its KV cache
    registered (which picks the I/O path: probe, self-test), stores under dirs/engine-<io_engine>.
    Returns the worker, the KV cache by layer name, and the layer names."""
    from kvlab_connector.config import ConnectorConfig
    from kvlab_connector.layout import Layout
    from kvlab_connector.store.store import Store
    from kvlab_connector.worker.worker import WorkerSide

    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    layout = Layout(
        names, BLOCK_TOKENS, BLOCK_BYTES, CHUNK_TOKENS, "gpu-check", device, "gpu-check", 1, False
    )
    config = ConnectorConfig.from_extra(
        {
            "paths": [str(d / f"engine-{io_engine}") for d in dirs],
            "ring_bytes": ring_bytes,
            "chunk_tokens": CHUNK_TOKENS,
            "io_engine": io_engine,
        }
    )
    worker = WorkerSide(config, layout, Store(config.paths, 4 << 30), rank=0)
    shape = (2, blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    kv = {n: torch.zeros(shape, dtype=torch.bfloat16, device=device) for n in names}
    worker.register_kv_caches(kv, blocks)
    return worker, kv, names


def wait_written(worker, objects: int, timeout_s: float = 120) -> None:  # type: ignore[no-untyped-def]
    """Until the store has committed `objects` objects in all (saves are never waited for
    by the engine; the check waits so that the next step starts with the ring free)."""
    deadline = time.monotonic() + timeout_s
    while worker.store.stats.objects_written < objects and time.monotonic() < deadline:
        time.sleep(0.001)


def engine_round_trip(dirs: list[Path], device: str, io_engine: str, device_io, torch, rounds: int) -> dict:  # type: ignore[no-untyped-def]
    """The connector's worker side as a GPU engine runs it, without vLLM: a paged KV cache
    in vLLM's GPU layout ([2, blocks, block size, KV heads, head dim] per layer), chunks
    saved layer by layer (copies on the save stream, writes queued), the cache wiped, the
    chunks loaded into other blocks layer by layer; every byte compared. The first round
    pays for the I/O threads' first CUDA calls and is reported apart (cold). Last, one
    saved object is damaged on the drive: its load must be an error, the others intact."""
    from kvlab_connector.scheduler import ChunkIO, StepMetadata

    layers, blocks = 8, 256
    per, half = CHUNK_TOKENS // BLOCK_TOKENS, blocks // 2
    n_chunks = half // per
    ring_bytes = 2 * n_chunks * layers * (per * BLOCK_BYTES + (64 << 10))  # a step's saves, twice
    worker, kv, names = gpu_worker(dirs, device, io_engine, layers, blocks, ring_bytes, torch)
    gen = torch.Generator(device=device).manual_seed(7)
    if device_io is not None:  # --cpu-dry-run: the device path on CPU tensors
        worker.use_device_io(device_io, torch.device(device))
    moved = n_chunks * layers * per * BLOCK_BYTES

    def load(chunks: list, after_layer=None) -> tuple[float, set]:  # type: ignore[no-untyped-def,type-arg]
        """The chunks loaded into the second half of the blocks, layer by layer; after_layer()
        runs as soon as each layer is ready (as a forward pass computes it)."""
        for t in kv.values():
            t[:, half:].zero_()
        targets = [ChunkIO(c.key, [b + half for b in c.block_ids]) for c in chunks]
        t0 = time.perf_counter()
        worker.start_load(StepMetadata(loads=targets))
        for n in names:
            worker.wait_for_layer(n)
            if after_layer is not None:
                after_layer()
        errors = worker.take_load_errors()
        sync()
        return time.perf_counter() - t0, errors

    results, same, load_errors = [], True, 0
    for r in range(rounds):
        for t in kv.values():
            t.copy_(torch.randn(t.shape, generator=gen, device=device))
        saved = {n: t[:, :half].clone() for n, t in kv.items()}
        chunks = [
            ChunkIO(key_of(1000 * (r + 1) + c), list(range(c * per, (c + 1) * per))) for c in range(n_chunks)
        ]
        written = worker.store.stats.objects_written
        sync()
        t0 = time.perf_counter()
        meta = StepMetadata(saves=chunks)
        for n, t in kv.items():
            worker.save_layer(n, t, meta)
        worker.end_step()
        wait_written(worker, written + n_chunks)
        save_s = time.perf_counter() - t0
        load_s, errors = load(chunks)
        load_errors += len(errors)
        same = same and all(torch.equal(kv[n][:, half:], saved[n]) for n in names)
        results.append((moved / 1e9 / save_s, moved / 1e9 / load_s))

    layer_load_s = moved / 1e9 / results[-1][1] / layers  # one layer's share of the last load
    overlap = overlap_with_compute(worker, kv, names, chunks, saved, load, device, torch, layer_load_s)
    same = same and overlap.pop("byte_for_byte")

    # A flipped byte in one layer's section of the first chunk: that chunk's blocks are
    # reported (vLLM recomputes them), every other chunk still loads byte for byte.
    frag, offset = worker.store.placement(chunks[0].key, worker.shape, 1)
    flip_byte(worker.store.fragment_path(worker.ns, chunks[0].key, worker.shape, frag), offset + 4096)
    _, errors = load(chunks)
    damaged_blocks = {b + half for b in chunks[0].block_ids}
    others_same = all(
        torch.equal(kv[n][:, half + per * c : half + per * (c + 1)], saved[n][:, per * c : per * (c + 1)])
        for n in names
        for c in range(1, n_chunks)
    )
    warm = results[1:] or results
    return {
        "io_engine": io_engine,
        "io_mode": worker.io_mode,
        "rounds": rounds,
        "objects_written": worker.store.stats.objects_written,
        "saves_dropped": worker.saves_dropped,
        "load_errors": load_errors,
        "byte_for_byte": same,
        "bytes_per_round": moved,
        "cold_save_gbps": round(results[0][0], 3),
        "cold_load_gbps": round(results[0][1], 3),
        "save_gbps": round(sorted(x[0] for x in warm)[len(warm) // 2], 3),  # median of the warm rounds
        "load_gbps": round(sorted(x[1] for x in warm)[len(warm) // 2], 3),
        "damaged_object_is_load_error": errors == damaged_blocks and others_same,
        "overlap": overlap,
    }


def overlap_with_compute(
    worker, kv, names, chunks, saved, load, device: str, torch, layer_load_s: float
) -> dict:  # type: ignore[no-untyped-def]
    """What a forward pass feels of the connector, with a stand-in for each layer's compute
    (matrix products on the forward stream, sized to take about as long as a layer's load):
    - loads: all layers loaded, then computed, against each layer computed as soon as it
      is loaded (wait_for_layer), as vLLM runs them; the second must overlap (ratio < 1)
      and still deliver every byte;
    - saves: a step that saves every layer (save_layer, end_step), against the same step
      without saves; saves are queued, never waited for (ratio near 1).
    Timings are reported, never judged: they depend on the drive of the day."""
    from kvlab_connector.scheduler import ChunkIO, StepMetadata

    half = kv[names[0]].shape[1] // 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = 4096 if device == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def layer_compute(k: int) -> None:
        for _ in range(k):
            torch.mm(a, b)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    # Size each layer's compute to about one layer's share of a warm load.
    one = min(timed(lambda: layer_compute(4)) for _ in range(3)) / 4
    k = max(1, round(layer_load_s / one))

    def compute_all() -> None:
        for _ in names:
            layer_compute(k)

    def load_then_compute() -> None:
        load(chunks)
        compute_all()

    def overlapped() -> None:
        load(chunks, after_layer=lambda: layer_compute(k))

    compute_s = min(timed(compute_all) for _ in range(3))
    sequential_s = min(timed(load_then_compute) for _ in range(3))
    overlapped_s = min(timed(overlapped) for _ in range(3))
    same = all(torch.equal(kv[name][:, half:], saved[name]) for name in names)

    def step_with_saves(r: int) -> float:
        meta = StepMetadata(
            saves=[ChunkIO(key_of(90_000 + 100 * r + i), c.block_ids) for i, c in enumerate(chunks)]
        )
        written = worker.store.stats.objects_written

        def step() -> None:
            for name in names:
                layer_compute(k)
                worker.save_layer(name, kv[name], meta)
            worker.end_step()

        seconds = timed(step)
        wait_written(worker, written + len(chunks))
        return seconds

    saving_s = min(step_with_saves(r) for r in range(3))
    return {
        "byte_for_byte": same,
        "matmuls_per_layer": k,
        "compute_s": round(compute_s, 4),
        "load_then_compute_s": round(sequential_s, 4),
        "overlapped_s": round(overlapped_s, 4),
        "overlap_ratio": round(overlapped_s / sequential_s, 3),
        "step_with_saves_s": round(saving_s, 4),
        "save_slowdown": round(saving_s / compute_s, 3),
    }


def auto_choice(dirs: list[Path], device: str, torch) -> str:  # type: ignore[no-untyped-def]
    """The I/O mode a GPU engine's connector picks with io_engine auto (probe, self-test)."""
    worker, _, _ = gpu_worker(dirs, device, "auto", layers=1, blocks=32, ring_bytes=16 << 20, torch=torch)
    return worker.io_mode


def flip_byte(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def damaged_restore(store, memory, shape, ns: str, key: str, expected, torch) -> dict:  # type: ignore[no-untyped-def]
    """One payload byte of section 1 flipped on the drive: restoring the object into device
    memory must fail that section (verified on the device) and deliver every other one."""
    n = shape.n_sections
    frag, offset = store.placement(key, shape, 1)
    flip_byte(store.fragment_path(ns, key, shape, frag), offset + 4096)
    dst = torch.zeros(n, shape.stride, dtype=torch.uint8, device=expected.device)
    sync()
    handles = store.open_object(ns, key, shape, memory)
    if handles is None:
        return {"failed_sections": "the whole object vanished", "others_byte_for_byte": False}
    oks = store.submit_read_sections(handles, ns, key, shape, list(range(n)), list(dst), memory=memory).result(
        timeout=60
    )
    sync()
    memory.close(handles)
    return {
        "failed_sections": [s for s, ok in enumerate(oks) if not ok],
        "others_byte_for_byte": all(
            torch.equal(dst[s, : shape.section_bytes], expected[s]) for s in range(n) if s != 1
        ),
    }


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
    ap.add_argument(
        "--engine-rounds", type=int, default=4, help="engine save/load rounds (the first is reported as cold)"
    )
    ap.add_argument(
        "--watchdog-s",
        type=float,
        default=270.0,
        help="past this, print every thread's stack and exit (a hung cuFile call or stream is named)",
    )
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)

    try:
        import torch
    except ImportError:
        fail(2, f"no torch in {sys.executable}: run with the machine's Python 3.12 that has torch and CUDA")
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        fail(2, "torch sees no CUDA GPU (driver or CUDA_VISIBLE_DEVICES)")
    device = "cpu" if dry else "cuda"
    report: dict = {
        "commit": source_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": "none (--cpu-dry-run)" if dry else torch.cuda.get_device_name(0),
        "nvidia_fs_loaded": "nvidia_fs" in Path("/proc/modules").read_text()
        if Path("/proc/modules").exists()
        else False,
    }
    from kvlab_connector.io.gds import DeviceIO, PosixFile, probe_gds
    from kvlab_connector.store.store import DeviceMemory, ObjectShape, Store

    if dry:
        report |= {"cufile": {"probe": "skipped (--cpu-dry-run)"}, "kvikio": "none"}
        device_io = DeviceIO(PosixFile, "posix (dry run)")
    else:
        step("probing kvikio and cuFile (subprocess)")
        probe = probe_gds(60)  # a subprocess: a cuFile hang costs a timeout, not the check
        if not probe.usable:
            fail(2, f"kvikio cannot run here: {probe.reason}")
        # Compat mode switched on first where GDS is absent; kvikio's pool gets --threads.
        device_io = DeviceIO.kvikio(probe, args.threads)
        import kvikio
        import kvikio.defaults

        report |= {
            "cufile": probe.detail | {"reason": probe.reason},
            "kvikio": kvikio.__version__,
            "compat_mode_setting": str(kvikio.defaults.get("compat_mode")),
            "kvikio_threads": kvikio_setting(kvikio, "num_threads"),
        }
    report["io_mode"] = device_io.mode

    tmp = None
    dirs = args.dir
    if not dirs:
        tmp = tempfile.TemporaryDirectory(prefix="kvlab-gpu-check-", dir="/var/tmp")
        dirs = [Path(tmp.name)]
    report["store_dirs"] = [f"{d} ({fstype(d)})" for d in dirs]
    shape = ObjectShape(n_sections=args.sections, section_bytes=args.section_mib << 20)
    n_objects = max(1, int(args.size_gib * (1 << 30)) // shape.object_bytes)
    n_rows = n_objects * shape.n_sections
    total = n_rows * shape.section_bytes  # payload bytes
    ns = hashlib.blake2b(b"gpu-check", digest_size=16).hexdigest()
    store = Store(
        [d / "store" for d in dirs],
        capacity_bytes=2 * n_objects * shape.object_bytes + (1 << 30),
        io_threads=args.threads,
    )
    memory = DeviceMemory(device_io)
    report["store_io_mode"] = store.io_mode
    try:
        expected = torch.empty(n_rows, shape.section_bytes, dtype=torch.uint8, device=device)
        step(f"writing {n_objects} objects ({total / 2**30:.2f} GiB) from {device} memory")
        keys, write_s = write_objects(store, memory, shape, ns, n_objects, expected, torch, seed=20261129)
        from kvlab_connector.osutil import drop_page_cache

        report["page_cache_dropped"] = drop_page_cache()
        dst = torch.zeros(n_rows, shape.stride, dtype=torch.uint8, device=device)
        sync()  # zeroed before kvikio (its own streams) writes into it
        step(f"restoring them into {device} memory ({device_io.mode})")
        gpu_s, gpu_bad = restore_device(store, memory, shape, ns, keys, dst)
        same = bool(torch.equal(dst[:, : shape.section_bytes], expected))
        if not same:
            diff = (dst[:, : shape.section_bytes] != expected).reshape(-1).to(torch.uint8)
            report["first_differing_byte"] = int(torch.argmax(diff))
        drop_page_cache()
        step("restoring them through the POSIX path, then a pinned host -> device copy")
        posix_s, posix_bad = restore_posix(store, shape, ns, keys)
        h2d_s, copied = pinned_copy(expected.reshape(-1), torch)
        same_copy = bool(torch.equal(copied, expected.reshape(-1)))
        step("one section damaged on the drive: its restore into device memory must fail, alone")
        damage = damaged_restore(store, memory, shape, ns, keys[0], expected[: shape.n_sections], torch)
        engine = []
        # kvikio's path (io_engine gds; in a dry run auto with the POSIX stand-in), then
        # the page-locked host ring.
        for io_engine in ("auto" if dry else "gds", "posix"):
            step(f"engine round trip, io_engine {io_engine}")
            dev_io = device_io if dry and io_engine == "auto" else None
            engine.append(engine_round_trip(dirs, device, io_engine, dev_io, torch, args.engine_rounds))
        auto_mode = None if dry else auto_choice(dirs, device, torch)
    finally:
        faulthandler.cancel_dump_traceback_later()
        store.close()
        if tmp:
            tmp.cleanup()

    gb = total / 1e9
    engine_ok = all(
        e["byte_for_byte"]
        and e["load_errors"] == 0
        and e["saves_dropped"] == 0
        and e["damaged_object_is_load_error"]
        for e in engine
    )
    damage_ok = damage["failed_sections"] == [1] and damage["others_byte_for_byte"]
    # On a GPU, io_engine gds must have run through kvikio (its start-up self-test passed),
    # and auto must take GDS where nvidia-fs is loaded and the host ring where it is not.
    kvikio_ran = dry or engine[0]["io_mode"] == report["io_mode"]
    auto_ok = dry or (auto_mode == "gds" if report["io_mode"] == "gds" else str(auto_mode).endswith("+h2d"))
    report["auto_io_mode"] = auto_mode
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
        "gpu_sections_failed": gpu_bad,
        "posix_sections_failed": posix_bad,
        "pinned_copy_byte_for_byte": same_copy,
        "engine": engine,
        "damaged_section": damage,
        "seconds": round(time.perf_counter() - T0, 1),
    }
    print(
        f"gpu-check on {report['gpu']}: {n_objects} objects, {total / 2**30:.2f} GiB, kvikio {report['kvikio']} "
        f"in {report['io_mode']} mode (nvidia-fs {'loaded' if report['nvidia_fs_loaded'] else 'absent'}; "
        f"store {report['store_io_mode']} on {', '.join(report['store_dirs'])})\n"
        f"  store: restore into {device} memory ({report['io_mode']}) {report['gpu_restore_gbps']} GB/s, "
        f"pinned host -> device {report['pinned_h2d_gbps']} GB/s "
        f"(ratio {report['gpu_restore_vs_pinned_h2d']}), POSIX read {report['posix_restore_gbps']} GB/s, "
        f"write from {device} memory {report['write_gbps']} GB/s\n"
        f"  byte for byte: {'yes' if same else 'NO'}; sections failed: {gpu_bad} ({device}), {posix_bad} (POSIX); "
        f"page cache dropped: {report['page_cache_dropped']}\n"
        f"  one damaged section: sections failed {damage['failed_sections']} (want [1]), "
        f"the others byte for byte: {'yes' if damage['others_byte_for_byte'] else 'NO'}"
    )
    for e in engine:
        print(
            f"  engine, io_engine {e['io_engine']} ({e['io_mode']}), {e['rounds']} rounds of "
            f"{e['bytes_per_round'] >> 20} MiB: save {e['save_gbps']} GB/s, load {e['load_gbps']} GB/s "
            f"(cold: {e['cold_save_gbps']}, {e['cold_load_gbps']}), byte for byte: "
            f"{'yes' if e['byte_for_byte'] else 'NO'}, load errors {e['load_errors']}, saves dropped "
            f"{e['saves_dropped']}, a damaged object is a load error: "
            f"{'yes' if e['damaged_object_is_load_error'] else 'NO'}\n"
            f"    with compute ({e['overlap']['matmuls_per_layer']} matmuls per layer): loads overlapped "
            f"{e['overlap']['overlapped_s']} s vs load then compute {e['overlap']['load_then_compute_s']} s "
            f"(ratio {e['overlap']['overlap_ratio']}); a step that saves every layer "
            f"{e['overlap']['step_with_saves_s']} s vs {e['overlap']['compute_s']} s without "
            f"(ratio {e['overlap']['save_slowdown']})"
        )
    if not dry:
        print(f"  io_engine auto chooses {auto_mode} here (kvikio's mode: {report['io_mode']})")
    print(f"  {report['seconds']} s")
    line = json.dumps(report, sort_keys=True)
    print(line)
    out = args.out or (Path(os.environ["OUT"]) / "gpu-check.json" if os.environ.get("OUT") else None)
    if out:
        out.write_text(line + "\n")
    if not kvikio_ran:
        print(f"gpu-check: io_engine gds ran in {engine[0]['io_mode']}: see the connector's warning above")
    if not auto_ok:
        print(f"gpu-check: io_engine auto chose {auto_mode} where kvikio's mode is {report['io_mode']}")
    ok = (
        same
        and same_copy
        and gpu_bad == 0
        and posix_bad == 0
        and engine_ok
        and damage_ok
        and kvikio_ran
        and auto_ok
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
