"""Issue 23, finding 8: authenticated hosts. Bidirectional DH-HMAC-CHAP is on in the lab: each
GPU node has its own pair of secrets in the vault, connects with both, and the target's nvmet
configuration holds the same pair for that node's NQN; `make plan` shows where each secret goes
with a placeholder, never a secret. The target's validator reads a secret as the kernel does
(a 32, 48 or 64-byte key and its CRC-32) and never echoes one; a plan's placeholder validates
but is never applied."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from test_lab_fabric_multipath import initiator, said
from test_nvmet_apply import config, load, run
from test_nvmet_seed import seed, validate
from test_roles_plan import HOSTS, LAB, lab_plan, lab_rendered, nvme_ports  # noqa: F401  (lab_plan: the lab's plan, rendered once)

from kvlab import inventory

ROOT = Path(__file__).resolve().parents[2]
APPLY = ROOT / "roles/nvmeof_target/files/kvlab-nvmet-apply"
pytestmark = pytest.mark.unit

TARGET = "nvmeof-01"


def dhhc(raw: bytes, hash_id: int = 0, crc: bytes | None = None) -> str:
    """A secret as nvme gen-dhchap-key writes it: DHHC-1:<hash>:base64(key + CRC-32 LE):"""
    crc = zlib.crc32(raw).to_bytes(4, "little") if crc is None else crc
    return f"DHHC-1:{hash_id:02d}:{base64.b64encode(raw + crc).decode()}:"


PLACEHOLDER = dhhc(b"*" * 32)


def lab_secrets() -> dict[str, dict[str, str]]:
    """{node: {secret, ctrl_secret}} as the lab inventory gives them (from its example vault)."""
    return {
        h: lab_rendered(h, "nvmeof_initiator_dhchap_secret", "nvmeof_initiator_dhchap_ctrl_secret")
        for h in HOSTS
    }


# ---- the lab: on by default, one pair per node, the same pair on both sides ----------------------


def test_each_node_has_its_own_pair_and_the_target_the_same(lab_plan: Path) -> None:  # noqa: F811
    secrets = lab_secrets()
    keys = [s for pair in secrets.values() for s in pair.values()]
    assert len(keys) == 2 * len(HOSTS) and len(set(keys)) == len(keys)  # no key shared, none reused
    for k in keys:
        assert validate_secret(k) == ""
    inv = inventory.load(LAB / "hosts.yml")
    on_target = inv.render(TARGET, ["nvmeof_target_host_secrets", "nvmeof_target_dhchap_required"])
    assert on_target["nvmeof_target_dhchap_required"] is True
    for host, pair in secrets.items():
        nqn = lab_rendered(host, "nvmeof_initiator_hostnqn")["nvmeof_initiator_hostnqn"]
        assert on_target["nvmeof_target_host_secrets"][nqn] == {
            "dhchap_key": pair["nvmeof_initiator_dhchap_secret"],
            "dhchap_ctrl_key": pair["nvmeof_initiator_dhchap_ctrl_secret"],
        }
        assert (
            lab_rendered(host, "nvmeof_initiator_dhchap_required")["nvmeof_initiator_dhchap_required"] is True
        )


def validate_secret(secret: str) -> str:
    """The applier's own reading of one secret ("" when the kernel would take it)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("kvlab_nvmet_apply_dhchap", str(APPLY))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod.dhchap_secret_error(secret)


@pytest.mark.parametrize("host", HOSTS)
def test_every_path_authenticates_both_ways_with_placeholders(lab_plan: Path, host: str) -> None:  # noqa: F811
    ports = nvme_ports(lab_plan / host)
    assert ports
    for p in ports:
        assert p["dhchap_key"] == PLACEHOLDER and p["dhchap_ctrl_key"] == PLACEHOLDER, p["traddr"]
        assert p["host"]["dhchap_key"] == PLACEHOLDER


def test_every_allowed_host_has_both_keys_as_placeholders(lab_plan: Path) -> None:  # noqa: F811
    cfg = json.loads((lab_plan / TARGET / "etc/kvlab/nvmet.json").read_text())
    assert cfg["hosts"]
    for h in cfg["hosts"]:
        assert h["dhchap_key"] == PLACEHOLDER and h["dhchap_ctrl_key"] == PLACEHOLDER, h["nqn"]
    assert {h["nqn"] for h in cfg["hosts"]} == {n for s in cfg["subsystems"] for n in s["allowed_hosts"]}


def test_no_secret_leaves_the_vault(lab_plan: Path) -> None:  # noqa: F811
    secrets = [s for pair in lab_secrets().values() for s in pair.values()]
    bodies = [s.split(":")[2] for s in secrets]
    for path in lab_plan.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            assert not any(b in text for b in bodies), path
    # nor the inventory in clear: the vault holds them
    clear = "".join(
        p.read_text() for p in LAB.rglob("*.yml") if not p.read_text().startswith("$ANSIBLE_VAULT")
    )
    assert not any(b in clear for b in bodies)
    assert "vault_nvmeof_dhchap" not in (LAB / "group_vars/all/vault.yml").read_text()


# ---- the validator reads a secret as the kernel does ---------------------------------------------

GOOD32 = bytes(range(32))


@pytest.mark.parametrize(
    ("secret", "message"),
    [
        (dhhc(GOOD32, crc=b"\0\0\0\0"), "its CRC does not match"),
        (dhhc(bytes(range(31))), "its key is 31 bytes, not 32, 48 or 64"),
        (dhhc(GOOD32, hash_id=2), "a key transformed with hash 02 is 48 bytes, not 32"),
        ("DHHC-1:00:" + base64.b64encode(GOOD32).decode() + ":", "not a DH-HMAC-CHAP secret"),  # no CRC at all
        ("DHHC-1:04:" + dhhc(GOOD32).split(":")[2] + ":", "not a DH-HMAC-CHAP secret"),
    ],
)  # fmt: skip
def test_a_secret_the_kernel_would_refuse_is_named_not_echoed(
    tmp_path: Path, secret: str, message: str
) -> None:
    cfg = seed()
    cfg["hosts"][0]["dhchap_ctrl_key"] = secret
    res = validate(tmp_path, cfg)
    assert res.returncode == 2
    [line] = [ln for ln in res.stderr.splitlines() if "hosts[0].dhchap_ctrl_key: " in ln]
    assert message in line, res.stderr
    assert secret.split(":")[2] not in res.stdout + res.stderr


@pytest.mark.parametrize("secret", [dhhc(GOOD32), dhhc(bytes(48), 2), dhhc(bytes(64), 3), dhhc(bytes(64), 0)])
def test_secrets_of_every_length_and_hash_validate(tmp_path: Path, secret: str) -> None:
    cfg = seed()
    cfg["hosts"][0] |= {"dhchap_key": secret, "dhchap_ctrl_key": dhhc(GOOD32), "dhchap_dhgroup": "ffdhe3072"}
    res = validate(tmp_path, cfg)
    assert res.returncode == 0, res.stderr


def test_an_unknown_dh_group_is_named(tmp_path: Path) -> None:
    cfg = seed()
    cfg["hosts"][0]["dhchap_dhgroup"] = "ffdhe1024"
    res = validate(tmp_path, cfg)
    assert (
        res.returncode == 2
        and 'hosts[0].dhchap_dhgroup: "ffdhe1024" is not one of null, ffdhe2048' in res.stderr
    )


def test_a_plans_placeholder_validates_but_is_never_applied(tmp_path: Path, monkeypatch, capsys) -> None:
    device = tmp_path / "disk0"
    device.write_bytes(b"")
    cfg = config(device)
    cfg["hosts"][0] |= {"dhchap_key": PLACEHOLDER, "dhchap_ctrl_key": PLACEHOLDER}
    assert validate(tmp_path, cfg).returncode == 0
    mod, root = load(tmp_path, monkeypatch)  # (stands in for subprocess.run from here on)
    assert run(mod, tmp_path, cfg) == 1
    err = capsys.readouterr().err
    assert "hosts[0].dhchap_key: the placeholder `make plan` writes, not a secret" in err
    assert "hosts[0].dhchap_ctrl_key: the placeholder" in err
    assert [p for d in ("subsystems", "ports", "hosts") for p in (root / d).iterdir()] == []


def test_both_keys_and_the_dh_group_reach_configfs(tmp_path: Path, monkeypatch) -> None:
    mod, root = load(tmp_path, monkeypatch)
    device = tmp_path / "disk0"
    device.write_bytes(b"")
    cfg = config(device)
    key, ctrl = dhhc(GOOD32), dhhc(bytes(range(1, 33)))
    cfg["hosts"][0] |= {"dhchap_key": key, "dhchap_ctrl_key": ctrl, "dhchap_dhgroup": "ffdhe2048"}
    assert run(mod, tmp_path, cfg) == 0
    host = root / "hosts" / cfg["hosts"][0]["nqn"]
    assert (host / "dhchap_key").read_text() == key and (host / "dhchap_ctrl_key").read_text() == ctrl
    assert (host / "dhchap_hash").read_text() == "hmac(sha256)" and (
        host / "dhchap_dhgroup"
    ).read_text() == "ffdhe2048"


# ---- the roles refuse to run without the keys the inventory requires --------------------------------


def test_the_initiator_refuses_to_connect_without_both_secrets(tmp_path: Path) -> None:
    proc = initiator(tmp_path, "6.8.0-85-generic", nvmeof_initiator_dhchap_required=True,
                     nvmeof_initiator_dhchap_secret=dhhc(GOOD32))  # fmt: skip
    assert proc.returncode != 0
    assert (
        "DH-HMAC-CHAP needs nvmeof_initiator_dhchap_secret (and, when nvmeof_initiator_dhchap_required is on,"
        in said(proc)
    )
    assert GOOD32.hex() not in said(proc) and dhhc(GOOD32).split(":")[2] not in said(proc)


def test_the_initiator_connects_with_both_secrets(tmp_path: Path) -> None:
    proc = initiator(tmp_path, "6.8.0-85-generic", nvmeof_initiator_dhchap_required=True,
                     nvmeof_initiator_dhchap_secret=dhhc(GOOD32), nvmeof_initiator_dhchap_ctrl_secret=dhhc(bytes(32)))  # fmt: skip
    assert proc.returncode == 0, said(proc)[-3000:]
    ports = nvme_ports(tmp_path / "plan/localhost")
    keys = [(p["dhchap_key"], p["dhchap_ctrl_key"]) for p in ports]
    assert keys == [(PLACEHOLDER, PLACEHOLDER)] * 4  # 2 subsystems x 2 ports
    text = (tmp_path / "plan/localhost/etc/nvme/config.json").read_text()
    assert dhhc(GOOD32).split(":")[2] not in said(proc) + text


def test_the_target_refuses_an_allowed_host_without_keys(tmp_path: Path) -> None:
    """Run as the role runs it: its validate step, naming the host, never a key."""
    import yaml

    host2 = "nqn.2014-08.org.nvmexpress:uuid:0c1f5e2a-6b1d-4e0a-9d7e-2a11c0de0021"
    pb = tmp_path / "play.yml"
    pb.write_text(yaml.safe_dump([{"name": "Target", "hosts": "localhost", "gather_facts": False, "connection": "local",
                                   "roles": ["nvmeof_target"]}]))  # fmt: skip
    sub = lambda n, h: {"nqn": f"nqn.2026-01.io.kvlab.test:{n}", "allowed_hosts": [h],  # noqa: E731
                        "namespaces": [{"nsid": 1, "device": f"/dev/disk/by-id/wwn-0x500{n[-1]}"}]}  # fmt: skip
    ev = {"ansible_python_interpreter": sys.executable, "nvmeof_target_plan_dir": str(tmp_path / "plan"),
          "ansible_facts": {"distribution": "Debian", "distribution_version": "13", "distribution_major_version": "13"},
          "nvmeof_target_dhchap_required": True,
          "nvmeof_target_subsystems": [sub("s0", "nqn.2014-08.org.nvmexpress:uuid:0c1f5e2a-6b1d-4e0a-9d7e-2a11c0de0011"),
                                       sub("s1", host2)],
          "nvmeof_target_ports": [{"id": 1, "transport": "rdma", "address": "192.168.100.31",
                                   "subsystems": ["nqn.2026-01.io.kvlab.test:s0", "nqn.2026-01.io.kvlab.test:s1"]}],
          "nvmeof_target_host_secrets": {"nqn.2014-08.org.nvmexpress:uuid:0c1f5e2a-6b1d-4e0a-9d7e-2a11c0de0011":
                                         {"dhchap_key": dhhc(GOOD32), "dhchap_ctrl_key": dhhc(bytes(32))},
                                         host2: {"dhchap_key": dhhc(GOOD32)}}}  # fmt: skip
    env = os.environ | {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", str(pb), "-e", json.dumps(ev)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    out = said(proc)
    assert proc.returncode != 0
    assert re.search(rf"has no dhchap_key and dhchap_ctrl_key for {re.escape(host2)} \(generate them", out), (
        out[-3000:]
    )
    assert dhhc(GOOD32).split(":")[2] not in out
