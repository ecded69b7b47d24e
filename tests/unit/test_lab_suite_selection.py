"""The lab suite against an inventory, as `make verify` runs it (the kvlab.verify plugin): a GPU
node whose inventory declares no GPU (kvlab_gpus_expected: false, the testbed) has its GPU
checks deselected, never skipped; a node that should have GPUs runs them (and here, without a
driver, each says what is absent)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def lab_suite(tmp: Path, expected: bool) -> subprocess.CompletedProcess:
    inv = tmp / "hosts.yml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"gpu_nodes": {"hosts": {"node": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "kvlab_gpus_expected": expected}}}}}}))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvlab.verify", "tests/lab",
         "--hosts=ansible://gpu_nodes", f"--ansible-inventory={inv}"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ | {"CI": "", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
    )


def test_no_gpu_declared_deselects_the_gpu_checks(tmp_path: Path) -> None:
    proc = lab_suite(tmp_path, expected=False)
    assert "declares kvlab_gpus_expected: false" in proc.stdout, proc.stdout[-2000:]
    assert " deselected" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
    assert proc.returncode == 0, "the inventory's answer for this host, not 'no tests ran'"


def test_gpus_declared_run_the_gpu_checks(tmp_path: Path) -> None:
    proc = lab_suite(tmp_path, expected=True)
    assert "deselected" not in proc.stdout and "skipped" in proc.stdout, proc.stdout[-2000:]
