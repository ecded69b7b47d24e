"""A campaign report carries the planner's predicted-vs-measured table, fitted on the run
itself and labelled in-sample; the summary (kvlab.summary/5) validates with it."""

from __future__ import annotations

import json
from pathlib import Path

from test_planner_fit import TRUE_CURVE, G, records, restore_ttft, restored

from kvlab.harness import results
from kvlab.harness.report import render_run
from kvlab.harness.summary import validate
from kvlab.planner.presets import SWEEP_TINY

ROOT = Path(__file__).resolve().parents[2]


def write_run(tmp_path: Path, provenance: dict) -> Path:
    w = results.RunWriter(tmp_path / "runs", "r1")
    w.write_once(results.CAMPAIGN, (ROOT / "campaigns/embedded-sweep.yml").read_bytes())
    w.write_once(results.PROVENANCE, json.dumps(provenance))
    for r in records([100, 1000, 10000, 50000]):
        w.append(r)
    n = 4098  # the restore scenario's cells: kvlab's warm restores, baseline's recompute reference
    for i in range(3):
        w.append(
            {
                "kind": "request",
                "scenario": "restore",
                "phase": "warm",
                "repeat": i,
                "setup": "kvlab",
                "tokens": n,
                "prompt_tokens": n,
                "cached_tokens": restored(n),
                "ttft_s": restore_ttft(n) + 0.01,
            }
        )
        w.append(
            {
                "kind": "request",
                "scenario": "restore",
                "phase": "recompute",
                "repeat": i,
                "setup": "baseline",
                "tokens": n,
                "prompt_tokens": n,
                "cached_tokens": 0,
                "ttft_s": TRUE_CURVE.time(G, n),
            }
        )
    w.close()
    return tmp_path / "runs" / "r1"


def test_report_has_the_in_sample_table(tmp_path: Path) -> None:
    run = write_run(tmp_path, {"model": {"kind": "tiny", "seed": 0, "geometry": SWEEP_TINY}})
    _, md = render_run(run)
    text = md.read_text()
    assert "## Predicted against measured (the restore planner, in-sample)" in text
    assert "In-sample: fitted on this run's own records" in text
    assert "| kvlab | sweep | 50000 |" in text and "| kvlab | warm | 4098 |" in text
    obj = json.loads((md.parent / "summary.json").read_text())
    assert obj["schema"] == "kvlab.summary/5"
    p = validate(obj).predicted
    assert p is not None and p.error is None and p.kv_bytes_per_token == 1024
    cell = next(c for c in p.cells if (c.setup, c.tier, c.tokens) == ("kvlab", "sweep", 50000))
    assert abs(cell.error) < 1e-6  # the synthetic run is the planner's own shape
    assert {(f.setup, f.tier) for f in p.fits} == {("kvlab", "sweep"), ("kvlab", "warm")}


def test_a_run_without_geometry_says_why(tmp_path: Path) -> None:
    run = write_run(tmp_path, {"model": {"kind": "path", "path": str(tmp_path / "absent")}})
    _, md = render_run(run)
    assert "no fit: run r1: its provenance names no model geometry" in md.read_text()
