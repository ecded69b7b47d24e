"""The POSIX I/O engine: many reads and writes in flight from a thread pool.

os.preadv/os.pwritev release the GIL, so Python threads keep several requests queued
at the drive at once; with O_DIRECT into page-aligned buffers they reach what fio
measures. Filesystems without O_DIRECT (tmpfs, some overlays) get buffered I/O, and the
mode says so.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvlab_connector.osutil import name_os_thread
from kvlab_connector.ring import PAGE


def supports_o_direct(directory: str | os.PathLike) -> bool:
    """Whether files in this directory can be opened and written with O_DIRECT."""
    probe = Path(directory) / f".kvlab-odirect-{uuid.uuid4().hex}"
    import mmap

    buf = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        os.pwritev(fd, [buf], 0)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
        buf.close()


def process_cpus() -> set[int]:
    """Every CPU that some thread of this process, or the process that started it, may run on.
    The parent counts because vLLM's CPU worker is a process of its own whose every thread is
    bound to the forward pass's cores (kvlab binds every core but the first), while the engine
    process that started it still runs on the cores the engine was given."""
    cpus: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except (OSError, ValueError):
            pass
    try:
        cpus |= os.sched_getaffinity(os.getppid())
    except OSError:
        pass
    return cpus


def spread_over_process_cpus() -> None:
    """Let the calling thread (the load feed) run on every CPU of the process and its parent.
    vLLM's CPU engine binds its threads to the forward pass's cores (libgomp's
    GOMP_CPU_AFFINITY) and a thread inherits its creator's mask: a restore's feed would otherwise
    share the forward pass's core, and on two cores leave the other one idle (a restore of 30K
    tokens took 1.15x ExampleConnector's). The I/O threads' reads get the same mask per job (_on)."""
    cpus = process_cpus()
    try:
        if cpus and cpus != os.sched_getaffinity(0):
            os.sched_setaffinity(0, cpus)
    except OSError:
        pass


# How much lower than their creator's the I/O threads' CPU priority is (nice). On a CPU engine
# they share the cores the forward pass's OpenMP threads are bound to: at the same priority a
# waking I/O thread preempts one of them, and the others wait for it at the next barrier. A
# section's write or read needs little CPU (O_DIRECT: the drive moves the bytes), so the I/O
# threads lose little by yielding, and the forward pass keeps its cores.
IO_THREAD_NICE = 10


def yield_to_compute(nice: int = IO_THREAD_NICE) -> None:
    """Lower the calling thread's CPU priority by `nice` (Linux: per thread), at most to 19."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError):
        pass  # not permitted, or not Linux: the thread keeps its priority


# Where an I/O thread runs depends on the job it runs. A read is a restore the forward pass
# waits on: every CPU of the engine process (process_cpus). A save's work (the write, what leads
# to it) is waited on by nothing: it stays on the cores of the process's main thread, in vLLM's
# CPU worker the forward pass's, at IO_THREAD_NICE. On the others it competes with the API server
# and the scheduler. Measured (kvlab bench overhead, three runs): with every job on every CPU a
# miss's first token took 1.058x baseline's and decode with nothing to save ran 0.945x; with every
# job on the forward pass's core 1.040x and 0.979x, but a 30K-token restore took 1.15x
# ExampleConnector's; placed by kind, 1.039x and 0.952x, and the restore 0.81x.
_placed = threading.local()


def _on(wide: bool, fn, *args):  # type: ignore[no-untyped-def]
    if not hasattr(_placed, "wide"):  # once per thread: reading every thread's mask is ~50 syscalls
        _placed.wide, _placed.narrow, _placed.cpus = process_cpus(), _main_thread_cpus(), None
    cpus = _placed.wide if wide else _placed.narrow
    if cpus and cpus != _placed.cpus:
        try:
            os.sched_setaffinity(0, cpus)
            _placed.cpus = cpus
        except OSError:
            pass
    return fn(*args)


def _main_thread_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(os.getpid())
    except OSError:
        return set()


def _io_thread_start() -> None:
    name_os_thread()
    yield_to_compute()


class PosixEngine:
    """Submit a transfer, get a Future of the bytes moved; wait on the Future."""

    name = "posix"

    def __init__(self, threads: int = 8):
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="kvlab-io", initializer=_io_thread_start
        )
        self.threads = threads

    def submit_read(self, fd: int, buf: memoryview, offset: int) -> Future[int]:
        return self.submit_readv(fd, [buf], offset)

    def submit_readv(self, fd: int, bufs: list[memoryview], offset: int) -> Future[int]:
        """Read the file from `offset` into the buffers back to back: one request for
        adjacent sections, however scattered their buffers."""
        return self._pool.submit(_on, True, preadv_full, fd, bufs, offset)

    def submit(self, fn, *args) -> Future:  # type: ignore[no-untyped-def]
        """Run other blocking work on the same threads (the store's writes: one drain
        per fragment file, see store.ObjectWriter), on the main thread's cores."""
        return self._pool.submit(_on, False, fn, *args)

    def shutdown(self) -> None:
        # Queued writes finish: a clean engine stop keeps the saves it accepted.
        self._pool.shutdown(wait=True, cancel_futures=False)


def preadv_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill the buffers from `offset` in as few system calls as the kernel allows; returns
    the bytes read (fewer at the end of the file: a truncated fragment)."""
    views = list(bufs)
    done = 0
    while views:
        got = os.preadv(fd, views, offset + done)
        if got == 0:
            break
        done += got
        while views and got >= len(views[0]):
            got -= len(views.pop(0))
        if views and got:
            views[0] = views[0][got:]
    return done


def pwritev_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Write the buffers back to back from `offset` in as few system calls as the kernel
    allows; returns the bytes written."""
    views = list(bufs)
    done = 0
    while views:
        n = os.pwritev(fd, views, offset + done)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]
    return done
