"""RDMA on every fabric host: links up, the path MTU end to end (don't-fragment pings of the full
size to every peer address), no transport errors, the RoCE QoS read back where the NIC holds it,
and under a bounded load the RoCE counters moved with no transport error or pause storm. The
judgements are kvlab.verify_checks' (unit-tested with broken inputs: a 1500-byte hop, a still
counter, an error counter that moved, a pause storm, another trust state)."""

from __future__ import annotations

import json
import re

import pytest

from kvlab import verify_checks as vc

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


def subnet_mtu(inv, netdev: dict) -> int:
    for sn in inv["roce_subnets"]:
        if sn["name"] == netdev.get("subnet"):
            return int(sn.get("mtu", 9000))
    return int(netdev.get("mtu", 9000))


def test_path_mtu_end_to_end(host, inv):
    """A don't-fragment ping of the subnet's full MTU from each fabric address to every peer's
    address on that subnet (targets to initiators and back): a 1500-byte switch port between two
    9000-byte hosts fails here, where each host's own MTU looks right."""
    peers = [nd["address"].split("/")[0] for nd in inv["peer_netdevs"]]
    pairs = vc.ping_pairs(inv["netdevs"], peers)
    assert pairs, f"no peer fabric address on this host's subnets (netdevs {inv['netdevs']}, peers {peers})"
    mtu_of = {nd["address"].split("/")[0]: subnet_mtu(inv, nd) for nd in inv["netdevs"]}
    results = []
    for src, dst in pairs:
        r = host.run(vc.ping_command(src, dst, mtu_of[src]))
        results.append({"src": src, "dst": dst, "mtu": mtu_of[src], "rc": r.rc, "output": r.stdout + r.stderr})
    problems = vc.path_mtu_problems(results)
    assert not problems, "\n".join(problems)
    print(f"{host.backend.get_hostname()}: {len(results)} path(s) carry {sorted(set(mtu_of.values()))}-byte frames "
          f"unfragmented: {pairs}")


def test_no_transport_errors_in_kernel_log(host, inv):
    log = host.check_output("dmesg --notime 2>/dev/null || journalctl -k -b --no-pager -o cat")
    bad = [line for line in log.splitlines() if TRANSPORT_ERRORS.search(line)]
    assert not bad, "transport errors in the kernel log:\n" + "\n".join(bad[:20])


def qos_devices(inv) -> list[str]:
    return vc.qos_devices(inv["lossless"], inv["netdevs"])


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


ROCE_TOS = (
    "for d in /sys/class/infiniband/*; do n=${d##*/}; "
    "f=/sys/kernel/config/rdma_cm/$n/ports/1/default_roce_tos; [ -r $f ] && echo \"$n $(cat $f)\"; "
    "f=$d/tc/1/traffic_class; [ -r $f ] && echo \"$n $(cat $f)\"; done; true"
)


@pytest.mark.lab
def test_roce_trust_dcbx_and_traffic_class_read_back(host, inv):
    """Trust state, DCBX mode (OS controlled: the host's PFC holds, not a switch's) and the RoCE
    traffic class, read back from the NIC where it exposes them (mlnx_qos under DOCA/MLNX_OFED;
    rdma_cm's default_roce_tos or the DOCA tc/1/traffic_class for the class). Soft-RoCE and virtio
    NICs hold none of them: a lab test, skipped there with the reason."""
    ll = inv["lossless"]
    if not (ll.get("enabled") and inv["lossless_apply"]):
        pytest.skip(f"{host.backend.get_hostname()}: the inventory applies no RoCE QoS to these NICs "
                    "(soft-RoCE over virtio-net has no trust, DCBX or traffic class to read back)")
    tos_lines = host.check_output(ROCE_TOS).splitlines()
    tos = None
    for line in tos_lines:
        m = re.search(r"(\d+)\s*$", line.replace("Global tclass=", ""))
        if m:
            tos = int(m.group(1))
    problems, read = [], []
    for dev in qos_devices(inv):
        found: dict = {}
        if host.exists("mlnx_qos"):
            found = vc.parse_mlnx_qos(host.check_output(f"mlnx_qos -i {dev}"))
        else:
            pfc = host.run(f"dcb pfc show dev {dev} prio-pfc")
            if pfc.rc == 0:
                found["pfc"] = {int(p): v == "on" for p, v in re.findall(r"(\d):(on|off)", pfc.stdout)}
        if tos is not None:
            found["tos"] = tos
        if not found:
            pytest.skip(f"{dev}: the NIC exposes no trust, DCBX, PFC or traffic class (no mlnx_qos, dcb refused)")
        read.append((dev, found))
        problems += [f"{dev}: {p}" for p in vc.qos_problems(found, ll.get("trust", "dscp"), int(ll.get("pfc_priority", 3)),
                                                          int(ll.get("dscp", 26)))]  # fmt: skip
    assert not problems, "\n".join(problems)
    print(f"{host.backend.get_hostname()}: QoS read back {read}")
