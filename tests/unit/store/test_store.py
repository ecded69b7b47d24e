"""The on-drive store: round trip, striping, corruption, torn writes, capacity, processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvlab_connector.ring import StagingRing
from kvlab_connector.store import ObjectShape, Store
from kvlab_connector.store.memory import HostMemory

NS = "ab" * 16
SHAPE = ObjectShape(n_sections=4, section_bytes=3 * 4096 + 100)  # not page-aligned on purpose


def key(i: int) -> str:
    return f"{i:032x}"


def payload(i: int, s: int) -> bytes:
    return np.random.default_rng(i * 1000 + s).integers(0, 256, SHAPE.section_bytes, dtype=np.uint8).tobytes()


def put(store: Store, ring: StagingRing, i: int) -> bool:
    w = store.begin_write(NS, key(i), SHAPE, num_tokens=512)
    for s in range(SHAPE.n_sections):
        slot = ring.acquire(timeout_s=10)
        buf = ring.buffer(slot)
        buf[:SHAPE.section_bytes] = payload(i, s)
        w.submit_section(s, buf, lambda ok, slot=slot: ring.release(slot))
    return w.done.result(timeout=30)


def get(store: Store, ring: StagingRing, i: int) -> list[bytes | None]:
    fds = store.open_object(NS, key(i), SHAPE)
    if fds is None:
        return [None] * SHAPE.n_sections
    out = []
    try:
        for s in range(SHAPE.n_sections):
            slot = ring.acquire(timeout_s=10)
            try:
                ok = store.submit_read_section(fds, NS, key(i), SHAPE, s, ring.buffer(slot)).result(timeout=30)
                out.append(bytes(ring.buffer(slot, SHAPE.section_bytes)) if ok else None)
            finally:
                ring.release(slot)
    finally:
        for fd in fds:
            os.close(fd)
    return out


@pytest.fixture
def ring() -> StagingRing:
    return StagingRing(8 * SHAPE.stride, SHAPE.stride)


def test_round_trip(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    assert put(store, ring, 1)
    assert store.exists(NS, key(1), SHAPE)
    assert get(store, ring, 1) == [payload(1, s) for s in range(SHAPE.n_sections)]
    assert not store.exists(NS, key(2), SHAPE)


def test_requests_in_flight_grow_with_the_drives(tmp_path: Path) -> None:
    from kvlab_connector.store.store import IO_THREADS_PER_DRIVE

    paths = [tmp_path / f"d{i}" for i in range(3)]
    for io_threads, expected in ((None, 3 * IO_THREADS_PER_DRIVE), (5, 5)):
        store = Store(paths, capacity_bytes=1 << 30, io_threads=io_threads)
        try:
            assert store.engine.threads == expected
        finally:
            store.close()


def test_sections_are_striped_over_every_drive(tmp_path: Path, ring: StagingRing) -> None:
    drives = [tmp_path / f"d{i}" for i in range(3)]
    store = Store(drives, capacity_bytes=1 << 30)
    for i in range(6):
        assert put(store, ring, i)
    for d in drives:
        frags = list((d / "kvlab-v1" / NS).rglob("*-3.*"))
        assert len(frags) == 6, f"{d} holds {len(frags)} fragments"
    assert all(get(store, ring, i) == [payload(i, s) for s in range(4)] for i in range(6))


def fragment_files(tmp_path: Path, i: int) -> list[Path]:
    return sorted(tmp_path.rglob(f"{key(i)}.*"))


def test_queued_sections_go_out_as_one_vectored_write(tmp_path: Path, ring: StagingRing) -> None:
    import threading

    from kvlab_connector.io.posix import PosixEngine

    engine = PosixEngine(threads=1)
    gate = threading.Event()
    engine.submit(gate.wait)  # the only I/O thread is busy while all four sections queue
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30, engine=engine)
    w = store.begin_write(NS, key(3), SHAPE, num_tokens=512)
    for s in (2, 0, 3, 1):  # out of order: the drain writes them by offset
        slot = ring.acquire(timeout_s=10)
        ring.buffer(slot)[:SHAPE.section_bytes] = payload(3, s)
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
    gate.set()
    assert w.done.result(timeout=30)
    assert len(store.stats.io_latency_s) == 1, "four adjacent sections should take one request"
    assert store.stats.bytes_written == SHAPE.object_bytes
    assert get(store, ring, 3) == [payload(3, s) for s in range(SHAPE.n_sections)]
    assert ring.in_use == 0


def get_runs(store: Store, ring: StagingRing, i: int, max_run: int) -> list[bytes | None]:
    """Read every section of object i with one request per run of adjacent sections."""
    fds = store.open_object(NS, key(i), SHAPE)
    assert fds is not None
    out: list[bytes | None] = [None] * SHAPE.n_sections
    try:
        for run in store.read_runs(key(i), SHAPE, range(SHAPE.n_sections), max_run):
            slots = [ring.acquire(timeout_s=10) for _ in run]
            try:
                oks = store.submit_read_sections(fds, NS, key(i), SHAPE, run, [ring.buffer(x) for x in slots]).result(30)
                for s, slot, ok in zip(run, slots, oks, strict=True):
                    out[s] = bytes(ring.buffer(slot, SHAPE.section_bytes)) if ok else None
            finally:
                for slot in slots:
                    ring.release(slot)
    finally:
        for fd in fds:
            os.close(fd)
    return out


@pytest.mark.parametrize(("drives", "max_run", "runs"), [
    (1, 4, [[0, 1, 2, 3]]),
    (1, 3, [[0, 1, 2], [3]]),
    (1, 1, [[0], [1], [2], [3]]),
    (2, 4, "two runs of two, one per fragment file"),
])
def test_adjacent_sections_are_read_as_one_request(
    tmp_path: Path, ring: StagingRing, drives: int, max_run: int, runs: list[list[int]] | str,
) -> None:
    store = Store([tmp_path / f"d{d}" for d in range(drives)], capacity_bytes=1 << 30)
    assert put(store, ring, 5)
    got_runs = store.read_runs(key(5), SHAPE, range(SHAPE.n_sections), max_run)
    if isinstance(runs, list):
        assert got_runs == runs
    else:
        assert sorted(sorted(r) for r in got_runs) == [[0, 2], [1, 3]]
    before = len(store.stats.io_latency_s)
    assert get_runs(store, ring, 5, max_run) == [payload(5, s) for s in range(SHAPE.n_sections)]
    assert len(store.stats.io_latency_s) - before == len(got_runs)
    assert ring.in_use == 0


def flip_a_byte_of_section_1(tmp_path: Path, i: int) -> Path:
    f = fragment_files(tmp_path, i)[0]
    data = bytearray(f.read_bytes())
    data[SHAPE.stride + 17] ^= 0x40  # inside section 1's payload
    f.write_bytes(bytes(data))
    return f


def test_a_bad_section_inside_a_run_is_a_miss_alone(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    assert put(store, ring, 1)
    f = flip_a_byte_of_section_1(tmp_path, 1)
    os.truncate(f, SHAPE.stride * 3 + 4096)  # and section 3 cut short
    got = get_runs(store, ring, 1, max_run=4)
    assert got == [payload(1, 0), None, payload(1, 2), None]
    assert store.stats.checksum_failures == 1 and store.stats.sections_failed == 2


def test_failed_write_discards_the_object_and_frees_its_slots(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    w = store.begin_write(NS, key(4), SHAPE, num_tokens=512)
    w._close_fds()  # the drive goes away under the writer: every write fails (EBADF)
    for s in range(SHAPE.n_sections):
        slot = ring.acquire(timeout_s=10)
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
    assert w.done.result(timeout=30) is False
    assert not store.exists(NS, key(4), SHAPE)
    assert not list((tmp_path / "d0").rglob("*.tmp"))
    assert ring.in_use == 0
    assert store.stats.writes_aborted == 1


def test_flipped_byte_is_a_miss(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    assert put(store, ring, 1)
    flip_a_byte_of_section_1(tmp_path, 1)
    got = get(store, ring, 1)
    assert got[0] == payload(1, 0) and got[1] is None
    assert store.stats.checksum_failures == 1


def test_truncated_fragment_is_a_miss(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    assert put(store, ring, 1)
    f = fragment_files(tmp_path, 1)[0]
    os.truncate(f, SHAPE.stride * 2 + 4096)
    got = get(store, ring, 1)
    assert got[:2] == [payload(1, 0), payload(1, 1)] and got[2] is None and got[3] is None


def test_section_swapped_between_objects_is_a_miss(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    assert put(store, ring, 1) and put(store, ring, 2)
    a, b = fragment_files(tmp_path, 1)[0], fragment_files(tmp_path, 2)[0]
    b.write_bytes(a.read_bytes())  # valid checksums, wrong key
    assert get(store, ring, 2) == [None] * 4


def test_vanished_drive_is_a_miss(tmp_path: Path, ring: StagingRing) -> None:
    import shutil

    drives = [tmp_path / "d0", tmp_path / "d1"]
    store = Store(drives, capacity_bytes=1 << 30)
    assert put(store, ring, 1)
    shutil.rmtree(drives[1])  # the path is gone, as after an unmount of its drive
    assert not store.exists(NS, key(1), SHAPE)
    assert get(store, ring, 1) == [None] * 4


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to attach and unmount a loop device")


def loop_drive(tmp_path: Path, size: str, inodes: int | None = None) -> Path:
    """A real ext4 filesystem of `size` (and as few as `inodes` inodes) on a loop device,
    mounted; the caller unmounts it."""
    img, mnt = tmp_path / "drive.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", size, str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", *(["-N", str(inodes)] if inodes else []), str(img)], check=True)
    if subprocess.run(["mount", "-o", "loop", str(img), str(mnt)]).returncode != 0:
        pytest.skip("this kernel refuses loop mounts here")
    return mnt


@needs_root
def test_unmounted_loop_drive_is_a_miss(tmp_path: Path, ring: StagingRing) -> None:
    mnt = loop_drive(tmp_path, "64M")
    try:
        store = Store([tmp_path / "d0", mnt], capacity_bytes=1 << 30)
        assert put(store, ring, 1)
        assert get(store, ring, 1) == [payload(1, s) for s in range(4)]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
    assert not store.exists(NS, key(1), SHAPE)
    assert get(store, ring, 1) == [None] * 4


@needs_root
def test_a_full_drive_lowers_the_bound_and_saves_go_on(tmp_path: Path, ring: StagingRing) -> None:
    mnt = loop_drive(tmp_path, "16M")
    try:
        store = Store([mnt], capacity_bytes=1 << 30)  # a bound far beyond what the drive holds
        n = 3 * (16 << 20) // SHAPE.object_bytes
        saved = [put(store, ring, i) for i in range(n)]
        full_at = saved.index(False)
        assert store.stats.out_of_space >= 1 and store.capacity_bytes < 16 << 20
        after = saved[full_at + 1:]
        assert len(after) - sum(after) <= 4, "saves go on once the bound came down"
        assert not list(mnt.rglob("*.tmp")), "a failed write leaves nothing behind"
        for i in range(n):  # each object is whole or a miss, never other bytes
            got = get(store, ring, i)
            assert got == [None] * SHAPE.n_sections or got == [payload(i, s) for s in range(SHAPE.n_sections)]
        newest = max(i for i, ok in enumerate(saved) if ok)
        assert get(store, ring, newest) == [payload(newest, s) for s in range(SHAPE.n_sections)]
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_capacity_bound_holds_under_ten_times_the_working_set(tmp_path: Path, ring: StagingRing) -> None:
    capacity = 10 * SHAPE.object_bytes
    store = Store([tmp_path / "d0", tmp_path / "d1"], capacity_bytes=capacity)
    for i in range(100):
        assert put(store, ring, i)
        assert store.usage_bytes() <= capacity
    scan = store.rebuild()
    assert scan.bytes <= capacity
    assert store.stats.evictions >= 85
    # The newest objects survive; the oldest went first.
    assert store.exists(NS, key(99), SHAPE) and not store.exists(NS, key(0), SHAPE)


def test_reads_refresh_recency(tmp_path: Path, ring: StagingRing) -> None:
    capacity = 4 * SHAPE.object_bytes
    store = Store([tmp_path / "d0"], capacity_bytes=capacity)
    for i in range(4):
        assert put(store, ring, i)
        time.sleep(0.02)
    assert get(store, ring, 0)[0] is not None
    store.touch(NS, key(0), SHAPE)
    time.sleep(0.02)
    assert put(store, ring, 4)  # crosses the capacity: evicts the least recently used
    assert store.exists(NS, key(0), SHAPE) and not store.exists(NS, key(1), SHAPE)


WRITER = r"""
import sys, time
sys.path[:0] = {paths!r}
from kvlab_connector.ring import StagingRing
from kvlab_connector.store import ObjectShape, Store
shape = ObjectShape({n}, {b})
store = Store([{d!r}], capacity_bytes=1 << 34)
ring = StagingRing(2 * shape.stride, shape.stride)
w = store.begin_write({ns!r}, "{k}", shape, num_tokens=1)
for s in range(shape.n_sections - 1):
    slot = ring.acquire(timeout_s=5)
    ring.buffer(slot)[:shape.section_bytes] = bytes([s]) * shape.section_bytes
    w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
print("written", flush=True)
time.sleep(60)  # killed here, one section short of a commit
"""


def test_kill_9_mid_save_leaves_no_readable_object(tmp_path: Path, ring: StagingRing) -> None:
    d = tmp_path / "d0"
    code = WRITER.format(paths=sys.path, n=SHAPE.n_sections, b=SHAPE.section_bytes, d=str(d), ns=NS, k=key(7))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "written"
        time.sleep(0.3)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    store = Store([d], capacity_bytes=1 << 30)
    assert not store.exists(NS, key(7), SHAPE)
    assert get(store, ring, 7) == [None] * 4
    assert list(d.rglob("*.tmp")), "the dead writer's temporary file should be there before the rebuild"
    scan = store.rebuild()
    assert scan.objects == 0 and scan.removed_partial >= 1
    assert not list(d.rglob("*.tmp"))


def test_rebuild_counts_committed_objects(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0", tmp_path / "d1"], capacity_bytes=1 << 30)
    for i in range(5):
        assert put(store, ring, i)
    fresh = Store([tmp_path / "d0", tmp_path / "d1"], capacity_bytes=1 << 30)
    scan = fresh.rebuild()
    assert scan.objects == 5
    assert scan.bytes == 5 * SHAPE.object_bytes
    assert fresh.usage_bytes() == scan.bytes


def _proc_writer(drives: list[str], start: int, count: int, q: mp.Queue) -> None:
    store = Store(drives, capacity_bytes=6 * SHAPE.object_bytes)
    ring = StagingRing(4 * SHAPE.stride, SHAPE.stride)
    ok = all(put(store, ring, i) for i in range(start, start + count))
    q.put(ok)


def _proc_reader(drives: list[str], count: int, q: mp.Queue) -> None:
    store = Store(drives, capacity_bytes=6 * SHAPE.object_bytes)
    ring = StagingRing(4 * SHAPE.stride, SHAPE.stride)
    wrong = 0
    for _ in range(3):
        for i in range(count):
            for s, got in enumerate(get(store, ring, i)):
                if got is not None and got != payload(i, s):
                    wrong += 1
    q.put(wrong)


def test_several_writer_and_reader_processes_share_one_store(tmp_path: Path) -> None:
    drives = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_proc_writer, args=(drives, w * 10, 10, q)) for w in range(3)]
    procs += [ctx.Process(target=_proc_reader, args=(drives, 30, q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    writers_ok = [r for r in results if isinstance(r, bool)]
    wrong = [r for r in results if not isinstance(r, bool)]
    assert writers_ok == [True, True, True]
    assert wrong == [0, 0], "a reader got bytes that are not the object's"
    store = Store(drives, capacity_bytes=6 * SHAPE.object_bytes)
    assert store.rebuild().bytes <= 6 * SHAPE.object_bytes


def test_store_bench_verifies_what_it_reads_back(tmp_path: Path) -> None:
    from kvlab_connector.bench import run_store

    paths = [tmp_path / "a", tmp_path / "b"]
    run = run_store(paths, size_mib=32, section_mib=1, sections=8, ring_mib=8, threads=2, verify=True)
    assert run.io_threads == 2
    assert run.verified is True and run.objects == 4 and run.bytes == 32 << 20
    assert run.read_gbps > 0 and run.write_gbps > 0 and run.paths == [str(p) for p in paths]


def test_beginning_a_write_touches_no_drive(tmp_path: Path, ring: StagingRing) -> None:
    """begin_write runs on the engine's forward pass: files are created by the I/O thread
    that first writes to them."""
    store = Store([tmp_path / "d0", tmp_path / "d1"], capacity_bytes=1 << 30)
    before = sorted(tmp_path.rglob("*"))
    w = store.begin_write(NS, key(8), SHAPE, num_tokens=512)
    assert sorted(tmp_path.rglob("*")) == before
    for s in range(SHAPE.n_sections):
        slot = ring.acquire(timeout_s=10)
        ring.buffer(slot)[:SHAPE.section_bytes] = payload(8, s)
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
    assert w.done.result(timeout=30)
    assert get(store, ring, 8) == [payload(8, s) for s in range(SHAPE.n_sections)]


def test_a_drive_that_refuses_files_fails_the_write_cleanly(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    w = store.begin_write(NS, key(9), SHAPE, num_tokens=512)
    w.tmp[0].parent.parent.mkdir(parents=True, exist_ok=True)
    w.tmp[0].parent.write_text("a file where the key's folder should be")  # mkdir/open fail
    for s in range(SHAPE.n_sections):
        slot = ring.acquire(timeout_s=10)
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
    assert w.done.result(timeout=30) is False
    assert ring.in_use == 0 and store.stats.writes_aborted == 1


class _SealWatch(HostMemory):
    """The host memory, noting which thread seals each section; optionally failing a seal."""

    def __init__(self, fail_section: int | None = None):
        self.threads: list[int] = []
        self.fail_section = fail_section

    def seal(self, fields, section, buf):  # type: ignore[no-untyped-def]
        self.threads.append(threading.get_ident())
        if section == self.fail_section:
            raise RuntimeError("seal failed")
        super().seal(fields, section, buf)


def test_sections_are_sealed_on_the_io_threads_not_the_callers(tmp_path: Path) -> None:
    # The seal (an xxh3 over the whole payload) ran in submit_section: on a CPU engine, in the
    # forward pass's thread.
    store = Store([str(tmp_path / "d0")], capacity_bytes=1 << 30)
    ring = StagingRing(8 * SHAPE.stride, SHAPE.stride)
    memory = _SealWatch()
    w = store.begin_write(NS, key(1), SHAPE, num_tokens=512)
    for s in range(SHAPE.n_sections):
        slot = ring.acquire(timeout_s=10)
        ring.buffer(slot)[:SHAPE.section_bytes] = payload(1, s)
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot), memory)
    assert w.done.result(timeout=30)
    assert len(memory.threads) == SHAPE.n_sections
    assert threading.get_ident() not in memory.threads
    assert get(store, ring, 1) == [payload(1, s) for s in range(SHAPE.n_sections)]
    store.close()


def test_a_failed_seal_fails_the_object_not_the_caller(tmp_path: Path) -> None:
    store = Store([str(tmp_path / "d0")], capacity_bytes=1 << 30)
    ring = StagingRing(8 * SHAPE.stride, SHAPE.stride)
    memory = _SealWatch(fail_section=2)
    released: list[bool] = []
    w = store.begin_write(NS, key(2), SHAPE, num_tokens=512)
    for s in range(SHAPE.n_sections):
        slot = ring.acquire(timeout_s=10)
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: (released.append(ok), ring.release(slot)), memory)
    assert w.done.result(timeout=30) is False
    assert len(released) == SHAPE.n_sections and not all(released)
    assert ring.in_use == 0
    assert get(store, ring, 2) == [None] * SHAPE.n_sections
    store.close()
