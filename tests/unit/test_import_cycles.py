"""kvlab and its connector import in one direction: no module imports one that imports it
back, at the top, inside a function or for type checking only (setups.py imported
setups_lmcache at its bottom, and setups_lmcache imported setups; the store's writer and
memory media named the Store for their types). A part that imports its own package's façade
(`from kvlab_connector.store import Store` inside store/) imports it back too: parts import
their siblings. The same rule as `../shared/acceptance/structure`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "kvlab": ROOT / "src" / "kvlab",
    "kvlab_connector": ROOT / "connector" / "src" / "kvlab_connector",
}


def module_files() -> dict[str, Path]:
    out = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = module_files()


def imports_in(source: str, module: str, is_package: bool = False) -> set[str]:
    """The modules of MODULES that `source` (the text of `module`) imports, wherever the
    import statement is, type checking included; relative imports resolved."""
    out: set[str] = set()
    base = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                parts = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                target = ".".join([*parts, *([target] if target else [])])
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return (out & set(MODULES)) - {module}


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    return imports_in(path.read_text(), module, path.name == "__init__.py")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path back to itself for each module that has one."""
    found = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            if start in graph[node]:
                found.append([*path, start])
                break
            stack.extend((n, [*path, n]) for n in sorted(graph[node]) if n not in path)
    return found


def test_the_check_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"],
        ["b", "c", "a", "b"],
        ["c", "a", "b", "c"],
    ]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_check_reads_imports_in_functions_for_type_checking_and_relative_ones() -> None:
    probe = (
        "from typing import TYPE_CHECKING\n"
        "from . import memory\n"
        "if TYPE_CHECKING:\n"
        "    from kvlab_connector.store.store import Store\n"
        "def f():\n"
        "    from kvlab_connector.store import ObjectShape\n"
    )
    found = imports_in(probe, "kvlab_connector.store.writer")
    assert {"kvlab_connector.store.memory", "kvlab_connector.store.store", "kvlab_connector.store"} <= found
    assert "kvlab.setups.registry" in imports_of("kvlab.cli")  # inside a function


def test_the_stores_parts_name_neither_the_store_nor_its_facade() -> None:
    parts = [m for m in MODULES if m.startswith("kvlab_connector.store.") and m != "kvlab_connector.store.store"]
    assert "kvlab_connector.store.writer" in parts and "kvlab_connector.store.memory" in parts
    named = {m: imports_of(m) & {"kvlab_connector.store", "kvlab_connector.store.store"} for m in parts}
    assert {m: n for m, n in named.items() if n} == {}


def test_no_module_imports_back_what_imports_it() -> None:
    graph = {m: imports_of(m) for m in MODULES}
    assert "kvlab.setups.registry" in graph["kvlab.setups.lmcache"]  # LMCache's setups use the registry's types
    found = cycles(graph)
    assert found == [], " ; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("first", ["kvlab.setups.registry", "kvlab.setups.lmcache"])
def test_the_registry_is_whole_whichever_module_is_imported_first(first: str) -> None:
    code = (
        f"import {first}\n"
        "from kvlab.setups import registry as setups\n"
        "assert setups.get('lmcache-mp+kvlab').name == 'lmcache-mp+kvlab'\n"
        "print(len(setups.REGISTRY), sorted(setups.REGISTRY) == sorted(dict(setups.REGISTRY.items())))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["12", "True"]
