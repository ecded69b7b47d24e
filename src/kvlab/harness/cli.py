"""`kvlab campaign run|compare|validate|plan|files` and `kvlab report RUN... [--summary-json]`.

`campaign run FILE [--engine local|container|systemd --endpoint URL] [--runs-dir DIR]`: local engines
(the default), the same engines from the CPU serving image (container), or, on a lab node, the
vllm_server role's systemd units (roles/bench_runner).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.harness import campaign as campaign_mod
from kvlab.harness.errors import InputError

if TYPE_CHECKING:
    from kvlab.harness.plan import Plan
    from kvlab.harness.runner import Engines


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("campaign", help="run, validate or plan a benchmark campaign (campaigns/*.yml)")
    s = p.add_subparsers(dest="campaign_command", required=True)
    v = s.add_parser("validate", help="check campaign files against the schema")
    v.add_argument("files", nargs="+", type=Path)
    v.set_defaults(func=_validate)
    pl = s.add_parser("plan", help="print the plan (engine lives, steps) and a time estimate")
    pl.add_argument("file", type=Path)
    _drives_option(pl)
    pl.set_defaults(func=_plan)
    f = s.add_parser("files", help="list the files a campaign refers to (traces), with their sha256: what "
                                   "roles/bench_runner ships beside it")
    f.add_argument("file", type=Path)
    f.add_argument("--json", action="store_true", help="the campaign and its files as JSON (src, dest, sha256)")
    f.set_defaults(func=_files)
    r = s.add_parser("run", help="run a campaign end to end and write results/runs/<run-id>/ with its report")
    r.add_argument("file", type=Path)
    r.add_argument("--dry-run", action="store_true", help="print the plan and an estimate; start nothing")
    r.add_argument("--runs-dir", "--results", dest="runs_dir", type=Path, default=Path("results/runs"),
                   help="runs folder (default results/runs)")
    r.add_argument("--engine", choices=("local", "container", "systemd"), default="local",
                   help="local: start the engines here (default); container: start them here from the CPU "
                        "serving image (images/serve, built once per set of inputs, podman); systemd: drive "
                        "the units the vllm_server role installed on this node (needs --endpoint)")
    r.add_argument("--endpoint", help="with --engine systemd: the engine's base URL as this node reaches it")
    r.add_argument("--keep-stores", action="store_true", help="keep the setups' KV stores after the run")
    _drives_option(r)
    r.add_argument("--no-report", action="store_true", help="write the raw results only")
    r.set_defaults(func=_run)

    cmp = s.add_parser("compare", help="run a campaign under two engine controls, interleaved: the same "
                                       "restored tokens? restore TTFT of the second over the first")
    cmp.add_argument("file", type=Path)
    cmp.add_argument("--engines", default="local,container",
                     help="two engine controls, A,B (default local,container): B's TTFT is divided by A's")
    cmp.add_argument("--repeats", type=int, default=3, help="runs per control, interleaved (ABBA...)")
    cmp.add_argument("--runs-dir", "--results", dest="runs_dir", type=Path, default=Path("results/runs"))
    cmp.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    cmp.set_defaults(func=_compare)

    rep = sub.add_parser("report", help="render a campaign run's tables and plots; several runs side by side")
    rep.add_argument("runs", nargs="+", type=Path, help="results/runs/<run-id> (or results/runs/latest)")
    rep.add_argument("--summary-json", action="store_true", help="print the summary (kvlab.summary/5) as JSON")
    rep.add_argument("--out", type=Path, help="where a side-by-side report of several runs goes")
    rep.add_argument("--check", action="store_true", help="validate each run's report/summary.json against the schema")
    rep.set_defaults(func=_report)


def _drives_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drives", metavar="JSON",
                   help="the drives this node's store is on, as a campaign's `drives` (model, count, capacity_tb, "
                        "dwpd or tbw, warranty_years): the run's wear is projected onto them instead of the "
                        "campaign's (roles/bench_runner passes the lab inventory's kvlab_store_drive)")


def _with_drives(c: campaign_mod.Campaign, drives: str | None) -> campaign_mod.Campaign:
    """The campaign with --drives in place of its own `drives`; a wrong one names the field."""
    from pydantic import ValidationError

    from kvlab.cli import UserError

    if drives is None:
        return c
    try:
        spec = campaign_mod.DrivesSpec.model_validate(json.loads(drives))
    except json.JSONDecodeError as e:
        raise UserError(f"--drives: not JSON ({e.msg}): give e.g. "
                        '\'{"count": 4, "capacity_tb": 7.68, "dwpd": 1.0}\'') from None
    except ValidationError as e:
        raise UserError(campaign_mod.one_line("--drives", e)) from None
    return c.model_copy(update={"drives": spec})


def _load(path: Path) -> tuple[campaign_mod.Campaign, str]:
    from kvlab.cli import UserError

    try:
        return campaign_mod.load(path)
    except campaign_mod.CampaignError as e:
        raise UserError(str(e)) from None


def _validate(args: argparse.Namespace) -> int:
    for f in args.files:
        c, sha = _load(f)
        print(f"{f}: ok ({c.name}: {len(c.setups)} setups, device {c.device}, sha256 {sha[:12]})")
    return 0


def _files(args: argparse.Namespace) -> int:
    from kvlab.cli import UserError

    try:
        ship = campaign_mod.shipment(args.file)
    except campaign_mod.CampaignError as e:
        raise UserError(str(e)) from None
    if args.json:
        print(json.dumps(ship, indent=2))
    else:
        for f in [ship["campaign"], *ship["files"]]:
            print(f"{f['field']}: {f['dest']} <- {f['src']} (sha256 {f['sha256']})")
    return 0


def _compile(path: Path, drives: str | None = None) -> tuple[Plan, str]:
    """The campaign file's plan (the compiler is the only reader of a campaign) and its sha256."""
    from kvlab.cli import UserError
    from kvlab.harness.compiler import compile_campaign

    c, sha = _load(path)
    c = _with_drives(c, drives)
    try:
        return compile_campaign(c, path.parent), sha
    except InputError as e:
        raise UserError(str(e)) from None


def _plan(args: argparse.Namespace) -> int:
    from kvlab.harness.plan import render_plan

    plan, _ = _compile(args.file, args.drives)
    print(render_plan(plan))
    return 0


def _run(args: argparse.Namespace) -> int:
    from kvlab.cli import UserError

    engines = _engines(args)
    if args.dry_run:
        return _plan(args)
    from kvlab.harness.report import render_run
    from kvlab.harness.runner import run_plan

    plan, sha = _compile(args.file, args.drives)
    t0 = time.monotonic()
    try:
        run_dir = run_plan(plan, args.file, sha, args.runs_dir, keep_stores=args.keep_stores, engines=engines)
    except InputError as e:
        raise UserError(str(e)) from None
    print(f"campaign {plan.campaign}: {time.monotonic() - t0:.0f} s; results in {run_dir}", file=sys.stderr)
    if not args.no_report:
        _, md = render_run(run_dir)
        print(f"report: {md}", file=sys.stderr)
        print(md.read_text())
    return 0


def _compare(args: argparse.Namespace) -> int:
    from kvlab.cli import UserError
    from kvlab.harness import compare
    from kvlab.harness.progress import note
    from kvlab.harness.runner import LocalEngines

    controls = [x.strip() for x in args.engines.split(",")]
    if len(controls) != 2 or len(set(controls)) != 2 or not set(controls) <= {"local", "container"}:
        raise UserError(f"--engines {args.engines}: give two different controls of local and container "
                        "(e.g. --engines local,container)")
    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}: give 1 or more (3 or more for quartiles)")
    _load(args.file)  # a bad campaign is named before any image is built

    def engines_for(control: str) -> Engines:
        if control == "local":
            return LocalEngines()
        from kvlab.engines.container import ContainerEngines

        return ContainerEngines("cpu")

    out = compare.compare(args.file, controls, args.repeats, args.runs_dir, engines_for, note)
    a, b = controls
    if args.json:
        print(json.dumps(out))
    else:
        for name, t in out["restore_ttft"].items():
            print(f"{name}: {b} {t[f'{b}_ttft_s']:.3f} s, {a} {t[f'{a}_ttft_s']:.3f} s: {b}/{a} "
                  f"{t[f'{b}_over_{a}']:.2f} ({t['q1']:.2f}-{t['q3']:.2f}, {t['repeats']} repeats)")
        print(f"same restored tokens: {out['same_restored_tokens']}; report {out['report']}")
    if not out["same_restored_tokens"]:
        print(f"{b} and {a} restored or answered different tokens: {out['token_differences'][:3]}",
              file=sys.stderr)
        return 1
    return 0


def _engines(args: argparse.Namespace) -> Engines | None:
    """The engine controller the options choose (None: the runner's local default); a wrong
    combination is a one-line error, also with --dry-run."""
    from urllib.parse import urlparse

    from kvlab.cli import UserError

    if args.engine in ("local", "container"):
        if args.endpoint:
            raise UserError(f"--endpoint is for --engine systemd ({args.engine} engines listen on ports the "
                            "harness chooses): drop --endpoint, or add --engine systemd")
        if args.engine == "local":
            return None
        if args.dry_run:
            return None  # a plan starts nothing: no image to build or load
        from kvlab.engines.container import ContainerEngines

        return ContainerEngines("cpu")
    if not args.endpoint:
        raise UserError("--engine systemd needs --endpoint URL, the engine's base URL as this node "
                        "reaches it (e.g. --endpoint http://127.0.0.1:8000)")
    url = urlparse(args.endpoint)
    if url.scheme != "http" or not url.hostname or not url.port or url.path not in ("", "/"):
        raise UserError(f"--endpoint {args.endpoint}: give the engine's base URL as http://HOST:PORT "
                        "(e.g. http://127.0.0.1:8000)")
    from kvlab.engines.systemd import SystemdEngines

    return SystemdEngines(args.endpoint)


def _report(args: argparse.Namespace) -> int:
    from kvlab.cli import UserError
    from kvlab.harness.report import load_run, render, render_run
    from kvlab.harness.summary import SCHEMA, to_json_obj, validate

    runs = []
    for r in args.runs:
        try:
            if len(args.runs) == 1 and not args.out:
                run, md = render_run(r)
            else:
                run, md = load_run(r), None
            if args.check:
                # the summary as written in report/ (regenerated just above for a single run)
                validate(json.loads((r / "report" / "summary.json").read_text()))
                print(f"{r}: report/summary.json validates against {SCHEMA}", file=sys.stderr)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise UserError(str(e)) from None
        except ValueError as e:
            raise UserError(f"{r}: report/summary.json does not validate: {str(e).splitlines()[0]}") from None
        runs.append(run)
        if args.summary_json:
            print(json.dumps(to_json_obj(run.summary), separators=(",", ":")))
    if len(runs) > 1 or args.out:
        out = args.out or Path("results/reports") / time.strftime("%Y%m%d-%H%M%S")
        md = render(runs, out)
    if not args.summary_json:
        print(md.read_text())
        print(f"report: {md}", file=sys.stderr)
    return 0
