"""Filters that render vLLM's systemd units from kvlab's setup registry.

The registry (src/kvlab/setups.py) is the one source of engine command lines: the role
never restates a flag. These filters run on the controller, from the checkout the role
lives in, so a plan or a deploy renders exactly what `kvlab setup render` prints there.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

_SRC = Path(__file__).resolve().parents[3] / "src"
# systemd splits ExecStart= on whitespace, expands %specifiers and $VARIABLES: anything
# beyond these characters is double-quoted with C escapes.
_BARE = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")


def _registry():
    # The registry of this checkout, not whatever kvlab another environment installed.
    if _SRC.is_dir() and str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))
    try:
        from kvlab import setup_cli, setups
    except ImportError as e:  # pragma: no cover - a broken checkout
        raise AnsibleFilterError(
            f"kvlab_setup_render: cannot import kvlab's setup registry from {_SRC} ({e}): "
            "run Ansible from the repository's .venv (make setup)"
        ) from None
    return setups, setup_cli


def kvlab_setup_render(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The Deployment of setup `name` for engine parameters `params`, as a plain dict."""
    setups, setup_cli = _registry()
    try:
        deployment = setups.render(str(name), setup_cli.params_from_mapping(dict(params)))
    except setups.SetupError as e:
        raise AnsibleFilterError(f"vllm_server_setups: {e}") from None
    except TypeError as e:
        raise AnsibleFilterError(f"vllm_server engine parameters: {e}") from None
    return dataclasses.asdict(deployment)


def kvlab_setup_names(_: Any = None) -> list[str]:
    """Every setup the registry knows (for validation messages)."""
    setups, _cli = _registry()
    return sorted(setups.REGISTRY)


def systemd_escape_arg(value: Any) -> str:
    """One argument or assignment as systemd reads it back verbatim."""
    text = str(value).replace("%", "%%").replace("$", "$$")
    if _BARE.match(text):
        return text
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{text}"'


def systemd_unit_safe(name: str) -> str:
    """A setup name as a unit name may spell it (systemd allows A-Z a-z 0-9 : _ . - only):
    'lmcache-mp+kvlab' -> 'lmcache-mp_kvlab'."""
    return re.sub(r"[^A-Za-z0-9:_.-]", "_", str(name))


def systemd_exec(argv: list[Any]) -> str:
    """An ExecStart= value for argv: argv[0] must be an absolute path."""
    if not argv or not str(argv[0]).startswith("/"):
        raise AnsibleFilterError(
            f"systemd_exec: the first argument must be an absolute path, got {argv[:1]!r}: "
            "set vllm_server_venv to an absolute folder"
        )
    return " ".join(systemd_escape_arg(a) for a in argv)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "kvlab_setup_render": kvlab_setup_render,
            "kvlab_setup_names": kvlab_setup_names,
            "systemd_escape_arg": systemd_escape_arg,
            "systemd_exec": systemd_exec,
            "systemd_unit_safe": systemd_unit_safe,
        }
