"""`make plan inventory=lab`: every template of the GPU and serving roles, rendered for the
H200 and the H20 groups without contacting a host, checked against the inventory and
against kvlab's setup registry (the one source of engine command lines)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_lab_engine_cmdline import ROOT, read_unit, shared_plan, unit_file, unit_process

from kvlab import inventory
from kvlab.setups import registry as setups

pytestmark = pytest.mark.unit

LAB = ROOT / "inventories" / "lab"
HOSTS = {"h200-01": "h200", "h20-01": "h20"}


def group_vars(*names: str) -> dict:
    out: dict = {}
    for name in names:
        for path in sorted((LAB / "group_vars" / name).glob("*.yml")):
            if path.name != "vault.yml":
                out |= yaml.safe_load(path.read_text()) or {}
    return out


def host_vars(host: str) -> dict:
    inv = yaml.safe_load((LAB / "hosts.yml").read_text())
    group = HOSTS[host]
    return (
        group_vars("all", "gpu_nodes", group)
        | inv["all"]["children"]["gpu_nodes"]["children"][group]["hosts"][host]
    )


_lab_inventory: list = []


def lab_rendered(host: str, *names: str) -> dict:
    """Values the lab inventory gives a host, rendered by Ansible."""
    if not _lab_inventory:
        _lab_inventory.append(inventory.load(LAB / "hosts.yml"))
    return _lab_inventory[0].render(host, list(names))


def nvme_ports(root: Path) -> list[dict]:
    """Every port of a node's rendered /etc/nvme/config.json (libnvme's JSON configuration:
    hosts, their subsystems, each subsystem's ports), with its subsystem's NQN and its host
    beside it; the file must be what libnvme reads: a list of hosts."""
    hosts = json.loads((root / "etc/nvme/config.json").read_text())
    assert isinstance(hosts, list), "libnvme reads a list of hosts"
    return [{**p, "nqn": s["nqn"], "host": h} for h in hosts for s in h["subsystems"] for p in s["ports"]]


def store_paths(host: str) -> list[str]:
    """The store paths the lab inventory gives a host (they derive from the node's NVMe-oF
    mounts, which derive from the storage exports)."""
    return lab_rendered(host, "kvlab_connector_store_paths")["kvlab_connector_store_paths"]


def lab_params(host: str) -> setups.EngineParams:
    """The engine parameters the lab inventory gives a host, resolved by hand (the inventory
    derives the store paths from its NVMe-oF mounts)."""
    v = host_vars(host)
    paths = tuple(store_paths(host))
    return setups.EngineParams(
        model=v["vllm_server_model_path"],
        python=f"{v['vllm_server_venv']}/bin/python",
        served_model_name=v["vllm_server_served_model_name"],
        host=v.get("vllm_server_host", "127.0.0.1"),  # the role's default: loopback
        port=8000,
        tensor_parallel_size=v["vllm_server_tensor_parallel_size"],
        enable_prefix_caching=v["vllm_server_enable_prefix_caching"],
        device="cuda",
        kv_store_paths=paths,
        example_storage_path=v["vllm_server_example_storage_path"],
        **v["vllm_server_engine_params"],
    )


@pytest.fixture(scope="session")
def lab_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The lab's plan, rendered once per test run (kvlab's unit tier runs on two workers, and
    every module that imports this fixture gets a fixture of its own: the rendering is shared on
    disk). Read it, never write."""
    return shared_plan(tmp_path_factory, "lab")


CASES = [(h, s) for h in HOSTS for s in group_vars("gpu_nodes")["vllm_server_setups"]]


def test_plan_renders_both_groups(lab_plan: Path) -> None:
    for host in HOSTS:
        files = {str(p.relative_to(lab_plan / host)) for p in (lab_plan / host).rglob("*") if p.is_file()}
        assert {
            "etc/cufile.json",
            "etc/modprobe.d/kvlab-blacklist-nouveau.conf",
            "etc/modules-load.d/nvidia-fs.conf",
            "etc/modules-load.d/nvidia-peermem.conf",
            "etc/profile.d/kvlab-cuda.sh",
            "etc/systemd/system/nvidia-fabricmanager.service.d/kvlab.conf",
            "etc/kvlab/store.json",
            "etc/kvlab/vllm-api.env",
            "etc/systemd/system/kvlab-vllm-kvlab.service",
            "etc/systemd/system/kvlab-vllm-lmcache-mp_kvlab.service",
            "etc/systemd/system/kvlab-cache-lmcache-mp_kvlab.service",
        } <= files, host


@pytest.mark.parametrize(("host", "name"), CASES)
def test_unit_is_the_registrys_command_line(lab_plan: Path, host: str, name: str) -> None:
    deployment = setups.render(name, lab_params(host))
    argv, env = unit_process(unit_file(lab_plan / host, "vllm", name))
    assert argv == list(deployment.engine.argv)
    site_env = host_vars(host)["vllm_server_environment"]
    assert env == site_env | deployment.engine.env
    cache = unit_file(lab_plan / host, "cache", name)
    if deployment.companion is None:
        assert not cache.exists()
    else:
        assert unit_process(cache) == (list(deployment.companion.argv), site_env | deployment.companion.env)
        engine = read_unit(unit_file(lab_plan / host, "vllm", name))
        link = "Wants" if deployment.companion_survives_engine_restart else "BindsTo"
        assert cache.name in engine[link] and cache.name in engine["After"]


@pytest.mark.parametrize(("host", "name"), CASES)
def test_kv_transfer_config_is_the_registrys(lab_plan: Path, host: str, name: str) -> None:
    deployment = setups.render(name, lab_params(host))
    path = lab_plan / host / f"etc/kvlab/setups/{name}.kv-transfer-config.json"
    if deployment.kv_transfer_config is None:
        assert not path.exists()
        return
    rendered = json.loads(path.read_text())
    assert rendered == deployment.kv_transfer_config
    # and it is the JSON the engine gets on its command line
    argv, _ = unit_process(unit_file(lab_plan / host, "vllm", name))
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == rendered


def test_lab_engines_follow_the_inventory(lab_plan: Path) -> None:
    h200, _ = unit_process(lab_plan / "h200-01/etc/systemd/system/kvlab-vllm-kvlab.service")
    h20, _ = unit_process(lab_plan / "h20-01/etc/systemd/system/kvlab-vllm-kvlab.service")
    for argv in (h200, h20):
        assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
        assert "--enforce-eager" not in argv
    assert "--enable-prefix-caching" in h200 and "--no-enable-prefix-caching" in h20
    assert h200[h200.index("--model") + 1] == "/models/GLM-5.3-FP8"
    assert h20[h20.index("--model") + 1] == "/models/DeepSeek-R1-0528"
    kv = json.loads(h200[h200.index("--kv-transfer-config") + 1])
    assert (
        kv["kv_connector_extra_config"]["paths"]
        == json.loads((lab_plan / "h200-01/etc/kvlab/store.json").read_text())["paths"]
    )


@pytest.mark.parametrize("host", HOSTS)
def test_units_wire_storage_secrets_and_exclusion(lab_plan: Path, host: str) -> None:
    v = host_vars(host)
    root = lab_plan / host
    for name in v["vllm_server_setups"]:
        unit = read_unit(unit_file(root, "vllm", name))
        assert unit["EnvironmentFile"] == ["/etc/kvlab/vllm-api.env"]
        assert unit["User"] == ["kvlab"]
        # One setup at a time: it stops every other engine and cache server (same GPUs, ports, RAM).
        others = {
            unit_file(root, kind, o)
            for o in v["vllm_server_setups"]
            if o != name
            for kind in ("vllm", "cache")
        }
        assert set(unit["Conflicts"]) == {p.name for p in others if p.exists()}
        if name == "kvlab":
            assert unit["RequiresMountsFor"] == [" ".join(store_paths(host))]


def test_api_key_never_leaves_the_vault(lab_plan: Path) -> None:
    """The example vault's key appears in no rendered file; the env file holds a mask."""
    key = "example-api-key-not-a-secret"
    for path in lab_plan.rglob("*"):
        if path.is_file():
            assert key not in path.read_text(), path
    for host in HOSTS:
        env = (lab_plan / host / "etc/kvlab/vllm-api.env").read_text()
        assert "VLLM_API_KEY=********" in env
        for unit in (lab_plan / host / "etc/systemd/system").glob("kvlab-*.service"):
            assert "VLLM_API_KEY" not in unit.read_text()
    assert "vault_vllm_server_api_key" not in (LAB / "group_vars/gpu_nodes/vault.yml").read_text()


@pytest.mark.parametrize("host", HOSTS)
def test_cufile_json_follows_the_inventory(lab_plan: Path, host: str) -> None:
    v = host_vars(host)
    cufile = json.loads((lab_plan / host / "etc/cufile.json").read_text())
    props, execution = cufile["properties"], cufile["execution"]
    assert props["max_direct_io_size_kb"] == v["gds_max_direct_io_size_kb"]
    assert props["allow_compat_mode"] is False
    assert props["use_poll_mode"] is v["gds_use_poll_mode"]
    # cuFile's RDMA devices are the node's RoCE ports of the wired link variant (hosts.yml)
    ports = yaml.safe_load((LAB / "hosts.yml").read_text())["all"]["children"]["gpu_nodes"]["children"][HOSTS[host]][
        "hosts"][host]["kvlab_storage_ports"]
    variant = group_vars("all")["kvlab_storage_link_variants"][group_vars("all")["kvlab_storage_link_variant"]]
    assert props["rdma_dev_addr_list"] == [p["address"].split("/")[0] for p in ports if p["subnet"] in variant["subnets"]]
    assert execution["max_io_queue_depth"] == v["gds_max_io_queue_depth"]
    assert execution["max_io_threads"] == v["gds_max_io_threads"]
    for key in (
        "max_device_cache_size_kb",
        "max_device_pinned_mem_size_kb",
        "poll_mode_max_size_kb",
        "gds_rdma_write_support",
    ):
        assert key in props
    assert "parallel_io" in execution


def test_units_pass_systemd_analyze(lab_plan: Path, tmp_path: Path) -> None:
    """systemd's own parser accepts every unit (the venv's python swapped for one that exists)."""
    tool = shutil.which("systemd-analyze")
    units = sorted(u for kind in ("vllm", "cache") for u in lab_plan.glob(f"*/etc/systemd/system/kvlab-{kind}-*.service"))
    assert units
    for unit in units:
        text = unit.read_text()
        # Every value the role quoted must split back to words (no stray quote or escape).
        argv, _ = unit_process(unit)
        assert argv[0] == "/opt/kvlab/venv/bin/python"
        if tool is None:
            continue  # the structural checks above still ran; systemd is not on this machine
        copy = tmp_path / unit.parent.parent.parent.parent.name / unit.name
        copy.parent.mkdir(exist_ok=True)
        copy.write_text(text.replace("/opt/kvlab/venv/bin/python", sys.executable))
        proc = subprocess.run([tool, "verify", "--man=no", str(copy)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{unit}: {proc.stderr}"


def _filter(role: str, module: str):
    path = ROOT / "roles" / role / "filter_plugins" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"kvlab_test_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_nvidia_pci_tells_hgx_from_pcie() -> None:
    pci = _filter("nvidia_driver", "nvidia_pci").nvidia_pci
    hgx = pci(group_vars("h200")["nvidia_driver_plan_lspci"])
    assert (hgx["gpu_count"], hgx["nvswitch_count"], hgx["gpu_device_ids"]) == (8, 4, ["2335"])
    h20 = pci(group_vars("h20")["nvidia_driver_plan_lspci"])
    assert (h20["gpu_count"], h20["nvswitch_count"]) == (8, 4)
    nvl = pci(
        '3b:00.0 "0302" "10de" "233b" -ra1 "10de" "1996"\n5e:00.0 "0302" "10de" "233b" -ra1 "10de" "1996"\n'
        '00:02.0 "0600" "8086" "2020" -r04 "8086" "0000"\n'
    )
    assert (nvl["gpu_count"], nvl["nvswitch_count"]) == (2, 0)
    assert pci("")["gpu_count"] == 0


def test_gdscheck_tells_gds_from_compat() -> None:
    parse = _filter("gds", "gdscheck").gdscheck
    data = ROOT / "tests" / "lab" / "data"
    on = parse((data / "gdscheck-gds-on.txt").read_text())
    assert on["backends"]["NVMeOF"] == "Supported" and on["backends"]["NVMe"] == "Supported"
    assert "--Mellanox PeerDirect" not in on["backends"] and "Mellanox PeerDirect" not in on["backends"]
    assert on["compat_mode"] is False and on["platform_verified"] is True
    assert [g["supports_gds"] for g in on["gpus"]] == [True, True]
    assert on["properties"]["properties.max_direct_io_size_kb"] == "16384"
    off = parse((data / "gdscheck-compat.txt").read_text())
    assert off["backends"]["NVMeOF"] == "Unsupported"
    assert off["compat_mode"] is True and off["platform_verified"] is False
    assert [g["supports_gds"] for g in off["gpus"]] == [True, False]


def test_registry_filter_names_the_bad_input() -> None:
    kvf = _filter("vllm_server", "kvlab_setups")
    from ansible.errors import AnsibleFilterError

    with pytest.raises(AnsibleFilterError, match="unknown setup 'nope'"):
        kvf.kvlab_setup_render("nope", {"model": "/m"})
    with pytest.raises(AnsibleFilterError, match="needs kv_store_paths"):
        kvf.kvlab_setup_render("kvlab", {"model": "/m", "device": "cuda"})
    with pytest.raises(AnsibleFilterError, match="unknown engine parameter"):
        kvf.kvlab_setup_render("baseline", {"model": "/m", "tp": 8})
    assert kvf.systemd_escape_arg('{"a": "50%", "b": "$X"}') == '"{\\"a\\": \\"50%%\\", \\"b\\": \\"$$X\\"}"'


def test_no_role_restates_an_engine_flag() -> None:
    """Engine flags come from the registry only: no role file spells one."""
    flags = re.compile(
        r"--(tensor-parallel-size|kv-transfer-config|enable-prefix-caching|max-model-len|served-model-name)"
    )
    for path in (ROOT / "roles").rglob("*"):
        if path.is_file() and path.suffix in {".yml", ".j2", ".py"}:
            assert not flags.search(path.read_text()), path


# The storage half of the plan: what the rdma, nvmeof_target and nvmeof_initiator roles write,
# derived from the inventory's one table of exports (group_vars/all/storage.yml).
def exports() -> list[dict]:
    return group_vars("all")["kvlab_store_exports"]


def test_target_exports_each_node_its_namespaces_to_that_node_only(lab_plan: Path) -> None:
    cfg = json.loads((lab_plan / "nvmeof-01/etc/kvlab/nvmet.json").read_text())
    want = {e["nqn"]: e for e in exports() if e["target"] == "nvmeof-01"}
    assert {s["nqn"] for s in cfg["subsystems"]} == set(want) and len(want) == len(HOSTS)
    for sub in cfg["subsystems"]:
        e = want[sub["nqn"]]
        node_nqn = lab_rendered(e["node"], "nvmeof_initiator_hostnqn")["nvmeof_initiator_hostnqn"]
        assert sub["allowed_hosts"] == [node_nqn]  # its own node, nobody else; never allow_any_host
        assert "allow_any_host" not in sub
        assert [(n["nsid"], n["device"], n["uuid"]) for n in sub["namespaces"]] == [
            (n["nsid"], n["device"], n["uuid"]) for n in e["namespaces"]
        ]
        # backing drives named by serial or WWN, never by a kernel name that can change at boot
        assert all(re.match(r"/dev/disk/by-id/(nvme-.+_\w+|wwn-0x[0-9a-f]+)$", n["device"]) for n in sub["namespaces"])
    # one port per RoCE port of the wired variant, each exporting both subsystems over RDMA
    assert [(p["address"], p["transport"], p["subsystems"]) for p in cfg["ports"]] == [
        ("192.168.100.31", "rdma", sorted(want)), ("192.168.101.31", "rdma", sorted(want))
    ]
    assert {h["nqn"] for h in cfg["hosts"]} == {s["allowed_hosts"][0] for s in cfg["subsystems"]}
    assert "nvmet-rdma" in (lab_plan / "nvmeof-01/etc/modules-load.d/kvlab-nvmet.conf").read_text()


@pytest.mark.parametrize("host", HOSTS)
def test_node_discovers_connects_and_mounts_its_namespaces(lab_plan: Path, host: str) -> None:
    root = lab_plan / host
    v = lab_rendered(host, "nvmeof_initiator_hostnqn", "nvmeof_initiator_hostid")
    assert (root / "etc/nvme/hostnqn").read_text().strip() == v["nvmeof_initiator_hostnqn"]
    assert (root / "etc/nvme/hostid").read_text().strip() == v["nvmeof_initiator_hostid"]
    ports = nvme_ports(root)
    assert sorted({p["traddr"] for p in ports}) == ["192.168.100.31", "192.168.101.31"]
    for p in ports:
        assert p["transport"] == "rdma" and p["host"]["hostnqn"] == v["nvmeof_initiator_hostnqn"]
        assert p["ctrl_loss_tmo"] == -1 and p["fast_io_fail_tmo"] == 5  # reconnect forever, fail I/O fast
    assert (root / "etc/modules-load.d/kvlab-nvmeof.conf").read_text().strip().endswith("nvme-rdma")
    unit = (root / "etc/systemd/system/kvlab-nvmeof-connect.service").read_text()
    assert "After=network-online.target" in unit and "Before=remote-fs-pre.target" in unit
    assert "ExecStart=/usr/local/sbin/kvlab-nvmeof-connect" in unit
    assert os.access(root / "usr/local/sbin/kvlab-nvmeof-connect", os.X_OK)
    [mine] = [e for e in exports() if e["node"] == host]
    fstab = [ln.split() for ln in (root / "etc/fstab").read_text().splitlines() if ln.strip()]
    assert [(f[0], f[1], f[2]) for f in fstab] == [
        (f"/dev/disk/by-id/nvme-uuid.{n['uuid']}", n["path"], "xfs") for n in mine["namespaces"]
    ]
    assert all("_netdev" in f[3].split(",") for f in fstab)
    # the store's paths lie on those mounts, one per namespace
    assert json.loads((root / "etc/kvlab/store.json").read_text())["paths"] == [
        f"{n['path']}/kvlab" for n in mine["namespaces"]
    ]


@pytest.mark.parametrize("host", [*HOSTS, "nvmeof-01"])
def test_roce_ports_and_qos_follow_the_wired_variant(lab_plan: Path, host: str) -> None:
    root = lab_plan / host
    fabric = group_vars("all")
    variant = fabric["kvlab_storage_link_variants"][fabric["kvlab_storage_link_variant"]]
    netdevs = lab_rendered(host, "rdma_netdevs")["rdma_netdevs"]
    assert {nd["subnet"] for nd in netdevs} == set(variant["subnets"])
    for nd in netdevs:
        network = (root / f"etc/systemd/network/20-kvlab-{nd['name']}.network").read_text()
        assert f"Address={nd['address']}" in network and "MTUBytes=9000" in network
    script = (root / "usr/local/sbin/kvlab-roce-lossless").read_text()
    qos = fabric["rdma_roce_lossless"]
    assert "mlnx_qos" not in script  # in no package list: iproute2's dcb does it
    for nd in netdevs:
        assert f"dcb app replace dev {nd['name']} dscp-prio {qos['dscp']}:{qos['pfc_priority']}" in script
        assert f"dcb pfc set dev {nd['name']} prio-pfc all:off {qos['pfc_priority']}:on" in script
        assert f"/sys/class/net/{nd['name']}/ecn/roce_np/enable/{qos['pfc_priority']}" in script
    assert "ExecStart=/usr/local/sbin/kvlab-roce-lossless" in (
        root / "etc/systemd/system/kvlab-roce-lossless.service"
    ).read_text()


def test_every_gpu_node_has_its_storage_gpu_and_serving_files(lab_plan: Path) -> None:
    for host in HOSTS:
        root = lab_plan / host
        for rel in ("etc/nvme/config.json", "etc/fstab", "usr/local/sbin/kvlab-roce-lossless", "etc/cufile.json",
                    "etc/systemd/system/kvlab-vllm-kvlab.service"):  # fmt: skip
            assert (root / rel).is_file(), f"{host}: no {rel} in the plan"
