"""NVMe-oF targets: subsystems, namespaces, ports and host allowlists exactly as configured, and
every allowed host authenticated (DH-HMAC-CHAP key on the target)."""

from __future__ import annotations

import pytest

from kvlab import verify_checks as vc

pytestmark = pytest.mark.infra
testinfra_hosts = ["ansible://nvmeof_targets"]

NVMET = "/sys/kernel/config/nvmet"


def ls(host, path: str) -> list[str]:
    return sorted(host.check_output(f"ls -1 {path} 2>/dev/null || true").split())


def read(host, path: str) -> str:
    return host.file(path).content_string.strip()


def test_target_service_enabled_and_in_sync(host):
    svc = host.service("kvlab-nvmet")
    assert svc.is_enabled and svc.is_running
    # exit 0: configfs matches /etc/kvlab/nvmet.json exactly
    host.run_expect([0], "/usr/local/sbin/kvlab-nvmet-apply --check")


def test_subsystems_exactly_as_configured(host, inv):
    assert ls(host, f"{NVMET}/subsystems") == sorted(s["nqn"] for s in inv["target_subsystems"])


def test_allowlist_is_explicit(host, inv):
    for sub in inv["target_subsystems"]:
        base = f"{NVMET}/subsystems/{sub['nqn']}"
        assert read(host, f"{base}/attr_allow_any_host") == "0", f"{sub['nqn']} allows any host"
        assert ls(host, f"{base}/allowed_hosts") == sorted(sub["allowed_hosts"])


# Whether each host entry holds a DH-HMAC-CHAP key, read without printing the key.
HOST_KEYS = (
    f"for h in {NVMET}/hosts/*; do [ -d \"$h\" ] || continue; "
    'if [ -n "$(cat $h/dhchap_key 2>/dev/null)" ]; then k=1; else k=0; fi; echo "${h##*/} $k"; done'
)


def test_every_allowed_host_has_a_dhchap_key(host, inv):
    """A host NQN is no credential (any host can present one): every allowed host of every
    subsystem must authenticate with DH-HMAC-CHAP, so nvmet holds a key for it."""
    with host.sudo():
        keyed = {name: k == "1" for name, k in (line.split() for line in host.check_output(HOST_KEYS).splitlines())}
    problems = vc.hosts_without_key(inv["target_subsystems"], keyed)
    assert not problems, "\n".join(problems)


def test_namespaces_enabled_on_their_devices(host, inv):
    for sub in inv["target_subsystems"]:
        for ns in sub["namespaces"]:
            base = f"{NVMET}/subsystems/{sub['nqn']}/namespaces/{ns['nsid']}"
            assert read(host, f"{base}/enable") == "1"
            assert read(host, f"{base}/device_path") == ns["device"]
            if ns.get("uuid"):
                assert read(host, f"{base}/device_uuid") == ns["uuid"]


def test_ports_as_configured(host, inv):
    assert ls(host, f"{NVMET}/ports") == sorted(str(p["id"]) for p in inv["target_ports"])
    for p in inv["target_ports"]:
        base = f"{NVMET}/ports/{p['id']}"
        assert read(host, f"{base}/addr_trtype") == p["transport"]
        assert read(host, f"{base}/addr_traddr") == p["address"]
        assert read(host, f"{base}/addr_trsvcid") == str(p.get("service", 4420))
        assert ls(host, f"{base}/subsystems") == sorted(p["subsystems"])


def test_target_listens_on_its_ports(host, inv):
    for p in inv["target_ports"]:
        if p["transport"] == "tcp":
            assert host.socket(f"tcp://{p['address']}:{p.get('service', 4420)}").is_listening
        else:  # RDMA CM listeners show in `rdma resource show cm_id`
            out = host.check_output("rdma resource show cm_id")
            assert f"src-addr {p['address']}:{p.get('service', 4420)}" in out and "LISTEN" in out, out
