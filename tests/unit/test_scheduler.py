"""The connector's scheduler side at the vLLM boundary, driven with synthetic scheduler
outputs as vLLM's own tests/v1/kv_connector/unit/ do: the objects carry the attributes of
vLLM's Request, NewRequestData, CachedRequestData and SchedulerOutput that the connector
reads, and a set stands for the drives (the worker's part, saving and loading, is
tests/unit/worker/test_worker.py's).

Geometry: blocks of 16 tokens, chunks of 64 (4 blocks), 2 layers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kvlab_connector import metrics
from kvlab_connector.config import ConnectorConfig
from kvlab_connector.keys import KeyChain
from kvlab_connector.layout import Layout
from kvlab_connector.scheduler import ChunkIO, SchedulerSide, StepMetadata
from kvlab_connector.store.store import ObjectShape

BS, CHUNK, PER = 16, 64, 4
LAYOUT = Layout(("l0", "l1"), BS, 1024, CHUNK, "spec", "cpu", "fp", 1, False)
NS = LAYOUT.namespace(0)


class Drives:
    """What the scheduler side asks of the store: does this object exist?"""

    def __init__(self) -> None:
        self.objects: set[tuple[str, str, ObjectShape]] = set()
        self.probes = 0

    def exists(self, ns: str, key: str, shape: ObjectShape) -> bool:
        self.probes += 1
        return (ns, key, shape) in self.objects

    def count_prefix(self, ns: str, keys: list[str], shape: ObjectShape) -> int:
        n = 0
        while n < len(keys) and self.exists(ns, keys[n], shape):
            n += 1
        return n

    def put(self, chunk: ChunkIO) -> None:
        self.objects.add((NS, chunk.key, LAYOUT.shape_of(len(chunk.block_ids))))

    def keys(self) -> set[str]:
        return {k for _, k, _ in self.objects}


@dataclass
class Req:
    """The attributes of vLLM's Request that the connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output


def tokens(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


class Engine:
    """A minimal vLLM scheduler loop around one SchedulerSide: admission (lookup, then
    allocation), steps (SchedulerOutput), finish, preemption. The worker's saves land on the
    drives at once."""

    def __init__(self, drives: Drives | None = None) -> None:
        self.drives = drives or Drives()
        config = ConnectorConfig.from_extra({"paths": ["/unused"], "chunk_tokens": CHUNK})
        self.side = SchedulerSide(config, LAYOUT, self.drives, [0])  # type: ignore[arg-type]
        self.next_block = 100
        self.blocks: dict[str, list[int]] = {}
        self.fresh: set[str] = set()  # scheduled next as new requests
        self.resumed: set[str] = set()
        self.saved: list[ChunkIO] = []

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def admit(self, req: Req, local_tokens: int = 0) -> int:
        """Lookup and allocation; returns the external tokens the load brings."""
        ext, is_async = self.side.get_num_new_matched_tokens(req, local_tokens)
        assert not is_async
        self.side.update_state_after_alloc(req, None, ext)
        req.num_computed_tokens = local_tokens + ext
        # Admitted before: back from a preemption, a resumed request with all new blocks.
        (self.resumed if req.request_id in self.blocks else self.fresh).add(req.request_id)
        self.blocks[req.request_id] = self.alloc(-(-len(req.all_token_ids) // BS))
        return ext

    def step(self, sched: dict[str, int], reqs: dict[str, Req], finished: set[str] | None = None) -> StepMetadata:
        """One step: the requests of `sched` compute that many tokens each."""
        new, cached = [], SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
        for rid, n in sched.items():
            req = reqs[rid]
            if rid in self.fresh:
                new.append(SimpleNamespace(req_id=rid, block_ids=(self.blocks[rid],),
                                           num_computed_tokens=req.num_computed_tokens))
                self.fresh.discard(rid)
            else:
                cached.req_ids.append(rid)
                if rid in self.resumed:
                    cached.resumed_req_ids.add(rid)
                    cached.new_block_ids.append((self.blocks[rid],))
                    self.resumed.discard(rid)
                else:
                    need = -(-(req.num_computed_tokens + n) // BS) - len(self.blocks[rid])
                    more = self.alloc(max(0, need))
                    self.blocks[rid] += more
                    cached.new_block_ids.append((more,) if more else None)
                cached.num_computed_tokens.append(req.num_computed_tokens)
        out = SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=sched,
                              finished_req_ids=finished or set())
        meta = self.side.build_connector_meta(out)
        for rid, n in sched.items():
            reqs[rid].num_computed_tokens += n
        for c in meta.saves:
            self.drives.put(c)
            self.saved.append(c)
        for chunks in meta.finish_saves.values():
            for c in chunks:
                self.drives.put(c)
                self.saved.append(c)
        return meta

    def prefill(self, req: Req, step_tokens: int = 10_000) -> list[StepMetadata]:
        metas = []
        while req.num_computed_tokens < len(req.all_token_ids):
            n = min(step_tokens, len(req.all_token_ids) - req.num_computed_tokens)
            metas.append(self.step({req.request_id: n}, {req.request_id: req}))
        return metas

    def decode(self, req: Req, n: int) -> list[StepMetadata]:
        metas = []
        for i in range(n):
            req.output.append(7000 + i)  # the token sampled by the last step
            metas.append(self.step({req.request_id: 1}, {req.request_id: req}))
        return metas

    def finish(self, req: Req) -> bool:
        """vLLM's request_finished, with the blocks of the computed tokens."""
        ids = self.blocks[req.request_id][: -(-req.num_computed_tokens // BS)]
        return self.side.request_finished(req, ids)

    def serve(self, req: Req, decode: int = 0, step_tokens: int = 10_000) -> int:
        """A request start to finish; returns the tokens it found on the drives."""
        ext = self.admit(req)
        self.prefill(req, step_tokens)
        req.output.append(6999)  # the prefill's sampled token
        self.decode(req, decode)
        if self.finish(req):
            self.step({}, {}, finished={req.request_id})
        return ext


def chain(salt: str | None = None) -> KeyChain:
    return KeyChain(CHUNK, BS, salt)


def warm(n: int) -> tuple[Engine, list[int], Req]:
    """Drives holding what a first request of n tokens saved, and a second request with
    the same prompt."""
    e = Engine()
    prompt = tokens(n)
    e.serve(Req("a", prompt))
    return e, prompt, Req("b", list(prompt))


def decoding(e: Engine, n_prompt: int, n_decode: int) -> tuple[Req, list[StepMetadata]]:
    """A request prefilled in one step, then `n_decode` decode steps."""
    a = Req("a", tokens(n_prompt))
    e.admit(a)
    e.prefill(a)
    a.output.append(6999)
    return a, e.decode(a, n_decode)


# ---- block-granular hits ------------------------------------------------------------
@pytest.mark.parametrize(("n", "hit"), [
    (60, 48),  # shorter than a chunk: its 3 whole blocks
    (100, 96),  # a chunk, then a tail of 2 blocks
    (64, 48),  # exactly a chunk: its first 3 blocks (vLLM computes the last token)
    (128, 112),  # exactly 2 chunks: 2 are saved, 1 and 3 blocks of the second restored
    (150, 144),  # 2 chunks and a tail of 1 block, 6 tokens past it
])
def test_a_repeated_prompt_finds_every_whole_block_it_may_take(n: int, hit: int) -> None:
    e = Engine()
    prompt = tokens(n)
    assert e.serve(Req("a", prompt)) == 0
    assert e.serve(Req("b", list(prompt))) == hit


def test_the_tail_is_an_object_of_its_whole_blocks_keyed_over_the_prefix() -> None:
    e = Engine()
    prompt = tokens(150)
    e.serve(Req("a", prompt))
    k = chain()
    assert [(c.key, len(c.block_ids)) for c in e.saved] == [
        (k.chunk_key(prompt, 0), 4), (k.chunk_key(prompt, 1), 4), (k.tail_key(prompt, 2, 1), 1),
    ]
    other = list(prompt)
    other[130] += 1  # a token inside the tail block
    assert chain().tail_key(other, 2, 1) != k.tail_key(prompt, 2, 1)
    assert chain().chunk_key(other, 1) == k.chunk_key(prompt, 1)
    assert chain("tenant").tail_key(prompt, 2, 1) != k.tail_key(prompt, 2, 1)
    assert len({k.tail_key(prompt, 1, m) for m in (1, 2, 3)} | {k.chunk_key(prompt, 1)}) == 4


def test_the_load_covers_the_chunks_and_the_tail_in_block_order() -> None:
    e, prompt, b = warm(150)
    assert e.admit(b) == 144
    meta = e.step({"b": 150 - 144}, {"b": b})
    blocks = e.blocks["b"]
    assert [c.block_ids for c in meta.loads] == [blocks[0:4], blocks[4:8], blocks[8:9]]
    assert [c.key for c in meta.loads] == [c.key for c in e.saved[:3]]
    assert meta.saves == [], "what was found is never written again"


def test_a_prompt_of_whole_chunks_loads_its_last_chunk_short_of_the_last_block() -> None:
    e, prompt, b = warm(128)
    assert e.admit(b) == 112
    meta = e.step({"b": 16}, {"b": b})
    blocks = e.blocks["b"]
    assert meta.loads[1].block_ids == blocks[4:7] + [-1], "the block vLLM computes is never written"
    assert meta.saves == []


def test_a_longer_tail_wins_and_the_lookup_probes_few_objects() -> None:
    e = Engine()
    prompt = tokens(120)
    e.serve(Req("a", prompt[:80]))  # chunk 0, tail of 1 block
    e.serve(Req("b", prompt[:112]))  # tail of 3 blocks
    e.drives.probes = 0
    assert e.admit(Req("c", list(prompt))) == 112
    # chunk 0, then the longest tail first (found): chunk 1 is not whole, no probe
    assert e.drives.probes == 2
    e.drives.probes = 0
    assert e.admit(Req("d", prompt[:64] + tokens(60, seed=3))) == 64
    assert e.drives.probes == 1 + 3, "chunk 0, then a tail of each length"


def test_chunked_prefill_saves_each_chunk_once_and_the_tail_at_the_end() -> None:
    e = Engine()
    prompt = tokens(150)
    a = Req("a", prompt)
    e.admit(a)
    metas = e.prefill(a, step_tokens=40)
    per_step = [[len(c.block_ids) for c in m.saves] for m in metas]
    assert per_step == [[], [4], [], [4, 1]]
    assert len({c.key for c in e.saved}) == len(e.saved)


def test_requests_sharing_a_prefix_in_one_step_save_each_object_once() -> None:
    """Concurrent requests with one prompt prefix (vLLM's bench `prefix_repetition`, agents
    sharing a system prompt) are scheduled in the same step: each object is one save. Planned
    once per request, the worker was handed the object twice and its second section 0 killed
    the engine ("section 0 was submitted twice")."""
    e = Engine()
    prefix = tokens(128)
    reqs = {r: Req(r, prefix + tokens(30, seed=i)) for i, r in enumerate("abc", start=2)}
    for r in reqs.values():
        assert e.admit(r) == 0
    meta = e.step({r: len(q.all_token_ids) for r, q in reqs.items()}, reqs)
    keys = [c.key for c in meta.saves]
    assert len(keys) == len(set(keys)), f"an object planned twice in one step: {keys}"
    assert chain().chunk_key(prefix, 0) in keys and chain().chunk_key(prefix, 1) in keys
    assert len(keys) == 2 + 3, "the shared chunks once, each request's own tail"


def test_requests_finishing_with_one_answer_save_it_once() -> None:
    e = Engine()
    prompt = tokens(100)
    reqs = {r: Req(r, list(prompt)) for r in "ab"}
    for r in reqs.values():
        e.admit(r)
    e.step({r: 100 for r in reqs}, reqs)
    for i in range(20):  # the same answer, 120 tokens computed: a tail of 3 blocks past chunk 0
        for r in reqs.values():
            r.output.append(6000 + i)
        e.step({r: 1 for r in reqs}, reqs)
    assert all(e.finish(r) for r in reqs.values())
    meta = e.step({}, {}, finished=set(reqs))
    assert set(meta.finish_saves) == {"a", "b"}, "both requests are reported finished"
    keys = [c.key for chunks in meta.finish_saves.values() for c in chunks] + [c.key for c in meta.saves]
    assert keys and len(keys) == len(set(keys)), f"an object planned twice in one step: {keys}"


# ---- prefix partly in vLLM's own cache ------------------------------------------------
def test_blocks_the_engine_holds_are_not_loaded() -> None:
    e, prompt, b = warm(150)
    assert e.admit(b, local_tokens=32) == 144 - 32
    meta = e.step({"b": 150 - 144}, {"b": b})
    blocks = e.blocks["b"]
    assert meta.loads[0].block_ids == [-1, -1] + blocks[2:4]
    assert meta.loads[1].block_ids == blocks[4:8]


def test_blocks_the_engine_holds_past_the_drives_are_saved() -> None:
    e = Engine()
    prompt = tokens(150)
    e.serve(Req("a", prompt[:64]))
    assert e.drives.keys() == {chain().chunk_key(prompt, 0)}
    b = Req("b", list(prompt))
    assert e.admit(b, local_tokens=128) == 0, "the engine holds more than the drives"
    meta = e.step({"b": 150 - 128}, {"b": b})
    assert meta.loads == []
    assert [c.key for c in meta.saves] == [chain().chunk_key(prompt, 1), chain().tail_key(prompt, 2, 1)]


# ---- decode, finish, the next turn --------------------------------------------------
def test_a_chunk_filled_during_decode_is_saved_in_that_step() -> None:
    e = Engine()
    a, metas = decoding(e, 100, 40)
    saving = [i for i, m in enumerate(metas) if m.saves]
    assert saving == [27], "chunk 1 (tokens 64..127) has KV once token 127 is computed"
    assert [len(c.block_ids) for c in metas[27].saves] == [4]
    assert metas[27].saves[0].key == chain().chunk_key(a.all_token_ids, 1)


def test_the_answer_is_saved_when_the_request_finishes_and_the_next_turn_hits_through_it() -> None:
    e = Engine()
    a, _ = decoding(e, 100, 15)
    assert a.num_computed_tokens == 115 and len(a.all_token_ids) == 116
    assert e.finish(a), "vLLM must hold the blocks until the last save is done"
    meta = e.step({}, {}, finished={"a"})
    (chunks,) = meta.finish_saves.values()
    assert list(meta.finish_saves) == ["a"]
    assert [(c.key, c.block_ids) for c in chunks] == [(chain().tail_key(a.all_token_ids, 1, 3), e.blocks["a"][4:7])]
    # The next turn carries the answer and a new message.
    turn2 = Req("b", a.all_token_ids + tokens(30, seed=2))
    assert e.admit(turn2) == 112, "every whole block of the first turn, its answer's included"


def test_a_request_with_nothing_new_frees_its_blocks_at_once() -> None:
    e, prompt, b = warm(100)
    e.admit(b)
    e.prefill(b)
    assert not e.finish(b)
    assert e.step({}, {}, finished={"b"}).finish_saves == {}


def test_the_same_answer_to_the_same_prompt_is_not_written_again() -> None:
    e = Engine()
    prompt = tokens(100)
    e.serve(Req("a", prompt), decode=15)
    written = len(e.saved)
    b = Req("b", list(prompt))
    e.admit(b)
    e.prefill(b)
    b.output.append(6999)
    e.decode(b, 15)
    assert b.all_token_ids == e.side._reqs["b"].request.all_token_ids
    assert not e.finish(b), "its answer's objects are on the drives: nothing to hold"
    assert len(e.saved) == written


def test_a_request_finished_while_its_load_is_in_flight() -> None:
    e, prompt, b = warm(150)
    e.admit(b)
    meta = e.step({"b": 6}, {"b": b})
    assert meta.loads
    assert not e.finish(b), "nothing past the objects it loads: nothing to hold"
    e.side.update_connector_output({meta.loads[0].block_ids[0]})  # the load failed after all
    assert e.step({}, {}, finished={"b"}) == StepMetadata()
    assert e.side._reqs == {}


def test_an_aborted_waiting_request_leaves_nothing_behind() -> None:
    e, prompt, b = warm(150)
    e.side.get_num_new_matched_tokens(b, 0)  # looked up, never allocated
    assert not e.side.request_finished(b, [])
    assert e.side._reqs == {}


# ---- preemption and resume ----------------------------------------------------------
def test_a_resumed_request_looks_up_all_its_tokens_and_rewrites_nothing() -> None:
    e = Engine()
    a = Req("a", tokens(100))
    e.admit(a)
    e.prefill(a)
    a.output.append(6999)
    e.decode(a, 40)  # 141 tokens, 140 computed: chunk 1 saved during decode
    stored = set(e.drives.keys())
    written = len(e.saved)
    # Preempted: vLLM frees the blocks and forgets what was computed.
    a.num_computed_tokens = 0
    ext = e.admit(a)
    assert ext == 128, "the lookup covers the answer so far, not only the prompt"
    meta = e.step({"a": len(a.all_token_ids) - 128}, {"a": a})
    assert [c.block_ids for c in meta.loads] == [e.blocks["a"][0:4], e.blocks["a"][4:8]]
    assert e.saved[written:] == meta.saves
    assert not {c.key for c in meta.saves} & stored, "objects on the drives are never written again"


def test_a_resumed_request_after_a_preemption_mid_prefill() -> None:
    e = Engine()
    a = Req("a", tokens(150))
    e.admit(a)
    e.step({"a": 70}, {"a": a})  # chunk 0 saved
    a.num_computed_tokens = 0
    assert e.admit(a) == 64
    meta = e.step({"a": 150 - 64}, {"a": a})
    assert [len(c.block_ids) for c in meta.saves] == [4, 1]
    assert len({c.key for c in e.saved}) == len(e.saved) == 3


# ---- repair -------------------------------------------------------------------------
def test_a_failed_load_is_saved_again_from_the_recompute() -> None:
    e, prompt, b = warm(150)
    e.admit(b)
    meta = e.step({"b": 6}, {"b": b})
    bad = meta.loads[1]  # chunk 1: a checksum failure, say
    # The worker reports its blocks and removes the object.
    e.drives.objects.discard((NS, bad.key, LAYOUT.shape))
    e.side.update_connector_output({bad.block_ids[2]})
    # vLLM recomputes from the first block that failed.
    b.num_computed_tokens = 4 * BS  # the first failed block's; the step's output is dropped
    meta = e.step({"b": 150 - 64}, {"b": b})
    assert [c.key for c in meta.saves] == [bad.key], "the recompute replaces the bad object, nothing else"
    assert meta.saves[0].epoch > bad.epoch, "a new generation: the worker drops the failed step's saves"
    c = Req("c", list(prompt))
    assert e.admit(c) == 144, "repaired"


def test_a_failed_load_of_another_request_changes_nothing() -> None:
    e, prompt, b = warm(150)
    e.admit(b)
    e.step({"b": 6}, {"b": b})
    e.side.update_connector_output({99_999})
    b.output.append(6999)
    metas = e.decode(b, 45)
    assert [c.key for m in metas for c in m.saves] == [chain().chunk_key(b.all_token_ids, 2)]
    assert {c.epoch for m in metas for c in m.saves} == {0}


# ---- the lookup has no side effects -------------------------------------------------
def _counter(name: str) -> float:
    m = metrics.metrics()
    assert m is not None, "prometheus-client is a dependency of the connector"
    return m[name]._value.get()


def test_the_lookup_can_be_asked_again_and_counts_once() -> None:
    e = Engine()
    prompt = tokens(150)
    e.serve(Req("a", prompt))
    hits, misses = _counter("hit_tokens"), _counter("miss_tokens")
    b = Req("b", list(prompt))
    for _ in range(3):  # vLLM may ask again while the request waits for blocks
        assert e.side.get_num_new_matched_tokens(b, 0) == (144, False)
    assert (_counter("hit_tokens"), _counter("miss_tokens")) == (hits, misses)
    e.side.update_state_after_alloc(b, None, 144)
    assert (_counter("hit_tokens") - hits, _counter("miss_tokens") - misses) == (144, 6)
    b.num_computed_tokens = 0  # a preemption: the request's second admission is not counted again
    e.side.get_num_new_matched_tokens(b, 0)
    e.side.update_state_after_alloc(b, None, 144)
    assert _counter("hit_tokens") - hits == 144


def test_the_lookup_changes_nothing_a_later_step_reads() -> None:
    e = Engine()
    a = Req("a", tokens(100))
    e.admit(a)
    e.prefill(a)
    e.drives.objects.clear()  # evicted meanwhile, say
    assert e.side.get_num_new_matched_tokens(a, 0) == (0, False)
    a.output.append(6999)
    metas = e.decode(a, 30)
    assert [c.key for m in metas for c in m.saves] == [chain().chunk_key(a.all_token_ids, 1)], \
        "what this request saved is not written again"
