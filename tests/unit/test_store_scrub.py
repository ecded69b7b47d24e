"""Scrub: objects re-verified at rest in the background at a bounded rate, off by default;
what fails is removed and counted, nothing else is touched."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_store_fsck import NS, SHAPE, filled, flip, fragment, key

from kvlab_connector import metrics
from kvlab_connector.config import ConfigError, ConnectorConfig
from kvlab_connector.fsck import fsck
from kvlab_connector.scrub import Scrubber
from kvlab_connector.store.format import ROOT_NAME


def served(name: str) -> float:
    m = metrics.metrics()
    assert m is not None
    return m[name]._value.get()


def test_scrub_removes_what_fails_at_rest_and_counts_it(tmp_path: Path) -> None:
    drives = [tmp_path / "d0", tmp_path / "d1"]
    store = filled(drives)
    flip(fragment(drives, 2, 1), 99)
    foreign = drives[0] / ROOT_NAME / NS / "notes.txt"
    foreign.write_text("not the store's")
    removed0, scrubbed0 = served("scrub_removed"), served("scrubbed_bytes")
    scrub = Scrubber(store.drives, store.ledger, bytes_per_s=1 << 30)
    assert scrub.pass_once() == 1
    assert (scrub.objects_checked, scrub.removed) == (6, 1)
    assert served("scrub_removed") - removed0 == 1
    assert served("scrubbed_bytes") - scrubbed0 >= 6 * SHAPE.object_bytes - SHAPE.stride
    assert not store.exists(NS, key(2), SHAPE) and store.exists(NS, key(3), SHAPE)
    assert foreign.exists()
    r = fsck(drives)
    assert (r.objects, r.damaged) == (5, 0)
    assert store.usage_bytes() == 5 * SHAPE.object_bytes, "the ledger counts what stays"
    assert scrub.pass_once() == 0


def test_scrub_stops_when_asked(tmp_path: Path) -> None:
    store = filled([tmp_path / "d0"], n=2)
    scrub = Scrubber(store.drives, store.ledger, bytes_per_s=1 << 30)
    scrub.start()
    scrub.stop()
    assert scrub._thread is not None and not scrub._thread.is_alive()


def test_scrub_is_off_by_default_and_its_rate_is_checked() -> None:
    assert ConnectorConfig.from_extra({"paths": ["/x"]}).scrub_bytes_per_s is None
    assert (
        ConnectorConfig.from_extra({"paths": ["/x"], "scrub_bytes_per_s": 1 << 20}).scrub_bytes_per_s
        == 1 << 20
    )
    for bad in (0, -5, "fast", 1.5):
        with pytest.raises(ConfigError, match="scrub_bytes_per_s"):
            ConnectorConfig.from_extra({"paths": ["/x"], "scrub_bytes_per_s": bad})
