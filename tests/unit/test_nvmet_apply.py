"""roles/nvmeof_target's configfs applier on a stand-in configfs: it touches only what it owns.

The target may be shared: subsystems, ports and hosts that another user made must survive every
apply, an empty configuration and a teardown (--remove); an entry of the file that someone else
already holds is refused, never taken over."""

from __future__ import annotations

import errno
import importlib.machinery
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT_DIR = Path(__file__).resolve().parents[2]
APPLY = ROOT_DIR / "roles/nvmeof_target/files/kvlab-nvmet-apply"
OURS = "nqn.2026-01.io.kvlab.test:store0"
THEIRS = "nqn.2020-01.org.example:someone-else"
HOST = "nqn.2014-08.org.nvmexpress:uuid:4f1d8a52-0c7e-4b7a-9a33-6b2c1e0d9f02"


def load(tmp_path: Path, monkeypatch):
    loader = importlib.machinery.SourceFileLoader("kvlab_nvmet_apply", str(APPLY))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    root = tmp_path / "nvmet"
    for d in ("subsystems", "ports", "hosts"):
        (root / d).mkdir(parents=True)
    monkeypatch.setattr(mod, "ROOT", str(root))
    monkeypatch.setattr(mod, "CONFIG", str(tmp_path / "nvmet.json"))
    monkeypatch.setattr(mod, "OWNED", str(tmp_path / "state" / "nvmet-owned.json"))
    # this machine's own /sys and /proc say nothing about the stand-in drives
    monkeypatch.setattr(mod, "SYSFS", str(tmp_path / "sys"))
    monkeypatch.setattr(mod, "PROC", str(tmp_path / "proc"))
    monkeypatch.setattr(mod, "wait_for_addresses", lambda cfg: None)
    monkeypatch.setattr(mod.subprocess, "run", lambda *a, **k: None)
    monkeypatch.setattr(mod.Applier, "fs_mkdir", staticmethod(lambda p: configfs_mkdir(root, p)))
    monkeypatch.setattr(mod.Applier, "fs_rmdir", staticmethod(lambda p: configfs_rmdir(root, p)))
    return mod, root


def configfs_mkdir(root: Path, path: str) -> None:
    """mkdir in nvmet's configfs: the kernel fills in each object's attributes and groups."""
    p = Path(path)
    p.mkdir()
    kind = p.parent.name
    if p.parent == root / "subsystems":
        (p / "attr_allow_any_host").write_text("1\n")
        (p / "attr_serial").write_text("\n")
        (p / "namespaces").mkdir()
        (p / "allowed_hosts").mkdir()
    elif kind == "namespaces":
        for attr, value in (("enable", "0"), ("device_path", ""), ("device_uuid", "")):
            (p / attr).write_text(value + "\n")
    elif p.parent == root / "ports":
        for attr in ("addr_trtype", "addr_adrfam", "addr_traddr", "addr_trsvcid"):
            (p / attr).write_text("\n")
        (p / "subsystems").mkdir()


def configfs_rmdir(root: Path, path: str) -> None:
    """rmdir in configfs fails while the object has children or something links to it."""
    p = Path(path)
    busy = [c for c in p.glob("namespaces/*")] + [c for c in p.glob("subsystems/*")]
    busy += [link for link in root.glob("*/*/*/*") if link.is_symlink() and Path(os.readlink(link)) == p]
    if busy:
        raise OSError(errno.EBUSY, f"busy: {busy[0]}")
    shutil.rmtree(p)


def config(device: Path, nqn: str = OURS, port: int = 1) -> dict:
    return {
        "hosts": [{"nqn": HOST}],
        "subsystems": [{"nqn": nqn, "serial": "s0", "allowed_hosts": [HOST],
                        "namespaces": [{"nsid": 1, "device": str(device), "uuid": "7b3b6f6e-2c1a-4d6a-9e51-0a1b2c3d4e01"}]}],
        "ports": [{"id": port, "transport": "tcp", "family": "ipv4", "address": "10.0.0.1", "service": 4420,
                   "subsystems": [nqn]}],
    }  # fmt: skip


def someone_elses(mod, root: Path, device: Path) -> None:
    """Another user's subsystem, host and port, made by hand (not through the applier)."""
    configfs_mkdir(root, str(root / "subsystems" / THEIRS))
    configfs_mkdir(root, str(root / "subsystems" / THEIRS / "namespaces" / "1"))
    (root / "subsystems" / THEIRS / "namespaces/1/device_path").write_text(f"{device}\n")
    configfs_mkdir(root, str(root / "hosts" / "nqn.2020-01.org.example:their-host"))
    os.symlink(root / "hosts/nqn.2020-01.org.example:their-host",
               root / "subsystems" / THEIRS / "allowed_hosts/nqn.2020-01.org.example:their-host")
    configfs_mkdir(root, str(root / "ports" / "7"))
    os.symlink(root / "subsystems" / THEIRS, root / "ports/7/subsystems" / THEIRS)


def run(mod, tmp_path: Path, cfg: dict | None, *args: str) -> int:
    if cfg is not None:
        (tmp_path / "nvmet.json").write_text(json.dumps(cfg))
    return mod.main(list(args))


def snapshot(root: Path, under: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / under).rglob("*"))


@pytest.fixture
def target(tmp_path, monkeypatch):
    mod, root = load(tmp_path, monkeypatch)
    device = tmp_path / "disk0"
    device.write_bytes(b"")
    someone_elses(mod, root, device)
    theirs = {d: snapshot(root, d) for d in ("subsystems", "ports", "hosts")}
    return mod, root, device, theirs


def their_entries_intact(root: Path, theirs: dict) -> None:
    assert (root / "subsystems" / THEIRS / "namespaces/1").is_dir()
    assert (root / "ports/7/subsystems" / THEIRS).is_symlink()
    assert (root / "hosts/nqn.2020-01.org.example:their-host").is_dir()
    assert (root / "subsystems" / THEIRS / "allowed_hosts/nqn.2020-01.org.example:their-host").is_symlink()
    def theirs_of(paths: list[str]) -> list[str]:
        return [p for p in paths if p.startswith(("ports/7", f"subsystems/{THEIRS}", "hosts/nqn.2020-01"))]

    for d, before in theirs.items():
        assert theirs_of(before) == theirs_of(snapshot(root, d))


def test_apply_builds_ours_and_marks_it_leaving_theirs(target, tmp_path):
    mod, root, device, theirs = target
    assert run(mod, tmp_path, config(device)) == 0
    sub = root / "subsystems" / OURS
    assert (sub / "attr_allow_any_host").read_text().strip() == "0"
    assert (sub / "allowed_hosts" / HOST).is_symlink()
    assert (root / "ports/1/subsystems" / OURS).is_symlink()
    owned = json.loads((tmp_path / "state/nvmet-owned.json").read_text())
    assert owned == {"subsystems": [OURS], "ports": ["1"], "hosts": [HOST]}
    their_entries_intact(root, theirs)
    # applied again, nothing differs: --check says so (exit 0)
    assert run(mod, tmp_path, None, "--check") == 0


def test_empty_configuration_removes_only_what_it_owns(target, tmp_path):
    mod, root, device, theirs = target
    run(mod, tmp_path, config(device))
    assert run(mod, tmp_path, {"hosts": [], "subsystems": [], "ports": []}) == 0
    assert not (root / "subsystems" / OURS).exists() and not (root / "ports/1").exists()
    assert not (root / "hosts" / HOST).exists()
    their_entries_intact(root, theirs)
    assert json.loads((tmp_path / "state/nvmet-owned.json").read_text()) == {"subsystems": [], "ports": [], "hosts": []}


def test_remove_tears_down_ours_only(target, tmp_path):
    mod, root, device, theirs = target
    run(mod, tmp_path, config(device))
    assert run(mod, tmp_path, None, "--remove", "--check") == 2  # it would change something
    assert run(mod, tmp_path, None, "--remove") == 0
    assert sorted(p.name for p in (root / "subsystems").iterdir()) == [THEIRS]
    assert sorted(p.name for p in (root / "ports").iterdir()) == ["7"]
    their_entries_intact(root, theirs)


def test_a_subsystem_someone_else_holds_is_refused_not_taken_over(target, tmp_path):
    mod, root, device, theirs = target
    with pytest.raises(SystemExit, match=f"subsystem {THEIRS}.*not kvlab's"):
        run(mod, tmp_path, config(device, nqn=THEIRS, port=2))
    with pytest.raises(SystemExit, match="port 7.*not kvlab's"):
        run(mod, tmp_path, config(device, port=7))
    their_entries_intact(root, theirs)
    assert not (root / "subsystems" / OURS).exists()


def test_their_subsystem_on_our_port_keeps_the_port(target, tmp_path):
    mod, root, device, theirs = target
    run(mod, tmp_path, config(device))
    os.symlink(root / "subsystems" / THEIRS, root / "ports/1/subsystems" / THEIRS)  # linked there by hand
    run(mod, tmp_path, {"hosts": [], "subsystems": [], "ports": []})
    assert not (root / "subsystems" / OURS).exists()
    assert (root / "ports/1/subsystems" / THEIRS).is_symlink()
    their_entries_intact(root, theirs)
