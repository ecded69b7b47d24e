"""Deterministic object keys: a chain of hashes over token ids, inside a namespace.

vLLM's own block hashes start from a random seed unless PYTHONHASHSEED is fixed, so they
cannot find objects written by another process. kvlab chains its own hashes: the key of
chunk i covers every token up to the end of chunk i, the tenant's cache salt and the
namespace (model fingerprint, KV layout, parallel rank). Two keys are equal only when
the KV they name must be equal.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

KEY_BYTES = 16
# Bumped whenever the key derivation changes (the sections' on-drive format carries its own
# version in every trailer's magic: store/format.py). Tail objects (see KeyChain.tail_key) added
# keys without changing any chunk's key. Objects written before trailer format 2 (the write
# id in every section) are clean misses by their magic, and evicted like the rest.
FORMAT_VERSION = 1


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def namespace(**fields: object) -> str:
    """A short hex id for everything that must match for KV to be interchangeable."""
    blob = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True, default=str).encode()
    return _h(b"kvlab-namespace", blob).hex()


def chunk_keys(
    token_ids: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    cache_salt: str | None = None,
    max_chunks: int | None = None,
) -> list[str]:
    """Keys of the full chunks of a token sequence (a trailing partial chunk has none)."""
    tokens = np.asarray(token_ids, dtype=np.int64).astype("<i8", copy=False)
    n = len(tokens) // chunk_tokens
    if max_chunks is not None:
        n = min(n, max_chunks)
    prev = _chain_seed(chunk_tokens, cache_salt)
    keys = []
    for i in range(n):
        prev = _h(prev, tokens[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes())
        keys.append(prev.hex())
    return keys


def _chain_seed(chunk_tokens: int, cache_salt: str | None) -> bytes:
    return _h(b"kvlab-chain", (cache_salt or "").encode(), chunk_tokens.to_bytes(4, "little"))


class KeyChain:
    """The keys of one request's objects, extended as its tokens grow.

    A chunk object's key is `chunk_keys`'s. A tail object holds the first `blocks` whole
    blocks of chunk `c` (fewer than a chunk): its key chains over every token before
    chunk c (the chain value before it) and those blocks' tokens, with the block count
    in the key, so a tail never shares a key with a chunk or a tail of another length."""

    def __init__(self, chunk_tokens: int, block_tokens: int, cache_salt: str | None = None):
        self.chunk_tokens, self.block_tokens = chunk_tokens, block_tokens
        self._chain = [_chain_seed(chunk_tokens, cache_salt)]  # [i]: chain value before chunk i

    def _extend(self, tokens: Sequence[int], chunks: int) -> None:
        c = self.chunk_tokens
        while len(self._chain) <= chunks:
            i = len(self._chain) - 1
            part = np.asarray(tokens[i * c:(i + 1) * c], dtype=np.int64).astype("<i8", copy=False)
            if len(part) < c:
                raise ValueError(f"chunk {i} is not complete: {len(tokens)} tokens")
            self._chain.append(_h(self._chain[-1], part.tobytes()))

    def chunk_key(self, tokens: Sequence[int], chunk: int) -> str:
        self._extend(tokens, chunk + 1)
        return self._chain[chunk + 1].hex()

    def tail_key(self, tokens: Sequence[int], chunk: int, blocks: int) -> str:
        self._extend(tokens, chunk)
        start, end = chunk * self.chunk_tokens, chunk * self.chunk_tokens + blocks * self.block_tokens
        part = np.asarray(tokens[start:end], dtype=np.int64).astype("<i8", copy=False)
        if not 0 < blocks < self.chunk_tokens // self.block_tokens or len(part) != end - start:
            raise ValueError(f"no tail of {blocks} blocks in chunk {chunk} of {len(tokens)} tokens")
        return _h(b"kvlab-tail", self._chain[chunk], blocks.to_bytes(4, "little"), part.tobytes()).hex()


def model_fingerprint(model_dir: str | os.PathLike, sample_bytes: int = 1 << 20) -> str:
    """A fingerprint of a model's weights and config, independent of where it lives.

    Hashing every byte of a 700 GB checkpoint at each start is not affordable: it hashes
    the config files, each weight file's size and safetensors header (names, shapes,
    dtypes, offsets) and samples of its bytes at the start, middle and end. Weights that
    differ anywhere in those samples or in shape give another fingerprint; a re-seeded
    random model differs everywhere.
    """
    root = Path(model_dir)
    if not root.is_dir():
        # A hub id or a single file: fall back to the name, which is all there is.
        return _h(b"kvlab-model-name", str(model_dir).encode()).hex()
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for path in sorted(root.iterdir()):
        if not path.is_file():
            continue
        name = path.name
        if name.endswith(".json") or name.endswith(".model") or name.endswith(".txt"):
            h.update(name.encode())
            h.update(path.read_bytes())
        elif name.endswith((".safetensors", ".bin", ".pt", ".gguf")):
            size = path.stat().st_size
            h.update(name.encode())
            h.update(size.to_bytes(8, "little"))
            with open(path, "rb") as f:
                if name.endswith(".safetensors"):
                    header_len = int.from_bytes(f.read(8), "little")
                    h.update(f.read(min(header_len, 64 << 20)))
                for offset in (0, max(0, size // 2 - sample_bytes // 2), max(0, size - sample_bytes)):
                    f.seek(offset)
                    h.update(f.read(sample_bytes))
    return h.hexdigest()
