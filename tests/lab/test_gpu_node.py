"""GPU nodes: the pinned driver and CUDA, every GPU visible, NVLink/NVSwitch healthy where the
board has them, GPUDirect Storage really on (nvidia-fs, gdscheck, not compat mode), peermem."""

from __future__ import annotations

import json

import pytest
from labhelpers import ROOT, host_name, load_filter

pytestmark = pytest.mark.lab

NVML = (
    "import json, pynvml as n; n.nvmlInit(); c = n.nvmlDeviceGetCount(); "
    "print(json.dumps({'driver': n.nvmlSystemGetDriverVersion(), 'gpus': ["
    "{'name': n.nvmlDeviceGetName(h), 'uuid': n.nvmlDeviceGetUUID(h), "
    "'memory': n.nvmlDeviceGetMemoryInfo(h).total} for h in map(n.nvmlDeviceGetHandleByIndex, range(c))]}))"
)


def test_driver_is_the_pin(gpu, lab):
    versions = gpu.check_output("nvidia-smi --query-gpu=driver_version --format=csv,noheader").split()
    assert set(versions) == {lab["driver_version"]}


def test_cuda_is_the_pin(gpu, lab):
    nvcc = f"/usr/local/cuda-{lab['cuda_version']}/bin/nvcc"
    assert gpu.file(nvcc).exists, f"{nvcc} absent: the cuda role has not installed CUDA {lab['cuda_version']}"
    assert f"release {lab['cuda_version']}," in gpu.check_output(f"{nvcc} --version")


def test_every_gpu_visible_through_nvml(gpu, lab):
    """nvidia-ml-py (in vLLM's environment) sees as many GPUs as the board has on its PCI bus."""
    pci = load_filter("nvidia_driver", "nvidia_pci").nvidia_pci(gpu.check_output("lspci -n -m -d 10de:"))
    out = json.loads(gpu.check_output(f'{lab["venv"]}/bin/python -c "{NVML}"'))
    assert len(out["gpus"]) == pci["gpu_count"] == lab["gpu_count"], out
    assert out["driver"] == lab["driver_version"]
    assert len({g["uuid"] for g in out["gpus"]}) == len(out["gpus"])


def test_nvlink_fabric_healthy_where_present(gpu, lab):
    pci = load_filter("nvidia_driver", "nvidia_pci").nvidia_pci(gpu.check_output("lspci -n -m -d 10de:"))
    if pci["nvswitch_count"] == 0:
        pytest.skip(f"{host_name(gpu)} reports no NVSwitch (a PCIe board): no fabric to check")
    assert gpu.service("nvidia-fabricmanager").is_running
    states = gpu.check_output("nvidia-smi --query-gpu=index,fabric.state,fabric.status --format=csv,noheader")
    assert all("Completed, Success" in line for line in states.splitlines()), states
    links = gpu.check_output("nvidia-smi nvlink --status")
    assert "inactive" not in links.lower(), links


def test_nvidia_fs_loaded(gpu, lab):
    assert gpu.file("/proc/modules").contains("^nvidia_fs "), "nvidia-fs is not loaded: GDS cannot be on"


def test_gds_on_not_compat(gpu, lab):
    tool = f"/usr/local/cuda-{lab['gds_cuda_version']}/gds/tools/gdscheck"
    report = load_filter("gds", "gdscheck").gdscheck(gpu.check_output(f"{tool} -p"))
    supported = {k for k, v in report["backends"].items() if v == "Supported"}
    assert set(lab["gds_required_backends"]) <= supported, report["backends"]
    assert report["compat_mode"] is False, (
        "cuFile allows compat mode: a result could silently bounce through host memory"
    )
    assert report["gpus"] and all(g["supports_gds"] for g in report["gpus"]), report["gpus"]
    assert report["platform_verified"]


def test_gds_reads_the_mounted_store(gpu, lab, store_paths):
    """gdsio in GDS mode (-x 0) on every store drive: with compat mode off it fails unless
    GDS really reaches that filesystem."""
    tools = f"/usr/local/cuda-{lab['gds_cuda_version']}/gds/tools"
    with gpu.sudo():
        for path in store_paths:
            d = f"{path}/.gdscheck"
            gpu.check_output(f"mkdir -p {d} && {tools}/gdsio -D {d} -d 0 -w 2 -s 64M -i 1M -x 0 -I 1")
            out = gpu.check_output(f"{tools}/gdsio -D {d} -d 0 -w 2 -s 64M -i 1M -x 0 -I 0; rm -rf {d}")
            assert "Throughput" in out and "GPUD" in out, f"{path}: {out}"


def test_peermem_loaded(gpu, lab):
    if not lab["peermem"]:
        pytest.skip(f"nvidia_peermem_enabled is false for {host_name(gpu)}")
    assert gpu.file("/proc/modules").contains("^nvidia_peermem ")


def platform(gpu) -> dict:  # type: ignore[no-untyped-def]
    """The gds role's own platform reading (roles/gds/files/gds-platform), run on the node as root."""
    script = (ROOT / "roles/gds/files/gds-platform").read_text()
    with gpu.sudo():
        return json.loads(gpu.check_output("python3 -c %s", script))


def test_iommu_off_or_passthrough(gpu, lab):
    """GDS and GPUDirect RDMA need DMA untranslated: IOMMU off, or passthrough (iommu=pt)."""
    assert platform(gpu)["iommu"] in ("off", "passthrough"), (
        f"{host_name(gpu)}: IOMMU {platform(gpu)['iommu']}: boot with iommu=pt (or intel_iommu=off / amd_iommu=off)"
    )


def test_acs_off_on_the_gpu_nic_path(gpu, lab):
    """ACS on a PCIe switch port between a GPU and a NIC sends their peer-to-peer traffic up
    through the root complex (or blocks it)."""
    found = platform(gpu)
    assert found["acs_on"] == [], (
        f"{host_name(gpu)}: ACS on at {found['acs_on']} (of the switch ports {found['checked']} above the "
        "GPUs and RDMA NICs): disable it in the BIOS, or with setpci at boot"
    )


def test_persistence_mode_on(gpu, lab):
    if not lab["persistenced"]:
        pytest.skip(f"nvidia_driver_persistenced is false for {host_name(gpu)}")
    assert gpu.service("nvidia-persistenced").is_running
    modes = gpu.check_output("nvidia-smi --query-gpu=persistence_mode --format=csv,noheader").split()
    assert modes and set(modes) == {"Enabled"}, modes


def test_store_on_its_nvmeof_namespace(gpu, lab, store_paths):
    """Each store folder sits on the mount of the inventory's namespace (by uuid), reached over
    RDMA; never on the root disk (findmnt --target answers for / too)."""
    mounts = {m["path"]: m for m in lab["store_mounts"]}
    for path in store_paths:
        mount = max((m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")), key=len, default=None)
        assert mount, f"{path} is under none of the inventory's store mounts {sorted(mounts)}"
        uuid = mounts[mount].get("namespace_uuid")
        assert uuid, f"the inventory gives {mount} no namespace_uuid: it cannot say which namespace holds {path}"
        source = gpu.check_output(f"findmnt -n -o SOURCE --mountpoint {mount} | xargs -r realpath")
        device = gpu.check_output(f"realpath -e /dev/disk/by-id/nvme-uuid.{uuid}")
        assert source == device, f"{mount} is mounted from {source or 'nothing'}, namespace {uuid} is {device}"
        # a namespace's controller; under native multipath, the controllers of its paths
        dev = device.rsplit("/", 1)[-1]
        transport = gpu.check_output(
            f"cat /sys/block/{dev}/device/transport 2>/dev/null || cat /sys/block/{dev}/multipath/*/device/transport | sort -u"
        )
        assert transport == "rdma", f"{mount}: namespace {uuid} is reached over {transport}, not NVMe-oF RDMA"
