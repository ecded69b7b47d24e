"""The connector's worker side on real tensors: layer-wise loads, saves, timeouts, drops."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from kvlab_connector.config import ConnectorConfig
from kvlab_connector.io.posix import PosixEngine
from kvlab_connector.layout import Layout
from kvlab_connector.scheduler import ChunkIO, StepMetadata
from kvlab_connector.store.store import Store
from kvlab_connector.worker.worker import WorkerSide

LAYERS, BLOCKS, HEADS, BS, HD = 3, 16, 2, 16, 8  # CPU layout: [blocks, heads, block_size, 2*head_dim]
CHUNK = 32  # two blocks per chunk


def layout() -> Layout:
    block_bytes = HEADS * BS * 2 * HD * 4
    return Layout(tuple(f"layers.{i}.attn" for i in range(LAYERS)), BS, block_bytes, CHUNK, "spec", "cpu",
                  "fp", 1, False)


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(BLOCKS, HEADS, BS, 2 * HD, generator=g) for i in range(LAYERS)}


_stores: list[Store] = []


@pytest.fixture(autouse=True)
def close_stores() -> Iterator[None]:
    """A test's stores close with it, so that their I/O threads end with the test (a load
    error's logged traceback holds the worker, and its store, past the test's end)."""
    yield
    while _stores:
        _stores.pop().close()


def worker(tmp_path: Path, engine: PosixEngine | None = None, **cfg) -> tuple[WorkerSide, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    config = ConnectorConfig.from_extra({"paths": [str(tmp_path / "d0"), str(tmp_path / "d1")],
                                         "ring_bytes": 1 << 20, "chunk_tokens": CHUNK, **cfg})
    store = Store(config.paths, 1 << 30, engine=engine)
    _stores.append(store)
    w = WorkerSide(config, layout(), store, rank=0)
    kv = kv_caches(seed=1)
    w.register_kv_caches(kv, BLOCKS)
    return w, kv


def save(w: WorkerSide, kv: dict[str, torch.Tensor], chunks: list[ChunkIO], written: int | None = None) -> None:
    """One step that saves `chunks`, then waits (up to 10 s) until `written` objects are on
    the drive: by default one per distinct key (a key handed twice is written once)."""
    meta = StepMetadata(saves=chunks)
    for name, t in kv.items():
        w.save_layer(name, t, meta)
    w.end_step()
    want = len({c.key for c in chunks}) if written is None else written
    deadline = time.monotonic() + 10
    while w.store.stats.objects_written < want and time.monotonic() < deadline:
        time.sleep(0.01)


def load(w: WorkerSide, kv: dict[str, torch.Tensor], chunks: list[ChunkIO]) -> set[int]:
    w.start_load(StepMetadata(loads=chunks))
    for name in kv:
        w.wait_for_layer(name)
    return w.take_load_errors()


def test_saved_chunks_load_back_into_other_blocks(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3]), ChunkIO("b" * 32, [7, 5])])
    assert w.store.stats.objects_written == 2
    before = {n: t.clone() for n, t in kv.items()}
    for t in kv.values():
        t.zero_()
    errors = load(w, kv, [ChunkIO("a" * 32, [10, 11]), ChunkIO("b" * 32, [12, 13])])
    assert errors == set()
    for n in kv:
        assert torch.equal(kv[n][[10, 11, 12, 13]], before[n][[2, 3, 7, 5]])
        assert torch.count_nonzero(kv[n][:10]) == 0, "blocks outside the load stay untouched"


@pytest.mark.parametrize("targets", [[10, 11, 12, 13], [13, 12, 11, 10], [14, 4, 5, 9]])
def test_loads_land_in_any_block_order(tmp_path: Path, targets: list[int]) -> None:
    w, kv = worker(tmp_path)
    assert w.transfers is not None and w.transfers.cache.direct_copy, "CPU KV blocks contiguous along dim 0 take the memmove path"
    save(w, kv, [ChunkIO("a" * 32, [2, 3]), ChunkIO("b" * 32, [7, 5])])
    before = {n: t.clone() for n, t in kv.items()}
    for t in kv.values():
        t.zero_()
    assert load(w, kv, [ChunkIO("a" * 32, targets[:2]), ChunkIO("b" * 32, targets[2:])]) == set()
    untouched = [b for b in range(BLOCKS) if b not in targets]
    for n in kv:
        assert torch.equal(kv[n][targets], before[n][[2, 3, 7, 5]])
        assert torch.count_nonzero(kv[n][untouched]) == 0


def test_blocks_interleaved_across_layers_load_in_place(tmp_path: Path) -> None:
    """A backing shared by all layers, blocks outermost: each layer's blocks sit apart."""
    backing = torch.randn(BLOCKS, LAYERS, HEADS, BS, 2 * HD, generator=torch.Generator().manual_seed(3))
    kv = {f"layers.{i}.attn": backing[:, i] for i in range(LAYERS)}
    w, _ = worker(tmp_path)
    w.register_kv_caches(kv, BLOCKS)
    assert w.transfers is not None and w.transfers.cache.direct_copy
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    saved = backing[[2, 3]].clone()
    backing.zero_()
    assert load(w, kv, [ChunkIO("a" * 32, [9, 10])]) == set()
    assert torch.equal(backing[[9, 10]], saved)
    assert torch.count_nonzero(backing[:9]) == 0 and torch.count_nonzero(backing[11:]) == 0


@pytest.mark.parametrize(("ids", "runs"), [
    ([4, 5, 6, 7], [(0, 4, 4)]),
    ([7, 6, 5, 4], [(0, 7, 1), (1, 6, 1), (2, 5, 1), (3, 4, 1)]),
    ([-1, 5, 6, 9], [(1, 5, 2), (3, 9, 1)]),
    ([4, -1, 5, 6], [(0, 4, 1), (2, 5, 2)]),
    ([-1, -1], []),
])
def test_block_runs(ids: list[int], runs: list[tuple[int, int, int]]) -> None:
    from kvlab_connector.worker.worker import _runs

    assert _runs(ids) == runs


def test_a_block_outside_the_cache_is_a_load_error_not_a_stray_write(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    assert load(w, kv, [ChunkIO("a" * 32, [BLOCKS - 1, BLOCKS])]) == {BLOCKS - 1, BLOCKS}


def test_blocks_the_engine_already_holds_are_left_alone(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    for t in kv.values():
        t[9].fill_(7.0)
    errors = load(w, kv, [ChunkIO("a" * 32, [-1, 8])])
    assert errors == set()
    for t in kv.values():
        assert torch.all(t[9] == 7.0) and torch.equal(t[8], t[3])


def test_missing_object_reports_its_blocks(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    assert load(w, kv, [ChunkIO("c" * 32, [4, 5])]) == {4, 5}


class SlowEngine(PosixEngine):
    """A drive whose reads hang (a dead NVMe-oF path): they finish long after the deadline."""

    def submit_readv(self, fd: int, bufs: list[memoryview], offset: int) -> Future[int]:
        def slow() -> int:
            time.sleep(1.5)
            return super(SlowEngine, self).submit_readv(fd, bufs, offset).result()

        return self._pool.submit(slow)


def test_a_hung_drive_becomes_load_errors_not_a_hung_engine(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    slow, _ = worker(tmp_path, engine=SlowEngine(4), load_timeout_s=0.3)
    kv2 = kv_caches(seed=2)
    slow.register_kv_caches(kv2, BLOCKS)
    target = {n: t[[6, 7]].clone() for n, t in kv2.items()}
    t0 = time.monotonic()
    errors = load(slow, kv2, [ChunkIO("a" * 32, [6, 7])])
    assert time.monotonic() - t0 < 1.4, "the wait must end at the deadline"
    assert errors == {6, 7}
    time.sleep(2.0)  # the late reads land now: they must not touch blocks handed to recompute
    for n, t in kv2.items():
        assert torch.equal(t[[6, 7]], target[n])


def test_an_object_handed_twice_in_one_step_is_written_once_and_the_forward_goes_on(tmp_path: Path) -> None:
    """The scheduler plans each object once per step; a worker handed one twice must not
    submit a section twice (the store refuses it, and the error in save_layer killed the
    engine under vLLM's prefix_repetition benchmark)."""
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3], "r1"), ChunkIO("a" * 32, [2, 3], "r2"), ChunkIO("b" * 32, [4, 5], "r2")])
    assert w.store.stats.objects_written == 2
    before = {n: t.clone() for n, t in kv.items()}
    assert load(w, kv, [ChunkIO("a" * 32, [10, 11]), ChunkIO("b" * 32, [12, 13])]) == set()
    for n in kv:
        assert torch.equal(kv[n][[10, 11, 12, 13]], before[n][[2, 3, 4, 5]])


def test_full_ring_drops_saves_and_counts_them(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    assert w.ring is not None
    held = [w.ring.acquire() for _ in range(w.ring.num_slots)]
    save(w, kv, [ChunkIO("d" * 32, [1, 2])], written=0)  # dropped at once: nothing to wait for
    assert w.saves_dropped == 1 and w.store.stats.objects_written == 0
    for s in held:
        w.ring.release(s)
    assert not w.store.exists(w.ns, "d" * 32, w.shape)


@pytest.mark.parametrize("bad", ["drop", "shape"])
def test_layout_mismatch_is_refused(tmp_path: Path, bad: str) -> None:
    config = ConnectorConfig.from_extra({"paths": [str(tmp_path / "d0")], "chunk_tokens": CHUNK})
    w = WorkerSide(config, layout(), Store(config.paths, 1 << 30), rank=0)
    kv = kv_caches(seed=1)
    if bad == "drop":
        kv.pop("layers.1.attn")
        match = "no KV tensor"
    else:
        kv = {n: torch.zeros(BLOCKS, HEADS, BS, HD) for n in kv}
        match = "holds"
    with pytest.raises(RuntimeError, match=match):
        w.register_kv_caches(kv, BLOCKS)


def test_io_threads_read_on_every_cpu_of_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU engine binds its main thread to one core; a read (a restore the forward pass
    waits on) must not inherit it from the thread that created the I/O thread."""
    import os
    import threading

    from kvlab_connector.io import posix

    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs a process allowed on two CPUs")
    monkeypatch.setattr(posix, "preadv_full", lambda fd, bufs, offset: os.sched_getaffinity(0))
    seen: list[set[int]] = []

    def bound_creator() -> None:
        os.sched_setaffinity(0, {min(allowed)})  # as libgomp binds vLLM's main thread
        engine = posix.PosixEngine(threads=1)
        seen.append(engine.submit_readv(-1, [], 0).result(timeout=10))
        engine.shutdown()

    t = threading.Thread(target=bound_creator)
    t.start()
    t.join()
    assert seen == [posix.process_cpus()] and seen[0] == allowed


def _io_job_cpus_in_a_bound_process(core: int, out) -> None:  # noqa: ANN001
    import os

    from kvlab_connector.io import posix

    for tid in os.listdir("/proc/self/task"):  # vLLM's CPU worker: every thread on the forward pass's cores
        os.sched_setaffinity(int(tid), {core})
    posix.preadv_full = lambda fd, bufs, offset: os.sched_getaffinity(0)  # a read that tells where it ran
    engine = posix.PosixEngine(threads=1)
    read = lambda: sorted(engine.submit_readv(-1, [], 0).result(timeout=10))  # noqa: E731
    save = lambda: sorted(engine.submit(os.sched_getaffinity, 0).result(timeout=10))  # noqa: E731
    out.put([read(), save(), read(), save()])
    engine.shutdown()


def test_in_a_worker_process_bound_to_one_core_reads_also_run_where_its_engine_may_and_saves_do_not() -> None:
    """vLLM's CPU worker is a process of its own, and every one of its threads is bound to the
    forward pass's cores (kvlab binds every core but the first). A read (a restore, which the
    forward pass waits on) also gets the cores of the engine process that started the worker, or
    it shares the forward pass's core; a save's work, which nothing waits on, stays on the forward
    pass's cores, or it competes with the API server and the scheduler on the others."""
    import multiprocessing
    import os

    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs a process allowed on two CPUs")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    core = max(allowed)
    child = ctx.Process(target=_io_job_cpus_in_a_bound_process, args=(core, out))
    child.start()
    try:
        assert out.get(timeout=60) == [sorted(allowed), [core], sorted(allowed), [core]]
    finally:
        child.join(timeout=30)


# ---- tail objects, repair, finished requests (the scheduler side plans them) -------------
def settle(w: WorkerSide) -> None:
    """Let the I/O threads finish what they were handed (removals included)."""
    w.store.engine.submit(lambda: None).result(timeout=10)
    time.sleep(0.05)
    w.store.engine.submit(lambda: None).result(timeout=10)


def test_a_tail_object_of_fewer_blocks_loads_back(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("e" * 32, [6])])
    assert w.store.exists(w.ns, "e" * 32, w.layout.shape_of(1))
    before = {n: t[6].clone() for n, t in kv.items()}
    assert load(w, kv, [ChunkIO("e" * 32, [11])]) == set()
    for n, t in kv.items():
        assert torch.equal(t[11], before[n])


def test_a_chunk_loads_short_of_its_last_block(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    for t in kv.values():
        t[9].fill_(5.0)
    assert load(w, kv, [ChunkIO("a" * 32, [8, -1])]) == set()
    for t in kv.values():
        assert torch.equal(t[8], t[2]) and torch.all(t[9] == 5.0)


def forward_step(w: WorkerSide, kv: dict[str, torch.Tensor], meta: StepMetadata) -> set[int]:
    """One step as vLLM drives the worker: loads, each layer's forward and save, the end."""
    w.start_load(meta)
    for name, t in kv.items():
        w.wait_for_layer(name)
        w.save_layer(name, t, meta)
    w.end_step(meta)
    return w.take_load_errors()


def test_a_wait_for_an_unregistered_layer_hands_the_load_to_recompute(tmp_path: Path) -> None:
    """A layer vLLM waits for but never registered cannot be waited for: returning would
    let its attention read blocks before they land."""
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    w.start_load(StepMetadata(loads=[ChunkIO("a" * 32, [8, 9], "r")]))
    w.wait_for_layer("model.layers.99.self_attn.attn")
    for name in kv:
        w.wait_for_layer(name)
    w.end_step(StepMetadata())
    assert w.take_load_errors() == {8, 9}


def corrupt(w: WorkerSide, key: str, shape) -> None:  # type: ignore[no-untyped-def]
    frag, offset = w.store.placement(key, shape, 1)
    with open(w.store.fragment_path(w.ns, key, shape, frag), "r+b") as f:
        f.seek(offset + 17)
        b = f.read(1)
        f.seek(offset + 17)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_load_that_fails_removes_its_object(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3]), ChunkIO("b" * 32, [4, 5])])
    corrupt(w, "a" * 32, w.shape)
    assert load(w, kv, [ChunkIO("a" * 32, [8, 9], "r"), ChunkIO("b" * 32, [10, 11], "r")]) == {8, 9}
    settle(w)
    assert not w.store.exists(w.ns, "a" * 32, w.shape), "the recompute's save must replace it"
    assert w.store.exists(w.ns, "b" * 32, w.shape), "an object that verified stays"


def test_saves_over_a_failed_load_are_given_up_and_the_repair_is_kept(tmp_path: Path) -> None:
    """The KV a step computes over blocks that never arrived is wrong: the saves of that
    request in that step, and of that generation later, never become objects."""
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    corrupt(w, "a" * 32, w.shape)
    meta = StepMetadata(loads=[ChunkIO("a" * 32, [8, 9], "r")],
                        saves=[ChunkIO("c" * 32, [10, 11], "r"), ChunkIO("d" * 32, [12, 13], "other")])
    assert forward_step(w, kv, meta) == {8, 9}
    settle(w)
    assert not w.store.exists(w.ns, "c" * 32, w.shape), "computed over a failed load"
    assert w.store.exists(w.ns, "d" * 32, w.shape), "another request's save is not affected"
    save(w, kv, [ChunkIO("e" * 32, [14, 15], "r", epoch=0)])
    settle(w)
    assert not w.store.exists(w.ns, "e" * 32, w.shape), "a later step of the failed generation"
    save(w, kv, [ChunkIO("a" * 32, [8, 9], "r", epoch=1)])  # the scheduler's repair
    settle(w)
    assert w.store.exists(w.ns, "a" * 32, w.shape)
    assert load(w, kv, [ChunkIO("a" * 32, [6, 7], "s")]) == set()


def test_saves_of_a_request_whose_load_verifies_are_written(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    meta = StepMetadata(loads=[ChunkIO("a" * 32, [8, 9], "r")], saves=[ChunkIO("c" * 32, [10, 11], "r")])
    assert forward_step(w, kv, meta) == set()
    settle(w)
    assert w.store.exists(w.ns, "c" * 32, w.shape)


def test_a_finished_request_is_saved_from_the_cache_then_reported(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    assert w.get_finished(set()) == set()
    meta = StepMetadata(finish_saves={"r": [ChunkIO("f" * 32, [4, 5], "r"), ChunkIO("9" * 32, [6], "r")],
                                      "nothing": []})
    w.save_finished(meta.finish_saves)  # vLLM's handle_preemptions, before the step zeroes blocks
    before = {n: t[[4, 5, 6]].clone() for n, t in kv.items()}
    for t in kv.values():
        t[[4, 5, 6]] = 0.0  # vLLM may hand the blocks to another request from now on
    forward_step(w, kv, meta)  # a step without a forward pass has the same calls, less the layers'
    assert w.get_finished({"r", "nothing"}) == {"r", "nothing"}, "copied out: the blocks may go at once"
    deadline = time.monotonic() + 10
    while w.store.stats.objects_written < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.store.exists(w.ns, "f" * 32, w.shape) and w.store.exists(w.ns, "9" * 32, w.layout.shape_of(1))
    assert load(w, kv, [ChunkIO("f" * 32, [12, 13]), ChunkIO("9" * 32, [14])]) == set()
    for n, t in kv.items():
        assert torch.equal(t[[12, 13, 14]], before[n])
    assert w.get_finished(set()) == set(), "each request is reported once"


def test_a_finished_request_is_reported_even_when_its_save_is_dropped(tmp_path: Path) -> None:
    w, kv = worker(tmp_path)
    assert w.ring is not None
    held = [w.ring.acquire() for _ in range(w.ring.num_slots)]
    w.save_finished({"r": [ChunkIO("f" * 32, [4, 5], "r")]})
    assert w.get_finished({"r"}) == {"r"} and w.saves_dropped == 1
    for s in held:
        w.ring.release(s)


class _Forbidden:
    """Stands for a lock, a thread or a pool that an idle step must not touch."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        raise AssertionError(f"an idle step used {self.what}.{name}")

    def __enter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError(f"an idle step took {self.what}")

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, *a: object, **kw: object) -> None:
        raise AssertionError(f"an idle step called {self.what}")


def test_a_step_with_nothing_to_load_or_save_takes_no_lock_and_wakes_no_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from kvlab_connector import metrics

    w, kv = worker(tmp_path)
    save(w, kv, [ChunkIO("a" * 32, [2, 3])])
    assert load(w, kv, [ChunkIO("a" * 32, [8, 9])]) == set()
    w.end_step(StepMetadata())  # the step after the last I/O: the gauge goes back to zero
    m = metrics.metrics()
    assert m is not None
    assert w.ring is not None
    monkeypatch.setattr(w.ring, "_cond", _Forbidden("the ring's lock"))
    monkeypatch.setattr(w.store, "engine", _Forbidden("the I/O pool"))
    monkeypatch.setattr(threading, "Thread", _Forbidden("threading.Thread"))
    monkeypatch.setitem(m, "ring_in_use", _Forbidden("the ring gauge"))
    monkeypatch.setattr(w.store, "_lock", _Forbidden("the store's lock"))
    for _ in range(3):  # decode steps: loads and saves empty
        meta = StepMetadata()
        assert forward_step(w, kv, meta) == set()
        assert w.get_finished({"done-1"}) == set()


class CountingEngine(PosixEngine):
    """Counts what is handed to the I/O threads."""

    def __init__(self) -> None:
        super().__init__()
        self.handed = 0

    def submit(self, fn, *args):  # type: ignore[no-untyped-def]
        self.handed += 1
        return super().submit(fn, *args)


def test_a_cpu_engines_saves_reach_the_io_threads_at_the_steps_end_not_between_its_layers(tmp_path: Path) -> None:
    """On a CPU engine the I/O threads share the forward pass's cores (and its GIL): a
    section's write starts once the step's forward is done, not between its layers."""
    engine = CountingEngine()
    w, kv = worker(tmp_path, engine=engine)
    meta = StepMetadata(saves=[ChunkIO("a" * 32, [2, 3], "r1"), ChunkIO("b" * 32, [4, 5], "r1")])
    w.start_load(meta)
    before = engine.handed
    for name, t in kv.items():
        w.wait_for_layer(name)
        w.save_layer(name, t, meta)
    assert engine.handed == before, "a section went to the I/O threads during the forward pass"
    w.end_step(meta)
    assert engine.handed > before
    settle(w)
    assert w.store.stats.objects_written == 2
    saved = {n: t[[2, 3, 4, 5]].clone() for n, t in kv.items()}
    assert load(w, kv, [ChunkIO("a" * 32, [10, 11]), ChunkIO("b" * 32, [12, 13])]) == set()
    for n, t in kv.items():
        assert torch.equal(t[[10, 11, 12, 13]], saved[n])


def test_a_cpu_step_that_saves_more_than_the_ring_holds_drops_nothing(tmp_path: Path) -> None:
    """Deferring a CPU step's writes to its end must not hold more slots than the ring has:
    a long prompt in one step (the demo's 30K tokens: 480 sections against 256 slots) lost
    every object when all its sections waited for end_step. Past half the ring, the step's
    sections go to the I/O threads at once, which the next layer's forward gives time."""
    w, kv = worker(tmp_path)
    slots = w.ring.num_slots
    n = slots // 2 - 4  # one layer's sections fit in half the ring; the step's do not fit the ring
    assert n * LAYERS > slots
    meta = StepMetadata(saves=[ChunkIO(f"{i:032x}", [2, 3], "r1") for i in range(n)])
    w.start_load(meta)
    for name, t in kv.items():
        w.wait_for_layer(name)
        w.save_layer(name, t, meta)
        settle(w)  # the next layer's forward: time for the writes already handed on
    w.end_step(meta)
    settle(w)
    assert w.saves_dropped == 0
    assert w.store.stats.objects_written == n
    assert w.ring.in_use == 0
    assert load(w, kv, [ChunkIO(f"{n - 1:032x}", [10, 11])]) == set()
    for t in kv.values():
        assert torch.equal(t[[10, 11]], t[[2, 3]])
