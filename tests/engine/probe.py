"""One engine life for the engine tests: the real vLLM CPU engine in this process.

Runs prompts through vLLM's offline engine with kvlab's connector, spies on the
connector's step metadata (the real objects, not replacements) to learn which paged
blocks each saved or loaded chunk occupies, and snapshots those blocks from the paged KV
cache right after the step. Writes JSON (outputs, cached tokens, chunk keys, connector
stats) and an .npz of the block bytes: chunk key -> [layers, blocks, bytes].

    python probe.py --model M --store DIR --out OUT --rounds 2 [--salt S] [--seed N]
        [--max-tokens N] [--next-turn N]

--next-turn N adds a last round: a conversation's second turn, whose prompt is the first
round's prompt, its answer, and N new tokens (after a prefix-cache reset, like every round).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

POISON = 100.0  # finite: masked positions (a score times zero) stay harmless


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=2700)
    ap.add_argument("--prompt-seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="rounds, with a prefix-cache reset between them")
    ap.add_argument("--salt", default=None)
    ap.add_argument("--max-batched", type=int, default=1024, help="< prompt: chunked prefill")
    ap.add_argument("--no-connector", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--next-turn", type=int, default=0, help="new tokens of a second turn")
    ap.add_argument("--slow-copy-ms", type=float, default=0.0,
                    help="each section lands this late in the KV cache: the forward pass must wait for it")
    args = ap.parse_args()

    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"), PYTHONHASHSEED="0",
    )
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kv = None
    if not args.no_connector:
        kv = {
            "kv_connector": "KvlabConnector",
            "kv_connector_module_path": "kvlab_connector.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"paths": [args.store], "ring_bytes": 64 << 20, "chunk_tokens": 512},
        }
    llm = LLM(
        model=args.model, enforce_eager=True, max_model_len=8192, kv_transfer_config=kv,
        enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=args.max_batched,
        seed=0,
    )
    core = llm.llm_engine.engine_core.engine_core

    def poison(worker):  # type: ignore[no-untyped-def]
        # A fresh cache holds zeros, and a zero key or value read before its load has
        # landed moves the answer only a little. A large value read anywhere the
        # attention does not mask moves it far: a restore read early can never pass.
        for kv_layer in worker.model_runner.kv_caches:
            kv_layer.fill_(POISON)

    core.model_executor.collective_rpc(poison)
    steps: list = []
    if kv is not None:
        connector = core.scheduler.connector
        real_build = connector.build_connector_meta

        def spy(scheduler_output):  # type: ignore[no-untyped-def]
            meta = real_build(scheduler_output)
            steps.append(meta.step)
            return meta

        connector.build_connector_meta = spy

    # How long the forward pass waited for restored layers, from vLLM's own calls.
    waited = [0.0]
    if kv is not None:
        import time

        from kvlab_connector.worker.load import LoadPipeline

        real_wait, real_copy = LoadPipeline.wait_for_layer, LoadPipeline.copy_in

        def timed_wait(self, layer_name):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            real_wait(self, layer_name)
            waited[0] += time.perf_counter() - t

        def slow_copy(self, *a, **kw):  # type: ignore[no-untyped-def]
            time.sleep(args.slow_copy_ms / 1000)  # on an I/O thread, before the bytes land
            real_copy(self, *a, **kw)

        LoadPipeline.wait_for_layer = timed_wait
        if args.slow_copy_ms:
            LoadPipeline.copy_in = slow_copy

    def snapshot(block_ids: list[int]) -> np.ndarray:
        def read(worker):  # type: ignore[no-untyped-def]
            ids = torch.tensor(block_ids, dtype=torch.long)
            return [kv_layer[ids].contiguous().view(torch.uint8).reshape(len(block_ids), -1).numpy().copy()
                    for kv_layer in worker.model_runner.kv_caches]

        return np.stack(core.model_executor.collective_rpc(read)[0])  # [layers, blocks, bytes]

    rng = random.Random(args.prompt_seed)
    tokens = [rng.randrange(10, 8000) for _ in range(args.tokens)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    result: dict = {"rounds": []}
    arrays: dict[str, np.ndarray] = {}

    def drain() -> None:
        """Step on while the scheduler holds finished requests (the connector's last saves),
        as a server's engine loop does; the offline LLM returns before."""
        import time

        deadline = time.monotonic() + 30
        while core.scheduler.has_requests() and time.monotonic() < deadline:
            core.step()

    prompts = [tokens] * args.rounds
    if args.next_turn:
        prompts.append(None)  # known once the first round has answered
    for r, prompt_tokens in enumerate(prompts):
        steps.clear()
        if prompt_tokens is None:
            prompt_tokens = tokens + result["rounds"][0]["output"] + [rng.randrange(10, 8000)
                                                                      for _ in range(args.next_turn)]
        prompt = TokensPrompt(prompt_token_ids=prompt_tokens)
        if args.salt:
            prompt["cache_salt"] = args.salt
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        drain()
        finish_saved = [c for s in steps for chunks in s.finish_saves.values() for c in chunks]
        saved = [c for s in steps for c in s.saves] + finish_saved
        loaded = [c for s in steps for c in s.loads]
        for kind, chunks in (("save", saved), ("load", loaded)):
            for c in chunks:
                ids = [b for b in c.block_ids if b >= 0]
                arrays[f"r{r}-{kind}-{c.key}"] = snapshot(ids)
        result["rounds"].append({
            "output": list(out.outputs[0].token_ids),
            # The two likeliest tokens at each position: how near a tie a difference was.
            "top2": [sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])[:2]
                     for pos in out.outputs[0].logprobs],
            "num_cached_tokens": out.num_cached_tokens,
            "saved": [c.key for c in saved],
            "saved_blocks": [len(c.block_ids) for c in saved],
            "finish_saved": [c.key for c in finish_saved],
            "prompt_tokens": len(prompt_tokens),
            "loaded": [c.key for c in loaded],
        })
        llm.reset_prefix_cache()
    if kv is not None:
        def stats(worker):  # type: ignore[no-untyped-def]
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            return get_kv_transfer_group()._worker.stats()

        # Saves are asynchronous: let the last writes land before reading the counters.
        import time

        time.sleep(1.0)
        result["stats"] = core.model_executor.collective_rpc(stats)[0]
        result["forward_waited_s"] = waited[0]
    np.savez(args.out + ".npz", **arrays)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
