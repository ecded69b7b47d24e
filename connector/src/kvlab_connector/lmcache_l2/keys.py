"""How LMCache's object keys and sizes map onto kvlab's store (see lmcache_l2.py)."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from kvlab_connector.store.store import ObjectShape

KEY_SCHEME = b"kvlab-lmcache-l2-v1"


def store_key(key: Any) -> str:
    """The store key of an LMCache ObjectKey: deterministic across processes and restarts."""
    h = hashlib.blake2b(digest_size=16, person=b"kvlab-lmc-key")
    for part in (key.model_name.encode(), key.cache_salt.encode(), bytes(key.chunk_hash)):
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    h.update(struct.pack("<QQ", key.kv_rank & (2**64 - 1), key.object_group_id))
    return h.hexdigest()


def namespace_of(model_name: str) -> str:
    return hashlib.blake2b(
        KEY_SCHEME + b"\0" + model_name.encode(), digest_size=16, person=b"kvlab-lmc-ns"
    ).hexdigest()


def shape_for(nbytes: int, section_bytes: int) -> ObjectShape:
    n = max(1, -(-nbytes // section_bytes))
    return ObjectShape(n_sections=n, section_bytes=max(1, -(-nbytes // n)))
