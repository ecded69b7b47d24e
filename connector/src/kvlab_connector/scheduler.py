"""The scheduler side: which chunks a request finds on the drives, and what to save.

Imports no GPU code. Each step it hands the worker a small metadata object: per request,
the chunks to load (key + the vLLM blocks they fill) and the chunks to save.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvlab_connector import metrics
from kvlab_connector.config import ConnectorConfig
from kvlab_connector.keys import chunk_keys
from kvlab_connector.layout import Layout
from kvlab_connector.store import Store

log = logging.getLogger("vllm.kvlab_connector")


@dataclass
class ChunkIO:
    key: str
    # vLLM block ids of the chunk, in token order; -1 marks a block the engine already
    # holds (its own prefix cache) and the load must leave alone.
    block_ids: list[int]


@dataclass
class StepMetadata:
    loads: list[ChunkIO] = field(default_factory=list)
    saves: list[ChunkIO] = field(default_factory=list)


@dataclass
class _Request:
    request: Any  # vLLM's Request: its token list grows as it decodes
    salt: str | None
    keys: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0  # chunks [0, saved_chunks) are on the drives or being saved
    load_from_token: int = 0
    load_to_token: int = 0


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, layout: Layout, store: Store, ranks: list[int]):
        self.config = config
        self.layout = layout
        self.store = store
        self.chunk = config.chunk_tokens
        self.block_size = layout.block_size
        # The namespaces of every rank that holds a share of the KV: a chunk is a hit
        # only when every rank's object is on the drives.
        self.namespaces = [layout.namespace(rank) for rank in ranks]
        self._reqs: dict[str, _Request] = {}

    def _keys(self, st: _Request, tokens: list[int], n_chunks: int) -> list[str]:
        if len(st.keys) < n_chunks:
            st.keys = chunk_keys(tokens, self.chunk, st.salt, max_chunks=n_chunks)
        return st.keys[:n_chunks]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids or []
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Request(request, getattr(request, "cache_salt", None))
        # vLLM must compute at least one token itself: never claim the last one.
        max_chunks = max(0, (len(prompt) - 1) // self.chunk)
        keys = self._keys(st, prompt, max_chunks)
        hits = min(self.store.count_prefix(ns, keys, self.layout.shape) for ns in self.namespaces) if keys else 0
        hit_tokens = hits * self.chunk
        st.saved_chunks = hits
        metrics.inc("hit_tokens", hit_tokens)
        metrics.inc("miss_tokens", max(0, len(prompt) - hit_tokens))
        external = max(0, hit_tokens - num_computed_tokens)
        st.load_from_token, st.load_to_token = num_computed_tokens, num_computed_tokens + external
        return external, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens == 0:
            st.load_from_token = st.load_to_token = 0

    def _chunk_blocks(self, st: _Request, chunk: int, skip_below_token: int = 0) -> list[int] | None:
        per = self.chunk // self.block_size
        first = chunk * per
        if first + per > len(st.block_ids):
            return None
        ids = st.block_ids[first:first + per]
        return [-1 if (first + j + 1) * self.block_size <= skip_below_token else b for j, b in enumerate(ids)]

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        meta = StepMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan(st, meta, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
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
            self._plan(st, meta, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        return meta

    def _plan(self, st: _Request, meta: StepMetadata, computed_after_step: int) -> None:
        # Loads decided by the last lookup, once.
        if st.load_to_token > st.load_from_token:
            for c in range(st.load_from_token // self.chunk, st.load_to_token // self.chunk):
                ids = self._chunk_blocks(st, c, skip_below_token=st.load_from_token)
                if ids is not None and any(b >= 0 for b in ids):
                    meta.loads.append(ChunkIO(st.keys[c], ids))
            st.load_from_token = st.load_to_token = 0
        # Saves: every chunk whose tokens all have KV by the end of this step.
        complete = computed_after_step // self.chunk
        if complete > st.saved_chunks:
            tokens = st.request.all_token_ids
            keys = self._keys(st, tokens, complete)
            for c in range(st.saved_chunks, complete):
                ids = self._chunk_blocks(st, c)
                if ids is None or c >= len(keys):
                    break
                meta.saves.append(ChunkIO(keys[c], ids))
                st.saved_chunks = c + 1

    def request_finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)
