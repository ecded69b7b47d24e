"""`kvlab campaign compare`: interleaved runs under two engine controls, divided within each repeat."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.harness import compare

CAMPAIGN = str(Path(__file__).resolve().parents[2] / "campaigns" / "container.yml")


def req(setup: str, phase: str, ttft: float, repeat: int = 0, cached: int = 2048, out: int = 1) -> dict:
    return {"kind": "request", "scenario": "restore", "setup": setup, "phase": phase, "repeat": repeat,
            "ttft_s": ttft, "cached_tokens": cached, "output_tokens": out}


def run(scale: float, cached: int = 2048) -> list[dict]:
    return [req("kvlab", "warm", 0.10 * scale, i, cached) for i in range(3)] + [
        req("kvlab", "restart", 0.30 * scale, 0, cached),
        req("kvlab", "compute", 9.0),  # computes: not a restore
        {**req("kvlab", "warm", 99.0, 7), "error": "timed out"},  # failed: not timed
        req("baseline", "restart", 1.0 * scale, 0, 0),
    ]


def test_the_controls_alternate_their_order_each_repeat() -> None:
    seen = []
    dirs = compare.run_interleaved(3, ["local", "container"], lambda c, r: seen.append((r, c)) or c, lambda m: None)
    assert seen == [(0, "local"), (0, "container"), (1, "container"), (1, "local"), (2, "local"), (2, "container")]
    assert dirs == {"local": ["local"] * 3, "container": ["container"] * 3}


def test_ratios_are_taken_within_each_repeat() -> None:
    # The machine drifts between repeats (x1, x2, x4); within a repeat B is 1.1x A.
    runs = {"local": [run(s) for s in (1, 2, 4)], "container": [run(1.1 * s) for s in (1, 2, 4)]}
    out = compare.summarize(runs, {"local": ["a"], "container": ["b"]}, ["local", "container"])
    warm = out["restore_ttft"]["kvlab.warm"]
    assert warm["container_over_local"] == pytest.approx(1.1) and warm["q1"] == pytest.approx(1.1)
    assert warm["repeats"] == 3 and warm["local_ttft_s"] == pytest.approx(0.2)
    assert set(out["restore_ttft"]) == {"kvlab.warm", "kvlab.restart", "baseline.restart"}
    assert out["same_restored_tokens"] and out["repeats"] == 3


def test_a_token_difference_is_named() -> None:
    runs = {"local": [run(1)], "container": [run(1, cached=1536)]}
    out = compare.summarize(runs, {}, ["local", "container"])
    assert not out["same_restored_tokens"]
    assert {"request": ["kvlab", "warm", 0], "local": (2048, 1), "container": (1536, 1)} in out["token_differences"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--engines", "local"], "give two different controls"),
    (["--engines", "local,local"], "give two different controls"),
    (["--engines", "local,systemd"], "give two different controls"),
    (["--repeats", "0"], "--repeats 0: give 1 or more"),
])
def test_bad_options_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab.cli import main

    assert main(["campaign", "compare", CAMPAIGN, *argv]) != 0
    assert message in capsys.readouterr().err


def test_each_runs_provenance_line_names_its_engine_control() -> None:
    from kvlab.harness.report import RunData, RunInputs, provenance_lines

    image = {"kind": "container", "image": {"digest": "sha256:" + "ab" * 32}}
    runs = [RunData(Path(n), n, RunInputs(None, "", [], {}), {"engine_control": ctl} if ctl else {}, [], None)  # type: ignore[arg-type]
            for n, ctl in (("a", image), ("b", {"kind": "local"}), ("c", None))]
    a, b, c = provenance_lines(runs)
    assert "engines container from image `sha256:abababababab…`" in a
    assert "engines local;" in b and "engines local;" in c
