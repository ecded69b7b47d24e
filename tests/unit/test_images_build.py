"""The orchestrator on a tiny builder (this module): the store path, the last line, the SBOM, and
a rebuild that differs from the cached build failing with diffoscope naming where."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from kvlab.images import ImageError, sbom
from kvlab.images import build as orchestrator
from kvlab.images.identity import Built, Component

# The builder interface, implemented here: a two-file tar whose motd is not an input, so that
# changing MOTD between builds is exactly a build that is not reproducible.
FLAVORS = ("",)
MOTD = b"hello\n"
COMPONENTS = [
    Component("deb", "bash", "5.2.37-2+b10", "a" * 64, "amd64"),
    Component("wheel", "numpy", "2.2.6", "b" * 64),
]


def inputs(flavor: str) -> list[Path]:
    return [Path(__file__)]


def tools(flavor: str) -> str:
    return "python tarfile"


BUILDS: list[str] = []  # one entry per build this builder ran
RELEASE = threading.Event()  # set: a build may finish (the concurrency test holds it open)
RELEASE.set()


def build(flavor: str, work: Path, log) -> Built:
    BUILDS.append(flavor)
    assert RELEASE.wait(30), "the test never let the build finish"
    artifact = work / "image.tar"
    with tarfile.open(artifact, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("etc/hostname", b"tiny\n"), ("etc/motd", MOTD)):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    (work / "note.txt").write_text("built\n")
    return Built(artifact, {"image.tar": artifact, "note.txt": work / "note.txt"}, COMPONENTS, {"files": 2})


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(orchestrator.REGISTRY, "tiny", __name__)
    monkeypatch.setattr(sys.modules[__name__], "MOTD", b"hello\n")
    return orchestrator


def test_a_build_is_stored_under_its_identity_with_sbom_provenance_and_last_line(tiny):
    store = orchestrator.build("tiny", log=lambda _m: None)
    p = orchestrator.plan("tiny")
    assert store == p.store and store.name == f"tiny-{p.identity}"
    m = orchestrator.manifest(store)
    assert m["artifact"] == "image.tar" and set(m["sha256"]) == {"image.tar", "note.txt"}
    line = orchestrator.final_line("tiny", store)
    assert re.fullmatch(r"image tiny sha256:[0-9a-f]{64} path \S+/image\.tar sbom \S+/sbom\.cdx\.json", line)
    assert sbom.read_components(store / "sbom.cdx.json") == {
        "pkg:deb/debian/bash@5.2.37-2+b10?arch=amd64": "a" * 64,
        "pkg:pypi/numpy@2.2.6": "b" * 64,
    }
    prov = json.loads((store / "provenance.json").read_text())
    assert prov["identity"] == p.identity and "tests/unit/test_images_build.py" in prov["inputs"]
    assert prov["builder"]["meta"] == {"files": 2} and "commit" in prov["git"]


def test_a_rebuild_that_matches_keeps_the_cached_build(tiny):
    first = orchestrator.build("tiny", log=lambda _m: None)
    before = (first / "provenance.json").read_bytes()
    assert orchestrator.build("tiny", log=lambda _m: None) == first
    assert (first / "provenance.json").read_bytes() == before  # the cached build stays as it was
    assert orchestrator.ensure("tiny", log=lambda _m: None) == first
    assert not list(orchestrator.images_dir().glob(".build-*"))  # no work folder left


@pytest.mark.skipif(
    not shutil.which("diffoscope"), reason="diffoscope not installed (run scripts/testbed-deps)"
)
def test_a_rebuild_that_differs_fails_and_diffoscope_names_the_file(tiny, monkeypatch):
    first = orchestrator.build("tiny", log=lambda _m: None)
    monkeypatch.setattr(sys.modules[__name__], "MOTD", b"hello, world\n")
    with pytest.raises(ImageError) as e:
        orchestrator.build("tiny", log=lambda _m: None)
    msg = str(e.value)
    assert msg.startswith("not reproducible") and "image.tar" in msg and "note.txt" not in msg.splitlines()[0]
    assert "etc/motd" in msg and "hello, world" in msg  # diffoscope went inside the tar
    rebuild = first.with_name(first.name + ".rebuild")
    assert (rebuild / "diffoscope-image.tar.txt").exists()
    assert orchestrator.manifest(first)["sha256"] != orchestrator.manifest(rebuild)["sha256"]


def test_an_ensure_beside_a_running_build_waits_for_it_and_builds_nothing(tiny, monkeypatch):
    """make test builds its images in the background while a tier may ask for the same one."""
    monkeypatch.setattr(sys.modules[__name__], "BUILDS", [])
    RELEASE.clear()
    waiting = threading.Event()
    stores: dict[str, Path] = {}

    def first() -> None:
        stores["first"] = orchestrator.ensure("tiny", log=lambda _m: None)

    def second_log(msg: str) -> None:
        if "waiting for its build" in msg:
            waiting.set()

    def second() -> None:
        stores["second"] = orchestrator.ensure("tiny", log=second_log)

    try:
        a = threading.Thread(target=first)
        a.start()
        while not BUILDS and a.is_alive():  # the first build is under way, holding the lock
            time.sleep(0.01)
        b = threading.Thread(target=second)
        b.start()
        assert waiting.wait(10), "the second ensure did not wait for the running build"
    finally:
        RELEASE.set()
    a.join(30)
    b.join(30)
    assert BUILDS == [""] and stores["first"] == stores["second"] == orchestrator.plan("tiny").store


def test_unknown_image_and_flavor_are_named():
    with pytest.raises(ImageError, match="unknown; choose one of"):
        orchestrator.builder("nope")
    with pytest.raises(ImageError, match="flavor 'cpu' unknown.*drop --flavor"):
        orchestrator.plan("testbed", "cpu")
