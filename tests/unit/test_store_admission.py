"""Admission: `always` saves every object (today's behaviour, the default); `reused` saves an
object the second time its key comes within the window, so a prompt that never returns is
never written; a write budget (bytes a day) drops what does not fit. Each refusal counted."""

from __future__ import annotations

import pytest
from test_scheduler import CHUNK, LAYOUT, Engine, Req, tokens

from kvlab_connector import metrics
from kvlab_connector.admission import Admission
from kvlab_connector.config import ConfigError, ConnectorConfig
from kvlab_connector.scheduler import SchedulerSide


def engine(**extra: object) -> Engine:
    e = Engine()
    config = ConnectorConfig.from_extra({"paths": ["/unused"], "chunk_tokens": CHUNK, **extra})
    e.side = SchedulerSide(config, LAYOUT, e.drives, [0])  # type: ignore[arg-type]
    return e


def served(name: str) -> float:
    m = metrics.metrics()
    assert m is not None
    return m[name]._value.get()


def test_always_saves_every_prompt_at_once() -> None:
    e = engine()
    assert e.serve(Req("a", tokens(150))) == 0
    assert len(e.saved) == 3  # two whole chunks and a tail
    assert e.serve(Req("b", tokens(150))) == 144


def test_reused_saves_a_prompt_the_second_time_it_comes_whole() -> None:
    e = engine(admission="reused")
    refused0 = served("admission_refused")
    prompt = tokens(150)
    assert e.serve(Req("once", tokens(300, seed=7))) == 0  # never returns: never written
    assert e.serve(Req("a", prompt)) == 0
    assert e.saved == []
    assert served("admission_refused") - refused0 == e.side.admission.counts["admission_refused"] > 0
    assert e.serve(Req("b", list(prompt))) == 0  # seen before: every object of it saved now
    assert len(e.saved) == 3
    assert e.serve(Req("c", list(prompt))) == 144


def test_reused_forgets_keys_beyond_its_window() -> None:
    e = engine(admission="reused", admission_window=2)
    prompt = tokens(150)
    e.serve(Req("a", prompt))
    e.serve(Req("other", tokens(150, seed=3)))  # three new keys push the first prompt's out
    e.serve(Req("b", list(prompt)))
    assert e.saved == []


def test_a_write_budget_drops_what_does_not_fit_and_counts_it() -> None:
    chunk_bytes = LAYOUT.shape_of(4).object_bytes
    # An hour's budget holds two whole chunks: the tail and the second prompt do not fit.
    e = engine(write_budget_bytes_per_day=int(2.5 * chunk_bytes * 24))
    over0 = served("over_write_budget")
    e.serve(Req("a", tokens(150)))
    e.serve(Req("b", tokens(150, seed=5)))
    assert len(e.saved) == 2
    assert e.side.admission.counts["over_write_budget"] == 4  # a's tail; all three of b's
    assert served("over_write_budget") - over0 == 4


def test_admission_is_always_by_default_and_checked() -> None:
    assert ConnectorConfig.from_extra({"paths": ["/x"]}).admission == "always"
    with pytest.raises(ConfigError, match="admission must be one of always, reused"):
        ConnectorConfig.from_extra({"paths": ["/x"], "admission": "sometimes"})
    for key in ("admission_window", "write_budget_bytes_per_day"):
        with pytest.raises(ConfigError, match=key):
            ConnectorConfig.from_extra({"paths": ["/x"], key: 0})
    with pytest.raises(ValueError, match="admission"):
        Admission("sometimes")
