"""kvlab and its connector import in one direction: no module imports one that imports it
back, at the top or inside a function (setups.py imported setups_lmcache at its bottom, and
setups_lmcache imported setups). Imports for type checking only are not imports."""

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


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(module: str) -> set[str]:
    """The modules of MODULES that `module` imports, wherever the import statement is."""
    out: set[str] = set()
    stack: list[ast.AST] = [ast.parse(MODULES[module].read_text())]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            stack.extend(getattr(node, "orelse", []))
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        stack.extend(ast.iter_child_nodes(node))
    return (out & set(MODULES)) - {module}


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


def test_the_check_reads_imports_in_functions_and_not_for_type_checking() -> None:
    # the writer names the Store for type checking only
    text = MODULES["kvlab_connector.store.writer"].read_text()
    assert "if TYPE_CHECKING:\n    from kvlab_connector.store.store import Store" in text
    assert "kvlab_connector.store.store" not in imports_of("kvlab_connector.store.writer")
    assert "kvlab.setups.registry" in imports_of("kvlab.cli")  # inside a function


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
    assert r.stdout.split() == ["11", "True"]
