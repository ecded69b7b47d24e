"""Test tiers: markers by folder; under CI=true only `lab` tests may skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TIERS = ("unit", "engine", "testbed", "infra", "lab")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


# tryfirst: the markers must be on the items before `-m` deselects by them
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(Path(__file__).parent).parts
        if parts and parts[0] in TIERS and not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    # In CI a skip outside the lab tier hides a missing install step: fail it instead.
    if IN_CI and report.skipped and not any(item.iter_markers(name="lab")):
        if hasattr(report, "wasxfail"):
            return
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (only lab tests may skip): {reason}"
