"""The GDS path (drive <-> device memory, checksummed on the device) on CPU tensors.

kvikio cannot run without a GPU, so io_gds.PosixFile makes kvikio.CuFile's calls with POSIX
I/O; everything around them (device ring, trailers, wsum64 on tensors, verification on the
device, the worker's copies) is the code a GPU engine runs. `make gpu-check` runs it with
kvikio on a GPU.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_worker import BLOCKS, CHUNK, kv_caches, layout, load, save

from kvlab_connector.checksum import wsum64, wsum64_tensor
from kvlab_connector.config import ConnectorConfig
from kvlab_connector.io.gds import DeviceIO, PosixFile
from kvlab_connector.ring import DeviceRing, StagingRing
from kvlab_connector.scheduler import ChunkIO
from kvlab_connector.store.store import MAGIC_WSUM, MAGIC_XXH3, DeviceMemory, ObjectShape, Store
from kvlab_connector.worker.worker import WorkerSide

NS = "cd" * 16
SHAPE = ObjectShape(n_sections=3, section_bytes=2 * 4096 + 12)


def key(i: int) -> str:
    return f"{i:032x}"


def payload(i: int, s: int) -> np.ndarray:
    return np.random.default_rng(i * 100 + s).integers(0, 256, SHAPE.section_bytes, dtype=np.uint8)


# Device memory as the GDS path sees it, on the CPU: torch tensors moved by posix reads
DEVICE = DeviceMemory(DeviceIO(PosixFile, "posix-stand-in"))


def device_store(tmp_path: Path) -> Store:
    return Store([tmp_path / "d0", tmp_path / "d1"], 1 << 30)


def put_device(store: Store, ring: DeviceRing, i: int) -> bool:
    w = store.begin_write(NS, key(i), SHAPE, num_tokens=64)
    for s in range(SHAPE.n_sections):
        slot = ring.acquire(timeout_s=10)
        ring.tensor(slot)[:SHAPE.section_bytes] = torch.from_numpy(payload(i, s))
        w.submit_section(s, ring.tensor(slot), lambda ok, slot=slot: ring.release(slot), DEVICE)
    return w.done.result(timeout=30)


def get_device(store: Store, ring: DeviceRing, i: int) -> list[bytes | None]:
    handles = store.open_object(NS, key(i), SHAPE, DEVICE)
    if handles is None:
        return [None] * SHAPE.n_sections
    slots = [ring.acquire(timeout_s=10) for _ in range(SHAPE.n_sections)]
    try:
        oks = store.submit_read_sections(
            handles, NS, key(i), SHAPE, list(range(SHAPE.n_sections)), [ring.tensor(s) for s in slots], memory=DEVICE
        ).result(timeout=30)
        return [bytes(ring.tensor(s, SHAPE.section_bytes).numpy()) if ok else None for s, ok in zip(slots, oks, strict=True)]
    finally:
        for s in slots:
            ring.release(s)
        for h in handles:
            h.close()


def get_host(store: Store, i: int) -> list[bytes | None]:
    ring = StagingRing(SHAPE.n_sections * SHAPE.stride, SHAPE.stride)
    fds = store.open_object(NS, key(i), SHAPE)
    assert fds is not None
    out = []
    for s in range(SHAPE.n_sections):
        ok = store.submit_read_section(fds, NS, key(i), SHAPE, s, ring.buffer(s)).result(timeout=30)
        out.append(bytes(ring.buffer(s, SHAPE.section_bytes)) if ok else None)
    for fd in fds:
        os.close(fd)
    return out


def magic_of(store: Store, i: int, s: int) -> bytes:
    frag, offset = store.placement(key(i), SHAPE, s)
    with open(store.fragment_path(NS, key(i), SHAPE, frag), "rb") as f:
        f.seek(offset + SHAPE.stride - 4096)
        return f.read(8)


@pytest.mark.parametrize("n", [1, 3, 4, 4097, 1 << 16])
def test_wsum64_is_the_same_on_host_and_tensor(n: int) -> None:
    b = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert wsum64(b.tobytes()) == wsum64_tensor(torch.from_numpy(b.copy()))


def test_wsum64_sees_a_changed_word_swapped_words_and_a_shift() -> None:
    b = np.random.default_rng(7).integers(0, 256, 8192, dtype=np.uint8)
    base = wsum64(b)
    flipped = b.copy()
    flipped[5000] ^= 0x10
    words = b.copy().view("<u4")
    words[[3, 900]] = words[[900, 3]]
    shifted = np.roll(b, 4)
    assert len({base, wsum64(flipped), wsum64(words.view(np.uint8)), wsum64(shifted)}) == 4


def test_device_sections_round_trip_and_read_on_either_path(tmp_path: Path) -> None:
    store = device_store(tmp_path)
    ring = DeviceRing(8 * SHAPE.stride, SHAPE.stride, "cpu")
    assert put_device(store, ring, 1)
    assert magic_of(store, 1, 0) == MAGIC_WSUM, "a section written from device memory carries wsum64"
    want = [payload(1, s).tobytes() for s in range(SHAPE.n_sections)]
    assert get_device(store, ring, 1) == want
    assert get_host(store, 1) == want, "the host path verifies wsum64 sections too"
    assert ring.in_use == 0


def test_host_sections_read_into_device_memory(tmp_path: Path) -> None:
    store = device_store(tmp_path)
    host_ring = StagingRing(8 * SHAPE.stride, SHAPE.stride)
    w = store.begin_write(NS, key(2), SHAPE, num_tokens=64)
    for s in range(SHAPE.n_sections):
        host_ring.buffer(s)[:SHAPE.section_bytes] = payload(2, s).tobytes()
        w.submit_section(s, host_ring.buffer(s), lambda ok: None)
    assert w.done.result(timeout=30)
    assert magic_of(store, 2, 0) == MAGIC_XXH3
    ring = DeviceRing(8 * SHAPE.stride, SHAPE.stride, "cpu")
    assert get_device(store, ring, 2) == [payload(2, s).tobytes() for s in range(SHAPE.n_sections)]


@pytest.mark.parametrize("damage", ["payload", "trailer", "truncate"])
def test_damaged_device_sections_are_misses(tmp_path: Path, damage: str) -> None:
    store = device_store(tmp_path)
    ring = DeviceRing(8 * SHAPE.stride, SHAPE.stride, "cpu")
    assert put_device(store, ring, 3)
    frag, offset = store.placement(key(3), SHAPE, 1)
    path = store.fragment_path(NS, key(3), SHAPE, frag)
    if damage == "truncate":
        os.truncate(path, offset + SHAPE.stride - 1)
    else:
        at = offset + (100 if damage == "payload" else SHAPE.stride - 4096 + 40)
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    got = get_device(store, ring, 3)
    assert got[1] is None
    for s in range(SHAPE.n_sections):
        if store.placement(key(3), SHAPE, s)[0] != frag:
            assert got[s] == payload(3, s).tobytes(), "a section on another drive still loads"
    if damage == "payload":
        assert store.stats.checksum_failures == 1


def device_worker(tmp_path: Path, **cfg) -> tuple[WorkerSide, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    config = ConnectorConfig.from_extra({"paths": [str(tmp_path / "d0"), str(tmp_path / "d1")],
                                         "ring_bytes": 1 << 20, "chunk_tokens": CHUNK, **cfg})
    w = WorkerSide(config, layout(), Store(config.paths, 1 << 30), rank=0)
    kv = kv_caches(seed=1)
    w.register_kv_caches(kv, BLOCKS)
    w.use_device_io(DeviceIO(PosixFile, "posix-stand-in"), torch.device("cpu"))
    return w, kv


def test_worker_saves_and_loads_through_device_memory(tmp_path: Path) -> None:
    w, kv = device_worker(tmp_path)
    assert isinstance(w.ring, DeviceRing) and w.io_mode == "posix-stand-in"
    save(w, kv, [ChunkIO("a" * 32, [2, 3]), ChunkIO("b" * 32, [7, 5])])
    assert w.store.stats.objects_written == 2
    before = {n: t.clone() for n, t in kv.items()}
    for t in kv.values():
        t.zero_()
    assert load(w, kv, [ChunkIO("a" * 32, [10, 11]), ChunkIO("b" * 32, [12, 13])]) == set()
    for n in kv:
        assert torch.equal(kv[n][[10, 11, 12, 13]], before[n][[2, 3, 7, 5]])
        assert torch.count_nonzero(kv[n][:10]) == 0
    assert w.ring.in_use == 0


def test_worker_device_load_of_a_corrupt_object_is_a_load_error(tmp_path: Path) -> None:
    w, kv = device_worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    frag, offset = w.store.placement("a" * 32, w.shape, 1)
    with open(w.store.fragment_path(w.ns, "a" * 32, w.shape, frag), "r+b") as f:
        f.seek(offset + 64)
        f.write(b"\x00" * 8)
    assert load(w, kv, [ChunkIO("a" * 32, [8, 9])]) == {8, 9}
    assert w.store.stats.checksum_failures == 1


def test_gds_on_a_cpu_engine_is_refused(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra({"paths": [str(tmp_path / "d0")], "chunk_tokens": CHUNK, "io_engine": "gds"})
    w = WorkerSide(config, layout(), Store(config.paths, 1 << 30), rank=0)
    with pytest.raises(RuntimeError, match="io_engine 'gds'.*set io_engine 'auto' or 'posix'"):
        w.register_kv_caches(kv_caches(seed=1), BLOCKS)


class _FlippingFile(PosixFile):
    """Reads come back with one byte changed: what a broken DMA path would deliver."""

    def pread(self, t, size: int, file_offset: int = 0):  # type: ignore[no-untyped-def]
        done = super().pread(t, size, file_offset)
        t.view(torch.uint8).reshape(-1)[size // 2] ^= 0xFF
        return done


class _StuckFile(PosixFile):
    """A write that hangs until the test releases it (a broken cuFile driver)."""

    released = threading.Event()

    def pwrite(self, t, size: int, file_offset: int = 0):  # type: ignore[no-untyped-def]
        self.released.wait(30)
        return super().pwrite(t, size, file_offset)


def test_device_io_self_test_passes_on_every_drive_and_leaves_nothing(tmp_path: Path) -> None:
    drives = [tmp_path / "d0", tmp_path / "d1" / "kvlab-v1"]
    assert DeviceIO(PosixFile, "posix-stand-in").self_test(torch.device("cpu"), drives) is None
    assert [p for d in drives for p in d.iterdir()] == [], "the scratch files are removed"


def test_device_io_self_test_names_the_drive_and_what_went_wrong(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "not-a-folder"
    bad.write_bytes(b"")
    why = DeviceIO(PosixFile, "posix-stand-in").self_test(torch.device("cpu"), [good, bad])
    assert why is not None and str(bad) in why and str(good) not in why
    why = DeviceIO(_FlippingFile, "flipping").self_test(torch.device("cpu"), [good])
    assert why == f"{good}: the bytes read back differ from those written"
    _StuckFile.released.clear()
    t0 = time.monotonic()
    try:
        why = DeviceIO(_StuckFile, "stuck").self_test(torch.device("cpu"), [good], timeout_s=0.3)
        took = time.monotonic() - t0
    finally:
        _StuckFile.released.set()  # the abandoned self-test ends with this test, whatever it found
    assert why == "timed out after 0.3 s" and took < 2, "a hung call costs the timeout only"


def test_device_io_self_test_refuses_a_device_checksum_the_host_would_not_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvlab_connector import checksum

    real = checksum.wsum64_tensor
    monkeypatch.setattr(checksum, "wsum64_tensor", lambda t: real(t) ^ 1)
    why = DeviceIO(PosixFile, "posix-stand-in").self_test(torch.device("cpu"), [tmp_path])
    assert why is not None and why.startswith("wsum64 on cpu differs from wsum64 on the host")


@pytest.mark.parametrize(
    ("io_engine", "mode", "wanted"),
    [("auto", "gds", True), ("gds", "gds", True), ("auto", "gds-compat", False), ("gds", "gds-compat", True),
     ("auto", None, False), ("gds", None, False)],
)
def test_kvikio_carries_kv_with_nvidia_fs_or_when_asked_for(io_engine: str, mode: str | None, wanted: bool) -> None:
    from kvlab_connector.io.gds import GdsProbe
    from kvlab_connector.worker.worker import kvikio_wanted

    assert kvikio_wanted(io_engine, GdsProbe(mode, "test", {})) is wanted
