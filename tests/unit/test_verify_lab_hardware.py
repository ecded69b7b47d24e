"""kvlab.verify deselects the lab tests (GPU health, drives, time sync) on a host whose inventory
declares kvlab_lab_hardware: false, naming that variable; a host with lab hardware runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def targets_suite(tmp: Path, lab_hardware: bool) -> subprocess.CompletedProcess:
    inv = tmp / "hosts.yml"
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "kvlab_lab_hardware": lab_hardware}  # fmt: skip
    inv.write_text(yaml.safe_dump({"all": {"children": {"nvmeof_targets": {"hosts": {"target": host}}}}}))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvlab.verify",
         "tests/lab/test_target_drives.py", "tests/lab/test_time_sync.py",
         "--hosts=ansible://nvmeof_targets", f"--ansible-inventory={inv}"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=os.environ | {"CI": "", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
    )  # fmt: skip


def test_no_lab_hardware_deselects_drive_and_time_checks(tmp_path: Path) -> None:
    proc = targets_suite(tmp_path, lab_hardware=False)
    assert "declares kvlab_lab_hardware: false (no lab hardware there" in proc.stdout, proc.stdout[-2000:]
    assert "3 deselected" in proc.stdout, proc.stdout[-2000:]
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_lab_hardware_runs_them(tmp_path: Path) -> None:
    proc = targets_suite(tmp_path, lab_hardware=True)
    # this machine exports nothing: the drive checks skip saying so; the time check runs
    assert "deselected" not in proc.stdout, proc.stdout[-2000:]
    assert "test_time_sync.py on ansible://target: 1 " in proc.stdout, proc.stdout[-2000:]
    assert "test_target_drives.py on ansible://target: 2 skipped" in proc.stdout, proc.stdout[-2000:]
