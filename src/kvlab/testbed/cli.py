"""`kvlab testbed up|down|status`: the VM testbed from the command line (its image: `kvlab image build testbed`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.images import ImageError
from kvlab.testbed import testbed, vm


class _Fail(Exception):
    pass


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testbed", help="the VM testbed (storage target + node over NVMe-oF)")
    s = p.add_subparsers(dest="testbed_command", required=True)

    u = s.add_parser("up", help="boot the VMs from the cached image; write their SSH ports beside inventories/testbed/hosts.yml")
    u.add_argument(
        "--transport",
        choices=testbed.TRANSPORTS,
        default="rdma",
        help="fabric transport the roles set up and verification asserts (default rdma)",
    )
    u.add_argument("--name", default="default", help="testbed name (state under kvlab's state folder)")
    u.add_argument(
        "--inventory",
        type=Path,
        help="an inventory's hosts.yml: the committed testbed inventory is copied there and the run-time "
        "values written beside it (default: beside inventories/testbed/hosts.yml itself)",
    )
    u.set_defaults(func=_up)

    d = s.add_parser("down", help="stop the VMs by PID (console logs are kept)")
    d.add_argument("--name", default="default")
    d.set_defaults(func=_down)

    st = s.add_parser("status", help="each VM and the node's NVMe controllers")
    st.add_argument("--name", default="default")
    st.add_argument("--json", action="store_true", help="one JSON object on stdout")
    st.set_defaults(func=_status)


def _errors(fn):
    def wrapped(args):
        from kvlab.cli import UserError

        try:
            return fn(args)
        except (testbed.TestbedError, ImageError, vm.VMError) as e:
            raise UserError(str(e)) from e

    return wrapped


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@_errors
def _up(args) -> int:
    testbed.up(args.name, transport=args.transport, inventory_path=args.inventory, log=_log)
    return 0


@_errors
def _down(args) -> int:
    testbed.down(args.name, log=lambda msg: print(msg, file=sys.stderr))
    return 0


@_errors
def _status(args) -> int:
    st = testbed.status(args.name)
    if args.json:
        print(json.dumps(st, sort_keys=True))
        return 0
    if not st["machines"]:
        print(f"testbed {args.name}: down")
        return 0
    print(f"testbed {args.name}: transport {st['transport']}, image {st['image']}")
    for m in st["machines"]:
        state = "running" if m["running"] else "stopped"
        print(
            f"  {m['name']:<7} {state} pid {m['pid']} ssh 127.0.0.1:{m['ssh_port']} console {m['console_log']}"
        )
        for c in m.get("nvme_controllers", []):
            print(
                f"    {c['name']} {c['transport']} {c['state']} {c['address'].get('traddr', '')} {c['subsysnqn']}"
            )
    return 0
