"""The bounded staging ring: the only memory outside the KV cache that KV passes through.

Equal slots cut from one allocation. A slot is lent for one section's trip between the
drives and the KV cache and given back when the I/O and the copy are done. Whatever the
working set, staging memory stays at the ring's size.

`StagingRing` is host memory (an anonymous, page-aligned mapping: O_DIRECT reads land in
it; on GPU engines it is also page-locked so copies to the device run asynchronously).
`DeviceRing` is GPU memory, for GDS: drive to device with no host copy at all.
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


class _Slots:
    """Lending equal slots: acquire waits up to a deadline, release gives back."""

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

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.num_slots - len(self._free)


class StagingRing(_Slots):
    def __init__(self, ring_bytes: int, slot_bytes: int):
        super().__init__(ring_bytes, slot_bytes)
        self._pinned = False
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

    def pin(self) -> None:
        """Page-lock the ring for CUDA (GPU engines): copies between it and the device
        then run asynchronously, on a copy stream, at the link's speed."""
        import torch

        err = torch.cuda.cudart().cudaHostRegister(self._address, self.ring_bytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the {self.ring_bytes >> 20} MiB staging ring failed: {err}")
        self._pinned = True

    def buffer(self, slot: int, nbytes: int | None = None) -> memoryview:
        start = slot * self.slot_bytes
        return self._view[start:start + (nbytes if nbytes is not None else self.slot_bytes)]

    def address(self, slot: int) -> int:
        return self._address + slot * self.slot_bytes

    def close(self) -> None:
        """Unmap now if no slot view is still referenced; otherwise when the last one goes."""
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._address)
            self._pinned = False
        try:
            self._view.release()
            self._map.close()
        except BufferError:
            pass


class DeviceRing(_Slots):
    """Slots in GPU memory (or, where there is no GPU, any torch device): GDS reads land
    here, are verified on the device and copied into the paged cache without a host copy."""

    def __init__(self, ring_bytes: int, slot_bytes: int, device: object):
        import torch

        super().__init__(ring_bytes, slot_bytes)
        # Zeroed, so a slot's padding never carries stale device memory onto a drive, and
        # complete before kvikio (on streams of its own) or an I/O thread touches it.
        self._memory = torch.zeros(self.ring_bytes, dtype=torch.uint8, device=device)
        if self._memory.is_cuda:
            torch.cuda.synchronize(self._memory.device)

    def tensor(self, slot: int, nbytes: int | None = None):  # type: ignore[no-untyped-def]
        start = slot * self.slot_bytes
        return self._memory[start:start + (nbytes if nbytes is not None else self.slot_bytes)]

    def close(self) -> None:
        self._memory = self._memory[:0]
