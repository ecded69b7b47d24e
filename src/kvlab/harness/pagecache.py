"""Dropping the kernel's page cache before a measurement, and saying why when it cannot be.

A file-backed tier whose files are still in the page cache is read from host RAM, not from
its drive: a sweep or a restart that compares tiers drops the cache first. Only the page
cache (1), not dentries and inodes (2, 3): the question is where the KV bytes come from,
and a cold directory lookup would charge each tier for the number of files it opens.
"""

from __future__ import annotations

import os

from kvlab_connector.osutil import DROP_CACHES, drop_caches


def drop_page_cache(control: str | os.PathLike = DROP_CACHES) -> str | None:
    """Drop the clean page cache (dirty pages written back first). None when it was dropped;
    otherwise why not, for the record."""
    return drop_caches(1, control)
