"""`kvlab predict`: one JSON line with the acceptance's top-level scalars, the node from the lab
inventory, each restore's limit named, and a user's mistake as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.cli import main
from kvlab.planner import node as node_mod
from kvlab.planner.restore import restore

ROOT = Path(__file__).resolve().parents[2]


def predict(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["predict", *argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1  # one line: scripts take the last JSON line
    return json.loads(out[0])


def test_glm53_seed_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    j = predict(capsys, "--model", "glm-5.3", "--kv-dtype", "fp8", "--tp", "8", "--tokens", "196000")
    assert j["kv_bytes_per_token"] == 53_940 and j["kv_bytes"] == 196_000 * 53_940
    assert abs(j["kv_bytes"] / 10.75e9 - 1) < 0.02
    assert j["kv_bytes_per_gpu"] == j["kv_bytes"]  # MLA: the latent whole on every rank
    assert set(j["points"][0]["restore"]) == {"nvme-gds", "nvme-host", "dram", "dram-l2"}


def test_several_lengths_have_no_top_level_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    j = predict(capsys, "--model", "llama-3.1-70b", "--kv-dtype", "bf16", "--tokens", "1000,2000")
    assert j["kv_bytes_per_token"] == 327_680 and "kv_bytes" not in j
    assert [p["kv_bytes"] for p in j["points"]] == [327_680_000, 655_360_000]


def test_node_from_the_lab_inventory() -> None:
    n = node_mod.from_inventory(str(ROOT / "inventories/lab"), "h200-01")
    assert (n.gpus, n.gpu, n.nic_gbps, n.drives) == (8, "H200", 100.0, 4)  # 800 Gb/s variant, 4 namespaces
    assert n.drive.model.startswith("Samsung PM1743")


def test_each_restore_names_its_limit() -> None:
    h200 = node_mod.PRESETS["h200"]
    # 10 GB from four 14 GB/s drives: the drives are the slowest stage
    assert restore("nvme-gds", h200, 10e9, 8, 8.0, 0.0, 78).limit == "drives"
    assert restore("dram", h200, 10e9, 8, 8.0, 0.0, 78).limit == "host copies"
    assert restore("dram", h200, 10e9, 8, 8.0, 0.0, 78, fixed_s=2.0).limit.startswith("fixed costs")
    assert restore("nvme-gds", h200, 1e6, 8, 8.0, 1.0, 78).limit == "the tail's compute"
    # two restores in flight share the links: twice the transfer
    one, two = (restore("nvme-gds", h200, 10e9, 8, 8.0, 0.0, 78, in_flight=k).transfer_s for k in (1, 2))
    assert two == pytest.approx(2 * one)


def test_a_wrong_model_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["predict", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such preset" in err[0]


def test_node_yaml_names_a_wrong_field(tmp_path: Path) -> None:
    p = tmp_path / "node.yml"
    p.write_text("preset: h200\ndrives: 8\ndrive: {read_gbps: 7}\nnic_gbit: 400\n")
    with pytest.raises(node_mod.NodeError, match="nic_gbit"):
        node_mod.resolve(str(p))
    p.write_text("preset: h200\ndrives: 8\ndrive: {read_gbps: 7}\n")
    n = node_mod.resolve(str(p))
    assert (n.drives, n.drive.read_gbps, n.gpu) == (8, 7, "H200")
