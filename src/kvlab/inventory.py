"""An Ansible inventory read the way ansible-playbook reads it, without contacting any host.

`make verify` uses it to see, before any test connects, which hosts each suite's group holds
and what the inventory declares for them (kvlab_gpus_expected); the unit tests use it to check
both inventories against the roles' argument specs. Values are rendered by Ansible's own
templating, with this checkout's filters (plugins/filter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab import paths


class InventoryError(Exception):
    """An inventory that cannot be read; the message names the file."""


@dataclass
class Inventory:
    path: Path
    _inv: Any = field(repr=False)
    _vm: Any = field(repr=False)
    _loader: Any = field(repr=False)

    def hosts(self, pattern: str) -> list[str]:
        return sorted(h.name for h in self._inv.get_hosts(pattern))

    def groups(self) -> dict[str, Any]:
        return self._inv.groups

    def vars(self, host: str) -> dict[str, Any]:
        """Every variable of a host, unrendered (as Ansible merges them)."""
        return self._vm.get_vars(host=self._inv.get_host(host), include_hostvars=True)

    def render(self, host: str, names: list[str] | None = None) -> dict[str, Any]:
        """The host's variables named (all it defines if None), rendered as a play on it would."""
        v = self.vars(host)
        templar = self._templar(v)
        keys = [n for n in (names if names is not None else list(v)) if n in v]
        return {k: _plain(templar.template(v[k])) for k in keys}

    def template(self, host: str, value: str) -> Any:
        """A template string of this repository's (a role's default, say) rendered with the
        host's variables, as a play on it would: trusted, as Ansible trusts what it loads from
        a role."""
        from ansible.template import trust_as_template

        return _plain(self._templar(self.vars(host)).template(trust_as_template(value)))

    def _templar(self, variables: dict[str, Any]) -> Any:
        from ansible.template import Templar

        return Templar(loader=self._loader, variables=variables)


def _plain(value: Any) -> Any:
    """Ansible's tagged values as plain Python (lists, dicts, str, int, bool)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool | int | float) or value is None:
        return value
    return str(value)


def load(path: Path | str, vault_password_file: Path | str | None = None) -> Inventory:
    path = Path(path)
    if not path.is_file():
        raise InventoryError(f"{path}: no such inventory file")
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.parsing.vault import VaultSecret
    from ansible.plugins.loader import filter_loader
    from ansible.vars.hostvars import HostVars
    from ansible.vars.manager import VariableManager

    filter_loader.add_directory(str(paths.repo_root() / "plugins" / "filter"))
    loader = DataLoader()
    if vault_password_file is None and (path.parent / "vault-password.example").is_file():
        vault_password_file = path.parent / "vault-password.example"
    if vault_password_file is not None:
        secret = Path(vault_password_file).read_bytes().strip()
        loader.set_vault_secrets([("default", VaultSecret(secret))])
    inv = InventoryManager(loader=loader, sources=[str(path)])
    if not inv.hosts and not inv.groups.get("all", None):
        raise InventoryError(f"{path}: Ansible parsed no inventory from it")
    vm = VariableManager(loader=loader, inventory=inv)
    HostVars(inventory=inv, variable_manager=vm, loader=loader)  # registers itself: templates see hostvars
    return Inventory(path=path, _inv=inv, _vm=vm, _loader=loader)
