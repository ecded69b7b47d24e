"""The testbed image the VMs boot: its SBOM lists every package of packages.lock with the locked
.deb hash, and its provenance names the identity it is stored under (the image is the tier's own,
cached by inputs: this adds about a second)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvlab.images import build, debian, sbom
from kvlab.testbed import image


@pytest.fixture(scope="module")
def store():
    p = build.plan("testbed")
    if not build.cached(p) and (os.geteuid() != 0 or not shutil.which("mmdebstrap")):
        pytest.skip("no cached testbed image, and building one needs root and mmdebstrap")
    return build.ensure("testbed")


def test_the_sbom_lists_every_locked_package_with_its_hash(store):
    defn = debian.Definition.load(image.definition_root())
    lock = {n: (p.version, p.sha256) for n, p in defn.lock.items()}
    assert sbom.against_lock(store / build.SBOM_FILE, "deb", lock) == []
    assert len(sbom.read_components(store / build.SBOM_FILE)) == len(lock)


def test_the_provenance_names_the_identity_and_every_input(store):
    prov = json.loads((store / build.PROVENANCE_FILE).read_text())
    p = build.plan("testbed")
    assert prov["identity"] == p.identity and store.name.endswith(p.identity)
    assert "images/testbed/packages.lock" in prov["inputs"] and prov["builder"]["meta"]["kernel"]
