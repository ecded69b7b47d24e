"""roles/gds/files/gds-platform: the IOMMU mode and ACS on the PCIe switch ports above GPUs
and RDMA NICs, read from a sysfs tree built here the way the kernel lays it out."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def load():  # type: ignore[no-untyped-def]
    loader = importlib.machinery.SourceFileLoader("gds_platform", str(ROOT / "roles/gds/files/gds-platform"))
    spec = importlib.util.spec_from_loader("gds_platform", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def config(acs_ctl: int | None) -> bytes:
    """4 KiB of configuration space: AER at 0x100, then ACS at 0x148 (or the chain ends)."""
    cfg = bytearray(4096)
    struct.pack_into("<I", cfg, 0x100, 0x0001 | (1 << 16) | ((0x148 if acs_ctl is not None else 0) << 20))
    if acs_ctl is not None:
        struct.pack_into("<IHH", cfg, 0x148, 0x000D | (1 << 16), 0x005F, acs_ctl)
    return bytes(cfg)


def device(tree: Path, chain: list[str], vendor: str = "0x8086", cls: str = "0x060400", acs: int | None = None) -> None:
    real = tree / "devices" / "pci0000:17" / Path(*chain)
    real.mkdir(parents=True, exist_ok=True)
    (real / "vendor").write_text(vendor + "\n")
    (real / "class").write_text(cls + "\n")
    (real / "config").write_bytes(config(acs))
    link = tree / "bus" / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(real)


@pytest.fixture
def gp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    mod = load()
    monkeypatch.setattr(mod, "PCI", tmp_path / "bus")
    monkeypatch.setattr(mod, "SYS", tmp_path / "sys")
    return mod


def hgx(tree: Path, downstream_acs: int) -> None:
    root, up, down, gpu = "0000:17:01.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"
    device(tree, [root], acs=0x1D)  # a root port's ACS is not between GPU and NIC
    device(tree, [root, up], acs=0)
    device(tree, [root, up, down], acs=downstream_acs)
    device(tree, [root, up, down, gpu], vendor="0x10de", cls="0x030200")


def test_acs_on_a_switch_port_above_a_gpu_is_found(gp, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hgx(tmp_path, downstream_acs=0x1D)
    gp.main()
    out = json.loads(capsys.readouterr().out)
    assert out["checked"] == ["0000:18:00.0", "0000:19:00.0"]
    assert out["acs_on"] == ["0000:19:00.0"] and out["iommu"] == "off"


def test_acs_off_passes(gp, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hgx(tmp_path, downstream_acs=0)
    gp.main()
    assert json.loads(capsys.readouterr().out)["acs_on"] == []


def test_a_port_without_acs_capability_reads_none(gp, tmp_path: Path) -> None:
    device(tmp_path, ["0000:17:01.0"], acs=None)
    assert gp.acs_control("0000:17:01.0") is None


@pytest.mark.parametrize(("types", "mode"), [
    ([], "off"), (["identity", "identity"], "passthrough"), (["DMA-FQ", "identity"], "translated (DMA-FQ,identity)"),
])
def test_iommu_mode(gp, tmp_path: Path, types: list[str], mode: str) -> None:
    groups = tmp_path / "sys" / "kernel" / "iommu_groups"
    groups.mkdir(parents=True)
    for i, t in enumerate(types):
        (groups / str(i)).mkdir()
        (groups / str(i) / "type").write_text(t + "\n")
    assert gp.iommu() == mode
