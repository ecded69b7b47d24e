"""The connector along its seams: small files, one job each, and host and GPU memory as two
media chosen once (worker/media.py), never by a type check in the pipelines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "connector" / "src" / "kvlab_connector"
FILES = sorted(SRC.rglob("*.py"))
MAX_LINES = 450
def rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


RINGS = {"DeviceRing", "StagingRing", "HostMedium", "DeviceMedium"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: rel(p))
def test_no_file_is_over_the_bar(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{rel(path)}: {lines} lines; split it by job"


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


@pytest.mark.parametrize("path", [p for p in FILES if rel(p).startswith("worker/")], ids=lambda p: rel(p))
def test_the_worker_never_asks_which_memory_a_slot_is_in(path: Path) -> None:
    assert ring_type_checks(path) == []


# Where a device flag may be read: where a medium or the cache's copies are chosen, and
# inside the device medium, where "device memory" is a CUDA tensor or (in the CPU tests of
# the GDS path) any torch tensor, and only CUDA needs a stream synchronised.
MEMORY_CHOSEN_IN = {
    "worker/worker.py": {"WorkerSide.register_kv_caches"},  # HostMedium or DeviceMedium, HostCopies or CudaCopies
    "worker/media.py": {"copies_for"},
    "ring.py": {"DeviceRing.__init__"},
    "checksum.py": {"wsum64_tensor"},
    "io/gds.py": {"DeviceIO._round_trips", "PosixFile._view"},
    "store/memory.py": {"DeviceMemory.seal"},  # kvikio writes from its own stream
}


def memory_choices(path: Path) -> list[tuple[str, int]]:
    """(function, line) of each place that asks whether memory is host or GPU memory: a
    `memoryview` or ring type check, `.is_cuda`, `.device.type`, or a `cuda` flag other
    than the torch.cuda module."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, f"{scope}.{child.name}" if scope else child.name)
                continue
            hit = False
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "isinstance":
                names = {n.id for n in ast.walk(child.args[1]) if isinstance(n, ast.Name)} if len(child.args) > 1 else set()
                hit = bool(names & (RINGS | {"memoryview"}))
            elif isinstance(child, ast.Attribute):
                hit = (
                    child.attr == "is_cuda"
                    or (child.attr == "type" and isinstance(child.value, ast.Attribute) and child.value.attr == "device")
                    or (child.attr == "type" and isinstance(child.value, ast.Name) and child.value.id == "device")
                    or (child.attr == "cuda" and not (isinstance(child.value, ast.Name) and child.value.id == "torch"))
                )
            if hit:
                found.append((scope, child.lineno))
            visit(child, scope)

    visit(ast.parse(path.read_text()), "")
    return found


def test_the_memory_check_finds_each_kind_of_choice(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\n"
        "class P:\n"
        "    def f(self, buf, t, cache, device):\n"
        "        a = isinstance(buf, memoryview)\n"
        "        b = t.is_cuda\n"
        "        c = t.device.type == 'cuda'\n"
        "        d = cache.cuda\n"
        "        e = device.type\n"
        "        return torch.cuda.current_stream()\n"
    )
    assert memory_choices(probe) == [("P.f", 4), ("P.f", 5), ("P.f", 6), ("P.f", 7), ("P.f", 8)]


@pytest.mark.parametrize("path", FILES, ids=lambda p: rel(p))
def test_host_or_gpu_memory_is_chosen_only_where_a_medium_is_built(path: Path) -> None:
    allowed = MEMORY_CHOSEN_IN.get(rel(path), set())
    stray = [f"{scope or '<module>'}:{line}" for scope, line in memory_choices(path) if scope not in allowed]
    assert stray == [], f"{rel(path)} chooses between host and GPU memory outside a medium's construction: {stray}"


def test_the_store_has_one_call_per_job_for_either_memory() -> None:
    """Host and device memory go through the same store calls (store/memory.py: SectionMemory
    names the memory), not through a pair of calls per job."""
    from kvlab_connector.store.store import ObjectWriter, Store

    paired = [f"{cls.__name__}.{n}" for cls in (Store, ObjectWriter) for n in dir(cls) if "device" in n and n != "device_file"]
    assert paired == []
