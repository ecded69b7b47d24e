"""The restore scenario's warm phase needs /reset_prefix_cache, a vLLM dev route that checks
no API key. An engine bound to the network runs without dev mode: the campaign says plainly
that it cannot measure warm restores there, and never reaches for an open route."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.engines.local import EngineError, EngineServer
from kvlab.harness import scenarios
from kvlab.harness.campaign import RestoreScenario
from kvlab.harness.compiler import restore_spec
from kvlab.harness.plan import restore_steps
from kvlab.setups import registry as setups

pytestmark = pytest.mark.unit


def server(host: str, tmp_path: Path) -> EngineServer:
    p = setups.EngineParams(model="/models/tiny", host=host, kv_store_paths=("/mnt/a",))
    return EngineServer(setups.render("kvlab", p), tmp_path)


def run_restore(srv: EngineServer, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], list[str], list[str]]:
    records: list[dict] = []
    notes: list[str] = []
    phases: list[str] = []
    resets: list[bool] = []
    monkeypatch.setattr(srv, "reset_prefix_cache", lambda: resets.append(True))
    monkeypatch.setattr(scenarios, "measured", lambda t, prompt, n, base, **kw: phases.append(base["phase"]))
    monkeypatch.setattr(scenarios.time, "sleep", lambda s: None)
    t = scenarios.Target("kvlab", srv, "tiny", None, records.append, notes.append, lambda ph: None)
    sc = RestoreScenario(tokens=64, warm_repeats=2, restart_repeats=0, drop_page_cache=False, settle_s=0)
    for step in restore_steps("kvlab", restore_spec(sc)):  # the steps the plan gives, in order
        scenarios.run_step(t, step, 0, lambda: 1.0)
    return records, notes, phases + ["reset"] * len(resets)


def test_loopback_engine_resets_and_measures_warm_restores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records, _, phases = run_restore(server("127.0.0.1", tmp_path), monkeypatch)
    assert phases == ["warmup", "compute", "warm", "warm", "reset", "reset"]
    assert not [r for r in records if r.get("kind") == "error"]


def test_network_engine_says_it_cannot_reset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records, notes, phases = run_restore(server("0.0.0.0", tmp_path), monkeypatch)
    assert phases == ["warmup", "compute"], "no warm phase, and no reset through any route"
    [err] = [r for r in records if r.get("kind") == "error"]
    assert "warm restores not measured" in err["message"] and "127.0.0.1" in err["message"]
    assert any("warm restores not measured" in n for n in notes)


def test_reset_prefix_cache_refuses_an_engine_without_dev_mode(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no /reset_prefix_cache"):
        server("0.0.0.0", tmp_path).reset_prefix_cache()


def test_a_request_record_carries_its_answers_digest_where_the_ids_came_back() -> None:
    from kvlab.client import Completion

    def fields(ids: list[int] | None) -> dict:
        return scenarios.completion_fields(Completion(0.1, 0.2, 3, 64, 0, "", token_ids=ids))

    assert "output_digest" not in fields(None)
    a, b = fields([5, 17, 2])["output_digest"], fields([5, 172])["output_digest"]
    assert a == fields([5, 17, 2])["output_digest"] and a != b and len(a) == 16


def test_every_restore_request_asks_for_its_answers_token_ids(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    srv = server("127.0.0.1", tmp_path)
    asked: dict[str, bool] = {}
    monkeypatch.setattr(srv, "reset_prefix_cache", lambda: None)
    monkeypatch.setattr(scenarios, "measured",
                        lambda t, prompt, n, base, **kw: asked.update({base["phase"]: kw.get("token_ids", False)}))
    monkeypatch.setattr(scenarios.time, "sleep", lambda s: None)
    t = scenarios.Target("kvlab", srv, "tiny", None, lambda r: None, lambda n: None, lambda ph: None)
    sc = RestoreScenario(tokens=64, warm_repeats=1, restart_repeats=0, drop_page_cache=False, settle_s=0)
    for step in restore_steps("kvlab", restore_spec(sc)):
        scenarios.run_step(t, step, 0, lambda: 1.0)
    assert asked == {"warmup": False, "compute": True, "warm": True}, asked
