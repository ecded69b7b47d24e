"""The GPU node's vendor stack (issue 23), as `make plan inventory=lab` renders it and as the
roles decide it on a node (their task files run by ansible-playbook with what a node would
report): DOCA's storage modules proven running, every tier's mounts, every NVIDIA package
pinned and held, persistence mode on, Secure Boot named before modprobe fails, netplan and CDI."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_gpu_roles import ROOT, msg_of, play
from test_roles_plan import lab_plan  # noqa: F401  (lab_plan: the lab's plan, rendered once)

pytestmark = pytest.mark.unit

NODES = ("h200-01", "h20-01")


@pytest.fixture(scope="module")
def lab(lab_plan: Path) -> Path:  # noqa: F811
    return lab_plan


def live(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def store_mounts(root: Path) -> list[str]:
    return [line.split()[1] for line in live((root / "etc/fstab").read_text()) if "_netdev" in line]


# ---- 5: every engine and cache-server unit requires the mount of every path it names -------
def unit_cases() -> list[tuple[str, str]]:
    return [(n, kind) for n in NODES for kind in ("kvlab-vllm-", "kvlab-cache-")]


@pytest.mark.parametrize(("node", "kind"), unit_cases())
def test_every_unit_requires_the_mounts_it_names(lab: Path, node: str, kind: str) -> None:
    root = lab / node
    mounts = store_mounts(root)
    units = sorted((root / "etc/systemd/system").glob(f"{kind}*.service"))
    assert mounts and units
    missing = []
    for unit in units:
        text = unit.read_text()
        required = " ".join(re.findall(r"^RequiresMountsFor=(.*)$", text, re.M)).split()
        body = "\n".join(line for line in text.splitlines() if not line.startswith("RequiresMountsFor="))
        for m in mounts:
            if re.search(re.escape(m) + r"(/|\b)", body) and not any(
                r == m or r.startswith(m + "/") for r in required
            ):
                missing.append(f"{unit.name}: {m}")
    assert not missing, missing


@pytest.mark.parametrize("node", NODES)
def test_the_store_filesystems_are_trimmed(lab: Path, node: str) -> None:
    """Mounted without discard (the README): fstrim.timer trims them, after they are mounted."""
    dropin = lab / node / "etc/systemd/system/fstrim.service.d/kvlab-store.conf"
    required = " ".join(re.findall(r"^RequiresMountsFor=(.*)$", dropin.read_text(), re.M)).split()
    assert sorted(required) == sorted(store_mounts(lab / node))
    tasks = (ROOT / "roles/kvlab_connector/tasks/service.yml").read_text()
    assert "fstrim.timer" in tasks


# ---- 6: every NVIDIA package pinned by apt preferences; kernel and DKMS stacks held -------
def apt_matches(pattern: str, name: str) -> bool:
    """apt_preferences(5): /regex/, a glob, or an exact name."""
    if len(pattern) > 1 and pattern.startswith("/") and pattern.endswith("/"):
        return re.search(pattern[1:-1], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def preferences(root: Path) -> list[dict[str, str]]:
    out = []
    for f in sorted((root / "etc/apt/preferences.d").glob("*")):
        for stanza in f.read_text().split("\n\n"):
            fields = dict(line.split(":", 1) for line in live(stanza) if ":" in line)
            if fields:
                out.append({k.strip(): v.strip() for k, v in fields.items()})
    return out


# Every set the GPU roles install, by what the plan pins from the roles' own versions: the driver's
# whole branch (its dependencies included, by pattern), the fabric manager, the toolkits' meta
# packages, the container toolkit. Components with versions of their own (CUDA's, nvidia-fs, DOCA's
# storage packages) are pinned exactly by make pin's closure (the fixture test below).
PINNED = {
    "driver": ["nvidia-driver-580-open", "nvidia-dkms-580-open", "nvidia-kernel-common-580", "libnvidia-compute-580",
               "nvidia-utils-580", "nvidia-compute-utils-580", "nvidia-firmware-580-580.95.05"],
    "fabric manager": ["nvidia-fabricmanager", "libnvidia-nscq-580"],
    "cuda": ["cuda-toolkit-13-0"],
    "gds": ["nvidia-gds-13-0"],
    "container toolkit": ["nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container1"],
}  # fmt: skip


@pytest.mark.parametrize("node", NODES)
@pytest.mark.parametrize("stack", sorted(PINNED))
def test_apt_preferences_pin_the_whole_set(lab: Path, node: str, stack: str) -> None:
    prefs = preferences(lab / node)
    unpinned = []
    for pkg in PINNED[stack]:
        first = next(
            (p for p in prefs if any(apt_matches(x, pkg) for x in p.get("Package", "").split())), None
        )
        if (
            first is None
            or not first.get("Pin", "").startswith("version ")
            or int(first.get("Pin-Priority", "0")) < 1000
        ):
            unpinned.append(pkg)
    assert not unpinned, f"{stack}: no version pin (priority >= 1000) for {unpinned}"


@pytest.mark.parametrize("node", [*NODES, "nvmeof-01"])
def test_unattended_upgrades_leave_kernel_and_dkms_stacks_alone(lab: Path, node: str) -> None:
    text = (lab / node / "etc/apt/apt.conf.d/51kvlab-hold").read_text()
    block = re.search(r"Unattended-Upgrade::Package-Blacklist\s*\{(.*?)\};", text, re.S)
    assert block
    held = re.findall(r'"([^"]+)"', block.group(1))
    for pkg in (
        "linux-image-6.8.0-85-generic",
        "linux-modules-6.8.0-85-generic",
        "nvidia-dkms-580-open",
        "libnvidia-compute-580",
        "doca-ofed",
        "mlnx-nvme-dkms",
        "cuda-toolkit-13-0",
        "nvidia-fs-dkms",
    ):
        assert any(re.match(p, pkg) for p in held), pkg


def dkms_check(tmp: Path, status: str) -> str:
    proc = play(
        tmp,
        [{"name": "dkms", "ansible.builtin.include_tasks": str(ROOT / "roles/nvidia_driver/tasks/dkms.yml")}],
        {
            "__nvidia_driver_dkms": {"stdout": status, "rc": 0},
            "nvidia_driver_version": "580.95.05",
            "ansible_facts": {"kernel": "6.8.0-85-generic"},
            "nvidia_driver_dkms_modules": ["nvidia"],
        },
        ("roles/nvidia_driver/defaults/main.yml",),
    )
    return ("ok " if proc.returncode == 0 else "failed ") + msg_of(proc)


def test_dkms_status_is_asserted(tmp_path: Path) -> None:
    good = "nvidia/580.95.05, 6.8.0-85-generic, x86_64: installed\n"
    assert dkms_check(tmp_path, good).startswith("ok ")
    stale = "nvidia/580.95.05, 6.8.0-79-generic, x86_64: installed\nnvidia/580.95.05: added\n"
    out = dkms_check(tmp_path, stale)
    assert out.startswith("failed ") and "6.8.0-85-generic" in out and "dkms" in out


FIXTURE = ROOT / "tests/unit/apt-fixture"


def gpu_pin_play(tmp_path: Path, extra: dict) -> tuple[subprocess.CompletedProcess, Path]:
    """make pin's GPU play, run locally for one GPU node with `extra` vars; the inventory folder."""
    inv = tmp_path / "inv"
    (inv / "group_vars/gpu_nodes").mkdir(parents=True)
    (inv / "hosts.yml").write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n        localhost:\n")
    plays = yaml.safe_load((ROOT / "playbooks/pin.yml").read_text())
    gpu = next(p for p in plays if p["hosts"] == "gpu_nodes")
    assert gpu["vars"]["package_pins_scope"] == "gpu" and gpu["roles"] == ["package_pins"]
    pb = tmp_path / "pin.yml"
    pb.write_text(yaml.safe_dump([{**gpu, "become": False, "connection": "local"}]))
    env = os.environ | {
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
    }
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(inv / "hosts.yml"), str(pb),
         "-e", json.dumps({"ansible_python_interpreter": sys.executable, **extra})],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, inv


def test_make_pin_skips_a_gpu_node_without_gpus_and_says_so(tmp_path: Path) -> None:
    """The testbed's node is in gpu_nodes without a GPU (kvlab_gpus_expected false) and without
    GPU repositories: make pin passes it by, naming why, and writes no GPU set for it."""
    proc, inv = gpu_pin_play(tmp_path, {"kvlab_gpus_expected": False})
    assert proc.returncode == 0, msg_of(proc)
    assert "expects no GPU (kvlab_gpus_expected false)" in proc.stdout
    assert not (inv / "group_vars/gpu_nodes/apt-pins.yml").exists()


def test_make_pin_refuses_a_gpu_node_without_its_repository_set(tmp_path: Path) -> None:
    proc, _ = gpu_pin_play(tmp_path, {"kvlab_gpus_expected": True})
    assert proc.returncode != 0
    assert "package_pins_gpu_sources is empty for localhost" in msg_of(proc)


@pytest.mark.skipif(
    shutil.which("apt-get") is None, reason="make pin's GPU flow runs apt-get; this machine has none"
)
def test_make_pin_resolves_the_gpu_sets_from_its_own_repository_set(tmp_path: Path) -> None:
    """make pin's GPU play, run for real against a fixture index: the closure of every set at the
    roles' pins (never the newer releases the index also offers), written as kvlab_apt_pins."""
    proc, inv = gpu_pin_play(
        tmp_path,
        {
            "nvidia_driver_version": "580.95.05",
            "rdma_package_versions": {"doca-ofed": "3.1.0-091000"},
            "package_pins_gpu_sources": [f"deb [trusted=yes] file:{FIXTURE} ./"],
        },
    )
    assert proc.returncode == 0, msg_of(proc)
    pins = yaml.safe_load((inv / "group_vars/gpu_nodes/apt-pins.yml").read_text())["kvlab_apt_pins"]
    assert pins["nvidia-driver-580-open"] == "580.95.05-0ubuntu1"  # pinned, though 580.105.08 is newer
    assert pins["nvidia-dkms-580-open"] == pins["libnvidia-compute-580"] == "580.95.05-0ubuntu1"
    assert pins["nvidia-fabricmanager"] == "580.95.05-1"
    assert pins["cuda-toolkit-13-0"] == "13.0.2-1" and pins["cuda-nvcc-13-0"] == "13.0.96-1"
    assert pins["nvidia-fs-dkms"] == "2.26.6-1" and pins["libcufile-13-0"] == "1.15.1.6-1"
    assert pins["nvidia-container-toolkit"] == pins["libnvidia-container1"] == "1.17.8-1"
    assert (
        pins["mlnx-nvme-dkms"] == "25.07.OFED.25.07.0.9.1.1-1"
        and "mlnx-fw-updater" in pins
        and "rdma-core" in pins
    )


def test_make_pins_closure_is_rendered_first(tmp_path: Path) -> None:
    proc = play(
        tmp_path,
        [
            {
                "name": "p",
                "ansible.builtin.include_role": {"name": "package_pins", "tasks_from": "preferences"},
                "vars": {
                    "package_pins_root": str(tmp_path / "root"),
                    "package_pins_set": "exact",
                    "package_pins_exact": {"cuda-nvcc-13-0": "13.0.96-1", "nvidia-fs-dkms": "2.26.6-1"},
                },
            }
        ],
    )
    assert proc.returncode == 0, msg_of(proc)
    files = sorted(p.name for p in (tmp_path / "root/etc/apt/preferences.d").iterdir())
    assert files == ["kvlab-00-exact.pref"]
    prefs = preferences(tmp_path / "root")
    assert {(p["Package"], p["Pin"]) for p in prefs} == {
        ("cuda-nvcc-13-0", "version 13.0.96-1"),
        ("nvidia-fs-dkms", "version 2.26.6-1"),
    }
    assert "kvlab-00-exact.pref" < "kvlab-container-runtime.pref"  # apt reads preferences.d in name order


# ---- 7: persistence mode on ------------------------------------------------------------------
@pytest.mark.parametrize("node", NODES)
def test_persistenced_runs_with_persistence_on(lab: Path, node: str) -> None:
    folder = lab / node / "etc/systemd/system/nvidia-persistenced.service.d"
    lines = [line for f in sorted(folder.glob("*.conf")) for line in live(f.read_text())]
    starts = [line for line in lines if line.startswith("ExecStart=")]
    assert starts[:1] == ["ExecStart="], "the packaged ExecStart must be reset first"
    assert (
        len(starts) == 2 and "nvidia-persistenced" in starts[1] and "--no-persistence-mode" not in starts[1]
    )


def test_the_role_asserts_persistence_mode(tmp_path: Path) -> None:
    def run(modes: str) -> str:
        proc = play(
            tmp_path,
            [
                {
                    "name": "p",
                    "ansible.builtin.include_tasks": str(ROOT / "roles/nvidia_driver/tasks/persistence.yml"),
                }
            ],
            {
                "__nvidia_driver_persistence": {"stdout_lines": modes.splitlines(), "rc": 0},
                "nvidia_driver_hardware": {"gpu_count": 2},
            },
            ("roles/nvidia_driver/defaults/main.yml",),
        )
        return ("ok " if proc.returncode == 0 else "failed ") + msg_of(proc)

    assert run("0, Enabled\n1, Enabled").startswith("ok ")
    out = run("0, Enabled\n1, Disabled")
    assert out.startswith("failed ") and "Disabled" in out


# ---- 9: Secure Boot detected, modules signed with a MOK, enrolment named ---------------------
@pytest.mark.parametrize("node", [*NODES, "nvmeof-01"])  # DOCA's DKMS modules on the target too
def test_dkms_signs_with_the_managed_mok(lab: Path, node: str) -> None:
    conf = (lab / node / "etc/dkms/framework.conf.d/kvlab-mok.conf").read_text()
    assert re.search(r"^mok_signing_key=\S+", conf, re.M) and re.search(r"^mok_certificate=\S+", conf, re.M)
    assert "PRIVATE KEY" not in conf


def secure_boot(tmp: Path, state: str, enrolled: str) -> str:
    proc = play(
        tmp,
        [
            {
                "name": "sb",
                "ansible.builtin.include_tasks": str(ROOT / "roles/nvidia_driver/tasks/secure_boot.yml"),
            }
        ],
        {
            "__nvidia_driver_sb": {"stdout": state, "rc": 0},
            "__nvidia_driver_mok_test": {"stdout": enrolled, "rc": 0},
            "__nvidia_driver_mok_key": {"stat": {"exists": True}},
        },
        ("roles/nvidia_driver/defaults/main.yml", "roles/nvidia_driver/vars/main.yml"),
    )
    return ("ok " if proc.returncode == 0 else "failed ") + msg_of(proc)


def test_secure_boot_with_an_unenrolled_key_stops_naming_the_enrolment(tmp_path: Path) -> None:
    out = secure_boot(tmp_path, "SecureBoot enabled", "/var/lib/shim-signed/mok/MOK.der is not enrolled")
    assert out.startswith("failed ")
    assert "mokutil --import" in out and "MOK manager" in out and "console" in out


@pytest.mark.parametrize(("state", "enrolled"), [
    ("SecureBoot disabled", "/var/lib/shim-signed/mok/MOK.der is not enrolled"),
    ("SecureBoot enabled", "/var/lib/shim-signed/mok/MOK.der is already enrolled"),
])  # fmt: skip
def test_secure_boot_off_or_enrolled_goes_on(tmp_path: Path, state: str, enrolled: str) -> None:
    assert secure_boot(tmp_path, state, enrolled).startswith("ok ")


# ---- 1: DOCA's storage modules installed, in force, proven running ---------------------------
def test_doca_installs_its_storage_packages_and_rebuilds_the_initramfs() -> None:
    defaults = yaml.safe_load((ROOT / "roles/rdma/defaults/main.yml").read_text())
    assert {"mlnx-nvme-dkms", "mlnx-fw-updater"} <= set(defaults["rdma_doca_storage_packages"])
    handlers = (ROOT / "roles/rdma/handlers/main.yml").read_text()
    assert "update-initramfs" in handlers


def modules_check(tmp: Path, paths: dict[str, str], compat: bool, same: bool, allowed: bool = False) -> str:
    lines = [f"{m} {p} {'a1' if same else 'b2'} a1" for m, p in paths.items()]
    proc = play(
        tmp,
        [{"name": "m", "ansible.builtin.include_tasks": str(ROOT / "roles/rdma/tasks/modules.yml")}],
        {
            "__rdma_running": {"stdout": "\n".join(lines), "rc": 0},
            "__rdma_mlx_compat": {"stat": {"exists": compat}},
            "rdma_stack": "doca",
            "rdma_reboot_allowed": allowed,
            "__rdma_proof_modules": list(paths),
            "__rdma_deploy": True,
        },
        ("roles/rdma/defaults/main.yml",),
    )
    return ("ok " if proc.returncode == 0 else "failed ") + msg_of(proc)


K = "/lib/modules/6.8.0-85-generic"


def test_running_doca_modules_pass(tmp_path: Path) -> None:
    paths = {"ib_core": f"{K}/updates/dkms/ib_core.ko", "nvme_rdma": f"{K}/updates/dkms/nvme-rdma.ko"}
    assert modules_check(tmp_path, paths, compat=True, same=True).startswith("ok ")


@pytest.mark.parametrize(("paths", "compat", "same", "why"), [
    ({"nvme_rdma": f"{K}/kernel/drivers/nvme/host/nvme-rdma.ko.zst"}, True, True, "nvme_rdma"),
    ({"nvme_rdma": f"{K}/updates/dkms/nvme-rdma.ko"}, False, True, "mlx_compat"),
    ({"nvme_rdma": f"{K}/updates/dkms/nvme-rdma.ko"}, True, False, "nvme_rdma"),
])  # fmt: skip
def test_inbox_modules_still_running_stop_naming_the_reboot(
    tmp_path: Path, paths: dict, compat: bool, same: bool, why: str
) -> None:
    out = modules_check(tmp_path, paths, compat, same)
    assert out.startswith("failed ") and why in out and "rdma_reboot_allowed" in out and "kvlab-vllm" in out


def test_gds_and_peermem_no_longer_take_ofed_info_as_proof() -> None:
    for f in ("roles/gds/tasks/verify.yml", "roles/nvidia_peermem/tasks/validate.yml"):
        text = (ROOT / f).read_text()
        assert "mlx_compat" in text, f
        assert "ofed_info -s" not in text, f


def test_the_targets_nvmet_modules_are_decided() -> None:
    defaults = yaml.safe_load((ROOT / "roles/rdma/defaults/main.yml").read_text())
    assert {"nvmet", "nvmet_rdma"} <= set(defaults["rdma_doca_proof_modules"]["nvmeof_targets"])
    assert {"nvme_rdma", "nvme_fabrics"} <= set(defaults["rdma_doca_proof_modules"]["nvmeof_initiators"])
    assert "nvmet_rdma" in (ROOT / "roles/rdma/README.md").read_text()


# ---- 10: netplan-managed hosts, CDI regenerated on a driver change ---------------------------
def test_netplan_hosts_get_their_storage_ports_through_netplan(tmp_path: Path) -> None:
    proc = play(
        tmp_path,
        [{"name": "rdma", "ansible.builtin.include_role": {"name": "rdma"}}],
        {
            "rdma_plan_dir": str(tmp_path / "plan"),
            "rdma_network_renderer": "netplan",
            "ansible_facts": {
                "distribution": "Ubuntu",
                "distribution_version": "24.04",
                "distribution_major_version": "24",
            },
            "rdma_roce_subnets": [{"name": "a", "cidr": "192.168.100.0/24", "mtu": 9000}],
            "rdma_netdevs": [{"name": "ens1f0np0", "address": "192.168.100.11/24", "subnet": "a"}],
        },
    )
    assert proc.returncode == 0, msg_of(proc)
    root = tmp_path / "plan/localhost"
    plan = yaml.safe_load((root / "etc/netplan/60-kvlab-storage.yaml").read_text())
    eth = plan["network"]["ethernets"]["ens1f0np0"]
    assert eth["addresses"] == ["192.168.100.11/24"] and eth["mtu"] == 9000
    assert not list((root / "etc/systemd/network").glob("*.network"))


def test_the_cdi_spec_is_regenerated_when_the_driver_changes(tmp_path: Path) -> None:
    proc = play(
        tmp_path,
        [{"name": "cr", "ansible.builtin.include_role": {"name": "container_runtime"}}],
        {
            "container_runtime_plan_dir": str(tmp_path / "plan"),
            "container_runtime_enabled": True,
            "container_runtime_nvidia": True,
            "nvidia_driver_hardware": {"gpu_count": 1},
            "ansible_facts": {
                "distribution": "Ubuntu",
                "distribution_version": "24.04",
                "distribution_major_version": "24",
            },
        },
    )
    assert proc.returncode == 0, msg_of(proc)
    units = tmp_path / "plan/localhost/etc/systemd/system"
    service, path = (
        (units / "kvlab-cdi-refresh.service").read_text(),
        (units / "kvlab-cdi-refresh.path").read_text(),
    )
    assert "nvidia-ctk" in service and "cdi generate" in service and "/etc/cdi/nvidia.yaml" in service
    assert re.search(r"^PathChanged=/lib/modules/.*modules\.dep", path, re.M)
