"""pytest plugin of `make verify` (`-p kvlab.verify`): no suite passes by checking nothing.

Before any test connects to a host it resolves every module's host groups (`testinfra_hosts`,
or `--hosts`) in the inventory: a group with no host stops the run, naming the group and the
suite. Tests of the lab suite (marker `lab`: GPU, drive, QoS and time checks) are deselected, not
skipped, on a host whose inventory declares `kvlab_lab_hardware: false` (the testbed's VMs) or,
without it, `kvlab_gpus_expected: false`, and the run says which. At the end it prints what it checked: per suite and host, how many tests passed,
failed, were skipped or deselected, and why.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import pytest

_state: dict = {"deselected": defaultdict(list), "outcomes": defaultdict(Counter), "inventory": None}


def _host_of(item: pytest.Item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    backend = getattr(params.get("_testinfra_host"), "backend", None)  # NOTSET: an empty host list
    return backend.get_hostname() if backend is not None else None


def _suite(item: pytest.Item) -> str:
    return os.path.relpath(str(item.path), str(item.config.rootpath))


def _specs(config: pytest.Config, module) -> list[str]:
    if config.option.hosts:
        return config.option.hosts.split(",")
    return list(getattr(module, "testinfra_hosts", []) or [])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    inv_file = config.getoption("ansible_inventory", default=None)
    if not inv_file:
        raise pytest.UsageError("kvlab.verify: give --ansible-inventory=inventories/<name>/hosts.yml")
    from kvlab import inventory

    inv = inventory.load(inv_file)
    _state["inventory"] = inv_file
    empty = []
    modules = {}
    for item in items:
        mod = item.getparent(pytest.Module)
        if mod is not None:
            modules[str(mod.path)] = mod
    for path, mod in sorted(modules.items()):
        for spec in _specs(config, mod.obj):
            if spec.startswith("ansible://"):
                group = spec[len("ansible://"):]
                if not inv.hosts(group):
                    empty.append(f"{os.path.relpath(path, str(config.rootpath))} checks group {group!r}")
    if empty:
        raise pytest.UsageError(
            f"verify: nothing to check in {inv_file}: " + "; ".join(empty)
            + " - but that group has no host (a suite that collects no host is a failure)"
        )
    keep, drop = [], []
    without: dict[str, str | None] = {}
    for item in items:
        host = _host_of(item)
        if host is not None and item.get_closest_marker("lab") is not None:
            if host not in without:
                without[host] = _no_lab_hardware(inv, host)
            if without[host]:
                drop.append(item)
                _state["deselected"][(_suite(item), host, without[host])].append(item.name)
                continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _no_lab_hardware(inv, host: str) -> str | None:
    """The inventory variable that declares this host without lab hardware, or None."""
    got = inv.render(host, ["kvlab_lab_hardware", "kvlab_gpus_expected"])
    for name in ("kvlab_lab_hardware", "kvlab_gpus_expected"):
        if name in got:
            return None if got[name] else name
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        host = report.nodeid.rsplit("[", 1)[1].rstrip("]") if "[" in report.nodeid else "-"
        suite = report.nodeid.split("::", 1)[0]
        _state["outcomes"][(suite, host)][report.outcome] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    tr = terminalreporter
    tr.section(f"kvlab verify: what was checked ({_state['inventory']})")
    for (suite, host), counts in sorted(_state["outcomes"].items()):
        tr.line(f"  {suite} on {host}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    for (suite, host, var), names in sorted(_state["deselected"].items()):
        what = "no GPU there" if var == "kvlab_gpus_expected" else "no lab hardware there: lab tests only"
        tr.line(f"  {suite} on {host.removeprefix('ansible://')}: {len(names)} deselected, not run: the inventory "
                f"declares {var}: false ({what})")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # every test deselected by what the inventory declares is a checked answer, not "no tests"
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and _state["deselected"] and not _state["outcomes"]:
        session.exitstatus = pytest.ExitCode.OK
