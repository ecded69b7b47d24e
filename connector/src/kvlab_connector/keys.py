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
# Bumped whenever the on-drive format or the key derivation changes.
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
    prev = _h(b"kvlab-chain", (cache_salt or "").encode(), chunk_tokens.to_bytes(4, "little"))
    keys = []
    for i in range(n):
        prev = _h(prev, tokens[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes())
        keys.append(prev.hex())
    return keys


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
