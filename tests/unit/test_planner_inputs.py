"""What a campaign records for the planner: the drive's fio limit on the stores' filesystem,
the model's geometry (campaign `model.tiny.geometry`, provenance, the plan's bytes), and the
host's CPU pressure in every memory sample (how much other work contended with the engine)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvlab.harness.campaign import CampaignError, load, parse
from kvlab.harness.compiler import cost_model, kv_bytes_per_token
from kvlab.harness.memory import CPU_PRESSURE, MemorySampler, cpu_pressure_us, process_tree
from kvlab.harness.runner import drive_limit
from kvlab.planner.calibrate import geometry_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (scripts/system-deps)")
def test_drive_limit_is_fios_read_and_write(tmp_path: Path) -> None:
    rec = drive_limit(tmp_path, size_mib=16)
    assert rec["kind"] == "drive_limit" and "error" not in rec
    assert rec["read_gbps"] > 0 and rec["write_gbps"] > 0
    assert {j["rw"] for j in rec["jobs"]} == {"read", "write"}
    assert not (tmp_path / "fio" / "kvlab-fio.dat").exists()  # nothing left behind


def test_embedded_sweep_names_its_light_model() -> None:
    c, _ = load(ROOT / "campaigns/embedded-sweep.yml")
    assert c.scenarios.sweep is not None and c.scenarios.sweep.lengths == [100, 1000, 10000, 50000, 100000]
    assert (c.scenarios.sweep.rounds, c.scenarios.sweep.average_rounds) == (10, (2, 9))
    assert c.scenarios.sweep.drop_page_cache and c.setups == ["kvlab", "vllm-example", "baseline"]
    assert kv_bytes_per_token(c) == 1024
    assert cost_model(c).geometry.kv_bytes_per_token() == 1024
    prov = {"model": {"kind": "tiny", "geometry": c.model.tiny.geometry}}
    assert geometry_of(prov).kv_bytes_per_token() == 1024
    assert geometry_of({"model": {"kind": "tiny"}}).kv_bytes_per_token() == 16384  # a run before geometry


def test_a_wrong_geometry_field_is_named() -> None:
    with pytest.raises(CampaignError, match="geometry.*num_layers"):
        parse(
            {
                "name": "x",
                "model": {"tiny": {"geometry": {"num_layers": 2}}},
                "setups": ["baseline"],
                "scenarios": {"sweep": {"lengths": [100]}},
            }
        )


def test_cpu_pressure_reads_psis_some_total(tmp_path: Path) -> None:
    f = tmp_path / "cpu"
    f.write_text(
        "some avg10=72.62 avg60=70.01 avg300=69.60 total=8438013592\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )
    assert cpu_pressure_us(f) == 8438013592
    assert cpu_pressure_us(tmp_path / "absent") is None


def test_memory_samples_carry_the_hosts_cpu_pressure() -> None:
    u = process_tree(os.getpid())
    rec = MemorySampler(lambda: {"engine": u, "cache_server": None}, 1, lambda r: None, "kvlab").sample()
    assert rec is not None
    if CPU_PRESSURE.exists():  # a kernel with PSI: a count that only grows
        assert isinstance(rec["cpu_pressure_some_us"], int) and rec["cpu_pressure_some_us"] >= 0
    else:
        assert rec["cpu_pressure_some_us"] is None
