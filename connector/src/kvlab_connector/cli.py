"""`kvlab-store` / `python -m kvlab_connector.cli`: the store's benchmark where the connector runs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kvlab_connector.bench import clear, run_store
from kvlab_connector.config import positive_int


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvlab-store", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="write then read objects through the store; GB/s")
    b.add_argument("--path", action="append", required=True, type=Path, help="a drive's directory (repeat per drive)")
    b.add_argument("--size-mib", type=positive_int, default=1024)
    b.add_argument("--threads", type=positive_int, default=None,
                   help="I/O threads over all drives (default: 8 per drive)")
    b.add_argument("--ring-mib", type=positive_int, default=256)
    b.add_argument("--verify", action="store_true", help="compare every byte read with what was written")
    b.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        run = run_store(args.path, args.size_mib, ring_mib=args.ring_mib, threads=args.threads, verify=args.verify)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"kvlab-store: {e}", file=sys.stderr)
        return 1
    finally:
        clear(args.path)
    if args.json:
        print(json.dumps(asdict(run)))
    else:
        print(f"write {run.write_gbps:.2f} GB/s, read {run.read_gbps:.2f} GB/s, {run.bytes / 2**20:.0f} MiB, "
              f"{run.objects} objects, io {run.io_mode}, verified {run.verified}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
