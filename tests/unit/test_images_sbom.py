"""The SBOM: CycloneDX 1.5, deterministic, every locked package present with its locked hash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.images import ImageError, debian, sbom
from kvlab.images.identity import Component

TESTBED = Path(__file__).resolve().parents[2] / "images" / "testbed"


def _status_of(lock: dict[str, debian.Pin], drop: str = "") -> str:
    """A dpkg status file holding every locked package (what the image's tree would hold)."""
    return "\n".join(
        f"Package: {n}\nStatus: install ok installed\nArchitecture: amd64\nVersion: {p.version}\n"
        for n, p in sorted(lock.items())
        if n != drop
    )


@pytest.fixture
def testbed_lock(tmp_path):
    defn = debian.Definition.load(TESTBED)
    (tmp_path / "status").write_text(_status_of(defn.lock))
    return defn, tmp_path / "status"


def _lock_table(defn: debian.Definition) -> dict[str, tuple[str, str]]:
    return {n: (p.version, p.sha256) for n, p in defn.lock.items()}


def test_the_testbed_sbom_lists_every_locked_deb_with_its_hash(testbed_lock, tmp_path):
    defn, status = testbed_lock
    comps = debian.components(defn, status)
    path = sbom.write(tmp_path / "sbom.cdx.json", "testbed", "0123456789abcdef", "f" * 64, comps)
    doc = json.loads(path.read_text())
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.5"
    assert len(doc["components"]) == len(defn.lock)
    assert sbom.against_lock(path, "deb", _lock_table(defn)) == []
    bash = next(c for c in doc["components"] if c["name"] == "bash")
    assert bash["purl"] == f"pkg:deb/debian/bash@{defn.lock['bash'].version}?arch=amd64"
    assert bash["hashes"] == [{"alg": "SHA-256", "content": defn.lock["bash"].sha256}]


def test_a_wrong_hash_or_missing_package_is_named(testbed_lock, tmp_path):
    defn, status = testbed_lock
    comps = [c for c in debian.components(defn, status) if c.name != "dash"]
    comps = [Component(c.kind, c.name, c.version, "0" * 64, c.arch) if c.name == "bash" else c for c in comps]
    path = sbom.write(tmp_path / "sbom.cdx.json", "testbed", "0123456789abcdef", "f" * 64, comps)
    assert sbom.against_lock(path, "deb", _lock_table(defn)) == [
        f"bash: SBOM has sha256 {'0' * 64}, the lock {defn.lock['bash'].sha256}",
        "dash: not in the SBOM",
    ]


def test_a_tree_missing_a_locked_package_gives_no_sbom(testbed_lock):
    defn, status = testbed_lock
    status.write_text(_status_of(defn.lock, drop="dash"))
    with pytest.raises(ImageError, match="dash"):
        debian.components(defn, status)


def test_wheels_are_pypi_purls_and_names_compare_as_pypi_does(tmp_path):
    comps = [
        Component("wheel", "LMCache", "0.3.9", "a" * 64),
        Component("wheel", "typing_extensions", "4.15.0", "b" * 64),
    ]
    path = sbom.write(tmp_path / "s.json", "serve", "0" * 16, "c" * 64, comps, image_type="container")
    assert set(sbom.read_components(path)) == {"pkg:pypi/lmcache@0.3.9", "pkg:pypi/typing-extensions@4.15.0"}
    lock = {"lmcache": ("0.3.9", "a" * 64), "typing-extensions": ("4.15.0", "b" * 64)}
    assert sbom.against_lock(path, "wheel", lock) == []
    assert json.loads(path.read_text())["metadata"]["component"]["type"] == "container"


def test_the_sbom_is_deterministic_and_has_no_timestamp(testbed_lock, tmp_path):
    defn, status = testbed_lock
    comps = debian.components(defn, status)
    a = sbom.write(tmp_path / "a.json", "testbed", "0123456789abcdef", "f" * 64, comps)
    b = sbom.write(tmp_path / "b.json", "testbed", "0123456789abcdef", "f" * 64, list(reversed(comps)))
    assert a.read_bytes() == b.read_bytes()
    doc = json.loads(a.read_text())
    assert "timestamp" not in doc["metadata"]
    other = sbom.document("testbed", "fedcba9876543210", "f" * 64, comps)
    assert other["serialNumber"] != doc["serialNumber"]  # derived from the identity
