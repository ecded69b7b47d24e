"""The kvlab L2 adapter's adapter_params (LMCache MP mode), validated where LMCache builds it."""

from __future__ import annotations

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvlab_connector.config import CAPACITY_BYTES, is_positive_int
from kvlab_connector.ring import PAGE


class KvlabL2AdapterConfig(L2AdapterConfigBase):
    """adapter_params of the plugin spec (LMCache finds this class by its name)."""

    def __init__(
        self,
        paths: list[str],
        capacity_bytes: int = CAPACITY_BYTES,
        ring_bytes: int = 64 << 20,
        section_bytes: int = 1 << 20,
        io_threads: int | None = None,
        o_direct: bool | None = None,
        slot_timeout_s: float = 30.0,
    ):
        self.paths = paths
        self.capacity_bytes = capacity_bytes
        self.ring_bytes = ring_bytes
        self.section_bytes = section_bytes
        self.io_threads = io_threads
        self.o_direct = o_direct
        self.slot_timeout_s = slot_timeout_s

    @classmethod
    def from_dict(cls, d: dict) -> KvlabL2AdapterConfig:
        paths = d.get("paths")
        if isinstance(paths, str):
            paths = [paths]
        if not paths or not all(isinstance(p, str) and p for p in paths):
            raise ValueError("kvlab L2 adapter: 'paths' must list one directory per drive")
        if "capacity_bytes" in d:
            capacity = int(d["capacity_bytes"])
        elif "capacity_gb" in d:
            capacity = int(float(d["capacity_gb"]) * (1 << 30))
        else:
            capacity = CAPACITY_BYTES  # the vLLM connector's bound over the same store
        if capacity <= 0:
            raise ValueError(f"kvlab L2 adapter: capacity must be positive, got {capacity}")
        section = int(d.get("section_bytes", 1 << 20))
        ring = int(d.get("ring_bytes", 64 << 20))
        if section <= 0 or section % PAGE:
            raise ValueError(f"kvlab L2 adapter: 'section_bytes' must be a positive multiple of {PAGE}")
        if ring < section + PAGE:
            raise ValueError(
                f"kvlab L2 adapter: 'ring_bytes' {ring} holds no slot of {section + PAGE} bytes: raise it"
            )
        o_direct = d.get("o_direct")
        if o_direct is not None and not isinstance(o_direct, bool):
            raise ValueError("kvlab L2 adapter: 'o_direct' must be true, false or absent (auto)")
        return cls(
            paths=list(paths),
            capacity_bytes=capacity,
            ring_bytes=ring,
            section_bytes=section,
            io_threads=_positive_int_or_none(d, "io_threads"),
            o_direct=o_direct,
            slot_timeout_s=float(d.get("slot_timeout_s", 30.0)),
        )

    @classmethod
    def help(cls) -> str:
        return (
            "kvlab L2 adapter (kvlab's on-drive store) config fields:\n"
            "- paths (list[str]): one directory per drive (required)\n"
            f"- capacity_bytes (int) or capacity_gb (float): the store's bound; LRU eviction "
            f"({CAPACITY_BYTES >> 30} GiB, the vLLM connector's)\n"
            "- ring_bytes (int): host staging ring, the only host memory KV passes through (64 MiB)\n"
            "- section_bytes (int): I/O size an object is cut into (1 MiB, a multiple of 4096)\n"
            "- io_threads (int): I/Os in flight over all drives (8 per drive)\n"
            "- o_direct (bool): force O_DIRECT on or off (default: where the filesystem supports it)"
        )


def _positive_int_or_none(d: dict, name: str) -> int | None:
    v = d.get(name)
    if v is not None and not is_positive_int(v):
        raise ValueError(f"kvlab L2 adapter: '{name}' must be a positive integer or absent, got {v!r}")
    return v
