"""Run one engine life of tests/engine/probe.py and read what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROBE = Path(__file__).with_name("probe.py")


@dataclass
class ProbeRun:
    result: dict
    blocks: dict[str, np.ndarray]

    def round(self, r: int) -> dict:
        return self.result["rounds"][r]

    def saved(self, r: int, key: str) -> np.ndarray:
        return self.blocks[f"r{r}-save-{key}"]

    def loaded(self, r: int, key: str) -> np.ndarray:
        return self.blocks[f"r{r}-load-{key}"]


def answer_difference(got: dict, want: dict) -> str:
    """Where two rounds' greedy outputs part, with the two likeliest tokens and their logprobs
    at that position in each: a tie within a rounding step reads differently from wrong KV."""
    pos = next((i for i, (a, b) in enumerate(zip(got["output"], want["output"], strict=True)) if a != b), None)
    if pos is None:
        return "the same output"
    return (f"outputs part at position {pos}: {got['output']} against {want['output']}; "
            f"top two there {got['top2'][pos]} against {want['top2'][pos]}")


def run_probe(out: Path, model: Path, store: Path, *extra: str, timeout: int = 600) -> ProbeRun:
    """One engine life in its own process: a restart is simply the next call."""
    cmd = [sys.executable, str(PROBE), "--model", str(model), "--store", str(store), "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"probe failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(Path(str(out) + ".json").read_text())
    with np.load(str(out) + ".npz") as z:
        blocks = {k: z[k] for k in z.files}
    return ProbeRun(result, blocks)
