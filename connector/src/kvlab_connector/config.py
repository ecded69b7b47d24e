"""The connector's configuration (`kv_connector_extra_config`), validated at start.

A wrong key or value stops the engine with one line that names the field and the fix.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from kvlab_connector.admission import POLICIES


class ConfigError(ValueError):
    pass


# The store's defaults, owned here: kvlab's registry sends a setting only where a user or a
# campaign set one, and the LMCache L2 adapter over the same store bounds it alike.
CAPACITY_BYTES = 64 << 30
RING_BYTES = 256 << 20


def check_load_failure_policy(kv_transfer_config: Any) -> None:
    """vLLM's kv_load_failure_policy must be "recompute" (vLLM's default is "fail")."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "fail")
    if policy != "recompute":
        raise ConfigError(
            "kvlab connector needs kv_transfer_config.kv_load_failure_policy = \"recompute\" "
            f"(it is {policy!r}): a missing or corrupt object must be recomputed, not fail the request"
        )


def is_positive_int(v: Any) -> bool:
    """An int above zero (a JSON `true` is not a count)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def positive_int(text: str) -> int:
    """argparse's type for a count or a size: it names the flag when the value is none."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if not is_positive_int(value):
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class ConnectorConfig:
    paths: tuple[str, ...]
    capacity_bytes: int = CAPACITY_BYTES
    ring_bytes: int = RING_BYTES
    chunk_tokens: int = 512
    # Requests in flight over all drives; None: 8 per drive (store.IO_THREADS_PER_DRIVE).
    io_threads: int | None = None
    load_timeout_s: float = 30.0
    # How long a save may wait for a ring slot before it is dropped: 0 means never wait,
    # so generation never waits on the drives.
    save_slot_wait_s: float = 0.0
    io_engine: str = "auto"  # auto | posix | gds
    o_direct: str = "auto"  # auto | on | off
    metrics_port: int | None = None
    model_fingerprint: str | None = None  # override (e.g. a checkpoint's release hash)
    # Refuse a path where no filesystem is mounted (the lab's roles set it for NVMe-oF
    # paths): an unmounted drive would otherwise fill the root filesystem.
    require_mount: bool = False
    # Re-verify objects at rest in the background, coldest first, at this rate (scrub.py);
    # None: off.
    scrub_bytes_per_s: int | None = None
    # Which objects are saved (admission.py): always | reused (seen before within the last
    # admission_window keys); and an optional bound on bytes written a day.
    admission: str = "always"
    admission_window: int = 100_000
    write_budget_bytes_per_day: int | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
                f"valid keys are {', '.join(sorted(known))}"
            )
        if "paths" not in extra:
            raise ConfigError("kv_connector_extra_config.paths is missing: give a list of directories, one per drive")
        paths = extra["paths"]
        if isinstance(paths, str) or not isinstance(paths, list | tuple) or not paths:
            raise ConfigError("kv_connector_extra_config.paths must be a non-empty list of directories")
        values = dict(extra, paths=tuple(str(p) for p in paths))
        for name in ("capacity_bytes", "ring_bytes", "chunk_tokens", "io_threads", "scrub_bytes_per_s",
                     "admission_window", "write_budget_bytes_per_day"):
            if name in values:
                v = values[name]
                if not is_positive_int(v):
                    raise ConfigError(f"kv_connector_extra_config.{name} must be a positive integer, got {v!r}")
        for name in ("load_timeout_s", "save_slot_wait_s"):
            if name in values:
                v = values[name]
                if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                    raise ConfigError(f"kv_connector_extra_config.{name} must be a number of seconds >= 0, got {v!r}")
        if values.get("io_engine", "auto") not in ("auto", "posix", "gds"):
            raise ConfigError("kv_connector_extra_config.io_engine must be one of auto, posix, gds")
        if values.get("admission", "always") not in POLICIES:
            raise ConfigError(f"kv_connector_extra_config.admission must be one of {', '.join(POLICIES)}")
        if values.get("o_direct", "auto") not in ("auto", "on", "off"):
            raise ConfigError("kv_connector_extra_config.o_direct must be one of auto, on, off")
        if not isinstance(values.get("require_mount", False), bool):
            raise ConfigError(
                f"kv_connector_extra_config.require_mount must be true or false, got {values['require_mount']!r}"
            )
        mp = values.get("metrics_port")
        if mp is not None and (not isinstance(mp, int) or not 0 < mp < 65536):
            raise ConfigError(f"kv_connector_extra_config.metrics_port must be a TCP port, got {mp!r}")
        return cls(**values)

    def o_direct_flag(self) -> bool | None:
        return {"auto": None, "on": True, "off": False}[self.o_direct]
