"""Timers around LMCache's restore path inside vLLM (MP mode, engine-driven), for
scripts/lmcache-ratio. On PYTHONPATH only for those runs; writes nothing unless
KVLAB_LMCACHE_TIMING names a file. LMCache's code is wrapped, never changed:

- lookup:    the scheduler submits a LOOKUP until its result is first available
- transfer:  prepare_retrieve: the server gathers the chunks from L1 and pickles them,
             ZMQ carries them, the worker unpickles them
- injection: scatter_cpu_to_paged_kv: the chunks are copied into vLLM's paged KV cache
- commit:    commit_retrieve, the closing round trip
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import threading
import time

_OUT = os.environ.get("KVLAB_LMCACHE_TIMING")
_lock = threading.Lock()
_lookup_t0: dict[str, float] = {}


def _emit(phase: str, seconds: float, **extra: object) -> None:
    rec = {"t": time.time(), "pid": os.getpid(), "phase": phase, "s": seconds, **extra}
    with _lock, open(_OUT, "a") as f:  # type: ignore[arg-type]
        f.write(json.dumps(rec) + "\n")


def _timed(fn, phase):  # type: ignore[no-untyped-def]
    def wrapper(*a, **kw):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _emit(phase, time.perf_counter() - t0)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _patch_scheduler(mod) -> None:  # type: ignore[no-untyped-def]
    cls = mod.LMCacheMPSchedulerAdapter
    submit, check = cls.maybe_submit_lookup_request, cls.check_lookup_result

    def maybe_submit_lookup_request(self, request_id, *a, **kw):  # type: ignore[no-untyped-def]
        _lookup_t0.setdefault(request_id, time.perf_counter())
        return submit(self, request_id, *a, **kw)

    def check_lookup_result(self, request_id, *a, **kw):  # type: ignore[no-untyped-def]
        r = check(self, request_id, *a, **kw)
        t0 = _lookup_t0.pop(request_id, None) if r is not None else None
        if t0 is not None:
            _emit("lookup", time.perf_counter() - t0, hit_tokens=r)
        return r

    cls.maybe_submit_lookup_request = maybe_submit_lookup_request
    cls.check_lookup_result = check_lookup_result


def _patch_worker_transfer(mod) -> None:  # type: ignore[no-untyped-def]
    mod.scatter_cpu_to_paged_kv = _timed(mod.scatter_cpu_to_paged_kv, "injection")


def _patch_pickle_context(mod) -> None:  # type: ignore[no-untyped-def]
    cls = mod.EngineDrivenContextPickle
    cls.prepare_retrieve = _timed(cls.prepare_retrieve, "transfer")
    cls.commit_retrieve = _timed(cls.commit_retrieve, "commit")


_PATCHES = {
    "lmcache.integration.vllm.vllm_multi_process_adapter": _patch_scheduler,
    "lmcache.v1.multiprocess.transfer_context.worker_transfer": _patch_worker_transfer,
    "lmcache.v1.multiprocess.transfer_context.pickle": _patch_pickle_context,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, _PATCHES[name]
        real_exec = loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            real_exec(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _OUT:
    import importlib.util

    sys.meta_path.insert(0, _PatchOnImport())
