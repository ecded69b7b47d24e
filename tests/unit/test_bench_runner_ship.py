"""roles/bench_runner ships a campaign with every file it refers to, checked by sha256.

Which fields name files, and where they resolve, is the campaign loader's (`kvlab campaign
files`, CampaignFile fields); the role calls it on the controller. The role's own tasks
(validate.yml, ship.yml) run for real here with Ansible, the "node" being this machine
over the local connection and its results folder a tmp dir; the copy is then loaded from
another working folder to prove that its references still hold.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvlab.cli import main
from kvlab.harness import campaign

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CAMPAIGNS = sorted((ROOT / "campaigns").glob("*.yml"))
MOONCAKE = ROOT / "campaigns" / "embedded-mooncake.yml"
TRACE_FIELD = "scenarios.agents.source.mooncake.path"
PLAYBOOK = """
- name: Ship a campaign as bench_runner does
  hosts: node
  gather_facts: false
  tasks:
    - name: Validate
      ansible.builtin.include_role: {name: bench_runner, tasks_from: validate}
    - name: Ship
      ansible.builtin.include_role: {name: bench_runner, tasks_from: ship}
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_json(path: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["campaign", "files", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def one_line_error(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["campaign", "files", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    return err


def with_trace(tmp_path: Path, value: str, write: str | None = "traces/t.jsonl") -> Path:
    """embedded-mooncake.yml in tmp_path with its trace path set to `value`; the real trace
    copied to `write` (relative to tmp_path) unless None."""
    d = yaml.safe_load(MOONCAKE.read_text())
    d["scenarios"]["agents"]["source"]["mooncake"]["path"] = value
    if write:
        (tmp_path / write).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(MOONCAKE.parent / "traces" / "mooncake-synthetic-3850-4049.jsonl", tmp_path / write)
    (tmp_path / "c").mkdir(exist_ok=True)
    out = tmp_path / "c" / "camp.yml" if value.startswith("../") else tmp_path / "camp.yml"
    out.write_text(yaml.safe_dump(d))
    return out


# ---- the loader: which files, where, what to check -------------------------------------
@pytest.mark.parametrize("path", CAMPAIGNS, ids=lambda p: p.name)
def test_every_campaign_lists_its_files_with_their_sha256(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ship = files_json(path, capsys)
    assert ship["campaign"] == {"field": "(the campaign)", "value": str(path), "src": str(path),
                                "dest": path.name, "sha256": sha256(path)}
    for f in ship["files"]:
        assert Path(f["src"]) == (path.parent / f["dest"]).resolve() and f["sha256"] == sha256(Path(f["src"]))


def test_the_mooncake_campaign_ships_its_trace(capsys: pytest.CaptureFixture[str]) -> None:
    (f,) = files_json(MOONCAKE, capsys)["files"]
    assert (f["field"], f["dest"]) == (TRACE_FIELD, "traces/mooncake-synthetic-3850-4049.jsonl")


def test_file_fields_come_from_the_schema() -> None:
    """Every field typed CampaignFile, found by walking the model: the model folder (on the
    engine host, never shipped) is not one."""
    c, _ = campaign.load(MOONCAKE)
    assert [(r.field, r.value) for r in c.files()] == [(TRACE_FIELD, "traces/mooncake-synthetic-3850-4049.jsonl")]
    lab, _ = campaign.load(ROOT / "campaigns" / "seed-nvme-vs-dram.yml")
    assert lab.model.path and lab.files() == []


@pytest.mark.parametrize(
    ("value", "write", "message"),
    [
        ("traces/gone.jsonl", None, f"camp.yml: {TRACE_FIELD}: traces/gone.jsonl: no such file ({{tmp}}/traces/gone.jsonl): "
         "fix the path (relative to the campaign file) or add the file"),
        ("{tmp}/traces/t.jsonl", "traces/t.jsonl", f"camp.yml: {TRACE_FIELD}: {{tmp}}/traces/t.jsonl is absolute"),
        ("../traces/t.jsonl", "traces/t.jsonl", f"camp.yml: {TRACE_FIELD}: ../traces/t.jsonl is outside"),
    ],
    ids=["missing", "absolute", "outside"],
)
def test_a_file_that_cannot_ship_is_one_line_naming_the_field(
    value: str, write: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = with_trace(tmp_path, value.format(tmp=tmp_path), write)
    err = one_line_error(path, capsys)
    assert err.startswith("kvlab: ") and message.format(tmp=tmp_path) in err
    if write:
        assert "give it relative to the campaign file, inside its folder" in err


def test_a_path_through_a_subfolder_keeps_its_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = with_trace(tmp_path, "data/./x/../traces/t.jsonl", "data/traces/t.jsonl")
    (tmp_path / "data" / "x").mkdir()
    (f,) = files_json(path, capsys)["files"]
    assert f["dest"] == "data/traces/t.jsonl" and f["src"] == str(tmp_path / "data" / "traces" / "t.jsonl")


# ---- the role, run for real against this machine ---------------------------------------
def ship(tmp_path: Path, campaign_file: Path, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(
        {"all": {"hosts": {"node": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "hosts.yml", "play.yml",
            "-e", f"bench_runner_campaign={campaign_file}", "-e", f"bench_runner_results_dir={tmp_path / 'node'}",
            *extra]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
           "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / ".ansible-tmp")}
    return subprocess.run(argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=False)


def test_the_role_ships_the_campaign_and_its_trace_and_the_copy_still_finds_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = ship(tmp_path, MOONCAKE)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    (run,) = (tmp_path / "node").iterdir()
    copy = run / "campaign" / MOONCAKE.name
    trace = run / "campaign" / "traces" / "mooncake-synthetic-3850-4049.jsonl"
    assert copy.read_bytes() == MOONCAKE.read_bytes()
    assert trace.read_bytes() == (MOONCAKE.parent / "traces" / trace.name).read_bytes()
    assert "Check that every copy is the controller's file, byte for byte" in r.stdout
    # The copy, loaded on the "node" from elsewhere, resolves its trace beside itself ...
    (f,) = files_json(copy, capsys)["files"]
    assert Path(f["src"]) == trace and f["sha256"] == sha256(MOONCAKE.parent / "traces" / trace.name)
    # ... and reads it (the plan sizes the agents step from the trace's prompts).
    assert main(["campaign", "plan", str(copy)]) == 0
    assert "agents: N=4" in capsys.readouterr().out


def test_a_missing_trace_stops_the_play_on_the_controller_naming_the_field(tmp_path: Path) -> None:
    r = ship(tmp_path, with_trace(tmp_path, "traces/gone.jsonl", None))
    assert r.returncode != 0
    assert (f"bench_runner: kvlab: {tmp_path}/camp.yml: {TRACE_FIELD}: traces/gone.jsonl: no such file"
            in r.stdout), r.stdout[-3000:]
    assert not (tmp_path / "node").exists()  # nothing reached the node


def test_a_copy_that_differs_from_the_controllers_fails_the_play(tmp_path: Path) -> None:
    """The check on arrival: a shipment whose recorded sha256 is not what lands on the node."""
    path = with_trace(tmp_path, "traces/t.jsonl")
    c, sha = campaign.load(path)
    wrong = {"campaign": {"field": "(the campaign)", "value": str(path), "src": str(path), "dest": path.name,
                          "sha256": sha},
             "files": [{"field": TRACE_FIELD, "value": "traces/t.jsonl", "src": str(tmp_path / "traces/t.jsonl"),
                        "dest": "traces/t.jsonl", "sha256": "0" * 64}]}
    (tmp_path / "wrong.json").write_text(json.dumps({"__bench_runner_shipment": wrong}))
    r = ship(tmp_path, path, "-e", "@wrong.json")
    assert r.returncode != 0
    got = sha256(tmp_path / "traces" / "t.jsonl")
    assert f"bench_runner: {TRACE_FIELD}:" in r.stdout and f"has sha256 {got}, the controller's" in r.stdout, (
        r.stdout[-3000:])
