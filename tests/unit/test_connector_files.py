"""The connector along its seams: small files, one job each, and host and GPU memory as two
media chosen once (worker_media.py), never by a type check in the pipelines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "connector" / "src" / "kvlab_connector"
FILES = sorted(SRC.glob("*.py"))
MAX_LINES = 450
RINGS = {"DeviceRing", "StagingRing", "HostMedium", "DeviceMedium"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_file_is_over_the_bar(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name}: {lines} lines; split it by job"


def ring_type_checks(path: Path) -> list[int]:
    """Lines where `isinstance` asks which ring or medium an object is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            names = (
                {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if len(node.args) > 1
                else set()
            )
            if names & RINGS:
                found.append(node.lineno)
    return found


def test_the_check_finds_a_type_check(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f(ring):\n    return isinstance(ring, (DeviceRing, int))\n")
    assert ring_type_checks(probe) == [2]


@pytest.mark.parametrize("path", [p for p in FILES if p.name.startswith("worker")], ids=lambda p: p.name)
def test_the_worker_never_asks_which_memory_a_slot_is_in(path: Path) -> None:
    assert ring_type_checks(path) == []
