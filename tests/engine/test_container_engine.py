"""`--engine container`: the setups run from the CPU serving image (images/serve) and behave as
the venv's engines: the same restored tokens and the same greedy outputs (each restore
request's `output_digest`). The restore TTFT ratio (container over venv) is printed, never
asserted (two cores shared with everything else)."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from kvlab.harness import campaign
from kvlab.harness.compiler import run_campaign
from kvlab.harness.runner import LocalEngines

HERE = Path(__file__).resolve().parent
CAMPAIGN = HERE / "container-small.yml"

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def container_engines(serving_image):
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: run scripts/system-deps (installs podman and runc)")
    from kvlab.engines.container import ContainerEngines

    serving_image()  # the build conftest.py started at the tier's start, if one was needed
    return ContainerEngines("cpu")  # builds the image once per set of inputs, loads it, checks its digest


def requests(run_dir: Path) -> list[dict]:
    out = []
    for f in sorted(run_dir.rglob("*.jsonl")):
        out += [r for r in map(json.loads, f.read_text().splitlines()) if r.get("kind") == "request"]
    return out


@pytest.fixture(scope="module")
def runs(tiny_model: Path, container_engines, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    c, sha = campaign.load(CAMPAIGN)
    out = {}
    for kind, engines in (("local", LocalEngines()), ("container", container_engines)):
        out[kind] = run_campaign(c, CAMPAIGN, sha, tmp_path_factory.mktemp(f"runs-{kind}"), engines=engines)
    return out


def test_provenance_carries_the_image_digest_of_each_engine(runs, container_engines) -> None:
    prov = json.loads((runs["container"] / "provenance.json").read_text())
    image = prov["engine_control"]["image"]
    assert image["digest"] == container_engines.digest and image["digest"].startswith("sha256:")
    assert prov["engine"]["kvlab"]["image"]["manifest_digest"] == container_engines.manifest_digest
    assert container_engines.image_id in prov["engine"]["kvlab"]["argv"]
    assert "image" not in json.loads((runs["local"] / "provenance.json").read_text())["engine"]["kvlab"]


def test_the_same_tokens_are_restored_and_the_ttft_ratio_is_reported(runs) -> None:
    by = {k: requests(v) for k, v in runs.items()}

    def cached(kind: str) -> list[tuple]:
        return sorted(
            (r["setup"], r["phase"], r.get("repeat"), r["cached_tokens"], r["output_tokens"])
            for r in by[kind]
            if r["scenario"] == "restore" and "error" not in r
        )

    assert cached("container") == cached("local")
    assert [
        r for r in cached("container") if r[0] == "kvlab" and r[1] == "warm" and r[3] >= 2048
    ]
    for phase in ("warm",):
        med = {
            k: statistics.median(
                r["ttft_s"] for r in by[k] if r["setup"] == "kvlab" and r.get("phase") == phase
            )
            for k in by
        }
        print(
            f"kvlab {phase} restore TTFT median: container {med['container']:.3f} s, venv {med['local']:.3f} s, "
            f"ratio {med['container'] / med['local']:.2f}"
        )


def test_the_same_greedy_outputs_from_the_image_and_the_venv(runs) -> None:
    # Every restore request records its answer's digest: the image's answers are the venv's,
    # request for request, and a restored prompt answers as the computed one did.
    answers = {
        kind: {(r["setup"], r["phase"], r.get("repeat")): r.get("output_digest")
               for r in requests(run) if r["scenario"] == "restore" and "error" not in r}
        for kind, run in runs.items()
    }
    assert answers["container"] == answers["local"]
    for kind, got in answers.items():
        computed = got[("kvlab", "compute", None)]
        warm = [d for (setup, phase, _), d in got.items() if setup == "kvlab" and phase == "warm"]
        assert computed and warm and set(warm) == {computed}, (kind, got)


def test_the_sbom_lists_every_locked_wheel_with_its_hash(container_engines) -> None:
    from kvlab.images import serve

    lock = serve.parse_wheel_lock((HERE.parents[1] / "images/serve/cpu/requirements.lock").read_text())
    bom = json.loads((container_engines.store / "sbom.cdx.json").read_text())
    wheels = {}
    for comp in bom["components"]:
        if comp.get("purl", "").startswith("pkg:pypi/"):
            wheels[comp["name"].lower().replace("_", "-")] = (
                comp["version"],
                {h["content"] for h in comp["hashes"]},
            )
    assert set(wheels) == set(lock)
    for name, (version, hashes) in wheels.items():
        assert version == lock[name][0] and hashes and hashes <= set(lock[name][1]), name


def test_memory_samples_the_containers_processes(runs) -> None:
    # the `podman run` process itself holds ~50 MiB; the engine's processes are conmon's children
    for kind, run_dir in runs.items():
        recs = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
        peak = max(
            (r.get("engine_rss_bytes") or 0)
            for r in recs
            if r.get("kind") == "memory" and r["setup"] == "kvlab"
        )
        assert peak > 300 << 20, (kind, peak)


def test_the_sbom_lists_every_locked_deb_with_its_hash(container_engines) -> None:
    from kvlab.images import debian, sbom

    defn = debian.Definition.load(HERE.parents[1] / "images/serve/base")
    lock = {n: (p.version, p.sha256) for n, p in defn.lock.items()}
    assert sbom.against_lock(container_engines.store / "sbom.cdx.json", "deb", lock) == []


CHECK_PYC = """
import os, struct, sys
bad = []
for top in sys.argv[1:]:
    for d, _, names in os.walk(top):
        for n in names:
            if n.endswith(".pyc"):
                with open(os.path.join(d, n), "rb") as f:
                    if struct.unpack("<I", f.read(8)[4:])[0] != 1:
                        bad.append(os.path.join(d, n))
print(len(bad), *bad[:5])
"""


def test_every_pyc_in_the_image_is_unchecked_hash(container_engines) -> None:
    # a timestamped .pyc carries the time pip unpacked its source: two builds would differ
    import subprocess

    from kvlab.engines import podman as container
    from kvlab.images import serve

    argv = ["podman", "run", "--rm", "--pull=never", container_engines.image_id, "python3", "-S", "-c", CHECK_PYC,
            f"/{serve.SITE}", f"/{serve.CONNECTOR_SITE}"]  # fmt: skip
    res = subprocess.run(
        argv, env=container.podman_env(), capture_output=True, text=True, timeout=300, check=True
    )
    assert res.stdout.split()[:1] == ["0"], res.stdout
