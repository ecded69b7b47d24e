"""The `kvlab` command. Each area registers its own subcommands from its own module."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

# Modules with a `register(subparsers)` function; each adds its subcommands.
COMMAND_MODULES = [
    "kvlab.model",
    "kvlab.setups.cli",
    "kvlab.bench.demo",
    "kvlab.bench.connector",
    "kvlab.testbed.cli",
    "kvlab.images.cli",
    "kvlab.harness.cli",
]


class UserError(Exception):
    """A mistake the user can fix; printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _unwind_on_signals() -> None:
    """SIGTERM and SIGINT (ignored by default in background jobs) unwind the command, so that
    every engine, cache server or VM it started is stopped by its PID in a `finally`."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def main(argv: list[str] | None = None) -> int:
    from kvlab.setups.registry import SetupError

    parser = build_parser()
    args = parser.parse_args(argv)
    _unwind_on_signals()
    try:
        return int(args.func(args) or 0)
    except (UserError, SetupError) as e:
        print(f"kvlab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
