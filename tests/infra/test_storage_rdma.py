"""RDMA on every fabric host: links up, MTU end to end, no transport errors, counters recorded."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.infra
testinfra_hosts = ["ansible://nvmeof_targets", "ansible://nvmeof_initiators"]

# Kernel messages that mean the datapath misbehaved (not the normal connect/disconnect notices).
TRANSPORT_ERRORS = re.compile(
    r"(nvme\S*: .*(I/O error|failed|error|timeout|resetting|Reconnecting)|"
    r"rdma_rxe: .*(error|fail)|rxe\d*: .*(error|fail|bad)|nvmet(_rdma|_tcp)?: .*(error|failed|expired)|"
    r"blk_update_request|Buffer I/O error|XFS .*(error|corruption|Shutting down))",
    re.IGNORECASE,
)


def rdma_links(host) -> list[dict]:
    return json.loads(host.check_output("rdma -j link show"))


def test_rdma_link_active(host, inv):
    links = {lk["ifname"]: lk for lk in rdma_links(host)}
    wanted = [rl["name"] for rl in inv["rxe_links"]] or list(links)
    assert wanted, "no RDMA link on a fabric host"
    for name in wanted:
        assert name in links, f"RDMA link {name} missing (have {sorted(links)})"
        assert links[name]["state"] == "ACTIVE" and links[name]["physical_state"] == "LINK_UP", links[name]
    for want in inv["rxe_links"]:
        assert links[want["name"]].get("netdev") == want["netdev"], "soft-RoCE link over the wrong netdev"


def test_fabric_netdev_mtu_and_address(host, inv):
    # netdevs this role configures must match exactly; site-configured RoCE netdevs need jumbo frames
    want = {nd["name"]: nd for nd in inv["netdevs"]}
    for link in rdma_links(host):
        want.setdefault(link["netdev"], {"name": link["netdev"], "mtu": None})
    assert want, "no fabric netdev"
    for name, nd in want.items():
        mtu = int(host.file(f"/sys/class/net/{name}/mtu").content_string.strip())
        if nd.get("mtu"):
            assert mtu == int(nd["mtu"]), f"{name}: MTU {mtu}, configured {nd['mtu']}"
        else:
            assert mtu >= 4200, f"{name}: MTU {mtu}, RoCE needs jumbo frames end to end"
        if nd.get("address"):
            assert nd["address"].split("/")[0] in host.interface(name).addresses


def test_no_transport_errors_in_kernel_log(host, inv):
    log = host.check_output("dmesg --notime 2>/dev/null || journalctl -k -b --no-pager -o cat")
    bad = [line for line in log.splitlines() if TRANSPORT_ERRORS.search(line)]
    assert not bad, "transport errors in the kernel log:\n" + "\n".join(bad[:20])


def test_roce_counters_recorded(host, inv, record_dir):
    out = host.check_output(
        "for f in /sys/class/infiniband/*/ports/*/counters/* /sys/class/infiniband/*/ports/*/hw_counters/*; do "
        '[ -r "$f" ] && printf \'%s %s\\n\' "$f" "$(cat $f 2>/dev/null)"; done; true'
    )
    counters = {}
    for line in out.splitlines():
        path, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            counters[path.removeprefix("/sys/class/infiniband/")] = int(value)
    # PFC pause and CNP counters of RoCE NICs (mlx5), where ethtool has them
    for nd in inv["lossless"].get("devices", []) if inv["lossless"].get("enabled") else []:
        stats = host.check_output(f"ethtool -S {nd}")
        for line in stats.splitlines():
            k, _, v = line.strip().partition(":")
            if re.search(r"(pause|pfc|cnp|ecn)", k):
                counters[f"{nd}/{k}"] = int(v)
    name = host.backend.get_hostname()
    (record_dir / f"{name}-roce-counters.json").write_text(json.dumps(counters, indent=1, sort_keys=True))
    assert counters, "no RDMA counters readable under /sys/class/infiniband"


def qos_devices(inv) -> list[str]:
    return inv["lossless"].get("devices") or [nd["name"] for nd in inv["netdevs"]]


def test_roce_qos(host, inv):
    """Trust DSCP, the RoCE DSCP mapped to the PFC priority, PFC on that priority only, ECN on it:
    read back from the NIC with iproute2's dcb where it holds them; where the inventory says the
    NICs cannot (soft-RoCE: rdma_roce_lossless_apply false), the rendered script is checked instead."""
    ll = inv["lossless"]
    assert ll.get("enabled"), "RoCE lossless settings are not enabled for this fabric host"
    prio, dscp = int(ll.get("pfc_priority", 3)), int(ll.get("dscp", 26))
    devices = qos_devices(inv)
    assert devices, "no RoCE netdev to hold the QoS settings"
    script = host.file("/usr/local/sbin/kvlab-roce-lossless").content_string
    for dev in devices:
        assert f"dcb pfc set dev {dev} prio-pfc all:off {prio}:on" in script, script
        if ll.get("trust", "dscp") == "dscp":
            assert f"dcb app replace dev {dev} dscp-prio {dscp}:{prio}" in script, script
        if ll.get("ecn", True):
            assert f"/sys/class/net/{dev}/ecn/roce_np/enable/{prio}" in script, script
    if not inv["lossless_apply"]:
        print(f"{host.backend.get_hostname()}: soft-RoCE holds no DCB settings: checked the rendered "
              f"configuration of {devices}, not read back from the NIC")
        assert not host.service("kvlab-roce-lossless").is_enabled
        return
    assert host.service("kvlab-roce-lossless").is_enabled
    for dev in devices:
        pfc = host.check_output(f"dcb pfc show dev {dev} prio-pfc")
        on = dict(re.findall(r"(\d):(on|off)", pfc))
        assert on and on.get(str(prio)) == "on" and all(v == "off" for p, v in on.items() if p != str(prio)), pfc
        app = host.check_output(f"dcb app show dev {dev} dscp-prio")
        pairs = set(re.findall(r"(\d+):(\d)", app))
        if ll.get("trust", "dscp") == "dscp":
            assert (str(dscp), str(prio)) in pairs, app
        else:
            assert not pairs, app
        if ll.get("ecn", True):
            for side in ("roce_np", "roce_rp"):
                assert host.file(f"/sys/class/net/{dev}/ecn/{side}/enable/{prio}").content_string.strip() == "1"
