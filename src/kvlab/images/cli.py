"""`kvlab image build|path|identity NAME [--flavor F]`: every image through one orchestrator."""

from __future__ import annotations

import argparse
import sys

from kvlab.images import ImageError, build


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "image", help="build images (testbed, target, serve) named by the hash of their inputs"
    )
    s.set_defaults(func=lambda _a: s.print_help() or 2)
    ss = s.add_subparsers(dest="image_command", metavar="ACTION")
    b = ss.add_parser(
        "build",
        help="build afresh; fail if it differs from the cached build of the same inputs (diffoscope says where)",
    )
    _name_args(b)
    b.add_argument(
        "--repin",
        action="store_true",
        help="re-resolve the package lock(s) from the mirror, with each .deb's sha256, instead of building",
    )
    b.set_defaults(func=_build)
    e = ss.add_parser(
        "ensure", help="the cached build (built if missing); prints the same last line as build"
    )
    _name_args(e)
    e.set_defaults(func=_ensure)
    i = ss.add_parser(
        "identity", help="print the image's identity (the hash of its inputs) and its store path"
    )
    _name_args(i)
    i.set_defaults(func=_identity)


def _name_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(build.REGISTRY), help="which image")
    p.add_argument("--flavor", default=None, help="the image's flavour (default: its first, e.g. serve: cpu)")


def _errors(fn):
    def wrapped(args):
        from kvlab.cli import UserError

        try:
            return fn(args)
        except ImageError as e:
            raise UserError(str(e)) from e

    return wrapped


@_errors
def _build(args) -> int:
    if args.repin:
        p = build.plan(args.name, args.flavor)
        if not hasattr(p.module, "repin"):
            raise ImageError(f"image {args.name}: its builder has no package lock to re-pin")
        p.module.repin(p.flavor, build._stderr_log)
        return 0
    store = build.build(args.name, args.flavor)
    print(build.final_line(args.name, store))
    return 0


@_errors
def _ensure(args) -> int:
    store = build.ensure(args.name, args.flavor)
    print(build.final_line(args.name, store))
    return 0


@_errors
def _identity(args) -> int:
    p = build.plan(args.name, args.flavor)
    print(f"{p.identity} {p.store}", file=sys.stdout)
    return 0
