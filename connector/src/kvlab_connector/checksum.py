"""Section checksums: xxh3 where the bytes are in host memory, a weighted sum where they
are on a GPU.

A section read straight into GPU memory (GDS) has no host copy to hash, and copying it
back to hash it would undo what GDS saves. So sections that a GPU writes carry `wsum64`,
which torch computes on the device and numpy on the host with identical results:

    wsum64 = sum(w[i] * x[i]) mod 2**64

over the payload's little-endian 32-bit words x[i] (the tail zero-padded), with fixed odd
weights w[i] < 2**31. Integer addition mod 2**64 does not depend on the order of the sum,
so every device and every reduction order agree. An odd weight makes any change of a
single word visible, and position-dependent weights make swapped or shifted words
visible; a section's identity (key, index, layout) is checked by its trailer, not here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

_MUL = 0x9E3779B1  # Knuth's multiplicative constant: well-spread weights
_ADD = 0x7F4A7C15
_MASK31 = (1 << 31) - 1


def _n_words(nbytes: int) -> int:
    return (nbytes + 3) // 4


@lru_cache(maxsize=8)
def _host_weights(n_words: int) -> np.ndarray:
    i = np.arange(n_words, dtype=np.uint64)
    return ((i * np.uint64(_MUL) + np.uint64(_ADD)) & np.uint64(_MASK31)) | np.uint64(1)


def wsum64(buf: Any) -> int:
    """wsum64 of a host buffer (bytes, memoryview, numpy array of bytes)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    n = _n_words(raw.size)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, dtype=np.uint8)])
    words = raw.view("<u4").astype(np.uint64)
    with np.errstate(over="ignore"):
        return int(np.sum(words * _host_weights(n), dtype=np.uint64))


_device_weights: dict[tuple[str, int], Any] = {}


def wsum64_tensor(t: Any) -> int:
    """wsum64 of a contiguous uint8 tensor, computed where it lives (a GPU: no host copy)."""
    import torch

    flat = t.reshape(-1)
    n = _n_words(flat.numel())
    if flat.numel() % 4:
        flat = torch.cat([flat, torch.zeros(4 - flat.numel() % 4, dtype=torch.uint8, device=flat.device)])
    key = (str(flat.device), n)
    w = _device_weights.get(key)
    if w is None:
        i = torch.arange(n, dtype=torch.int64, device=flat.device)
        w = ((i * _MUL + _ADD) & _MASK31) | 1
        if w.is_cuda:
            # Other threads use them from other streams: they must exist before they are shared.
            torch.cuda.current_stream(w.device).synchronize()
        _device_weights[key] = w
    # int64 products stay below 2**63 (x < 2**32, w < 2**31); the sum wraps mod 2**64,
    # which is what the unsigned host sum does.
    words = flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return int((words * w).sum().item()) & ((1 << 64) - 1)
