"""An image's identity: every byte of every input counts, nothing else does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvlab import paths
from kvlab.images import build
from kvlab.images.identity import identity


@pytest.fixture
def definition(tmp_path: Path) -> list[Path]:
    files = {
        "images/x/image.yml": "name: x\n",
        "images/x/packages.lock": "bash=5.2 sha256=00\n",
        "images/x/overlay/usr/local/sbin/init": "#!/bin/sh\n",
        "images/tools/mke2fs.conf": "[defaults]\n",
        "src/builder.py": "BUILDER = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    os.chmod(tmp_path / "images/x/overlay/usr/local/sbin/init", 0o755)
    return [tmp_path / rel for rel in files]


def _id(
    inputs: list[Path], root: Path, tools: str = "mmdebstrap 1.3.5", name: str = "x", flavor: str = ""
) -> str:
    return identity(name, flavor, inputs, tools, root)


def test_identity_is_stable_and_order_free(definition, tmp_path):
    assert _id(definition, tmp_path) == _id(list(reversed(definition)), tmp_path)
    assert len(_id(definition, tmp_path)) == 16


@pytest.mark.parametrize("index", range(5))
def test_one_byte_of_any_input_changes_the_identity(definition, tmp_path, index):
    before = _id(definition, tmp_path)
    p = definition[index]
    data = bytearray(p.read_bytes())
    data[0] ^= 1
    p.write_bytes(bytes(data))
    assert _id(definition, tmp_path) != before


def test_the_exec_bit_counts_but_the_umask_does_not(definition, tmp_path):
    before = _id(definition, tmp_path)
    os.chmod(definition[0], 0o600)  # a checkout made under umask 077
    assert _id(definition, tmp_path) == before
    os.chmod(definition[2], 0o644)  # the overlay's script is no longer executable
    assert _id(definition, tmp_path) != before


def test_renaming_an_input_changes_the_identity(definition, tmp_path):
    before = _id(definition, tmp_path)
    definition[1].rename(definition[1].with_name("packages.lock2"))
    definition[1] = definition[1].with_name("packages.lock2")
    assert _id(definition, tmp_path) != before


def test_tools_name_and_flavor_count(definition, tmp_path):
    base = _id(definition, tmp_path)
    assert _id(definition, tmp_path, tools="mmdebstrap 1.5.0") != base
    assert _id(definition, tmp_path, name="y") != base
    assert _id(definition, tmp_path, flavor="cpu") != base


def test_an_unrelated_file_does_not_count(definition, tmp_path):
    before = _id(definition, tmp_path)
    (tmp_path / "README.md").write_text("hello\n")
    (tmp_path / "src" / "other.py").write_text("x = 1\n")
    assert _id(definition, tmp_path) == before


def test_an_input_outside_the_checkout_is_refused(definition, tmp_path):
    with pytest.raises(ValueError, match="inside the checkout"):
        _id(definition, tmp_path / "images")


def test_the_testbed_identity_covers_its_definition_and_builders_and_nothing_else():
    p = build.plan("testbed")
    root = paths.repo_root()
    names = {q.relative_to(root).as_posix() for q in p.inputs}
    assert {
        "images/testbed/image.yml",
        "images/testbed/packages.lock",
        "images/testbed/customize.sh",
        "images/testbed/overlay/usr/local/sbin/kvlab-guest-init",
        "images/tools/mke2fs.conf",
        "src/kvlab/testbed/image.py",
        "src/kvlab/images/build.py",
        "src/kvlab/images/sbom.py",
    } <= names
    assert not any(n.startswith(("README", "tests/", "roles/", "src/kvlab/harness")) for n in names)
    assert p.store.name == f"testbed-{p.identity}"
