"""The bounded host staging ring: the only host memory that KV passes through.

One anonymous, page-aligned mapping cut into equal slots. A slot is lent for one
section's trip between the drives and the KV cache and given back when the I/O and the
copy are done. Whatever the working set, host memory for KV stays at the ring's size.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

PAGE = 4096


def align_up(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


class RingFull(Exception):
    """No free slot within the time the caller allowed."""


class StagingRing:
    def __init__(self, ring_bytes: int, slot_bytes: int):
        slot_bytes = align_up(slot_bytes)
        if ring_bytes < slot_bytes:
            raise ValueError(
                f"ring_bytes {ring_bytes} is smaller than one slot ({slot_bytes} bytes): "
                f"raise ring_bytes or lower chunk_tokens"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = ring_bytes // slot_bytes
        self.ring_bytes = self.num_slots * slot_bytes
        self._map = mmap.mmap(-1, self.ring_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Fault every page in now: the ring's memory is paid once, at start, and O_DIRECT
        # into a pre-faulted buffer runs at the drive's speed.
        view = memoryview(self._map)
        zeros = bytes(1 << 20)
        for off in range(0, self.ring_bytes, len(zeros)):
            n = min(len(zeros), self.ring_bytes - off)
            view[off:off + n] = zeros[:n]
        self._view = view
        # The mapping's address, for copies that bypass Python buffers (the worker's
        # memmove into the paged cache); the temporary export ends with the expression.
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._cond = threading.Condition()
        self.high_water = 0

    def acquire(self, timeout_s: float | None = 0.0) -> int:
        """A free slot's index; waits up to timeout_s (None: forever), else RingFull."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._free:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RingFull()
                self._cond.wait(remaining)
            slot = self._free.pop()
            self.high_water = max(self.high_water, self.num_slots - len(self._free))
            return slot

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def buffer(self, slot: int, nbytes: int | None = None) -> memoryview:
        start = slot * self.slot_bytes
        return self._view[start:start + (nbytes if nbytes is not None else self.slot_bytes)]

    def address(self, slot: int) -> int:
        return self._address + slot * self.slot_bytes

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.num_slots - len(self._free)

    def close(self) -> None:
        """Unmap now if no slot view is still referenced; otherwise when the last one goes."""
        try:
            self._view.release()
            self._map.close()
        except BufferError:
            pass
