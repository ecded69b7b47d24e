"""`kvlab bench overhead` without an engine: the interleaving, the ratios and the JSON keys the
acceptance reads, from a fake measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.bench import overhead as bo
from kvlab.cli import main


def fake_measure(decode: dict[str, float], miss: dict[str, float], seen: list[tuple[str, int]],
                 save: dict[str, float] | None = None, decode_save: dict[str, float] | None = None,
                 second: float = 1.0) -> bo.Measure:
    """kvlab's figures a fixed share of baseline's, both drifting with the repeat (a machine
    whose speed changes), and the setup that goes second in a repeat `second` times slower: the
    ratio within a repeat cancels the drift, a pair's figure the cost of going second."""

    def life(setup: str, repeat: int) -> bo.LifeSample:
        seen.append((setup, repeat))
        drift = (1 + 0.1 * repeat) * (second if bo.order_of(repeat)[1] == setup else 1.0)
        return bo.LifeSample(setup, repeat, decode[setup] / drift, miss[setup] * drift, 30.0,
                             save_ttft_s=save[setup] * drift if save else None,
                             decode_save_tok_s=decode_save[setup] / drift if decode_save else None)

    return lambda repeat: [life(setup, repeat) for setup in bo.order_of(repeat)]


def test_repeats_alternate_which_setup_goes_first() -> None:
    seen: list[tuple[str, int]] = []
    bo.run_overhead(4, fake_measure({"baseline": 100, "kvlab": 90}, {"baseline": 0.1, "kvlab": 0.11}, seen),
                    progress=lambda m: None)
    assert seen == [("baseline", 0), ("kvlab", 0), ("kvlab", 1), ("baseline", 1),
                    ("baseline", 2), ("kvlab", 2), ("kvlab", 3), ("baseline", 3)]


def test_ratios_are_kvlab_over_baseline_within_each_repeat() -> None:
    samples = bo.run_overhead(6, fake_measure({"baseline": 100, "kvlab": 97}, {"baseline": 0.1, "kvlab": 0.102}, []),
                              progress=lambda m: None)
    res = bo.summarize(samples, bo.Workload(), {"git": {}})
    assert (res["repeats"], res["pairs"]) == (6, 3)
    for key, want in (("decode_rate_over_baseline", 0.97), ("miss_ttft_over_baseline", 1.02)):
        assert res[key] == pytest.approx(want)  # the drift cancels within a repeat
        assert res[f"{key}_q1"] == pytest.approx(want) and res[f"{key}_q3"] == pytest.approx(want)
        assert isinstance(res[key], float)
    assert res["per_repeat"]["order"][1] == ["kvlab", "baseline"]


def test_saving_figures_are_kvlab_over_baseline_within_each_repeat() -> None:
    samples = bo.run_overhead(8, fake_measure({"baseline": 100, "kvlab": 99}, {"baseline": 0.1, "kvlab": 0.1}, [],
                                              save={"baseline": 2.0, "kvlab": 2.08},
                                              decode_save={"baseline": 80, "kvlab": 76}),
                              progress=lambda m: None)
    res = bo.summarize(samples, bo.Workload(), {})
    assert res["repeats"] == 8
    for key, want in (("compute_save_ttft_over_baseline", 1.04), ("decode_save_rate_over_baseline", 0.95)):
        assert res[key] == pytest.approx(want)  # the drift cancels within a repeat
        assert res[f"{key}_q1"] == pytest.approx(want) and res[f"{key}_q3"] == pytest.approx(want)
        assert res["per_repeat"][key] == pytest.approx([want] * 8)
        assert res["per_pair"][key] == pytest.approx([want] * 4)
    # each setup's own medians over the repeats, beside the ratios
    assert res["kvlab"]["save_ttft_s"] == pytest.approx(2.08 * 1.35)
    assert res["baseline"]["decode_save_tok_s"] == pytest.approx((80 / 1.3 + 80 / 1.4) / 2)


def test_a_lifes_place_in_its_repeat_cancels_within_each_pair() -> None:
    """The setup that goes second in a repeat 12% slower, whichever it is: single repeats'
    ratios swing either way of the truth, each pair's figure is exact (and so is the median
    over an odd count of repeats no more: the last, unpaired repeat is left out)."""
    samples = bo.run_overhead(9, fake_measure({"baseline": 100, "kvlab": 97}, {"baseline": 0.1, "kvlab": 0.102}, [],
                                              save={"baseline": 2.0, "kvlab": 2.0},
                                              decode_save={"baseline": 80, "kvlab": 80}, second=1.12),
                              progress=lambda m: None)
    res = bo.summarize(samples, bo.Workload(), {})
    assert (res["repeats"], res["pairs"]) == (8, 4)
    singles = res["per_repeat"]["decode_rate_over_baseline"]
    assert singles[0] == pytest.approx(0.97 / 1.12) and singles[1] == pytest.approx(0.97 * 1.12)
    for key, want in (("decode_rate_over_baseline", 0.97), ("miss_ttft_over_baseline", 1.02),
                      ("compute_save_ttft_over_baseline", 1.0), ("decode_save_rate_over_baseline", 1.0)):
        assert res[key] == pytest.approx(want)
        assert (res[f"{key}_q1"], res[f"{key}_q3"]) == (pytest.approx(want), pytest.approx(want))


def test_saving_quartiles_and_a_life_without_them() -> None:
    ratios = (1.2, 1.2, 1.0, 1.0, 1.1, 1.1, 0.9, 0.9)  # a pair's two repeats alike: its figure is theirs
    lives = [bo.LifeSample("baseline", r, 100.0, 0.1, 1.0, save_ttft_s=2.0, decode_save_tok_s=50.0) for r in range(8)]
    lives += [bo.LifeSample("kvlab", r, 100.0, 0.1, 1.0, save_ttft_s=2.0 * x, decode_save_tok_s=50.0)
              for r, x in enumerate(ratios)]
    res = bo.summarize(lives, bo.Workload(), {})
    assert res["compute_save_ttft_over_baseline"] == pytest.approx(1.05)
    assert (res["compute_save_ttft_over_baseline_q1"], res["compute_save_ttft_over_baseline_q3"]) == (
        pytest.approx(0.975), pytest.approx(1.125))
    assert res["decode_save_rate_over_baseline"] == pytest.approx(1.0)
    # a life that did not measure saving: the figure is left out, not made up
    lives[0] = bo.LifeSample("baseline", 0, 100.0, 0.1, 1.0)
    res = bo.summarize(lives, bo.Workload(), {})
    assert "compute_save_ttft_over_baseline" not in res and "decode_rate_over_baseline" in res


def test_quartiles_spread_around_the_median() -> None:
    pairs = (0.9, 1.0, 0.95, 0.8, 1.1)
    lives = [bo.LifeSample("baseline", r, 100.0, 0.1, 1.0) for r in range(10)]
    # each pair's two ratios x*1.1 and x/1.1: their geometric mean is x
    lives += [bo.LifeSample("kvlab", r, 100.0 * pairs[r // 2] * (1.1 if r % 2 else 1 / 1.1), 0.1, 1.0) for r in range(10)]
    res = bo.summarize(lives, bo.Workload(), {})
    assert res["per_pair"]["decode_rate_over_baseline"] == pytest.approx(list(pairs))
    assert res["decode_rate_over_baseline"] == pytest.approx(0.95)
    assert (res["decode_rate_over_baseline_q1"], res["decode_rate_over_baseline_q3"]) == (pytest.approx(0.9),
                                                                                          pytest.approx(1.0))


def test_a_pair_missing_a_life_is_left_out_and_none_is_an_error() -> None:
    lives = [bo.LifeSample(s, r, 100.0 if s == "baseline" else 90.0, 0.1, 1.0) for r in range(4) for s in bo.SETUPS]
    lives.pop()  # repeat 3's second life failed: the pair (2, 3) is left out
    res = bo.summarize(lives, bo.Workload(), {})
    assert (res["repeats"], res["pairs"]) == (2, 1) and res["decode_rate_over_baseline"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="both baseline and kvlab"):
        bo.summarize(lives[:3], bo.Workload(), {})


def test_the_cli_prints_one_json_object_with_the_keys_and_provenance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import kvlab.model

    monkeypatch.setattr(kvlab.model, "ensure_tiny", lambda: tmp_path / "tiny")
    monkeypatch.setattr(bo, "engine_measure", lambda params, work, w: fake_measure(
        {"baseline": 120, "kvlab": 118}, {"baseline": 0.05, "kvlab": 0.051}, [],
        {"baseline": 1.5, "kvlab": 1.52}, {"baseline": 90, "kvlab": 89}))
    assert main(["bench", "overhead", "--repeats", "6", "--json", "--workdir", str(tmp_path / "w")]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out.strip().splitlines()[-1])
    for key in ("decode_rate_over_baseline", "miss_ttft_over_baseline", "compute_save_ttft_over_baseline",
                "decode_save_rate_over_baseline"):
        assert {key, f"{key}_q1", f"{key}_q3"} <= set(res) and float(res[key]) > 0
    assert res["repeats"] == 6 and res["pairs"] == 3 and res["schema"] == "kvlab.bench.overhead/6"
    prov = res["provenance"]
    assert prov["git"]["commit"] and prov["versions"]["python"] and prov["host"]["cpu_count"]
    assert set(prov["engine_argv"]) == {"baseline", "kvlab"}
    # identical flags but the connector's
    assert prov["engine_argv_difference"]["baseline_only"] == []
    assert any("kv-transfer-config" in x or "KVLabConnector" in x for x in prov["engine_argv_difference"]["kvlab_only"])
    assert "[6/6 ·" in err and "repeat 6/6: kvlab and baseline, side by side" in err  # progress while it runs


def test_the_engines_hold_the_saved_prompt_and_five_pairs_of_repeats_are_the_default(tmp_path: Path) -> None:
    w = bo.Workload()
    params = bo.engine_params(tmp_path / "tiny", tmp_path, w)
    assert params.max_model_len > w.save_prompt_tokens  # the computed-and-saved prompt fits
    # a chunk (512 tokens) fills while the decode-while-saving request decodes, not before
    assert w.decode_save_prompt_tokens % 512 != 0
    assert w.decode_save_prompt_tokens // 512 < (w.decode_save_prompt_tokens + w.decode_save_tokens - 1) // 512
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    bo.register(sub)
    repeats = sub.choices["overhead"].parse_args([]).repeats
    assert repeats >= 10 and repeats % 2 == 0


def test_both_setups_compute_on_the_same_cores(tmp_path: Path) -> None:
    from kvlab.setups import registry as setups

    params = bo.engine_params(tmp_path / "tiny", tmp_path, bo.Workload())
    assert params.cpu_cores == setups.compute_cores()
    binds = {setups.render(s, params).engine.env.get("VLLM_CPU_OMP_THREADS_BIND") for s in bo.SETUPS}
    assert binds == {params.cpu_cores}  # the same cores for both setups


def test_a_lifes_misses_each_follow_a_decode_request_so_they_sample_the_whole_life() -> None:
    # 20 misses of ~20 ms back to back fall in one of a life's streaks; after each decode they
    # spread over it
    assert bo.life_rounds(bo.Workload(decode_requests=4, miss_requests=4, save_requests=0,
                                      decode_save_requests=0)) == [("decode", "miss")] * 4
    def life_order(w: bo.Workload) -> list[str]:  # each engine's requests in the order it gets them
        return [kind for r in bo.life_rounds(w) for kind in r]

    uneven = life_order(bo.Workload(decode_requests=3, miss_requests=5, save_requests=1, decode_save_requests=2))
    assert uneven == ["decode", "miss"] * 3 + ["miss", "miss", "save", "decode_save", "decode_save"]
    w = bo.Workload()
    assert life_order(w) == ["decode", "miss"] * 10 + ["save"] * 3 + ["decode_save"] * 10


class FakeServer:
    """An engine that answers at once; records what it was sent, and its start and stop."""

    log: list[str] = []

    def __init__(self, deployment, log_dir) -> None:  # type: ignore[no-untyped-def]
        self.setup, self.port = deployment.setup, deployment.engine.argv[deployment.engine.argv.index("--port") + 1]
        self.base_url = f"http://{self.setup}"

    def start(self, progress: bool = False) -> float:
        FakeServer.log.append(f"start {self.setup} :{self.port}")
        return 30.0

    def stop(self) -> None:
        FakeServer.log.append(f"stop {self.setup}")


def test_both_engines_of_a_repeat_live_side_by_side_and_their_rounds_alternate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds ABBA: a round to one engine, then the same to the other; the next round starts
    with the one that went second. Each engine has its own port, both are stopped."""
    FakeServer.log = []
    monkeypatch.setattr(bo, "EngineServer", FakeServer)
    monkeypatch.setattr(bo, "SETTLE_S", {})
    monkeypatch.setattr(bo, "SETTLE_DEFAULT_S", 0)
    monkeypatch.setattr(bo, "decode", lambda url, key, prompt, tokens: (
        FakeServer.log.append(f"{url[7:]} {key.split(':')[-1]}") or (tokens, 0.02, 0.02 + tokens / 100)))
    w = bo.Workload(decode_requests=2, miss_requests=2, save_requests=1, decode_save_requests=2)
    lives = bo.engine_measure(bo.engine_params(tmp_path / "tiny", tmp_path, w), tmp_path, w)(1)
    log = FakeServer.log
    assert sorted(x.split()[1] for x in log[:2]) == ["baseline", "kvlab"] and log[0].split()[2] != log[1].split()[2]
    assert log[2:] == [
        "kvlab warmup", "baseline warmup",
        "kvlab decode0", "kvlab miss0", "baseline decode0", "baseline miss0",
        "baseline decode1", "baseline miss1", "kvlab decode1", "kvlab miss1",
        "kvlab save0", "baseline save0",
        "baseline decode_save0", "kvlab decode_save0", "kvlab decode_save1", "baseline decode_save1",
        "stop kvlab", "stop baseline"]
    assert [(s.setup, s.repeat) for s in lives] == [("kvlab", 1), ("baseline", 1)]
    assert lives[0].miss_ttft_s_all == (0.02, 0.02) and lives[0].decode_tok_s == pytest.approx(127 / 1.28)


def test_a_failed_engine_start_stops_the_engine_already_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeServer.log = []

    class FailsSecond(FakeServer):
        def start(self, progress: bool = False) -> float:
            if FakeServer.log:
                raise RuntimeError("no engine")
            return super().start(progress)

    monkeypatch.setattr(bo, "EngineServer", FailsSecond)
    w = bo.Workload()
    with pytest.raises(RuntimeError, match="no engine"):
        bo.engine_measure(bo.engine_params(tmp_path / "tiny", tmp_path, w), tmp_path, w)(0)
    assert FakeServer.log[0].startswith("start ") and {"stop baseline", "stop kvlab"} <= set(FakeServer.log)


def test_a_repeat_count_below_one_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overhead", "--repeats", "0"]) == 2
    assert "--repeats 0" in capsys.readouterr().err


def test_an_odd_repeat_count_is_a_one_line_error_naming_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overhead", "--repeats", "9"]) == 2
    err = capsys.readouterr().err
    assert "--repeats 9: give an even number (e.g. 10)" in err


def test_a_lifes_decode_rate_is_its_requests_midmean_so_neither_a_burst_nor_a_step_mode_carries_it() -> None:
    # (output_tokens, ttft_s, total_s): 127 tokens in ~1.3 s, and one answer whose tokens all
    # arrived with its first (the API server streamed it late): ~0.001 s of decoding. Pooled
    # (tokens over decoding time) it would add its tokens and almost none of the time.
    steady = [(128, 0.05, 0.05 + 127 / r) for r in (95.0, 100.0, 105.0, 98.0)]
    late = (128, 1.3, 1.3013)
    rate, each = bo.rates_of([*steady, late])
    assert rate == pytest.approx((98 + 100 + 105) / 3) and len(each) == 5 and max(each) > 90_000
    # steps of ~8 or ~16 ms (where the kernel puts the engine's processes): a median of such
    # requests is one mode or the other; the midmean is between
    fast, slow = (129, 0.1, 0.1 + 128 * 0.008), (129, 0.1, 0.1 + 128 * 0.016)
    rate, each = bo.rates_of([fast, slow, slow, fast])
    assert each == pytest.approx((125.0, 62.5, 62.5, 125.0)) and rate == pytest.approx(93.75)
    assert bo.rates_of([(1, 0.1, 0.2)]) == (None, ())  # one token: nothing decoded after the first
