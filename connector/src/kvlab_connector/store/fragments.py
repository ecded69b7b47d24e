"""An object's fragment files on the store's drives: where each goes (format.FragmentNames)
and how it opens (O_DIRECT where the drive takes it). The reader, the writer and the memory
media take this, not the store."""

from __future__ import annotations

import os
from pathlib import Path

from kvlab_connector.store.format import FragmentNames


class Fragments(FragmentNames):
    def __init__(self, drives: list[Path], o_direct: list[bool]):
        self.drives = drives  # each drive's store root (format.ROOT_NAME)
        self.o_direct = o_direct

    def open_for(self, frag: int, path: os.PathLike, flags: int) -> int:
        """A fragment file on drive `frag`, with O_DIRECT where the drive takes it (the
        writer's files too)."""
        if self.o_direct[frag]:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o640)

    @property
    def io_mode(self) -> str:
        if all(self.o_direct):
            return "posix-odirect"
        if any(self.o_direct):
            return "posix-mixed"
        return "posix-buffered"
