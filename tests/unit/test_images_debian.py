"""kvlab.images.debian's parts that need no mirror and no root: the lock, the local repository,
the dpkg status, normalisation, the unmount of an interrupted build."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvlab.images import ImageError, debian
from kvlab.images.identity import sha256_file

SHA = "e50984d2e1ef6300e3fd51303839842189a077b10cb5cadff1923df10c61c493"


def test_lock_round_trip():
    pins = {"bash": debian.Pin("5.2.37-2+b10", SHA), "bsdutils": debian.Pin("1:2.41.5-0+deb13u1", "0" * 64)}
    assert debian.parse_lock(debian.format_lock(pins)) == pins


def test_an_old_lock_line_without_sha256_names_the_line_and_the_repin_command(tmp_path):
    root = tmp_path / "testbed"
    with pytest.raises(ImageError) as e:
        debian.parse_lock(f"# c\nbash=5.2 sha256={SHA}\nadduser=3.152\n", root / "packages.lock", root)
    msg = str(e.value)
    assert "packages.lock:3: adduser=3.152 has no sha256=" in msg
    assert "kvlab image build testbed --repin" in msg


@pytest.mark.parametrize(
    "line", ["bash", "bash=5.2 sha256=abc", "bash=5.2 md5=" + "0" * 32, "=5.2 sha256=" + SHA]
)
def test_a_malformed_lock_line_is_named(line):
    with pytest.raises(ImageError, match="is not `name=version sha256=HEX`"):
        debian.parse_lock(line + "\n")


def test_lock_versions_reads_old_and_new_locks():
    assert debian.lock_versions(f"a=1\nb=2 sha256={SHA}\n# x\n") == {"a": "1", "b": "2"}


def test_the_committed_testbed_lock_has_a_hash_for_every_package():
    defn = debian.Definition.load(Path(__file__).resolve().parents[2] / "images" / "testbed")
    assert len(defn.lock) > 100 and all(len(p.sha256) == 64 for p in defn.lock.values())


def _deb(tmp_path: Path, name: str, version: str) -> Path:
    src = tmp_path / f"{name}-src"
    (src / "DEBIAN").mkdir(parents=True)
    (src / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: kvlab <kvlab@example.org>\n"
        "Description: a test package\n"
    )
    (src / "usr/share").mkdir(parents=True)
    (src / "usr/share" / f"{name}.txt").write_text("x\n")
    out = tmp_path / f"{name}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(src), str(out)], check=True, capture_output=True
    )
    return out


def test_local_repository_indexes_each_deb_by_its_hash(tmp_path):
    debs = {}
    for name, version in (("kvlab-a", "1.0"), ("kvlab-b", "2:0.1-1")):
        deb = _deb(tmp_path, name, version)
        sha = sha256_file(deb)
        debs[name] = deb.rename(tmp_path / f"{sha}.deb")
    repo = debian.local_repo(debs, tmp_path / "repo")
    stanzas = (repo / "Packages").read_text().strip().split("\n\n")
    assert len(stanzas) == 2
    for stanza, (name, deb) in zip(stanzas, sorted(debs.items()), strict=True):
        assert f"Package: {name}\n" in stanza and f"SHA256: {deb.stem}" in stanza
        assert f"Filename: ./{deb.name}" in stanza and f"Size: {deb.stat().st_size}" in stanza
        assert (repo / deb.name).read_bytes() == deb.read_bytes()
    assert debian.deb_fields(debs["kvlab-b"], "Package", "Version") == ["kvlab-b", "2:0.1-1"]
    assert not (repo / "Release").exists()


def test_local_repository_names_its_suite_for_the_essential_variant(tmp_path):
    """mmdebstrap --variant=essential picks the Essential set by ?archive(^SUITE$): a repository
    without a Release naming the suite gives it none ("Could not exec dpkg!")."""
    deb = _deb(tmp_path, "kvlab-a", "1.0")
    repo = debian.local_repo({"kvlab-a": deb}, tmp_path / "repo", "trixie")
    release = (repo / "Release").read_text()
    assert "Suite: trixie\nCodename: trixie\n" in release
    index = repo / "Packages"
    assert f" {sha256_file(index)} {index.stat().st_size} Packages\n" in release


STATUS = """Package: bash
Status: install ok installed
Architecture: amd64
Version: 5.2.37-2+b10
Description: shell
 more text: with a colon

Package: gone
Status: deinstall ok config-files
Architecture: amd64
Version: 1.0

Package: tzdata
Status: install ok installed
Architecture: all
Version: 2025b-4
"""


def _defn(tmp_path: Path, lock: dict[str, debian.Pin]) -> debian.Definition:
    return debian.Definition(
        root=tmp_path, name="x", release="trixie", arch="amd64", sources=(), keyring=Path("/k"),
        key_fingerprints=(), source_date_epoch=0, packages=("bash",), lock=lock, spec={},
    )  # fmt: skip


def test_components_come_from_the_dpkg_status_with_the_locked_hashes(tmp_path):
    (tmp_path / "status").write_text(STATUS)
    lock = {"bash": debian.Pin("5.2.37-2+b10", "a" * 64), "tzdata": debian.Pin("2025b-4", "b" * 64)}
    comps = debian.components(_defn(tmp_path, lock), tmp_path / "status")
    assert [(c.name, c.version, c.arch, c.sha256) for c in comps] == [
        ("bash", "5.2.37-2+b10", "amd64", "a" * 64),
        ("tzdata", "2025b-4", "all", "b" * 64),
    ]


def test_a_tree_that_differs_from_the_lock_is_refused(tmp_path):
    (tmp_path / "status").write_text(STATUS)
    lock = {"bash": debian.Pin("5.2.37-2+b9", "a" * 64), "tzdata": debian.Pin("2025b-4", "b" * 64)}
    with pytest.raises(ImageError, match="different package set.*5.2.37-2"):
        debian.components(_defn(tmp_path, lock), tmp_path / "status")


def test_normalize_removes_what_differs_and_clamps_shadow(tmp_path):
    for rel in ("var/log/apt/history.log", "etc/ssh/ssh_host_ed25519_key", "etc/passwd-", "etc/hostname"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x\n")
    (tmp_path / "etc/machine-id").write_text("0123\n")
    (tmp_path / "etc/shadow").write_text("root:*:20424:0:99999:7:::\nnobody:*::::::\n")
    debian.normalize(tmp_path, 1767225600)
    assert not (tmp_path / "var/log/apt/history.log").exists() and (tmp_path / "var/log/apt").is_dir()
    assert (
        not (tmp_path / "etc/ssh/ssh_host_ed25519_key").exists() and not (tmp_path / "etc/passwd-").exists()
    )
    assert (tmp_path / "etc/hostname").exists() and (tmp_path / "etc/machine-id").read_text() == ""
    assert (tmp_path / "etc/shadow").read_text() == "root:*:20454:0:99999:7:::\nnobody:*::::::\n"


def test_interrupted_build_is_unmounted_deepest_first_and_only_inside_its_folder(tmp_path, monkeypatch):
    work = tmp_path / "build x"
    (work / "rootfs").mkdir(parents=True)
    root = str(work.resolve()).replace(" ", "\\040")
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / /proc rw - proc proc rw\n"
        f"90 1 0:50 / {root}/rootfs/proc ro - proc proc ro\n"
        f"91 90 0:51 / {root}/rootfs/dev/pts rw - devpts devpts rw\n"
        f"92 1 0:52 / {root}x/rootfs/sys ro - sysfs sys ro\n"
    )
    calls = []
    monkeypatch.setattr(debian.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    points = debian.unmount_under(work, info)
    inside = str(work.resolve())
    assert points == [f"{inside}/rootfs/dev/pts", f"{inside}/rootfs/proc"]
    assert calls == [["umount", "--lazy", p] for p in points]


def test_every_committed_lock_names_a_repin_command_that_exists():
    """A stale lock's error tells the user what to run: that image must exist (the tools tree and
    the serving image's base are re-pinned by the image that uses them)."""
    from kvlab.images import build

    images = Path(__file__).resolve().parents[2] / "images"
    locks = sorted(images.rglob(debian.LOCK_FILE))
    assert len(locks) >= 4
    for lock in locks:
        image = debian.pinning_image(lock.parent)
        assert image in build.REGISTRY, f"{lock}: re-pinned by {image!r}, which is not an image"
        assert f"kvlab image build {image} --repin" in debian.repin_command(lock.parent)
