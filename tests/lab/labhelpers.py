"""Helpers of the lab suite (conftest.py holds its fixtures)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_filter(role: str, module: str):  # type: ignore[no-untyped-def]
    """A role's filter plugin module (the parsers the roles decide with)."""
    path = ROOT / "roles" / role / "filter_plugins" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"kvlab_lab_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def host_name(host) -> str:  # type: ignore[no-untyped-def]
    return host.backend.get_hostname()
