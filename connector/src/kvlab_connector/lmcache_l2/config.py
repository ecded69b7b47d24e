"""The kvlab L2 adapter's adapter_params (LMCache MP mode), validated where LMCache builds it."""

from __future__ import annotations

import math

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvlab_connector.config import CAPACITY_BYTES, is_positive_int
from kvlab_connector.ring import PAGE

# Every key adapter_params may hold; any other is refused, named.
KEYS = ("paths", "capacity_bytes", "capacity_gb", "ring_bytes", "section_bytes", "io_threads", "o_direct",
        "slot_timeout_s", "require_mount")


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
        require_mount: bool = False,
    ):
        self.paths = paths
        self.capacity_bytes = capacity_bytes
        self.ring_bytes = ring_bytes
        self.section_bytes = section_bytes
        self.io_threads = io_threads
        self.o_direct = o_direct
        self.slot_timeout_s = slot_timeout_s
        self.require_mount = require_mount

    @classmethod
    def from_dict(cls, d: dict) -> KvlabL2AdapterConfig:
        if not isinstance(d, dict):
            raise ValueError(f"kvlab L2 adapter: adapter_params must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise ValueError(
                f"kvlab L2 adapter: unknown key(s) {', '.join(map(repr, unknown))} in adapter_params; "
                f"valid keys are {', '.join(KEYS)}"
            )
        paths = d.get("paths")
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, list | tuple) or not paths or not all(isinstance(p, str) and p for p in paths):
            raise ValueError("kvlab L2 adapter: 'paths' must list one directory per drive")
        for i, p in enumerate(paths):
            if p in paths[:i]:
                raise ValueError(f"kvlab L2 adapter: 'paths' lists {p!r} twice: give each drive's directory once")
        if "capacity_bytes" in d and "capacity_gb" in d:
            raise ValueError("kvlab L2 adapter: give 'capacity_bytes' or 'capacity_gb', not both")
        if "capacity_gb" in d:
            gb = _number(d, "capacity_gb", 0.0)
            capacity = int(gb * (1 << 30))
            if capacity <= 0:
                raise ValueError(f"kvlab L2 adapter: 'capacity_gb' must be positive, got {gb!r}")
        else:
            capacity = _positive_int(d, "capacity_bytes", CAPACITY_BYTES)  # the vLLM connector's bound
        section = _positive_int(d, "section_bytes", 1 << 20)
        ring = _positive_int(d, "ring_bytes", 64 << 20)
        if section % PAGE:
            raise ValueError(f"kvlab L2 adapter: 'section_bytes' must be a positive multiple of {PAGE}, got {section}")
        if ring < section + PAGE:
            raise ValueError(
                f"kvlab L2 adapter: 'ring_bytes' {ring} holds no slot of {section + PAGE} bytes: raise it"
            )
        o_direct = d.get("o_direct")
        if o_direct is not None and not isinstance(o_direct, bool):
            raise ValueError("kvlab L2 adapter: 'o_direct' must be true, false or absent (auto)")
        require_mount = d.get("require_mount", False)
        if not isinstance(require_mount, bool):
            raise ValueError(f"kvlab L2 adapter: 'require_mount' must be true or false, got {require_mount!r}")
        io_threads = d.get("io_threads")
        if io_threads is not None:
            io_threads = _positive_int(d, "io_threads", None)
        return cls(
            paths=list(paths),
            capacity_bytes=capacity,
            ring_bytes=ring,
            section_bytes=section,
            io_threads=io_threads,
            o_direct=o_direct,
            slot_timeout_s=_number(d, "slot_timeout_s", 30.0),
            require_mount=require_mount,
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
            "- o_direct (bool): force O_DIRECT on or off (default: where the filesystem supports it)\n"
            "- slot_timeout_s (float): how long a transfer waits for a ring slot (30 s; 0: never)\n"
            "- require_mount (bool): refuse a path where no filesystem is mounted (false)"
        )


def _positive_int(d: dict, name: str, default: int | None) -> int:
    v = d.get(name, default)
    if not is_positive_int(v):
        raise ValueError(f"kvlab L2 adapter: '{name}' must be a positive integer, got {v!r}")
    return v  # type: ignore[return-value]


def _number(d: dict, name: str, default: float) -> float:
    """A finite number >= 0 (seconds, gigabytes)."""
    v = d.get(name, default)
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < math.inf:
        raise ValueError(f"kvlab L2 adapter: '{name}' must be a number >= 0, got {v!r}")
    return float(v)
