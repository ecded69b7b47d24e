"""Small host facts shared by the connector and the tooling (which depends on it)."""

from __future__ import annotations

import os


def drop_page_cache() -> bool:
    """Drop the kernel's page cache so that a read comes from the drives; False if not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID runs (one we may not signal counts; a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
