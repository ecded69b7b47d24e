"""Small host facts shared by the connector and the tooling (which depends on it)."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_caches(level: int, control: str | os.PathLike = DROP_CACHES) -> str | None:
    """Write dirty pages back, then write `level` to the kernel's drop_caches (1: the page
    cache; 3: dentries and inodes too). None when it was done; otherwise why not (not root,
    a read-only /proc, ...), for the caller's record."""
    os.sync()  # dirty pages cannot be dropped: written back first, they can
    try:
        with open(control, "w") as f:
            f.write(f"{level}\n")
    except OSError as e:
        return f"cannot write {level} to {control}: {e.strerror or e}"
    return None


def drop_page_cache() -> bool:
    """Drop the kernel's caches so that a read comes from the drives; False if not allowed."""
    return drop_caches(3) is None


def syncfs(path: str | os.PathLike) -> bool:
    """Commit the filesystem holding `path` (its journal included), and no other; False
    where the call is missing or refused. Blocks a filesystem frees are reusable only once
    the journal has committed their release (ext4, XFS)."""
    libc = _libc()
    if libc is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        return bool(libc.syncfs(fd) == 0)
    except AttributeError:
        return False
    finally:
        os.close(fd)


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


def name_os_thread() -> None:
    """Give the calling thread's kernel name (what top -H, ps -L and /proc/PID/task/TID/comm
    show) its Python name, cut to the kernel's 15 bytes. Python 3.11 leaves every thread with
    its process's name: a profile of an engine's threads could not tell kvlab's I/O threads
    from vLLM's worker. Linux only; elsewhere nothing happens."""
    import threading

    libc = _libc()
    try:
        if libc is not None:
            libc.prctl(15, threading.current_thread().name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except AttributeError:
        pass


@lru_cache(maxsize=1)
def _libc() -> Any:
    """The C library of this process, loaded once (a load costs ~11 us, and a restore's feed
    thread names itself each time); None where there is none to load."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
