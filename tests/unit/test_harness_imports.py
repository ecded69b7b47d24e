"""The harness's modules import in one direction: no module imports one that imports it back,
not even inside a function (campaign.py and sessions.py did)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "src" / "kvlab" / "harness"
MODULES = sorted(f"kvlab.harness.{p.stem}" for p in HARNESS.glob("*.py") if p.stem != "__init__")


def harness_imports(module: str) -> set[str]:
    """Every kvlab.harness module this one imports, at the top or inside a function."""
    tree = ast.parse((HARNESS / f"{module.rsplit('.', 1)[1]}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "kvlab.harness":
                out |= {f"kvlab.harness.{a.name}" for a in node.names}
            elif node.module.startswith("kvlab.harness."):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvlab.harness.")}
    return out & set(MODULES)


def cycle_through(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in path:
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_harness_module_imports_back_what_imports_it() -> None:
    graph = {m: harness_imports(m) for m in MODULES}
    assert "kvlab.harness.sessions" in graph["kvlab.harness.campaign"]  # the campaign names the sources
    cycles = [c for m in MODULES if (c := cycle_through(m, graph))]
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module: str) -> None:
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
