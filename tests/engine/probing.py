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


# The CPU engine's logits come in steps of 2**-7 (bfloat16's, near 1): in one run every gap
# between the two likeliest tokens was a multiple of 0.0078125, and a third of the positions
# had two tokens exactly tied. The same KV computed in another batch shape (a restore and the
# prompt's last 20 tokens, against 1300 tokens in three chunks) can round one of them a step
# the other way, and greedy decoding then takes the other token of the tie: measured, a
# restored 1300-token prompt and its recompute, byte-exact KV, tied at their second token.
# KV read before its load landed (the poisoned cache, probe.py) moves the answer far more.
ROUNDING_STEP = 2.0**-7
TIE = 2 * ROUNDING_STEP


def answer_difference(got: dict, want: dict) -> str:
    """Where two rounds' greedy outputs part, with the two likeliest tokens and their logprobs
    at that position in each: a tie within a rounding step reads differently from wrong KV."""
    pos = next((i for i, (a, b) in enumerate(zip(got["output"], want["output"], strict=True)) if a != b), None)
    if pos is None:
        return "the same output"
    return (f"outputs part at position {pos}: {got['output']} against {want['output']}; "
            f"top two there {got['top2'][pos]} against {want['top2'][pos]}")


def answer_problem(got: dict, want: dict) -> str | None:
    """None where `got` answers as `want` does: at each position the same token with its
    logprob within TIE of want's, up to the end or up to a tie, a position where want's two
    likeliest tokens are within TIE of each other, got's are the same two, and got took the
    other one (past it the contexts differ, and so may the answers). Else what differs."""
    for pos, (a, b) in enumerate(zip(got["output"], want["output"], strict=True)):
        gl, wl = got["top2"][pos][0][1], want["top2"][pos][0][1]  # the chosen tokens' logprobs (greedy: the likeliest)
        if a == b and abs(gl - wl) <= TIE:
            continue
        # got's likeliest is a and want's is b, so one pair ranked first by both holds both.
        tie = (len(want["top2"][pos]) == 2 and abs(want["top2"][pos][0][1] - want["top2"][pos][1][1]) <= TIE
               and {t for t, _ in got["top2"][pos]} == {t for t, _ in want["top2"][pos]} and abs(gl - wl) <= TIE)
        if tie:
            return None
        if a != b:
            return answer_difference(got, want)
        return f"position {pos}: the same token {a}, its logprob {gl:.6f} against {wl:.6f} (more than {TIE} apart)"
    return None


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
