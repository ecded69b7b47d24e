"""kvlab's store as LMCache's L2 adapter, called as LMCache's storage controllers call it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from kvlab_connector.lmcache_l2.adapter import (
    KvlabL2Adapter,
    KvlabL2AdapterConfig,
    namespace_of,
    shape_for,
    store_key,
)
from kvlab_connector.ring import align_up

SIZE = 300_000  # not a multiple of a section or a page, on purpose
SECTION = 64 << 10


def objkey(i: int, model: str = "m", salt: str = "", rank: int = 0) -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(16, "big"), model_name=model, kv_rank=rank, cache_salt=salt)


def memobj(data: np.ndarray) -> TensorMemoryObj:
    t = torch.from_numpy(data.copy())
    meta = MemoryObjMetadata(shape=torch.Size([len(data)]), dtype=torch.uint8, address=0,
                             phy_size=len(data), fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)


def pattern(i: int, n: int = SIZE) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def adapter(paths: list[Path], capacity: int = 1 << 30, **kw: object) -> KvlabL2Adapter:
    params = {"paths": [str(p) for p in paths], "capacity_bytes": capacity, "section_bytes": SECTION,
              "ring_bytes": 16 * (SECTION + 4096)} | kw
    return KvlabL2Adapter(KvlabL2AdapterConfig.from_dict(params))


def wait(fn, tid: int, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = fn(tid)
        if r is not None:
            return r
        time.sleep(0.002)
    raise TimeoutError(f"task {tid} did not complete")


def store(a: KvlabL2Adapter, keys: list[ObjectKey], objs: list[TensorMemoryObj]) -> bool:
    tid = a.submit_store_task(keys, objs)
    done: dict = {}

    def pop(t: int):  # type: ignore[no-untyped-def]
        done.update(a.pop_completed_store_tasks())
        return done.get(t)

    return wait(pop, tid).is_successful()


def lookup(a: KvlabL2Adapter, keys: list[ObjectKey]) -> list[int]:
    bm = wait(a.query_lookup_and_lock_result, a.submit_lookup_and_lock_task(keys, {}))
    return [i for i in range(len(keys)) if bm.test(i)]


def load(a: KvlabL2Adapter, keys: list[ObjectKey], n: int = SIZE) -> tuple[list[int], list[np.ndarray]]:
    objs = [memobj(np.zeros(n, dtype=np.uint8)) for _ in keys]
    bm = wait(a.query_load_result, a.submit_load_task(keys, objs))
    return [i for i in range(len(keys)) if bm.test(i)], [o.raw_data.numpy() for o in objs]


@pytest.fixture
def drives(tmp_path: Path) -> list[Path]:
    return [tmp_path / "d0", tmp_path / "d1"]


@pytest.fixture
def a(drives: list[Path]) -> Iterator[KvlabL2Adapter]:
    ad = adapter(drives)
    yield ad
    ad.close()


def test_round_trip_is_byte_exact(a: KvlabL2Adapter) -> None:
    keys = [objkey(i) for i in range(6)]
    assert store(a, keys, [memobj(pattern(i)) for i in range(6)])
    assert lookup(a, keys + [objkey(99)]) == list(range(6))
    hits, data = load(a, keys)
    assert hits == list(range(6))
    for i in range(6):
        assert np.array_equal(data[i], pattern(i)), f"object {i} differs after the round trip"


def test_objects_are_striped_over_every_drive(a: KvlabL2Adapter, drives: list[Path]) -> None:
    assert store(a, [objkey(1)], [memobj(pattern(1))])
    for d in drives:
        assert list(d.rglob("*.0-2.*")) or list(d.rglob("*.1-2.*")), f"no fragment on {d}"


def test_hits_survive_a_restart_of_the_cache_server(drives: list[Path]) -> None:
    a = adapter(drives)
    keys = [objkey(i) for i in range(4)]
    assert store(a, keys, [memobj(pattern(i)) for i in range(4)])
    a.close()
    b = adapter(drives)  # a new process would see exactly this: only the drives
    try:
        assert b.objects_at_start == 4
        assert lookup(b, keys) == [0, 1, 2, 3]
        hits, data = load(b, keys)
        assert hits == [0, 1, 2, 3] and np.array_equal(data[3], pattern(3))
    finally:
        b.close()


def test_keys_are_deterministic_and_isolate_every_field() -> None:
    # Fixed values: no process-local hash, and a change of scheme (which would orphan every
    # object already on the drives) cannot slip through unnoticed.
    k = ObjectKey(chunk_hash=bytes(range(16)), model_name="m/x", kv_rank=3)
    assert store_key(k) == "413554f0cfc48aae8dc4785e8b907769"
    assert namespace_of("m/x") == "d902447042f217f2a37ac073f95512bf"
    variants = [
        ObjectKey(chunk_hash=bytes(range(16)), model_name="m/y", kv_rank=3),
        ObjectKey(chunk_hash=bytes(range(16)), model_name="m/x", kv_rank=4),
        ObjectKey(chunk_hash=bytes(range(16)), model_name="m/x", kv_rank=3, object_group_id=1),
        ObjectKey(chunk_hash=bytes(range(16)), model_name="m/x", kv_rank=3, cache_salt="tenant-b"),
        ObjectKey(chunk_hash=bytes(range(1, 17)), model_name="m/x", kv_rank=3),
    ]
    assert len({store_key(v) for v in variants} | {store_key(k)}) == 6
    assert namespace_of("m/x") != namespace_of("m/y")


def test_salted_and_unsalted_objects_do_not_meet(a: KvlabL2Adapter) -> None:
    assert store(a, [objkey(1, salt="tenant-a")], [memobj(pattern(1))])
    assert lookup(a, [objkey(1), objkey(1, salt="tenant-b"), objkey(1, salt="tenant-a")]) == [2]


def test_shape_is_a_function_of_the_size_alone() -> None:
    for n in (1, 4095, 4096, SECTION, SECTION + 1, 4 << 20, 300_000):
        s = shape_for(n, SECTION)
        assert s.n_sections * s.section_bytes >= n > (s.n_sections - 1) * s.section_bytes
        assert s.section_bytes <= SECTION


@pytest.mark.parametrize("damage", ["payload", "trailer", "truncate"])
def test_a_corrupt_object_is_a_miss_never_kv(a: KvlabL2Adapter, drives: list[Path], damage: str) -> None:
    assert store(a, [objkey(7), objkey(8)], [memobj(pattern(7)), memobj(pattern(8))])
    ns, k = namespace_of("m"), store_key(objkey(7))
    frag = sorted(p for d in drives for p in (d / "kvlab-v1" / ns / k[:2]).glob(f"{k}.*"))[0]
    raw = bytearray(frag.read_bytes())
    if damage == "payload":
        raw[100] ^= 0xFF
    elif damage == "trailer":
        raw[align_up(shape_for(SIZE, SECTION).section_bytes) + 20] ^= 0xFF  # the first trailer
    else:
        raw = raw[: len(raw) // 2]
    frag.write_bytes(bytes(raw))
    hits, data = load(a, [objkey(7), objkey(8)])
    assert hits == [1], "the damaged object must be reported as a miss"
    assert np.array_equal(data[1], pattern(8))
    assert a.report_status()["load_failures"] == 1


def test_a_load_into_a_buffer_of_another_size_is_a_miss(a: KvlabL2Adapter) -> None:
    assert store(a, [objkey(1)], [memobj(pattern(1))])
    hits, _ = load(a, [objkey(1)], n=SIZE - 4096)
    assert hits == []


def test_capacity_is_declared_and_enforced_by_lru_eviction(drives: list[Path]) -> None:
    one = shape_for(SIZE, SECTION).object_bytes
    cap = 8 * one
    a = adapter(drives, capacity=cap)
    try:
        assert a.supports_global_eviction and a.get_usage().total_capacity_bytes == cap
        for i in range(30):
            assert store(a, [objkey(i)], [memobj(pattern(i))])
            if i == 2:
                load(a, [objkey(0)])  # a read refreshes object 0: it must outlive 1 and 2
                os.utime(next(drives[0].rglob(f"{store_key(objkey(0))}.0-*")), None)
            time.sleep(0.01)  # distinct mtimes order the eviction
        a.store.flush_usage()
        used = a.get_usage().total_bytes_used
        assert 0 < used <= cap, f"usage {used} exceeds the capacity {cap}"
        present = lookup(a, [objkey(i) for i in range(30)])
        assert 29 in present and 1 not in present, "eviction must drop the least recently used"
        assert a.store.stats.evictions > 0
    finally:
        a.close()


def test_delete_removes_from_every_drive_and_updates_usage(drives: list[Path]) -> None:
    a = adapter(drives, capacity=1 << 20)  # a small capacity: the ledger is updated per commit
    try:
        assert store(a, [objkey(1), objkey(2)], [memobj(pattern(1)), memobj(pattern(2))])
        before = a.get_usage().total_bytes_used
        a.delete([objkey(1), objkey(3)])
        assert lookup(a, [objkey(1), objkey(2)]) == [1]
        assert not [p for d in drives for p in d.rglob(f"{store_key(objkey(1))}.*")]
        assert a.get_usage().total_bytes_used == before - shape_for(SIZE, SECTION).object_bytes
    finally:
        a.close()


def test_storing_an_existing_object_is_a_success_without_a_write(a: KvlabL2Adapter) -> None:
    assert store(a, [objkey(1)], [memobj(pattern(1))])
    assert store(a, [objkey(1)], [memobj(pattern(1))])
    st = a.report_status()
    assert st["objects_stored"] == 1 and st["objects_already_there"] == 1


def test_tasks_run_concurrently(drives: list[Path]) -> None:
    """LMCache's store and prefetch controllers call from two threads."""
    a = adapter(drives)
    errors: list[BaseException] = []
    done: dict = {}
    lock = threading.Lock()

    def finished(tid: int):  # type: ignore[no-untyped-def]
        with lock:  # one completion table, popped by both threads: share what was popped
            done.update(a.pop_completed_store_tasks())
            return done.get(tid)

    def worker(base: int) -> None:
        try:
            for i in range(base, base + 10):
                tid = a.submit_store_task([objkey(i)], [memobj(pattern(i))])
                assert wait(finished, tid).is_successful()
                assert lookup(a, [objkey(i)]) == [0]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(b,)) for b in (0, 100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        hits, data = load(a, [objkey(i) for i in list(range(10)) + list(range(100, 110))])
        assert hits == list(range(20)) and np.array_equal(data[15], pattern(105))
    finally:
        a.close()


# The store call each task's thread makes first: held shut, the task cannot finish.
GATED = {"store": "begin_write", "lookup": "exists_any_shape", "load": "open_object"}


@pytest.mark.parametrize("task", sorted(GATED))
def test_a_submit_returns_before_its_io_is_done(a: KvlabL2Adapter, monkeypatch: pytest.MonkeyPatch,
                                                task: str) -> None:
    """LMCache calls from its controllers' loops: a submit that waited for the drives would
    stall them. (This was a `< 0.05 s` timing, which a busy machine failed.)"""
    assert store(a, [objkey(1)], [memobj(pattern(1))])
    gate = threading.Event()
    entered = threading.Event()
    real = getattr(a.store, GATED[task])

    def held(*args, **kw):  # type: ignore[no-untyped-def]
        entered.set()
        # If the submit itself ran the task, it would be held here until the timeout and
        # return a finished task: the assertion below fails, it does not hang.
        gate.wait(timeout=30)
        return real(*args, **kw)

    monkeypatch.setattr(a.store, GATED[task], held)
    if task == "store":
        tid = a.submit_store_task([objkey(2)], [memobj(pattern(2))])
        result = a.pop_completed_store_tasks
    elif task == "lookup":
        tid = a.submit_lookup_and_lock_task([objkey(1)], {})
        result = a.query_lookup_and_lock_result  # type: ignore[assignment]
    else:
        tid = a.submit_load_task([objkey(1)], [memobj(np.zeros(SIZE, dtype=np.uint8))])
        result = a.query_load_result  # type: ignore[assignment]
    assert entered.wait(timeout=30), "the task started on the adapter's own thread"
    done = result() if task == "store" else result(tid)
    assert not done, "nothing completes while the I/O is held"
    gate.set()
    if task == "store":
        finished: dict = {}

        def pop(t: int):  # type: ignore[no-untyped-def]
            finished.update(a.pop_completed_store_tasks())
            return finished.get(t)

        assert wait(pop, tid).is_successful()
    else:
        assert wait(result, tid).test(0)


def test_bad_params_name_the_field() -> None:
    with pytest.raises(ValueError, match="paths"):
        KvlabL2AdapterConfig.from_dict({"capacity_bytes": 1})
    with pytest.raises(ValueError, match="capacity"):
        KvlabL2AdapterConfig.from_dict({"paths": ["/x"], "capacity_bytes": -1})
    with pytest.raises(ValueError, match="section_bytes"):
        KvlabL2AdapterConfig.from_dict({"paths": ["/x"], "capacity_bytes": 1, "section_bytes": 1000})
    with pytest.raises(ValueError, match="io_threads"):
        KvlabL2AdapterConfig.from_dict({"paths": ["/x"], "capacity_bytes": 1, "io_threads": "8"})


def test_an_unset_capacity_is_the_vllm_connectors_bound() -> None:
    """One default for one store: the registry sends capacity_bytes only where it was set."""
    from kvlab_connector.config import CAPACITY_BYTES, ConnectorConfig

    assert KvlabL2AdapterConfig.from_dict({"paths": ["/x"]}).capacity_bytes == CAPACITY_BYTES
    assert ConnectorConfig.from_extra({"paths": ["/x"]}).capacity_bytes == CAPACITY_BYTES


def test_lmcache_loads_it_as_a_plugin(drives: list[Path]) -> None:
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

    cfg = PluginL2AdapterConfig.from_dict({
        "type": "plugin", "module_path": "kvlab_connector.lmcache_l2.adapter", "class_name": "KvlabL2Adapter",
        "adapter_params": {"paths": [str(d) for d in drives], "capacity_gb": 1},
    })
    a = create_l2_adapter(cfg)
    try:
        assert isinstance(a, KvlabL2Adapter) and a.config.capacity_bytes == 1 << 30
        fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
        assert len(fds) == 3, "the three event fds must be distinct"
    finally:
        a.close()
