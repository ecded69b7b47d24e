"""The store's I/O threads yield the CPU to the engine's forward pass: on a CPU engine they share
its cores, and a save's write or read needs little CPU of its own (issue 26's profile)."""

from __future__ import annotations

import os
import threading

from kvlab_connector.io.posix import IO_THREAD_NICE, PosixEngine


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_io_threads_run_below_the_priority_of_the_thread_that_submits() -> None:
    engine = PosixEngine(threads=2)
    try:
        mine = _nice()
        theirs = {engine.submit(_nice).result(timeout=30) for _ in range(4)}
        assert theirs == {min(19, mine + IO_THREAD_NICE)} and IO_THREAD_NICE > 0
        assert _nice() == mine  # the caller (the forward pass) keeps its own priority
    finally:
        engine.shutdown()


def _comm() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


def test_io_threads_carry_their_name_in_the_kernel() -> None:
    # What top -H and a per-thread CPU count read: not the engine process's name.
    engine = PosixEngine(threads=2)
    try:
        names = {engine.submit(_comm).result(timeout=30) for _ in range(4)}
        assert names and all(n.startswith("kvlab-io") for n in names), names
    finally:
        engine.shutdown()
