"""The packages a role installs, from its vars/<OS>.yml, and apt-cache's answer about them."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError


def package_pins_role_packages(os_vars: dict, role: str, hostvars: dict) -> list[str]:
    """Every package name a role's vars/<OS>.yml pins, as the role picks them for this host
    (rdma: the base packages, then the inbox stack or the DOCA-OFED profile)."""
    if role == "rdma":
        stack = hostvars.get("rdma_stack", "inbox")
        names = list(os_vars.get("__rdma_base_packages", {}))
        if stack == "inbox":
            names += list(os_vars.get("__rdma_inbox_packages", {}))
        else:
            names += [hostvars.get("rdma_doca_profile", "doca-ofed")]
            names += hostvars.get("rdma_doca_storage_packages", ["mlnx-nvme-dkms", "mlnx-fw-updater"])
        return names
    key = f"__{role}_packages"
    if key not in os_vars:
        raise AnsibleFilterError(f"package_pins: roles/{role}/vars has no {key} for this OS")
    return list(os_vars[key])


def package_pins_apt_show(text: str) -> dict:
    """`apt-cache show --no-all-versions` stanzas -> {package: {version, sha256}}."""
    out: dict = {}
    for stanza in text.strip().split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            if line[:1] not in (" ", "") and ":" in line:
                k, _, v = line.partition(":")
                fields[k] = v.strip()
        if "Package" in fields and "Version" in fields:
            out[fields["Package"]] = {"version": fields["Version"], "sha256": fields.get("SHA256", "")}
    return out


def package_pins_apt_simulated(text: str) -> dict:
    """`apt-get --simulate install` output -> {package: version} of every package it would install
    ("Inst NAME (VERSION RELEASE [ARCH])"; a "[OLD]" before the parenthesis is an upgrade)."""
    out: dict = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "Inst":
            version = next((p for p in parts[2:] if p.startswith("(")), "")[1:]
            if version:
                out[parts[1]] = version
    return out


class FilterModule:
    def filters(self):
        return {
            "package_pins_role_packages": package_pins_role_packages,
            "package_pins_apt_show": package_pins_apt_show,
            "package_pins_apt_simulated": package_pins_apt_simulated,
        }
