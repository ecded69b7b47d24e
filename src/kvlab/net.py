"""Loopback ports for what kvlab starts (engines, cache servers, VM forwards)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Where free_port looks when the kernel's ephemeral range is unknown: Linux's default.
_EPHEMERAL_DEFAULT = (32768, 60999)
_LOWEST = 10000


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out itself (to a socket bound to port 0, and as a client's
    source port)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, below the kernel's ephemeral range.

    A port the kernel picks is one it hands out again to the next socket that asks: vLLM binds
    its own internal ports that way while it starts, and an engine once failed to start because
    its kvlab metrics port, picked here a moment before, had gone to one of them ("Address
    already in use"). Ports below the range are only ever taken by asking for them by number."""
    low, _ = ephemeral_range()
    if low - _LOWEST >= 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(_LOWEST, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no room below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
