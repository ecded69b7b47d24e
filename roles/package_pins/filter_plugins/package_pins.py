"""The packages a role installs, from its vars/<OS>.yml, and apt-cache's answer about them."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError


def package_pins_role_packages(os_vars: dict, role: str, hostvars: dict) -> list[str]:
    """Every package name a role's vars/<OS>.yml pins, as the role picks them for this host
    (rdma: the base packages, then the inbox stack or the DOCA-OFED profile)."""
    if role == "rdma":
        stack = hostvars.get("rdma_stack", "inbox")
        names = list(os_vars.get("__rdma_base_packages", {}))
        names += list(os_vars.get("__rdma_inbox_packages", {})) if stack == "inbox" else [hostvars.get("rdma_doca_profile", "doca-ofed")]
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


class FilterModule:
    def filters(self):
        return {"package_pins_role_packages": package_pins_role_packages, "package_pins_apt_show": package_pins_apt_show}
