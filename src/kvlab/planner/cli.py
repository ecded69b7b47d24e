"""`kvlab predict`: KV bytes, restore per tier, recompute and the bill for a model on a node;
`--calibrate RUN` fits the free constants on a run and predicts its cells."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.planner import node as node_mod
from kvlab.planner import restore as restore_mod
from kvlab.planner.bill import BillInputs
from kvlab.planner.calibrate import CONTENDED, CalibrationError, calibrate, cells
from kvlab.planner.geometry import DTYPE_BYTES
from kvlab.planner.modelconfig import ModelError, resolve
from kvlab.planner.predict import SCHEMA, Ask, answer
from kvlab.planner.recompute import DEFAULT_UTILISATION, flops_model
from kvlab.planner.render import cells_table, plot, table

NODE_FLAGS = {  # flag -> Node field (drive_*: the drive's)
    "gpus": int,
    "pcie_gbps": float,
    "nvlink_gbps": float,
    "host_copy_gbps": float,
    "nic_gbps": float,
    "drives": int,
    "drive_read_gbps": float,
    "drive_write_gbps": float,
    "drive_capacity_tb": float,
    "drive_dwpd": float,
    "gpu_tflops": float,
    "gpu_mem_gb": float,
    "dram_gb": float,
}


def _tokens(text: str) -> list[int]:
    try:
        out = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tokens {text!r}: comma-separated token counts, e.g. 1000,196000"
        ) from None
    if not out or any(n <= 0 for n in out):
        raise argparse.ArgumentTypeError(f"--tokens {text!r}: positive token counts")
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict", help="predict KV bytes, restore per tier, recompute and the bill (docs/planner.md)"
    )
    p.add_argument("--model", default="glm-5.3", help="a preset name, a config.json or a model folder")
    p.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), help="KV cache dtype (default: the model's)")
    p.add_argument("--with-mtp", action="store_true", help="count the MTP layer's KV too")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism")
    p.add_argument("--tokens", type=_tokens, help="prompt lengths, comma-separated (default 1000..196000)")
    p.add_argument("--node", help=f"a preset ({', '.join(node_mod.PRESETS)}) or a YAML of node fields")
    p.add_argument(
        "--inventory", help="a lab inventory (folder or hosts.yml): the node from --host's variables"
    )
    p.add_argument("--host", help="the inventory host")
    for flag, typ in NODE_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=typ, dest=flag, help=argparse.SUPPRESS)
    p.add_argument(
        "--tier", action="append", choices=restore_mod.TIERS, help="tiers to predict (default: all)"
    )
    p.add_argument(
        "--utilisation",
        type=float,
        default=DEFAULT_UTILISATION,
        help=f"prefill's share of the GPUs' peak FLOP/s (default {DEFAULT_UTILISATION})",
    )
    p.add_argument(
        "--restore-fixed-s", type=float, default=0.0, help="fixed cost per restore (default 0: physics only)"
    )
    p.add_argument("--in-flight", type=int, default=1, help="restores in flight sharing the links")
    p.add_argument("--tail-tokens", type=int, default=0, help="tokens past the last stored chunk, recomputed")
    p.add_argument(
        "--prompts", type=int, default=1, help="the working set: this many prompts of the longest length"
    )
    p.add_argument("--save-tokens-s", type=float, default=0.0, help="new tokens per second the cache saves")
    p.add_argument(
        "--weights-gb", type=float, help="the model's weights, GB (the GPU cache is what they leave)"
    )
    p.add_argument("--ring-gib", type=float, default=10.0, help="the connector's staging ring")
    p.add_argument(
        "--price-dram-gb", type=float, help="money per GB of DRAM (the bill prices only what you give)"
    )
    p.add_argument("--price-nvme-tb", type=float, help="money per TB of NVMe")
    p.add_argument("--calibrate", type=Path, metavar="RUN", help="fit on a run's records; predict its setups")
    p.add_argument("--json", action="store_true", help="print the answer as JSON (schema kvlab.predict/1)")
    p.add_argument("--explain", action="store_true", help="show the arithmetic")
    p.add_argument("--plot", type=Path, metavar="PNG", help="write TTFT against length per tier")
    p.set_defaults(func=main)


def _node(args: argparse.Namespace) -> node_mod.Node:
    if args.inventory:
        if not args.host:
            raise node_mod.NodeError(
                "--inventory needs --host (the inventory host whose variables describe the node)"
            )
        n = node_mod.from_inventory(args.inventory, args.host)
    else:
        n = node_mod.resolve(args.node)
    return n.with_overrides(**{k: getattr(args, k) for k in NODE_FLAGS})


def _calibrated(args: argparse.Namespace) -> int:
    cal = calibrate(args.calibrate)
    cs = cells(cal, args.tokens)
    out = {
        "schema": SCHEMA,
        "calibration": cal.to_dict(),
        "kv_bytes_per_token": cal.kv_bytes_per_token,
        "cells": cs,
        "note": "fitted on the run itself: in-sample where the run measured the cell",
    }
    if args.plot:  # the run's own lengths (measured beside predicted) and the asked ones
        lengths = sorted({n for _, _, n in cal.measured} | set(args.tokens or []))
        a = Ask(cal.geometry, None, 1, node_mod.PRESETS["cpu"], tuple(lengths), cal.prefill, tiers=())
        plot(answer(a), args.plot, cells(cal, lengths))
    if args.json:
        print(json.dumps(out))  # one line: scripts read the last JSON line
        return 0
    print(
        cells_table(
            cs,
            f"calibrated on {args.calibrate} ({cal.geometry.name}, {cal.kv_bytes_per_token:,} B/token; "
            f"prefill {cal.prefill.source}, {cal.prefill_points} requests)",
        )
    )
    busy = [c for c in cs if c.get("cpu_pressure", 0.0) > CONTENDED]
    if busy:
        print(
            f"  measured while other work wanted the CPUs (runnable tasks waited > {CONTENDED:.0%} of the time): "
            + ", ".join(f"{c['setup']} {c['tokens']:,} ({c['cpu_pressure']:.0%})" for c in busy)
        )
    print(f"  prefill regime: {cal.prefill.regime()}")
    if cal.prefill.memory:
        longest = max([n for _, _, n in cal.measured] + list(args.tokens or []))
        print(f"  {cal.prefill.memory.describe(cal.geometry, longest)}")
    for t in cal.tiers.values():
        print(
            f"  {t.setup} {t.tier}: fixed {t.fixed_s:.3f} s, effective {t.gbps or 0:.2f} GB/s of restored KV "
            f"(drive's fio limit {cal.drive_read_gbps or 0:.2f} GB/s), {t.points} requests"
        )
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def main(args: argparse.Namespace) -> int:
    from kvlab.cli import UserError

    try:
        if args.calibrate:
            return _calibrated(args)
        g = resolve(args.model)
        n = _node(args)
        tokens = tuple(args.tokens or [1000, 10000, 50000, 100000, 196000])
        fp8 = (args.kv_dtype or g.native_dtype) == "fp8"
        a = Ask(
            g,
            args.kv_dtype,
            args.tp,
            n,
            tokens,
            flops_model(n, args.utilisation, fp8=fp8),
            tiers=tuple(args.tier or (t for t in restore_mod.TIERS if n.gds or t != "nvme-gds")),
            fixed_s=args.restore_fixed_s,
            in_flight=args.in_flight,
            with_mtp=args.with_mtp,
            tail_tokens=args.tail_tokens,
            bill=BillInputs(
                prompt_tokens=max(tokens),
                prompts=args.prompts,
                save_tokens_s=args.save_tokens_s,
                weights_bytes=args.weights_gb * 1e9 if args.weights_gb else None,
                ring_bytes=args.ring_gib * 2**30,
                price_dram_gb=args.price_dram_gb,
                price_nvme_tb=args.price_nvme_tb,
            ),
        )
        ans = answer(a)
    except (ModelError, node_mod.NodeError, CalibrationError, ValueError) as e:
        raise UserError(str(e)) from None
    if args.plot:
        plot(ans, args.plot)
    if args.json:
        print(json.dumps(ans))  # one line: scripts read the last JSON line
        return 0
    if args.explain:
        print("\n".join(ans["explain"]))
        print(f"node: {node_mod.describe(n)}")
        print()
    print(table(ans))
    if args.plot:
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0
