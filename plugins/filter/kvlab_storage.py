"""The storage wiring of an inventory, derived from one table (kvlab_store_exports).

An inventory says once which namespaces each node's store gets from which target; the target's
subsystems and allowlists, its ports, the node's connections and its mounts are all derived here,
so no NQN, uuid or address is written twice. Each export:
  {node, target, nqn, serial?, namespaces: [{nsid, device, uuid, path, fstype?, options?}]}
where device is the target's backing block device (by serial or WWN, /dev/disk/by-id/...),
uuid the namespace's uuid on the wire (the identity the node mounts by), path the node's mount.
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError


def _exports(exports, key, name):
    if not isinstance(exports, list):
        raise AnsibleFilterError(f"kvlab_store_exports must be a list, not {type(exports).__name__}")
    for e in exports:
        for field in ("node", "target", "nqn", "namespaces"):
            if field not in e:
                raise AnsibleFilterError(f"kvlab_store_exports: an entry has no {field!r}: {e}")
    return [e for e in exports if e[key] == name]


def _ip(address: str) -> str:
    return str(address).split("/", 1)[0]


def target_subsystems(exports, target, hostvars):
    """nvmeof_target_subsystems of one target: each allows exactly the node it is for."""
    out = []
    for e in _exports(exports, "target", target):
        nqn = hostvars[e["node"]].get("nvmeof_initiator_hostnqn") if e["node"] in hostvars else None
        if not nqn:
            raise AnsibleFilterError(
                f"kvlab_store_exports: {e['nqn']} is for {e['node']!r}, which is not an inventory host "
                "with nvmeof_initiator_hostnqn set"
            )
        sub = {
            "nqn": e["nqn"],
            # fstype: what the node makes on it, the one signature the target expects on its drive
            "namespaces": [{"nsid": n["nsid"], "device": n["device"], "uuid": n["uuid"], "fstype": n.get("fstype", "xfs")}
                           for n in e["namespaces"]],  # fmt: skip
            "allowed_hosts": [nqn],
        }
        if e.get("serial"):
            sub["serial"] = e["serial"]
        out.append(sub)
    return out


def target_host_secrets(exports, target, hostvars):
    """nvmeof_target_host_secrets of one target: for each node it exports to, the DH-HMAC-CHAP pair
    that node connects with (its nvmeof_initiator_dhchap_secret and _ctrl_secret), by its host NQN."""
    out = {}
    for e in _exports(exports, "target", target):
        node = hostvars[e["node"]] if e["node"] in hostvars else {}  # noqa: SIM401  (hostvars has no .get)
        nqn, secret = node.get("nvmeof_initiator_hostnqn"), node.get("nvmeof_initiator_dhchap_secret")
        if nqn and secret:
            ctrl = node.get("nvmeof_initiator_dhchap_ctrl_secret")
            out[nqn] = {"dhchap_key": secret, **({"dhchap_ctrl_key": ctrl} if ctrl else {})}
    return out


def target_ports(exports, target, netdevs, transport, service=4420):
    """nvmeof_target_ports of one target: one port per fabric netdev, exporting all its subsystems."""
    nqns = sorted(e["nqn"] for e in _exports(exports, "target", target))
    if not nqns:
        return []
    return [
        {"id": i + 1, "transport": transport, "address": _ip(nd["address"]), "service": int(service),
         "subsystems": nqns}
        for i, nd in enumerate(netdevs)
    ]  # fmt: skip


def initiator_targets(exports, node, hostvars, service=4420):
    """nvmeof_initiator_targets of one node: every port of each target that exports to it."""
    by_addr: dict[str, dict] = {}
    for e in _exports(exports, "node", node):
        netdevs = hostvars[e["target"]]["rdma_netdevs"] if e["target"] in hostvars else None
        if not netdevs:
            raise AnsibleFilterError(
                f"kvlab_store_exports: target {e['target']!r} of {e['nqn']} is not an inventory host with rdma_netdevs"
            )
        for nd in netdevs:
            t = by_addr.setdefault(_ip(nd["address"]), {"traddr": _ip(nd["address"]), "trsvcid": int(service),
                                                        "subsystems": []})  # fmt: skip
            t["subsystems"].append(e["nqn"])
    return [dict(t, subsystems=sorted(set(t["subsystems"]))) for _, t in sorted(by_addr.items())]


def initiator_filesystems(exports, node):
    """nvmeof_initiator_filesystems of one node: its namespaces, mounted by uuid."""
    return [
        {"namespace_uuid": n["uuid"], "path": n["path"], "fstype": n.get("fstype", "xfs"),
         "options": n.get("options", "noatime")}
        for e in _exports(exports, "node", node)
        for n in e["namespaces"]
    ]  # fmt: skip


class FilterModule:
    def filters(self):
        return {
            "kvlab_target_subsystems": target_subsystems,
            "kvlab_target_ports": target_ports,
            "kvlab_target_host_secrets": target_host_secrets,
            "kvlab_initiator_targets": initiator_targets,
            "kvlab_initiator_filesystems": initiator_filesystems,
        }
