"""Dropping the kernel's page cache before a measurement, and saying why when it cannot be.

A file-backed tier whose files are still in the page cache is read from host RAM, not from
its drive: a sweep or a restart that compares tiers drops the cache first. Only the page
cache (1), not dentries and inodes (2, 3): the question is where the KV bytes come from,
and a cold directory lookup would charge each tier for the number of files it opens.
"""

from __future__ import annotations

import os
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache(control: Path = DROP_CACHES) -> str | None:
    """Write dirty pages back, then drop the clean page cache. None when it was dropped;
    otherwise why not (not root, a read-only /proc, ...), for the record."""
    os.sync()  # dirty pages cannot be dropped: written back first, they can
    try:
        with open(control, "w") as f:
            f.write("1\n")
    except OSError as e:
        return f"cannot write 1 to {control}: {e.strerror or e}"
    return None
