"""`make pin`'s parts that need no node: which packages a role installs, and apt-cache's answer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _filters():
    path = ROOT / "roles/package_pins/filter_plugins/package_pins.py"
    spec = importlib.util.spec_from_file_location("kvlab_package_pins", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def os_vars(role: str, os: str = "Ubuntu_24.04") -> dict:
    return yaml.safe_load((ROOT / "roles" / role / "vars" / f"{os}.yml").read_text())


def test_every_pinned_package_of_the_storage_roles_is_read():
    f = _filters()
    assert f.package_pins_role_packages(os_vars("nvmeof_initiator"), "nvmeof_initiator", {}) == [
        "nvme-cli", "xfsprogs", "e2fsprogs"]  # fmt: skip
    assert f.package_pins_role_packages(os_vars("nvmeof_target"), "nvmeof_target", {}) == ["kmod", "python3"]
    inbox = f.package_pins_role_packages(os_vars("rdma"), "rdma", {"rdma_stack": "inbox"})
    assert inbox == ["iproute2", "ethtool", "rdma-core", "ibverbs-utils", "rdmacm-utils"]
    doca = f.package_pins_role_packages(
        os_vars("rdma"), "rdma", {"rdma_stack": "doca", "rdma_doca_profile": "doca-ofed"}
    )
    assert doca == ["iproute2", "ethtool", "doca-ofed", "mlnx-nvme-dkms", "mlnx-fw-updater"]


def test_apt_cache_show_gives_the_candidates_version_and_hash():
    text = (
        "Package: nvme-cli\nVersion: 2.8-1build2\nArchitecture: amd64\nDescription: NVMe\n continued line: x\n"
        "SHA256: " + "a" * 64 + "\n\n"
        "Package: kmod\nStatus: install ok installed\nVersion: 34.2-2\n"
    )
    assert _filters().package_pins_apt_show(text) == {
        "nvme-cli": {"version": "2.8-1build2", "sha256": "a" * 64},
        "kmod": {"version": "34.2-2", "sha256": ""},
    }


def test_pin_playbook_reaches_the_storage_hosts_of_both_inventories():
    from kvlab import inventory

    play = yaml.safe_load((ROOT / "playbooks/pin.yml").read_text())[0]
    for name in ("lab", "testbed"):
        assert inventory.load(ROOT / "inventories" / name / "hosts.yml").hosts(play["hosts"])
