"""The judgement of `make verify`'s checks, as pure functions of what a host reported.

The testinfra suites (tests/infra, tests/lab) read a host (sysfs, nvidia-smi, nvme smart-log,
ping, counters) and hand what they read to these functions with what the inventory expects;
each returns the problems it found, one line each naming what was found and what was expected
(an empty list: the check passes). Unit tests (tests/unit/test_verify_checks.py) feed them the
broken states a lab meets: a dead path, a 1500-byte hop, a still counter, an unauthenticated host,
an uncorrectable ECC error, a worn drive, a clock that is not synchronised.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Mapping

# ---------------------------------------------------------------- NVMe-oF initiator: paths, policy


def _traddr(address: str | Mapping) -> str:
    if isinstance(address, Mapping):
        return str(address.get("traddr", ""))
    m = re.search(r"traddr=([^,\s]+)", address)
    return m.group(1) if m else ""


def _trsvcid(address: str | Mapping) -> str:
    if isinstance(address, Mapping):
        return str(address.get("trsvcid", ""))
    m = re.search(r"trsvcid=([^,\s]+)", address)
    return m.group(1) if m else ""


def missing_paths(targets: Iterable[Mapping], controllers: Iterable[Mapping]) -> list[str]:
    """Every subsystem needs a live controller to EVERY configured target address that exports it.

    targets: the inventory's nvmeof_initiator_targets ([{traddr, trsvcid, subsystems}]);
    controllers: the host's fabrics controllers ([{name, subsysnqn, state, address}], address as
    /sys/class/nvme/*/address has it, or parsed)."""
    ctrls = list(controllers)
    problems = []
    for t in targets:
        addr, port = str(t["traddr"]), str(t.get("trsvcid", 4420))
        for nqn in t["subsystems"]:
            here = [c for c in ctrls if c["subsysnqn"] == nqn and _traddr(c["address"]) == addr
                    and _trsvcid(c["address"]) in ("", port)]  # fmt: skip
            if not any(c["state"] == "live" for c in here):
                found = ", ".join(f"{c['name']} {c['state']}" for c in here) or "no controller"
                problems.append(
                    f"{nqn}: no live path to {addr}:{port} (found {found}; expected a live controller)"
                )
    return problems


def expected_iopolicy(configured: str, kernel_release: str) -> str:
    """The I/O policy a configured value means on this kernel: `auto` is queue-depth from Linux
    6.11 (where the policy exists), round-robin before it; any other value is itself."""
    if configured != "auto":
        return configured
    m = re.match(r"(\d+)\.(\d+)", kernel_release)
    return "queue-depth" if m and (int(m.group(1)), int(m.group(2))) >= (6, 11) else "round-robin"


def iopolicy_problems(subsystems: Iterable[str], policies: Mapping[str, str], expected: str) -> list[str]:
    """Each subsystem's multipath I/O policy (/sys/class/nvme-subsystem/*/iopolicy, by subsystem
    NQN) is the configured one."""
    problems = []
    for nqn in subsystems:
        got = policies.get(nqn)
        if got is None:
            problems.append(f"{nqn}: no NVMe subsystem on this host (expected iopolicy {expected})")
        elif got.strip() != expected:
            problems.append(f"{nqn}: iopolicy {got.strip()}, expected {expected}")
    return problems


# ------------------------------------------------------------------------ fabric: path MTU


def ping_command(src: str, dst: str, mtu: int) -> str:
    """A don't-fragment ping of the full frame size (IP 20 + ICMP 8 headers under the MTU)."""
    return f"ping -M do -s {mtu - 28} -c 2 -i 0.2 -W 3 -I {src} {dst}"


def ping_pairs(local_netdevs: Iterable[Mapping], remote_addresses: Iterable[str]) -> list[tuple[str, str]]:
    """(local address, remote address) for every remote address on the subnet of a local netdev
    (netdevs as rdma_netdevs: {name, address: CIDR})."""
    pairs = []
    for nd in local_netdevs:
        iface = ipaddress.ip_interface(nd["address"])
        for dst in remote_addresses:
            if ipaddress.ip_address(dst) in iface.network:
                pairs.append((str(iface.ip), dst))
    return pairs


def path_mtu_problems(results: Iterable[Mapping]) -> list[str]:
    """results: [{src, dst, mtu, rc, output}] of ping_command. A don't-fragment ping of the full
    size that does not come back means a hop on the path has a smaller MTU (or the path is down)."""
    problems = []
    for r in results:
        if r["rc"] == 0 and not re.search(r"\b0 received\b", r["output"]):
            continue
        m = re.search(r"mtu\s*=\s*(\d+)", r["output"], re.I)
        why = (
            f"a hop's MTU is {m.group(1)}" if m else "no reply (a smaller hop drops it, or the path is down)"
        )
        problems.append(f"{r['src']} -> {r['dst']}: a {r['mtu']}-byte don't-fragment ping failed: {why}; "
                        f"expected {r['mtu']} end to end")  # fmt: skip
    return problems


# ------------------------------------------------------------------------ RoCE counters under load

# Error counters of an RDMA port that must not move under a clean load: soft-RoCE (rxe) and mlx5.
RDMA_ERROR_COUNTERS = (
    "send_err", "retry_exceeded_err", "retry_rnr_exceeded_err", "completer_retry_err", "rcvd_seq_err",
    "link_downed", "out_of_sequence", "packet_seq_err", "local_ack_timeout_err", "implied_nak_seq_err",
    "req_cqe_error", "resp_cqe_error", "req_remote_access_errors", "resp_remote_access_errors",
    "rnr_nak_retry_err", "resp_local_length_error", "req_remote_invalid_request",
)  # fmt: skip
# Of all pause time on the RoCE priority, at most this share of the load's duration: more is a storm.
PAUSE_SHARE_MAX = 0.2


def counter_problems(before: Mapping[str, int], after: Mapping[str, int], priority: int | None,
                     duration_s: float) -> list[str]:  # fmt: skip
    """Counters read before and after a bounded load over the fabric ({path: value}: the RDMA
    port counters as `<dev>/ports/<n>/(hw_)counters/<name>`, the NIC's ethtool statistics as
    `<netdev>/<name>`). priority: the RoCE PFC priority (None: soft-RoCE, which has no priority).

    - the RoCE traffic moved: on a NIC with priorities, its priority's rx or tx bytes/packets
      (ethtool `rx_prio3_bytes`...); without, the RDMA port's packet counters;
    - no transport error counter moved;
    - no pause storm: no mlx5 pause-storm event, no PFC pause on another priority, and pause time on
      the RoCE priority under PAUSE_SHARE_MAX of the load."""

    def delta(name_rx: str) -> dict[str, int]:
        rx = re.compile(name_rx)
        return {k: after[k] - before.get(k, 0) for k in after if rx.search(k.rsplit("/", 1)[-1])}

    problems = []
    if priority is not None:
        moved = delta(rf"^[rt]x_prio{priority}_(bytes|packets)$")
        what = f"priority {priority}'s rx/tx bytes (ethtool -S *_prio{priority}_bytes)"
    else:
        moved = delta(r"^(sent_pkts|rcvd_pkts|port_xmit_packets|port_rcv_packets|rdma_sends|rdma_recvs)$")
        what = "RDMA packet counters (sent_pkts/rcvd_pkts, port_xmit/rcv_packets)"
    if not moved:
        problems.append(f"no {what} found to read (found {len(after)} counters)")
    elif not any(v > 0 for v in moved.values()):
        problems.append(
            f"{what} did not move under load: {dict(sorted(moved.items()))}; expected an increase"
        )
    errors = {k: v for k, v in delta(rf"^({'|'.join(RDMA_ERROR_COUNTERS)})$").items() if v > 0}
    if errors:
        problems.append(
            f"transport error counters moved under load: {dict(sorted(errors.items()))}; expected 0"
        )
    storms = {k: v for k, v in delta(r"pause_storm").items() if v > 0}
    if storms:
        problems.append(f"pause storm events: {dict(sorted(storms.items()))}; expected none")
    if priority is not None:
        other = {k: v for k, v in delta(r"^[rt]x_prio(\d)_pause$").items()
                 if v > 0 and not k.endswith(f"prio{priority}_pause")}  # fmt: skip
        if other:
            problems.append(
                f"PFC pause frames on priorities other than {priority}: {dict(sorted(other.items()))}"
            )
        paused_us = sum(delta(rf"^[rt]x_prio{priority}_pause_duration$").values())
        if duration_s > 0 and paused_us / 1e6 > PAUSE_SHARE_MAX * duration_s:
            problems.append(f"priority {priority} paused {paused_us / 1e6:.1f} s of a {duration_s:.0f} s load "
                            f"(expected under {PAUSE_SHARE_MAX:.0%}): a pause storm")  # fmt: skip
    return problems


# ------------------------------------------------------------------------ RoCE QoS read back


def qos_devices(lossless: Mapping, netdevs: Iterable[Mapping]) -> list[str]:
    """The netdevs that hold the RoCE QoS: rdma_roce_lossless.devices, else every fabric netdev."""
    return list(lossless.get("devices") or [nd["name"] for nd in netdevs])


def parse_mlnx_qos(text: str) -> dict:
    """`mlnx_qos -i DEV` (DOCA/MLNX_OFED): DCBX mode, trust state, PFC per priority."""
    out: dict = {}
    if m := re.search(r"DCBX mode:\s*(.+)", text):
        out["dcbx"] = m.group(1).strip()
    if m := re.search(r"Priority trust state:\s*(\S+)", text):
        out["trust"] = m.group(1).strip()
    if m := re.search(r"PFC configuration:.*?priority\s+([\d\s]+)\n\s*enabled\s+([\d\s]+)", text, re.S):
        prios, enabled = m.group(1).split(), m.group(2).split()
        out["pfc"] = {int(p): e == "1" for p, e in zip(prios, enabled, strict=False)}
    return out


def qos_problems(found: Mapping, trust: str, priority: int, dscp: int) -> list[str]:
    """found: what the NIC reports ({dcbx, trust, pfc: {prio: on}, tos}); expected: DCBX in the
    OS's hands (the host's settings hold, not a switch's), the trust state, PFC on the RoCE
    priority only, and the RoCE traffic class (TOS) carrying the DSCP (ECN bits aside)."""
    problems = []
    if "dcbx" in found and not re.search(r"os", found["dcbx"], re.I):
        problems.append(
            f"DCBX mode {found['dcbx']!r}, expected OS controlled (the host's PFC and trust hold)"
        )
    if "trust" in found and found["trust"] != trust:
        problems.append(f"trust state {found['trust']!r}, expected {trust!r}")
    if "pfc" in found:
        on = sorted(p for p, v in found["pfc"].items() if v)
        if on != [priority]:
            problems.append(f"PFC on priorities {on}, expected on {priority} only")
    if "tos" in found and found["tos"] is not None and int(found["tos"]) >> 2 != dscp:
        problems.append(f"RoCE traffic class {found['tos']} (DSCP {int(found['tos']) >> 2}), expected DSCP {dscp} "
                        f"(traffic class {dscp << 2})")  # fmt: skip
    return problems


# ------------------------------------------------------------------------ DH-HMAC-CHAP


def hosts_without_key(subsystems: Iterable[Mapping], keyed: Mapping[str, bool]) -> list[str]:
    """Every allowed host of every subsystem has a DH-HMAC-CHAP key on the target (nvmet configfs
    hosts/<nqn>/dhchap_key not empty). keyed: {host nqn: key present}, read without the key."""
    problems = []
    for sub in subsystems:
        for nqn in sub["allowed_hosts"]:
            if not keyed.get(nqn):
                state = "no dhchap_key" if nqn in keyed else "no host entry"
                problems.append(f"{sub['nqn']}: allowed host {nqn} has {state}: any host presenting its NQN "
                                "gets in (expected a DH-HMAC-CHAP key)")  # fmt: skip
    return problems


# ------------------------------------------------------------------------ lab: GPU health


def parse_csv_rows(text: str, fields: Iterable[str]) -> list[dict[str, str]]:
    """nvidia-smi --query-gpu=... --format=csv,noheader,nounits rows, by field name."""
    names = list(fields)
    rows = []
    for line in text.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) == len(names):
            rows.append(dict(zip(names, values, strict=True)))
    return rows


GPU_HEALTH_FIELDS = (
    "index", "pci.bus_id", "ecc.mode.current", "ecc.errors.uncorrected.volatile.total",
    "remapped_rows.pending", "remapped_rows.failure", "remapped_rows.uncorrectable",
    "pcie.link.gen.max", "pcie.link.gen.gpumax", "pcie.link.width.current", "pcie.link.width.max",
)  # fmt: skip


def _truthy(v: str) -> bool:
    return v.strip().lower() in ("yes", "1", "true") or (v.strip().isdigit() and int(v) > 0)


def ecc_problems(rows: Iterable[Mapping[str, str]]) -> list[str]:
    problems = []
    for r in rows:
        if r["ecc.mode.current"] != "Enabled":
            problems.append(f"GPU {r['index']}: ECC mode {r['ecc.mode.current']}, expected Enabled")
        n = r.get("ecc.errors.uncorrected.volatile.total", "0")
        if n.isdigit() and int(n) > 0:
            problems.append(
                f"GPU {r['index']}: {n} uncorrected ECC errors since the driver loaded, expected 0"
            )
    return problems


def remap_problems(rows: Iterable[Mapping[str, str]]) -> list[str]:
    """Row remapping (A100/H100/H200): a pending remap needs a GPU reset; a failed one, an RMA."""
    problems = []
    for r in rows:
        if _truthy(r["remapped_rows.pending"]):
            problems.append(f"GPU {r['index']}: a row remap is pending (reset the GPU), expected none")
        if _truthy(r["remapped_rows.failure"]):
            problems.append(
                f"GPU {r['index']}: row remapping failed (the GPU needs replacing), expected no failure"
            )
    return problems


def pcie_link_problems(rows: Iterable[Mapping[str, str]], expected_gen: int | None = None) -> list[str]:
    """The link trains at the GPU's generation (the current generation drops at idle, so the
    maximum the GPU and the system reach is compared) and at its full width."""
    problems = []
    for r in rows:
        gen, gpumax = r["pcie.link.gen.max"], r["pcie.link.gen.gpumax"]
        want_gen = str(expected_gen) if expected_gen else gpumax
        if gen.isdigit() and want_gen.isdigit() and int(gen) < int(want_gen):
            problems.append(f"GPU {r['index']} ({r['pci.bus_id']}): PCIe Gen{gen}, expected Gen{want_gen}")
        width, wmax = r["pcie.link.width.current"], r["pcie.link.width.max"]
        if width.isdigit() and wmax.isdigit() and int(width) < int(wmax):
            problems.append(f"GPU {r['index']} ({r['pci.bus_id']}): PCIe x{width}, expected x{wmax}")
    return problems


# Xids an application causes (a bad kernel, an MMU fault it made): reported, not a hardware fault.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})
XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")


def xid_problems(journal: str) -> list[str]:
    """Xid errors in this boot's kernel journal that point at the hardware or the driver."""
    seen: dict[tuple[str, int], int] = {}
    for m in XID_RE.finditer(journal):
        key = (m.group(1), int(m.group(2)))
        seen[key] = seen.get(key, 0) + 1
    return [f"Xid {xid} on GPU {bus} ({n}x in this boot's kernel log), expected none"
            for (bus, xid), n in sorted(seen.items()) if xid not in APPLICATION_XIDS]  # fmt: skip


# ------------------------------------------------------------------------ lab: topology


def parse_topo(text: str) -> dict[str, dict]:
    """`nvidia-smi topo -m`: for each device row (GPU0, NIC0, ...), its link to every column and
    its NUMA affinity. Returns {row: {"links": {col: "PIX"|"NODE"|...}, "numa": "0"}} plus, under
    "_nics", the legend's NIC names ({"NIC0": "mlx5_0"})."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s*GPU0\b", ln)), None)
    if header is None:
        return {}
    cols = header.split()
    devices = [c for c in cols if re.fullmatch(r"(GPU|NIC)\d+|mlx5_\d+", c)]
    out: dict[str, dict] = {}
    for ln in lines[lines.index(header) + 1 :]:
        parts = ln.split()
        if not parts or not re.fullmatch(r"(GPU|NIC)\d+|mlx5_\d+", parts[0]):
            continue
        links = dict(zip(devices, parts[1 : 1 + len(devices)], strict=False))
        rest = parts[1 + len(devices) :]
        numa = next((p for p in rest[1:2]), "") if rest else ""
        out[parts[0]] = {"links": links, "numa": numa}
    out["_nics"] = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)", text, re.M))
    return out


NEAR = ("PIX", "PXB")  # on the GPU's own PCIe switch (one or more bridges), not across the CPU


def topo_problems(
    topo: Mapping[str, dict], rdma_devices: Iterable[str], numa_of: Mapping[str, str]
) -> list[str]:
    """Each GPU has one of the inventory's RDMA NICs on its own PCIe switch (PIX/PXB: GPUDirect
    RDMA and GDS stay off the CPU), and that NIC sits on the GPU's NUMA node.
    rdma_devices: the RDMA devices the inventory uses (mlx5_0...); numa_of: each one's NUMA node."""
    names = topo.get("_nics", {})
    wanted = set(rdma_devices)
    problems = []
    gpus = [k for k in topo if k.startswith("GPU")]
    if not gpus:
        return ["nvidia-smi topo -m lists no GPU"]
    for g in gpus:
        near = [(col, names.get(col, col)) for col, link in topo[g]["links"].items()
                if not col.startswith("GPU") and link in NEAR and names.get(col, col) in wanted]  # fmt: skip
        if not near:
            links = {names.get(c, c): v for c, v in topo[g]["links"].items() if not c.startswith("GPU")}
            problems.append(f"{g}: none of the inventory's RDMA NICs {sorted(wanted)} on its PCIe switch "
                            f"(found {links}; expected PIX or PXB)")  # fmt: skip
            continue
        gnuma = topo[g]["numa"]
        if gnuma and gnuma != "N/A" and not any(numa_of.get(nic) in (gnuma, None) for _, nic in near):
            problems.append(f"{g}: NUMA node {gnuma}, its nearest NIC(s) "
                            f"{[(n, numa_of.get(n)) for _, n in near]} on another node")  # fmt: skip
    return problems


def numa_problems(drives: Mapping[str, str], nics: Mapping[str, str]) -> list[str]:
    """On a target: every exported drive's NUMA node is one of its fabric NICs' nodes (the data
    crosses no socket link between the drive and the port). {name: numa node}; -1 means the
    platform does not say (single socket)."""
    nic_nodes = {v for v in nics.values() if v not in ("-1", "")}
    if not nic_nodes:
        return []
    return [f"drive {d}: NUMA node {n}, its fabric NICs {dict(nics)} on node(s) {sorted(nic_nodes)}"
            for d, n in sorted(drives.items()) if n not in ("-1", "") and n not in nic_nodes]  # fmt: skip


# ------------------------------------------------------------------------ lab: drives


def smart_problems(device: str, smart: Mapping, max_used_percent: int = 80) -> list[str]:
    """`nvme smart-log DEV -o json`: no critical warning, no media error, spare above its
    threshold, wear under max_used_percent (a KV cache writes a lot)."""
    used = smart.get("percent_used", smart.get("percentage_used", 0))
    problems = []
    if int(smart.get("critical_warning", 0)):
        problems.append(f"{device}: critical_warning {smart['critical_warning']}, expected 0")
    if int(smart.get("media_errors", 0)):
        problems.append(f"{device}: {smart['media_errors']} media errors, expected 0")
    spare, thresh = int(smart.get("avail_spare", 100)), int(smart.get("spare_thresh", 0))
    if spare <= thresh:
        problems.append(f"{device}: available spare {spare}% at or below its threshold {thresh}%")
    if int(used) >= max_used_percent:
        problems.append(f"{device}: {used}% of its rated endurance used, expected under {max_used_percent}%")
    return problems


def parse_smart(text: str) -> dict:
    return json.loads(text)


# ------------------------------------------------------------------------ time sync


def time_sync_problems(timedatectl: str, chrony: str) -> list[str]:
    """timedatectl show (NTPSynchronized=yes) or chronyc tracking (Leap status : Normal): either
    daemon may keep the clock; one of them must say it is synchronised."""
    if re.search(r"^NTPSynchronized=yes$", timedatectl, re.M):
        return []
    if re.search(r"^Leap status\s*:\s*Normal", chrony, re.M):
        return []
    got = (re.search(r"^NTPSynchronized=(\S+)", timedatectl, re.M) or [None, "unknown"])[1]
    leap = (re.search(r"^Leap status\s*:\s*(.+)$", chrony, re.M) or [None, "no chrony"])[1]
    return [f"clock not synchronised (timedatectl NTPSynchronized={got}, chronyc leap status {leap}); "
            "expected chrony or systemd-timesyncd synchronised"]  # fmt: skip
