"""Which configured mount point a store folder lies under (the longest one that contains it)."""

from __future__ import annotations

import posixpath


def kvlab_connector_mount_of(path: str, mounts: list[str]) -> str:
    path = posixpath.normpath(path)
    inside = [m for m in mounts if path == posixpath.normpath(m) or path.startswith(posixpath.normpath(m).rstrip("/") + "/")]
    return max(inside, key=len) if inside else ""


class FilterModule:
    def filters(self):
        return {"kvlab_connector_mount_of": kvlab_connector_mount_of}
