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


@pytest.mark.lab
def test_roce_lossless_settings(host, inv):
    ll = inv["lossless"]
    if not ll.get("enabled"):
        pytest.skip("RoCE lossless settings not enabled for this host (soft-RoCE testbed)")
    prio = int(ll.get("pfc_priority", 3))
    for dev in ll["devices"]:
        qos = host.check_output(f"mlnx_qos -i {dev}")
        assert re.search(rf"Priority trust state:\s*{ll.get('trust', 'dscp')}", qos), qos
        enabled = re.search(r"enabled\s+((?:\d\s+){8})", qos)
        assert enabled and enabled.group(1).split()[prio] == "1", qos
        if ll.get("ecn", True):
            assert host.file(f"/sys/class/net/{dev}/ecn/roce_np/enable/{prio}").content_string.strip() == "1"
