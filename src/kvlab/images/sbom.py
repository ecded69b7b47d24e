"""A CycloneDX 1.5 JSON SBOM of one image: every .deb and wheel in it, with the sha256 of the file
that was installed.

Our own writer rather than cyclonedx-py: one document must hold the Debian packages (read from
the image's dpkg status, hashed from packages.lock) and the wheels, each with the hash of the one
file installed; cyclonedx-py reads only Python environments or requirement files, and from a
hash-checked lock it records every hash the lock allows (all platforms' wheels), not the one used.
Deterministic: components sorted, no timestamp, the serial number derived from the identity.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from kvlab.images.identity import Component

SPEC_VERSION = "1.5"
# uuid5 namespace for serial numbers: the same identity always gives the same serial number
_SERIAL_NS = uuid.UUID("6c0e3f4a-2b1d-5e8f-9a7c-3d2e1f0a4b5c")


def purl(c: Component) -> str:
    if c.kind == "deb":
        return f"pkg:deb/debian/{c.name}@{c.version}" + (f"?arch={c.arch}" if c.arch else "")
    if c.kind == "wheel":
        return f"pkg:pypi/{c.name.lower().replace('_', '-')}@{c.version}"
    raise ValueError(f"component {c.name}: kind {c.kind!r} is neither deb nor wheel")


def document(
    name: str, identity: str, digest: str, components: list[Component], image_type: str = "operating-system"
) -> dict:
    """The SBOM as a JSON object; `digest` is the image artifact's sha256 (hex), `image_type` the
    CycloneDX type of the image itself ("operating-system" for a disk, "container" for an OCI image)."""
    comps = sorted(components, key=lambda c: (c.kind, c.name, c.version, c.arch))
    return {
        "bomFormat": "CycloneDX",
        "specVersion": SPEC_VERSION,
        "serialNumber": f"urn:uuid:{uuid.uuid5(_SERIAL_NS, f'{name}-{identity}')}",
        "version": 1,
        "metadata": {
            "component": {
                "type": image_type,
                "bom-ref": f"image:{name}",
                "name": name,
                "version": identity,
                "hashes": [{"alg": "SHA-256", "content": digest}],
            },
            "tools": {"components": [{"type": "application", "name": "kvlab.images.sbom"}]},
        },
        "components": [
            {
                "type": "library",
                "bom-ref": purl(c),
                "name": c.name,
                "version": c.version,
                "purl": purl(c),
                "hashes": [{"alg": "SHA-256", "content": c.sha256}],
            }
            for c in comps
        ],
    }


def write(path: Path, *args, **kw) -> Path:
    """document(*args, **kw) written to path, keys sorted."""
    path.write_text(json.dumps(document(*args, **kw), indent=2, sort_keys=True) + "\n")
    return path


def read_components(path: Path) -> dict[str, str]:
    """purl -> SHA-256 of every component of an SBOM (what a check against the locks compares)."""
    doc = json.loads(path.read_text())
    out = {}
    for c in doc.get("components", []):
        sha = [h["content"] for h in c.get("hashes", []) if h.get("alg") == "SHA-256"]
        out[c["purl"]] = sha[0] if sha else ""
    return out
