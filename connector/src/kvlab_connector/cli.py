"""`kvlab-store` / `python -m kvlab_connector.cli`: the store's benchmark and its check at rest,
where the connector runs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kvlab_connector.bench import KEPT_NS, NS, clear, run_store
from kvlab_connector.config import positive_int
from kvlab_connector.fsck import CannotCheck, as_json, fsck, terminal_progress


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
    b.add_argument("--keep", action="store_true",
                   help=f"leave the objects on the drives, in a namespace of their own ({KEPT_NS}): a store "
                        "filled for fsck, eviction or restart drills")
    b.add_argument("--json", action="store_true")
    f = sub.add_parser("fsck", help="verify every object at rest; exit 0 clean, 1 damage found, 2 could not check")
    f.add_argument("--path", action="append", required=True, type=Path,
                   help="a drive's directory, as the store was given it (repeat per drive)")
    f.add_argument("--repair", action="store_true",
                   help="remove the damaged objects and orphaned temporary files (never a foreign file) and "
                        "set the ledger's usage to what stays")
    f.add_argument("--rate-mib-s", type=positive_int, default=256,
                   help="read at most this many MiB/s, so that engines beside it keep the drives (default 256)")
    f.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.cmd == "fsck":
        return _fsck(args)
    try:
        run = run_store(args.path, args.size_mib, ring_mib=args.ring_mib, threads=args.threads, verify=args.verify,
                        ns=KEPT_NS if args.keep else NS)  # fmt: skip
    except (OSError, RuntimeError, ValueError) as e:
        print(f"kvlab-store: {e}", file=sys.stderr)
        return 1
    finally:
        clear(args.path)
    if args.json:
        print(json.dumps(asdict(run)))
    else:
        print(f"write {run.write_gbps:.2f} GB/s, read {run.read_gbps:.2f} GB/s, {run.bytes / 2**20:.0f} MiB, "
              f"{run.objects} objects, io {run.io_mode}, verified {run.verified}"
              + (f", kept in namespace {KEPT_NS}" if args.keep else ""))
    return 0


def _fsck(args: argparse.Namespace) -> int:
    progress = terminal_progress if sys.stderr.isatty() else None
    try:
        report = fsck(args.path, repair=args.repair, bytes_per_s=args.rate_mib_s << 20, progress=progress)
    except CannotCheck as e:
        print(f"kvlab-store fsck: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_json(report)))
    else:
        kinds = ", ".join(f"{k} {n}" for k, n in report.damage.items() if n) or "none"
        print(f"{report.objects} objects, {report.bytes / 2**20:.0f} MiB in {len(report.namespaces)} namespace(s); "
              f"damaged {report.damaged} ({kinds}); orphaned files {report.orphaned_files}, foreign files "
              f"{report.foreign_files}; in flight {report.in_flight}; {report.seconds:.1f} s")
        for key in report.damaged_keys:
            print(f"damaged: {key}")
        if report.repaired:
            print(f"repaired: removed {report.removed_objects} objects ({report.removed_files} files); "
                  f"usage now {report.usage_bytes} bytes")
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
