"""The store under faults and misuse: TP ranks, aliased paths, bad keys and sections, an
unreadable directory, inode exhaustion, a bound that comes back, two writers of one key."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
import xxhash
from test_store import NS, SHAPE, get, get_runs, key, loop_drive, needs_root, payload, put

from kvlab_connector.layout import Layout
from kvlab_connector.ring import StagingRing
from kvlab_connector.store import ObjectShape, Store


@pytest.fixture
def ring() -> StagingRing:
    return StagingRing(8 * SHAPE.stride, SHAPE.stride)


def spread_key(i: int) -> str:
    """Keys that land in many key directories, as real chunk keys do."""
    return hashlib.md5(f"object {i}".encode()).hexdigest()


def write(store: Store, ring: StagingRing, ns: str, k: str, shape: ObjectShape, fill: int) -> bool:
    w = store.begin_write(ns, k, shape, num_tokens=1)
    for s in range(shape.n_sections):
        slot = ring.acquire(timeout_s=10)
        ring.buffer(slot)[:shape.section_bytes] = bytes([(fill + s) % 256]) * shape.section_bytes
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
    return w.done.result(timeout=30)


def committed_on_drives(drives: list[Path], nfrag: int) -> int:
    """Objects whose fragments all sit on the drives, counted from the files themselves."""
    names = [p.name for d in drives for p in d.rglob("*") if p.is_file() and not p.name.startswith(".")
             and p.parent.parent.parent.name == "kvlab-v1"]
    return len([n for n in names if ".0-" in n]) if nfrag == 1 else min(
        len([n for n in names if f".{f}-{nfrag}." in n]) for f in range(nfrag))


def age(drives: list[Path], seconds: float) -> None:
    """Make every file look `seconds` old, as after a restart long after the writes."""
    for d in drives:
        for p in d.rglob("*"):
            st = p.stat()
            os.utime(p, (st.st_atime - seconds, st.st_mtime - seconds))


# ---- TP ranks: one namespace per rank, the same keys in each ---------------------------------
def tp8(mla: bool) -> Layout:
    return Layout(
        layer_names=tuple(f"layer.{i}" for i in range(4)), block_size=16, block_bytes=1024, chunk_tokens=64,
        spec="FullAttentionSpec:test", device="cpu", model_fingerprint="f" * 32, tp_size=8, mla=mla,
    )


def write_ranks(store: Store, ring: StagingRing, layouts: list[Layout], n_keys: int) -> int:
    written = 0
    for lay in layouts:
        for rank in lay.ranks():
            for i in range(n_keys):
                assert write(store, ring, lay.namespace(rank), spread_key(i), lay.shape, rank)
                written += 1
    return written


def test_tp_ranks_of_a_gqa_and_an_mla_model_are_counted_and_survive_a_rebuild(tmp_path: Path) -> None:
    gqa, mla = tp8(mla=False), tp8(mla=True)
    assert len(gqa.ranks()) == 8 and mla.ranks() == [0], "GQA stores per rank, MLA once"
    drives = [tmp_path / "d0", tmp_path / "d1"]
    store = Store(drives, capacity_bytes=1 << 30)
    ring = StagingRing(8 * gqa.shape.stride, gqa.shape.stride)
    written = write_ranks(store, ring, [gqa, mla], n_keys=5)
    assert written == 45
    assert store.scan().objects == written
    assert store.scan().bytes == written * gqa.shape.object_bytes
    age(drives, 600)  # a rebuild at the next start, long after the writes
    scan = Store(drives, capacity_bytes=1 << 30).rebuild()
    assert (scan.objects, scan.removed_partial) == (written, 0)
    assert committed_on_drives(drives, 2) == written
    for lay in (gqa, mla):
        for rank in lay.ranks():
            assert store.count_prefix(lay.namespace(rank), [spread_key(i) for i in range(5)], lay.shape) == 5


def test_tp_ranks_under_a_bound_are_evicted_to_it(tmp_path: Path) -> None:
    gqa, mla = tp8(mla=False), tp8(mla=True)
    drives = [tmp_path / "d0", tmp_path / "d1"]
    bound = 10 * gqa.shape.object_bytes
    store = Store(drives, capacity_bytes=bound)
    ring = StagingRing(8 * gqa.shape.stride, gqa.shape.stride)
    write_ranks(store, ring, [gqa, mla], n_keys=5)
    assert committed_on_drives(drives, 2) <= 10, "the bound holds over every rank's namespace"
    assert store.usage_bytes() <= bound and store.scan().bytes <= bound
    assert store.stats.evictions >= 35
    # The newest writes (the MLA namespace, last) survive the oldest.
    assert store.exists(mla.namespace(0), spread_key(4), mla.shape)
    assert not store.exists(gqa.namespace(0), spread_key(0), gqa.shape)


@pytest.mark.parametrize("tail", [
    ObjectShape(n_sections=1, section_bytes=SHAPE.section_bytes),  # fewer fragments than a chunk
    ObjectShape(n_sections=SHAPE.n_sections, section_bytes=4096),  # as many: fewer blocks a layer
])
def test_objects_of_different_shapes_under_one_key_are_counted_and_kept(tmp_path: Path, tail: ObjectShape) -> None:
    """A whole chunk and a shorter (tail) object in one namespace, under the same keys."""
    drives = [tmp_path / "d0", tmp_path / "d1"]
    store = Store(drives, capacity_bytes=1 << 30)
    ring = StagingRing(8 * SHAPE.stride, SHAPE.stride)
    for i in range(3):
        assert write(store, ring, NS, key(i), SHAPE, i) and write(store, ring, NS, key(i), tail, i)
    age(drives, 600)
    scan = Store(drives, capacity_bytes=1 << 30).rebuild()
    assert (scan.objects, scan.removed_partial) == (6, 0)
    assert scan.bytes == 3 * (SHAPE.object_bytes + tail.object_bytes)
    assert all(store.exists(NS, key(i), s) for i in range(3) for s in (SHAPE, tail))
    assert store.remove(NS, key(0)) == SHAPE.object_bytes + tail.object_bytes
    assert not store.exists(NS, key(0), SHAPE) and not store.exists(NS, key(0), tail)
    assert store.scan().objects == 4


def test_a_chunk_and_tails_in_one_namespace_stay_under_the_bound(tmp_path: Path) -> None:
    drives = [tmp_path / "d0", tmp_path / "d1"]
    tail = ObjectShape(n_sections=SHAPE.n_sections, section_bytes=4096)
    store = Store(drives, capacity_bytes=10 * SHAPE.object_bytes)
    ring = StagingRing(8 * SHAPE.stride, SHAPE.stride)
    for i in range(40):
        assert write(store, ring, NS, spread_key(i), SHAPE, i)
        assert write(store, ring, NS, spread_key(1000 + i), tail, i)
    assert store.scan().bytes <= 10 * SHAPE.object_bytes
    assert store.exists(NS, spread_key(1039), tail) and store.exists(NS, spread_key(39), SHAPE)
    assert not store.exists(NS, spread_key(0), SHAPE)


# ---- refused at the boundary ----------------------------------------------------------------
def test_the_same_directory_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="d0"):
        Store([tmp_path / "d0", tmp_path / "d1", tmp_path / "d0"], capacity_bytes=1 << 30)
    with pytest.raises(ValueError, match="d0"):
        Store([tmp_path / "d0", f"{tmp_path}/./d0/"], capacity_bytes=1 << 30)


def test_one_directory_reached_through_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d0").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "d0")
    with pytest.raises(ValueError, match="alias"):
        Store([tmp_path / "d0", tmp_path / "alias"], capacity_bytes=1 << 30)


@needs_root
def test_one_directory_reached_through_a_bind_mount_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d0").mkdir()
    (tmp_path / "bound").mkdir()
    subprocess.run(["mount", "--bind", str(tmp_path / "d0"), str(tmp_path / "bound")], check=True)
    try:
        with pytest.raises(ValueError, match="bound"):
            Store([tmp_path / "d0", tmp_path / "bound"], capacity_bytes=1 << 30)
    finally:
        subprocess.run(["umount", str(tmp_path / "bound")], check=True)


@pytest.mark.parametrize(("args", "named"), [
    ({"capacity_bytes": -1}, "capacity_bytes"),
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"capacity_bytes": 1.5e9}, "capacity_bytes"),
    ({"capacity_bytes": True}, "capacity_bytes"),
    ({"capacity_bytes": 1 << 30, "io_threads": 0}, "io_threads"),
    ({"capacity_bytes": 1 << 30, "io_threads": -2}, "io_threads"),
])
def test_nonsense_arguments_are_refused(tmp_path: Path, args: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Store([tmp_path / "d0"], **args)


def test_a_path_given_as_one_string_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="paths"):
        Store(str(tmp_path / "d0"), capacity_bytes=1 << 30)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(0, 4096), (-1, 4096), (4, 0), (4, -5)])
def test_a_shape_without_sections_or_bytes_is_refused(shape: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="n_sections|section_bytes"):
        ObjectShape(*shape)


BAD_KEYS = ["AB" * 16, "ab" * 8, "ab" * 16 + "a", "g" * 32, "ab" * 15 + "/x", ""]
CALLS = {
    "begin_write": lambda s, ns, k: s.begin_write(ns, k, SHAPE, num_tokens=1),
    "exists": lambda s, ns, k: s.exists(ns, k, SHAPE),
    "count_prefix": lambda s, ns, k: s.count_prefix(ns, [key(1), k], SHAPE),
    "open_object": lambda s, ns, k: s.open_object(ns, k, SHAPE),
    "touch": lambda s, ns, k: s.touch(ns, k, SHAPE),
    "remove": lambda s, ns, k: s.remove(ns, k),
    "exists_any_shape": lambda s, ns, k: s.exists_any_shape(ns, k),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("bad", BAD_KEYS)
def test_a_key_that_is_not_well_formed_is_refused(tmp_path: Path, ring: StagingRing, call: str, bad: str) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    assert put(store, ring, 1)
    with pytest.raises(ValueError, match=f"key {bad!r}"):
        CALLS[call](store, NS, bad)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_namespace_that_is_not_well_formed_is_refused(tmp_path: Path, call: str) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    with pytest.raises(ValueError, match="namespace 'AB"):
        CALLS[call](store, NS.upper(), key(1))


MISUSES = {
    "short buffer": lambda ring, slot: (1, ring.buffer(slot)[:SHAPE.stride - 1]),
    "read-only buffer": lambda ring, slot: (1, memoryview(bytes(ring.buffer(slot)))),
    "negative index": lambda ring, slot: (-1, ring.buffer(slot)),
    "index = n_sections": lambda ring, slot: (SHAPE.n_sections, ring.buffer(slot)),
    "index past n_sections": lambda ring, slot: (SHAPE.n_sections + 3, ring.buffer(slot)),
    "index twice": lambda ring, slot: (0, ring.buffer(slot)),
}


@pytest.mark.parametrize("misuse", sorted(MISUSES))
def test_a_misused_section_fails_its_writer_and_returns_the_slot(
    tmp_path: Path, ring: StagingRing, misuse: str,
) -> None:
    store = Store([tmp_path / "d0", tmp_path / "d1"], capacity_bytes=1 << 30)
    w = store.begin_write(NS, key(3), SHAPE, num_tokens=1)
    released = []
    # Sections 0..n-2 as they should be; then the misused one in place of the last.
    for s in range(SHAPE.n_sections - 1):
        slot = ring.acquire(timeout_s=10)
        ring.buffer(slot)[:SHAPE.section_bytes] = payload(3, s)
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
    slot = ring.acquire(timeout_s=10)
    section, buf = MISUSES[misuse](ring, slot)
    with pytest.raises(ValueError, match="section"):
        w.submit_section(section, buf, lambda ok, slot=slot: (released.append(ok), ring.release(slot)))
    assert released == [False], "the misused section's slot comes back at once"
    assert w.done.result(timeout=10) is False, "the writer resolves, failed"
    assert ring.in_use == 0
    # The section that never came, late: still no object.
    late = ring.acquire(timeout_s=10)
    w.submit_section(SHAPE.n_sections - 1, ring.buffer(late), lambda ok: ring.release(late))
    assert ring.in_use == 0
    assert not store.exists(NS, key(3), SHAPE)
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and ".meta" not in p.parts]


def test_an_object_with_a_section_never_submitted_never_commits(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    w = store.begin_write(NS, key(2), SHAPE, num_tokens=1)
    for s in (0, 1, 2, 2):  # 3 never comes; 2 comes twice
        slot = ring.acquire(timeout_s=10)
        ring.buffer(slot)[:SHAPE.section_bytes] = payload(2, s)
        try:
            w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
        except ValueError:
            pass
    assert w.done.result(timeout=10) is False
    assert not store.exists(NS, key(2), SHAPE) and ring.in_use == 0


def test_closing_the_store_resolves_writers_still_waiting_for_sections(tmp_path: Path, ring: StagingRing) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    w = store.begin_write(NS, key(2), SHAPE, num_tokens=1)
    slot = ring.acquire(timeout_s=10)
    w.submit_section(0, ring.buffer(slot), lambda ok: ring.release(slot))
    store.close()
    assert w.done.result(timeout=10) is False and ring.in_use == 0


# ---- an unreadable key directory ------------------------------------------------------------
def _as_nobody(d: str, q: multiprocessing.Queue) -> None:
    """In a forked child: drop to nobody (root reads every directory, whatever its mode),
    lock one key directory away, and save far past the bound."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("vllm.kvlab_connector").addHandler(handler)
    shape = ObjectShape(4, 4096)
    store = Store([d], capacity_bytes=10 * shape.object_bytes)
    ring = StagingRing(8 * shape.stride, shape.stride)
    for i in range(5):
        assert write(store, ring, NS, spread_key(i), shape, i)
    locked = os.path.join(d, "kvlab-v1", NS, spread_key(0)[:2])
    os.chmod(locked, 0)
    try:
        saved = sum(write(store, ring, NS, spread_key(i), shape, i) for i in range(5, 80))
        scan, rebuilt = store.scan(), store.rebuild()
        q.put({"locked": locked, "saved": saved, "scan": scan.objects, "rebuilt": rebuilt.objects,
               "evictions": store.stats.evictions, "logs": logs})
    except Exception as e:
        q.put({"error": repr(e)})


def test_an_unreadable_key_directory_is_skipped_and_the_bound_holds() -> None:
    d = tempfile.mkdtemp(prefix="kvlab-unreadable-")  # outside pytest's root-only tmp folder
    try:
        if os.geteuid() == 0:
            os.chown(d, 65534, 65534)
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_as_nobody, args=(d, q))
        p.start()
        try:
            out = q.get(timeout=120)
        finally:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        assert "error" not in out, out.get("error")
        assert any(out["locked"] in line for line in out["logs"]), "the skipped directory is named in the log"
        assert out["saved"] >= 60
        assert out["scan"] <= 10 and out["rebuilt"] <= 10
        assert out["evictions"] >= 50
        stuck = len([f for f in Path(out["locked"]).iterdir() if ".0-1." in f.name])
        held = committed_on_drives([Path(d)], 1) - stuck
        assert held <= 10, f"{held} objects outside the unreadable directory, over a 10-object bound"
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- inodes, and a bound that comes back ----------------------------------------------------
@needs_root
def test_inode_exhaustion_recovers_as_objects_are_evicted(tmp_path: Path, ring: StagingRing) -> None:
    mnt = loop_drive(tmp_path, "16M", inodes=64)
    try:
        store = Store([mnt], capacity_bytes=12 * SHAPE.object_bytes)
        saved = []
        for i in range(200):
            ok = write(store, ring, NS, spread_key(i), SHAPE, i)
            saved.append(ok)
        assert all(saved[-20:]), f"{sum(saved[-20:])} of the last 20 saves committed"
        key_dirs = [p for p in (mnt / "kvlab-v1" / NS).iterdir()]
        assert all(any(p.iterdir()) for p in key_dirs), "evicted objects leave no empty key directory"
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_the_lock_file_and_the_ledger_are_made_at_open(tmp_path: Path) -> None:
    """So that a drive out of inodes later still takes the ledger's updates."""
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    meta = tmp_path / "d0" / "kvlab-v1" / ".meta"
    assert (meta / "lock").is_file() and (meta / "usage").is_file()
    before = {p.stat().st_ino for p in meta.iterdir()}
    ring = StagingRing(8 * SHAPE.stride, SHAPE.stride)
    for i in range(3):
        assert put(store, ring, i)
    store.flush_usage()
    assert store.usage_bytes() == 3 * SHAPE.object_bytes
    assert {p.stat().st_ino for p in meta.iterdir()} == before, "no new file per ledger update"


def test_an_empty_key_directory_goes_with_its_last_object(tmp_path: Path, ring: StagingRing) -> None:
    drives = [tmp_path / "d0", tmp_path / "d1"]
    store = Store(drives, capacity_bytes=1 << 30)
    assert put(store, ring, 1)
    store.remove(NS, key(1))
    assert not [p for d in drives for p in (d / "kvlab-v1" / NS).iterdir()]


@needs_root
def test_a_lowered_bound_grows_back_when_room_returns(tmp_path: Path, ring: StagingRing) -> None:
    mnt = loop_drive(tmp_path, "16M")
    foreign = mnt / "foreign"
    fs = os.statvfs(mnt)
    room = fs.f_bfree * fs.f_frsize  # root may fill the blocks reserved for it too
    subprocess.run(["fallocate", "-l", str(room - 8 * SHAPE.object_bytes), str(foreign)], check=True)
    try:
        store = Store([mnt], capacity_bytes=1 << 30)
        for i in range(30):
            write(store, ring, NS, spread_key(i), SHAPE, i)
        assert store.stats.out_of_space >= 1
        lowered = store.capacity_bytes
        assert lowered <= 8 * SHAPE.object_bytes
        foreign.unlink()
        for i in range(30, 130):
            write(store, ring, NS, spread_key(i), SHAPE, i)
        assert store.capacity_bytes >= 4 * lowered, "the bound grows back with the room"
        assert store.capacity_bytes <= 1 << 30
        assert store.scan().objects > lowered // SHAPE.object_bytes
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


# ---- two writers of one key -----------------------------------------------------------------
def which_write(got: list[bytes | None], a: int, b: int) -> set[int]:
    """The writes (fill a or b) whose sections a read returned."""
    seen = set()
    for s, section in enumerate(got):
        if section is not None:
            seen |= {f for f in (a, b) if section == bytes([(f + s) % 256]) * SHAPE.section_bytes}
    return seen


def test_fragments_of_two_writes_of_one_key_are_never_read_together(tmp_path: Path, ring: StagingRing) -> None:
    """The drives as two interleaved commits leave them: fragment 0 of one write, fragment 1
    of the other, every section verifying on its own."""
    drives = [tmp_path / "d0", tmp_path / "d1"]
    store = Store(drives, capacity_bytes=1 << 30)
    assert write(store, ring, NS, key(1), SHAPE, 10)
    frag0 = store.fragment_path(NS, key(1), SHAPE, 0)
    first = frag0.read_bytes()
    assert write(store, ring, NS, key(1), SHAPE, 20)
    tmp = frag0.with_name(".swap")
    tmp.write_bytes(first)
    os.replace(tmp, frag0)
    got = get_runs(store, ring, 1, max_run=4)
    assert len(which_write(got, 10, 20)) == 1, f"a read combined two writes: {which_write(got, 10, 20)}"


def test_two_concurrent_writers_of_one_key_never_give_a_reader_both(tmp_path: Path, ring: StagingRing) -> None:
    drives = [tmp_path / f"d{i}" for i in range(4)]
    store = Store(drives, capacity_bytes=1 << 30)
    assert write(store, ring, NS, key(5), SHAPE, 10)  # renames replace it from now on: never missing
    stop = threading.Event()
    commits = {10: 0, 20: 0}

    def writer(fill: int) -> None:
        ring = StagingRing(8 * SHAPE.stride, SHAPE.stride)
        while not stop.is_set():
            commits[fill] += write(store, ring, NS, key(5), SHAPE, fill)

    threads = [threading.Thread(target=writer, args=(f,)) for f in (10, 20)]
    for t in threads:
        t.start()
    mixed = whole = reads = 0
    try:
        # Reads go on while both writers replace the object, many times each.
        while (min(commits.values()) < 100 or reads < 400) and reads < 20_000:
            seen = which_write(get_runs(store, ring, 5, max_run=4), 10, 20)
            mixed += len(seen) > 1
            whole += len(seen) == 1
            reads += 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert min(commits.values()) >= 100, f"the writers committed {commits} times"
    assert mixed == 0, f"{mixed} of {reads} reads combined sections of two writes"
    assert whole > 0


# ---- an object in the previous on-drive format -----------------------------------------------
V1_TRAILER = struct.Struct("<8s16s16sIIQIQQ")


def test_an_object_in_the_previous_format_is_a_clean_miss_and_still_evictable(
    tmp_path: Path, ring: StagingRing,
) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    path = store.fragment_path(NS, key(1), SHAPE, 0)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        for s in range(SHAPE.n_sections):
            data = payload(1, s)
            head = V1_TRAILER.pack(b"KVLBSEC1", bytes.fromhex(NS), bytes.fromhex(key(1)), s, SHAPE.n_sections,
                                   SHAPE.section_bytes, 512, 0, xxhash.xxh3_64_intdigest(data))
            trailer = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
            pad = SHAPE.stride - 4096
            f.write(data.ljust(pad, b"\0") + trailer.ljust(4096, b"\0"))
    assert store.exists(NS, key(1), SHAPE)
    assert get(store, ring, 1) == [None] * SHAPE.n_sections
    assert store.rebuild().objects == 1
    assert store.remove(NS, key(1)) == SHAPE.object_bytes
