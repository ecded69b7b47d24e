"""The scheduler side: which objects a request finds on the drives, and what to save.

Imports no GPU code. Each step it hands the worker a small metadata object: per request,
the objects to load (key + the vLLM blocks they fill) and the objects to save.

Objects: whole chunks (`chunk_tokens`) are the unit of large, striped I/O. The whole
blocks of a request past its last whole chunk are a tail object of their own (KeyChain.
tail_key), written when the prefill ends and when the request finishes, so a request finds
the longest block-aligned prefix that was stored: its whole chunks, then at the first chunk
that is missing the longest tail stored there.

Why tail objects, from measurements here (Store.exists ~25-40 us a probe on 2 busy cores,
1 and 4 drives): a tail is found by probing each block count from the longest down, at
most blocks_per_chunk - 1 probes per namespace: 3 with the CPU engine's 128-token blocks
(a 4000-token lookup that finds nothing: 4 probes, 0.2-0.3 ms; that finds everything: 8
probes), 31 with vLLM's GPU block size of 16 (nothing found: 32 probes, ~2 ms at 80
layers; everything: 9). A variable-length last object needs the same probes (its key must
cover its tokens) and rewrites a whole chunk's bytes each time it grows; a tail object is
written once, and read like a chunk: its sections sit side by side in each fragment file
and are read up to store.READ_REQUEST_BYTES a request, so restores keep their large reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvlab_connector import metrics
from kvlab_connector.config import ConnectorConfig
from kvlab_connector.keys import KeyChain
from kvlab_connector.layout import Layout
from kvlab_connector.store.store import Store

log = logging.getLogger("vllm.kvlab_connector")


@dataclass
class ChunkIO:
    """One object to load or save: a whole chunk, or a tail of fewer blocks (the object's
    shape follows from len(block_ids))."""

    key: str
    # vLLM block ids of the object, in token order; -1 marks a block the engine already
    # holds (its own prefix cache) and the load must leave alone.
    block_ids: list[int]
    req_id: str = ""
    # The request's repair generation: after a failed load the worker drops this request's
    # saves of that generation (their KV was computed over blocks that never arrived).
    epoch: int = 0


@dataclass
class StepMetadata:
    loads: list[ChunkIO] = field(default_factory=list)
    saves: list[ChunkIO] = field(default_factory=list)
    # Finished requests whose blocks vLLM holds (request_finished returned True) until the
    # worker has copied these objects out of the paged cache (handle_preemptions, at the start
    # of this step) and reported them (get_finished, at its end).
    finish_saves: dict[str, list[ChunkIO]] = field(default_factory=dict)


@dataclass
class _Found:
    first_block: int
    blocks: int  # the object's
    key: str
    usable: int  # its leading blocks the request may take (it must compute its last token)

    @property
    def end(self) -> int:
        return self.first_block + self.usable


@dataclass
class _Request:
    request: Any  # vLLM's Request: its token list grows as it decodes
    chain: KeyChain
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # leading blocks whose objects are on the drives or being saved
    # Objects past saved_blocks known to be on the drives (they loaded fine before a
    # repair moved saved_blocks below them): never written again.
    known: set[str] = field(default_factory=set)
    found: list[_Found] = field(default_factory=list)  # the last lookup's objects
    lookup_from: int = 0  # tokens the engine held at the last lookup
    load_blocks: tuple[int, int] | None = None  # blocks [from, to) to load at the next step
    issued: list[_Found] = field(default_factory=list)  # loads handed to the worker
    counted: bool = False
    epoch: int = 0


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, layout: Layout, store: Store, ranks: list[int]):
        self.config = config
        self.layout = layout
        self.store = store
        self.chunk = config.chunk_tokens
        self.block_size = layout.block_size
        self.per = layout.blocks_per_chunk
        # The namespaces of every rank that holds a share of the KV: an object is a hit
        # only when every rank's object is on the drives.
        self.namespaces = [layout.namespace(rank) for rank in ranks]
        self._reqs: dict[str, _Request] = {}
        self._finishing: dict[str, list[ChunkIO]] = {}

    # ---- lookup ---------------------------------------------------------------------
    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            chain = KeyChain(self.chunk, self.block_size, getattr(request, "cache_salt", None))
            st = self._reqs[request.request_id] = _Request(request, chain)
        return st

    def _on_drives(self, key: str, blocks: int) -> bool:
        shape = self.layout.shape_of(blocks)
        return all(self.store.exists(ns, key, shape) for ns in self.namespaces)

    def _lookup(self, st: _Request, tokens: Any) -> list[_Found]:
        """The objects of the longest stored block-aligned prefix of tokens. vLLM must
        compute at least the last token: an object that holds it (a prompt of whole
        chunks, say) is used short of its last block."""
        usable = max(0, len(tokens) - 1) // self.block_size
        whole = len(tokens) // self.block_size  # blocks whose tokens are all known
        found: list[_Found] = []
        c = 0
        while (c + 1) * self.per <= whole and c * self.per < usable:
            key = st.chain.chunk_key(tokens, c)
            if not self._on_drives(key, self.per):
                break
            found.append(_Found(c * self.per, self.per, key, min(self.per, usable - c * self.per)))
            c += 1
        if c * self.per < usable:
            for m in range(min(self.per - 1, whole - c * self.per), 0, -1):
                key = st.chain.tail_key(tokens, c, m)
                if self._on_drives(key, m):
                    found.append(_Found(c * self.per, m, key, min(m, usable - c * self.per)))
                    break
        return found

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        # vLLM may ask several times for one request: this only remembers the answer, the
        # counters move when vLLM commits to it (update_state_after_alloc).
        st = self._state(request)
        # All of its tokens: after a preemption the answer so far is on the drives too.
        st.found = self._lookup(st, request.all_token_ids)
        st.lookup_from = num_computed_tokens
        hit = st.found[-1].end * self.block_size if st.found else 0
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        last = st.found[-1] if st.found else None
        if not st.counted:  # the first admission: what the prompt found on the drives
            st.counted = True
            prompt = len(request.prompt_token_ids or [])
            hit = min(prompt, last.end * self.block_size if last else 0)
            metrics.inc("hit_tokens", hit)
            metrics.inc("miss_tokens", prompt - hit)
        # What was found is on the drives, all of each object: never written again (a
        # resumed request included).
        if last is not None:
            st.saved_blocks = max(st.saved_blocks, last.first_block + last.blocks)
        st.issued = []  # a new admission: earlier block ids are gone
        st.load_blocks = None
        if num_external_tokens > 0:
            first = st.lookup_from // self.block_size
            end = -(-(st.lookup_from + num_external_tokens) // self.block_size)
            st.load_blocks = (first, end)

    # ---- each step ------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        meta = StepMetadata(finish_saves=self._finishing)
        self._finishing = {}
        n_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._issue_loads(st, meta)
            self._plan(st, meta, new.num_computed_tokens, n_sched[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Back from preemption: its blocks were freed and are given anew.
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._issue_loads(st, meta)
            self._plan(st, meta, cached.num_computed_tokens[i], n_sched[req_id])
        return meta

    def _issue_loads(self, st: _Request, meta: StepMetadata) -> None:
        """The loads decided at the last admission, once."""
        if st.load_blocks is None:
            return
        first, last = st.load_blocks
        st.load_blocks = None
        for obj in st.found:
            if obj.end <= first or obj.first_block >= last or obj.end > len(st.block_ids):
                continue
            # -1: blocks the engine holds, and an object's blocks past what the request takes.
            ids = [-1 if obj.first_block + j < first else b for j, b in enumerate(st.block_ids[obj.first_block:obj.end])]
            ids += [-1] * (obj.blocks - obj.usable)
            if all(b < 0 for b in ids):
                continue
            meta.loads.append(ChunkIO(obj.key, ids, st.request.request_id, st.epoch))
            st.issued.append(obj)

    def _plan(self, st: _Request, meta: StepMetadata, computed_before: int, scheduled: int) -> None:
        tokens = st.request.all_token_ids
        n = len(tokens)
        # The tail is saved when a prefill ends (not at each decode step: a tail object per
        # block would rewrite the same blocks again and again); request_finished saves the rest.
        tail = computed_before + scheduled >= n and computed_before < n - 1
        self._plan_saves(st, meta.saves, computed_before + scheduled, tail)

    def _plan_saves(self, st: _Request, saves: list[ChunkIO], computed: int, tail: bool) -> None:
        """Objects of blocks whose every token has KV once `computed` tokens are, past
        what is saved: whole chunks, and with `tail` the whole blocks after them."""
        tokens = st.request.all_token_ids
        # A token scheduled but not yet known (async scheduling) has no key yet: its block
        # waits for a later step.
        done = min(min(computed, len(tokens)) // self.block_size, len(st.block_ids))
        rid = st.request.request_id
        c = st.saved_blocks // self.per
        while (c + 1) * self.per <= done:
            key = st.chain.chunk_key(tokens, c)
            if key not in st.known:
                saves.append(ChunkIO(key, st.block_ids[c * self.per:(c + 1) * self.per], rid, st.epoch))
            c += 1
            st.saved_blocks = c * self.per
        if tail and done > st.saved_blocks and done % self.per:
            m = done - c * self.per
            key = st.chain.tail_key(tokens, c, m)
            if key not in st.known:
                saves.append(ChunkIO(key, st.block_ids[c * self.per:done], rid, st.epoch))
            st.saved_blocks = done

    # ---- outcomes -------------------------------------------------------------------
    def update_connector_output(self, invalid_block_ids: set[int]) -> None:
        """Loads that failed (vLLM recomputes their blocks, and the worker removed their
        objects): their blocks are saved again from the recompute, and objects that loaded
        fine are not."""
        if not invalid_block_ids:
            return
        for st in self._reqs.values():
            bad = [o for o in st.issued if any(
                b in invalid_block_ids for b in st.block_ids[o.first_block:o.end] if b >= 0
            )]
            if not bad:
                continue
            start = min(o.first_block for o in bad)
            st.known |= {o.key for o in st.issued if o.first_block >= start and o not in bad}
            st.known -= {o.key for o in bad}
            st.saved_blocks = min(st.saved_blocks, start)
            st.issued = []
            st.epoch += 1
            log.info("kvlab connector: %d object(s) of request %s failed to load: saving them again",
                     len(bad), st.request.request_id)

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """Whether vLLM must hold the request's blocks until the worker has saved what the
        request computed past the saved objects (its answer's whole blocks included)."""
        st = self._reqs.pop(request.request_id, None)
        if st is None or not block_ids:
            return False
        st.block_ids = list(block_ids)
        saves: list[ChunkIO] = []
        # KV exists for the tokens fed to a forward pass: never for the last token sampled.
        self._plan_saves(st, saves, int(request.num_computed_tokens), tail=True)
        # The same answer to the same prompt (a repeated request) is on the drives already:
        # a probe costs less than a rewrite, and vLLM frees the blocks at once.
        saves = [c for c in saves if not self._on_drives(c.key, len(c.block_ids))]
        if not saves:
            return False
        self._finishing[request.request_id] = saves
        return True
