"""The store's on-drive format: how objects are cut, named and striped, and each section's
trailer.

An object is `n_sections` sections (one per layer) of `section_bytes` each. Sections are
striped round-robin over the drives; the sections that land on one drive form that object's
fragment file there:

    <drive>/kvlab-v1/<namespace>/<key[:2]>/<key>.<fragment>-<fragments>.<bytes>

(the size in the name lets the start-up rebuild count usage from directory listings alone,
without a stat per file).

Each section is stored as its payload (padded to a page) followed by a one-page trailer
that carries the namespace, key, section index, length, the id of the write it belongs
to and a checksum of the payload:
xxh3 for sections written from host memory, wsum64 (checksum.py) for sections a GPU wrote
straight from device memory; the trailer's magic says which, and either path reads either.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvlab_connector.config import is_positive_int
from kvlab_connector.ring import PAGE, align_up

ROOT_NAME = "kvlab-v1"
# The magic names the trailer's format and the payload's checksum. Format 1 (KVLBSEC1,
# KVLBSECW) had no write id: its sections fail the check, so objects written by an older
# connector are clean misses, counted and evicted like any other until they age out.
MAGIC_XXH3 = b"KVLBSX02"
MAGIC_WSUM = b"KVLBSW02"
# magic, namespace, key, section, n_sections, payload_len, num_tokens, tag, write id, payload checksum
_TRAILER = struct.Struct("<8s16s16sIIQIQQQ")
_TRAILER_CHECK = struct.Struct("<Q")
TRAILER_BYTES = _TRAILER.size + _TRAILER_CHECK.size
FRAGMENT_RE = re.compile(r"^([0-9a-f]{32})\.(\d+)-(\d+)\.(\d+)$")
TMP_RE = re.compile(r"^\.([0-9a-f]{32})\.(\d+)-(\d+)\.(\d+)\.(\d+)\.[0-9a-f]+\.tmp$")
# Namespaces and keys: what the names above can hold, and what the trailer's bytes encode.
_NAME_RE = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class ObjectShape:
    """How an object is cut: `n_sections` sections of `section_bytes` payload each."""

    n_sections: int
    section_bytes: int

    def __post_init__(self) -> None:
        for name in ("n_sections", "section_bytes"):
            v = getattr(self, name)
            if not is_positive_int(v):
                raise ValueError(f"ObjectShape.{name} must be a positive integer, got {v!r}")

    @property
    def stride(self) -> int:
        """Bytes one section takes on a drive and in a ring slot: payload + trailer page."""
        return align_up(self.section_bytes) + PAGE

    @property
    def object_bytes(self) -> int:
        return self.n_sections * self.stride


def check_name(what: str, value: object) -> str:
    """A namespace or key as the store names files: 32 lowercase hex characters."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(f"kvlab store: {what} {value!r} is not 32 lowercase hex characters")
    return value


class FragmentNames:
    """Where an object's sections go on `self.drives` (a list of the drives' store roots)."""

    drives: list[Path]

    def n_fragments(self, shape: ObjectShape) -> int:
        return min(len(self.drives), shape.n_sections)

    def _first_fragment(self, key: str, nfrag: int) -> int:
        return int(key[:8], 16) % nfrag

    def placement(self, key: str, shape: ObjectShape, section: int) -> tuple[int, int]:
        """(fragment index = drive index, byte offset in the fragment file) of a section."""
        nfrag = self.n_fragments(shape)
        frag = (section + self._first_fragment(key, nfrag)) % nfrag
        return frag, (section // nfrag) * shape.stride

    def fragment_bytes(self, key: str, shape: ObjectShape, frag: int) -> int:
        nfrag = self.n_fragments(shape)
        first = self._first_fragment(key, nfrag)
        return sum(1 for s in range(shape.n_sections) if (s + first) % nfrag == frag) * shape.stride

    def fragment_path(self, ns: str, key: str, shape: ObjectShape, frag: int) -> Path:
        check_name("namespace", ns)
        check_name("key", key)
        return self._path(ns, key, shape, frag)

    def fragment_paths(self, ns: str, key: str, shape: ObjectShape) -> list[Path]:
        """Every fragment's path, in fragment order (the names checked once: lookups are
        per key, many a request)."""
        check_name("namespace", ns)
        check_name("key", key)
        return [self._path(ns, key, shape, f) for f in range(self.n_fragments(shape))]

    def _path(self, ns: str, key: str, shape: ObjectShape, frag: int) -> Path:
        nfrag = self.n_fragments(shape)
        return self.drives[frag] / ns / key[:2] / f"{key}.{frag}-{nfrag}.{self.fragment_bytes(key, shape, frag)}"


def pack_trailer(
    ns: str, key: str, shape: ObjectShape, section: int, num_tokens: int, tag: int, write_id: int, magic: bytes,
    checksum: int,
) -> bytes:
    head = _TRAILER.pack(
        magic, bytes.fromhex(ns), bytes.fromhex(key), section, shape.n_sections,
        shape.section_bytes, num_tokens, tag, write_id, checksum,
    )
    return head + _TRAILER_CHECK.pack(xxhash.xxh3_64_intdigest(head))


def check_trailer(
    trailer: bytes, ns: str, key: str, shape: ObjectShape, section: int, tag: int
) -> tuple[bytes, int, int] | None:
    """(magic, write id, payload checksum) of a trailer that is intact and names this very
    section of this object in this layout; None otherwise."""
    try:
        fields = _TRAILER.unpack_from(trailer)
        (check,) = _TRAILER_CHECK.unpack_from(trailer, _TRAILER.size)
    except struct.error:
        return None
    magic, t_ns, t_key, t_sec, t_n, t_len, _tokens, t_tag, t_write, t_sum = fields
    if (
        magic not in (MAGIC_XXH3, MAGIC_WSUM)
        or check != xxhash.xxh3_64_intdigest(trailer[:_TRAILER.size])
        or t_ns != bytes.fromhex(ns)
        or t_key != bytes.fromhex(key)
        or t_sec != section
        or t_n != shape.n_sections
        or t_len != shape.section_bytes
        or t_tag != tag
    ):
        return None
    return magic, t_write, t_sum
