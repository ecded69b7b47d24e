"""`make plan inventory=lab`'s engine units, as a lab engineer's node would start them: the
dtype FP8 checkpoints accept, dev mode only on loopback, after the fabric manager, and every
setup's Python packages in the lab's lock."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from test_lab_engine_cmdline import ROOT, read_unit, unit_process
from test_roles_plan import lab_plan  # noqa: F401  (lab_plan: the lab's plan, rendered once)

pytestmark = pytest.mark.unit

LOCKS = ROOT / "roles"
VLLM_LOCK = LOCKS / "vllm_server/files/vllm-0.33.0-cp312-manylinux-x86_64.lock"
SIDE_LOCKS = (LOCKS / "kvlab_connector/files/kvlab-connector-deps.lock", LOCKS / "bench_runner/files/kvlab-bench-deps.lock")


@pytest.fixture(scope="module")
def units(lab_plan: Path) -> list[Path]:  # noqa: F811
    found = sorted(lab_plan.glob("*/etc/systemd/system/kvlab-vllm-*.service"))
    assert found
    return found


def test_no_unit_passes_float32(units: list[Path]) -> None:
    """The old default (float32) crash-looped every lab unit on its FP8 checkpoint."""
    for unit in units:
        argv, _ = unit_process(unit)
        assert argv[argv.index("--dtype") + 1] == "auto", unit


def test_dev_mode_only_with_an_explicit_loopback_host(units: list[Path]) -> None:
    for unit in units:
        argv, env = unit_process(unit)
        if env.get("VLLM_SERVER_DEV_MODE") == "1":
            assert argv[argv.index("--host") + 1] in ("127.0.0.1", "::1"), unit


def test_engines_start_after_the_fabric_manager(units: list[Path]) -> None:
    for unit in units:
        after = " ".join(read_unit(unit)["After"]).split()
        assert "nvidia-fabricmanager.service" in after, unit


def pins(lock: Path) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", lock.read_text(), re.M))


def test_every_lab_setup_imports_from_the_lab_lock() -> None:
    """LMCache's setups import lmcache: the lab's lock must hold it (it did not)."""
    setups_ = yaml.safe_load((ROOT / "inventories/lab/group_vars/gpu_nodes/main.yml").read_text())["vllm_server_setups"]
    locked = pins(VLLM_LOCK)
    assert {"vllm", "kvikio-cu13", "xxhash"} <= set(locked)
    if any(s.startswith("lmcache") for s in setups_):
        assert "lmcache" in locked


@pytest.mark.parametrize("lock", SIDE_LOCKS, ids=lambda p: p.name)
def test_side_locks_agree_with_the_vllm_lock(lock: Path) -> None:
    """Installed into the same environment: one pin apart would flip on every deploy."""
    vllm = pins(VLLM_LOCK)
    assert {k: v for k, v in pins(lock).items() if k in vllm} == {k: vllm[k] for k in pins(lock) if k in vllm}
