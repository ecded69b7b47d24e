"""`kvlab model tiny`: a small random-weight Llama and its tokenizer, built offline.

KV-heavy on purpose: 16 KiB of KV per token (8 layers x 4 KV heads x head dim 64 x K,V x
fp32), as real long-context models move tens of KiB per token, with a small hidden size so
that prefill stays affordable on two cores. float32 rather than bf16: CPUs without
AVX512-BF16 emulate bf16 and prefill three times slower (measured here), while the KV
bytes per token are what a restore moves either way. Deterministic: the same seed gives
the same bytes, and the result is cached outside the checkout under the hash of its inputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvlab.paths import cache_dir

BUILDER_VERSION = 1


@dataclass(frozen=True)
class TinyGeometry:
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 64
    hidden_size: int = 256
    intermediate_size: int = 512
    vocab_size: int = 8192
    max_position_embeddings: int = 131072
    dtype: str = "float32"

    @property
    def kv_bytes_per_token(self) -> int:
        elem = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2 * elem  # K and V


def model_dir(seed: int = 0, geometry: TinyGeometry = TinyGeometry()) -> Path:
    key = json.dumps({"v": BUILDER_VERSION, "seed": seed, **asdict(geometry)}, sort_keys=True)
    return cache_dir() / "models" / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _corpus(seed: int) -> list[str]:
    """A deterministic, code-and-prose-like corpus for the BPE trainer."""
    import random

    rng = random.Random(seed)
    words = ["kv", "cache", "token", "layer", "block", "drive", "restore", "prefill", "decode", "agent",
             "def", "return", "class", "import", "self", "value", "key", "store", "load", "save",
             "the", "a", "of", "to", "in", "and", "is", "for", "with", "on"]
    lines = []
    for _ in range(20000):
        n = rng.randint(3, 16)
        lines.append(" ".join(rng.choice(words) + (str(rng.randint(0, 99)) if rng.random() < 0.2 else "")
                              for _ in range(n)))
    return lines


def build_tiny(dest: Path, seed: int, geometry: TinyGeometry) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the BPE trainer is deterministic single-threaded
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=geometry.vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(dest)

    config = LlamaConfig(
        vocab_size=geometry.vocab_size,
        hidden_size=geometry.hidden_size,
        intermediate_size=geometry.intermediate_size,
        num_hidden_layers=geometry.num_hidden_layers,
        num_attention_heads=geometry.num_attention_heads,
        num_key_value_heads=geometry.num_key_value_heads,
        head_dim=geometry.head_dim,
        max_position_embeddings=geometry.max_position_embeddings,
        rope_theta=1_000_000.0,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=geometry.dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, geometry.dtype))
    model.save_pretrained(dest, safe_serialization=True)
    # Sorted keys and no timestamps: the same seed gives the same bytes.
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        p = dest / name
        if p.exists():
            p.write_text(json.dumps(json.loads(p.read_text()), indent=2, sort_keys=True) + "\n")
    (dest / "kvlab-model.json").write_text(json.dumps(
        {"builder_version": BUILDER_VERSION, "seed": seed, **asdict(geometry),
         "kv_bytes_per_token": geometry.kv_bytes_per_token}, indent=2, sort_keys=True) + "\n")


def ensure_tiny(seed: int = 0, geometry: TinyGeometry = TinyGeometry(), dest: Path | None = None,
                quiet: bool = False) -> Path:
    """The tiny model's folder, built if it is not cached yet."""
    final = dest or model_dir(seed, geometry)
    if (final / "kvlab-model.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    if not quiet:
        print(f"building the tiny model (seed {seed}) in {final} …", file=sys.stderr, flush=True)
    build_tiny(tmp, seed, geometry)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if not quiet:
        print(f"built in {time.monotonic() - t0:.1f} s: {geometry.kv_bytes_per_token} B of KV per token",
              file=sys.stderr, flush=True)
    return final


def tree_sha256(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="build models made locally")
    s = p.add_subparsers(dest="model_command", required=True)
    t = s.add_parser("tiny", help="build (or find cached) the tiny KV-heavy random-weight model")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", type=Path, help="build here instead of the user cache")
    t.add_argument("--print-path", action="store_true", help="print only the model folder")
    t.set_defaults(func=_tiny)


def _tiny(args: argparse.Namespace) -> int:
    path = ensure_tiny(args.seed, dest=args.out, quiet=args.print_path)
    if args.print_path:
        print(path)
    else:
        print(f"{path}  sha256 {tree_sha256(path)}")
    return 0
