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
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvlab.paths import models_dir

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
    return models_dir() / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


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
    """The tiny model's folder, built if it is not cached yet.

    The build runs in a process of its own (`kvlab model tiny`): whatever the caller has
    imported must not reach it. Ansible's module_utils, for one, replaces `sys.intern` with
    an object that transformers' Llama classes (through torch._dynamo) refuse, so a test
    process that loaded the testinfra plugin could not build a model in-process.
    """
    final = dest or model_dir(seed, geometry)
    if _complete(final):
        return final
    argv = [sys.executable, "-m", "kvlab", "model", "tiny", "--seed", str(seed),
            "--geometry", json.dumps(asdict(geometry), sort_keys=True), "--out", str(final), "--print-path"]
    if not quiet:
        print(f"building the tiny model (seed {seed}) in {final} …", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    # stdout carries only the path; the builder's warnings and errors pass through on stderr.
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=_builder_env())
    if proc.returncode != 0 or not _complete(final):
        raise RuntimeError(f"building the tiny model (seed {seed}) into {final} failed "
                           f"(exit {proc.returncode}; its stderr is above): {' '.join(argv)}")
    if not quiet:
        print(f"built in {time.monotonic() - t0:.1f} s: {geometry.kv_bytes_per_token} B of KV per token",
              file=sys.stderr, flush=True)
    return final


def _complete(folder: Path) -> bool:
    return (folder / "kvlab-model.json").exists()


def _builder_env() -> dict[str, str]:
    """The caller's environment, with this checkout's packages first on the path, so that the
    builder imports the same kvlab as its caller (a checkout run without installing it)."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _build_cached(final: Path, seed: int, geometry: TinyGeometry) -> None:
    """Build into a temporary folder beside `final`, then move it into place in one rename,
    so that a reader never sees a half-written model."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny(tmp, seed, geometry)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


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
    t.add_argument("--geometry", type=_geometry, default=TinyGeometry(),
                   help="JSON object of TinyGeometry fields to change (default: the KV-heavy campaign model)")
    t.add_argument("--out", type=Path, help="build here instead of the user cache")
    t.add_argument("--print-path", action="store_true", help="print only the model folder")
    t.set_defaults(func=_tiny)


def _geometry(text: str) -> TinyGeometry:
    try:
        fields = json.loads(text)
        return TinyGeometry(**fields)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"--geometry wants a JSON object of {sorted(asdict(TinyGeometry()))}: {e}") from None


def _tiny(args: argparse.Namespace) -> int:
    """The builder process: here the build runs in-process, in a process started for it."""
    final = args.out or model_dir(args.seed, args.geometry)
    if not _complete(final):
        t0 = time.monotonic()
        if not args.print_path:
            print(f"building the tiny model (seed {args.seed}) in {final} …", file=sys.stderr, flush=True)
        _build_cached(final, args.seed, args.geometry)
        if not args.print_path:
            print(f"built in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    if args.print_path:
        print(final)
    else:
        print(f"{final}  sha256 {tree_sha256(final)}")
    return 0
