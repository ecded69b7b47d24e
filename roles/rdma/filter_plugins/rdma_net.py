"""Address checks for the rdma role's inputs (Python's ipaddress: no netaddr on the controller)."""

from __future__ import annotations

import ipaddress


def rdma_in_subnet(address: str, cidr: str) -> bool:
    """An interface address in CIDR form ("192.168.100.11/24") lies inside a subnet ("192.168.100.0/24")."""
    try:
        iface = ipaddress.ip_interface(address)
        return iface.ip in ipaddress.ip_network(cidr) and iface.network.prefixlen == ipaddress.ip_network(cidr).prefixlen
    except ValueError:
        return False


class FilterModule:
    def filters(self):
        return {"rdma_in_subnet": rdma_in_subnet}
