"""`kvlab setup list|render`: the setup registry as the Ansible serving role and people see it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from kvlab.setups import registry as setups


def params_from_mapping(values: dict[str, Any]) -> setups.EngineParams:
    """EngineParams from a JSON/YAML mapping; unknown keys are a user error naming the key."""
    fields = {f.name: f for f in dataclasses.fields(setups.EngineParams)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise setups.SetupError(
            f"unknown engine parameter(s) {', '.join(unknown)}: valid ones are {', '.join(sorted(fields))}"
        )
    if "model" not in values:
        raise setups.SetupError("engine parameters need 'model': the model folder the engine serves")
    clean = dict(values)
    for key in ("kv_store_paths", "extra_engine_args"):
        if key in clean:
            clean[key] = tuple(clean[key])
    return setups.EngineParams(**clean)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("setup", help="the registry of KV setups")
    s = p.add_subparsers(dest="setup_command", required=True)
    ls = s.add_parser("list", help="list the setups and where they run")
    ls.set_defaults(func=_list)
    r = s.add_parser("render", help="print the processes a setup starts, as JSON")
    r.add_argument("name", help="setup name (see `kvlab setup list`)")
    r.add_argument("--params", required=True, help="JSON object of engine parameters (EngineParams fields)")
    r.set_defaults(func=_render)


def _list(args: argparse.Namespace) -> int:
    for name, setup in sorted(setups.REGISTRY.items()):
        print(f"{name:22s} {'/'.join(setup.devices):10s} {setup.description}")
    return 0


def _render(args: argparse.Namespace) -> int:
    try:
        values = json.loads(args.params)
    except json.JSONDecodeError as e:
        raise setups.SetupError(f"--params is not valid JSON ({e}): pass a JSON object") from None
    print(setups.render(args.name, params_from_mapping(values)).to_json())
    return 0
