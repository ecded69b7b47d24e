"""`vllm_server_runtime: image`: the lab's units run the registry's processes from the serving
image, through kvlab.engines.podman.podman_argv, and hand the container the GPUs, GPUDirect Storage
and the KV drives (the store's mounts), on the host's network. Rendered by `make plan
inventory=lab` (no host contacted) for one H200 node, beside the venv runtime's plan; the image's
delivery (podman load, the digest check) runs for real against a small OCI archive."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from test_lab_engine_cmdline import ROOT, read_unit, run_plan, unit_file, unit_process
from test_roles_plan import lab_plan, lab_rendered  # noqa: F401  (lab_plan: the lab's plan, rendered once)

pytestmark = pytest.mark.unit

HOST = "h200-01"
DIGEST = "sha256:" + "ab" * 32
ARCHIVE = "/srv/images/serve-cuda.oci.tar"  # a plan copies nothing: it need not exist
IMAGE_ARGS = ("-e", "vllm_server_runtime=image", "-e", f"vllm_server_image_archive={ARCHIVE}")


def plan_h200(out: Path, *extra: str) -> Path:
    return run_plan("lab", out, "--limit", HOST, *extra) / HOST


def build_store(folder: Path, manifest_digest: str) -> Path:
    """What `make image name=serve` leaves for a plan: the archive (a plan copies nothing) and
    the provenance.json beside it that records the manifest's digest."""
    folder.mkdir(parents=True)
    (folder / "provenance.json").write_text(
        json.dumps({"builder": {"meta": {"manifest_digest": manifest_digest}}})
    )
    (folder / "serve.oci.tar").write_bytes(b"")
    return folder / "serve.oci.tar"


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory, lab_plan: Path) -> dict[str, Path]:  # noqa: F811
    """The node's plan in each runtime: the venv's is the lab's plan (venv is the default)."""
    tmp = tmp_path_factory.mktemp("serve-runtime")
    archive = build_store(tmp / "store", DIGEST)
    image = ("-e", "vllm_server_runtime=image", "-e", f"vllm_server_image_archive={archive}")
    return {
        "venv": lab_plan / HOST,
        "image": plan_h200(tmp / "image", *image, "-e", f"vllm_server_image_digest={DIGEST}"),
    }


def units(root: Path) -> list[str]:
    return sorted(
        p.name
        for p in (root / "etc/systemd/system").glob("kvlab-*-*.service")
        if "vllm" in p.name or "cache" in p.name
    )


def podman_run(unit: Path) -> tuple[list[str], list[str]]:
    """(podman's options, the process after the image) of an image-runtime unit."""
    argv, _ = unit_process(unit)
    assert argv[:2] == ["/usr/bin/podman", "run"], argv[:3]
    i = argv.index(f"localhost/kvlab-serve@{DIGEST}")
    return argv[:i], argv[i + 1 :]


def volumes(options: list[str]) -> dict[str, str]:
    """--volume=SRC:DST:MODE -> {SRC: MODE}; every bind is at the same path."""
    out = {}
    for o in options:
        if o.startswith("--volume="):
            src, dst, mode = o.removeprefix("--volume=").split(":")
            assert src == dst or (src, dst) == ("/etc/cufile.json", "/etc/cufile.json"), o
            out[src] = mode
    return out


def test_both_runtimes_render_the_same_units(plans):
    assert units(plans["venv"]) == units(plans["image"]) and len(units(plans["venv"])) > 10


@pytest.mark.parametrize(
    "name",
    [
        "kvlab-vllm-baseline.service",
        "kvlab-vllm-kvlab.service",
        "kvlab-vllm-lmcache-gds.service",
        "kvlab-vllm-lmcache-mp_kvlab-detached.service",
        "kvlab-cache-lmcache-mp_kvlab-detached.service",
    ],
)
def test_units_differ_in_exec_start_only(plans, name: str):
    venv, image = (
        (plans[r] / "etc/systemd/system" / name).read_text().splitlines() for r in ("venv", "image")
    )
    assert len(venv) == len(image)
    differ = [(a, b) for a, b in zip(venv, image, strict=True) if a != b]
    assert [(a.split("=", 1)[0], b.split("=", 1)[0]) for a, b in differ] == [("ExecStart", "ExecStart")]


def test_engine_container_gets_the_gpus_gds_and_the_kv_drives(plans):
    options, process = podman_run(unit_file(plans["image"], "vllm", "kvlab"))
    stores = lab_rendered(HOST, "vllm_server_kv_store_paths")["vllm_server_kv_store_paths"]
    assert len(stores) == 4
    binds = volumes(options)
    assert {p: binds.get(p) for p in stores} == dict.fromkeys(stores, "rw")  # the KV drives, writable
    assert binds["/models/GLM-5.3-FP8"] == "ro" and binds["/etc/cufile.json"] == "ro"
    assert "--network=host" in options and "--shm-size=16g" in options and "--pull=never" in options
    assert "--device=nvidia.com/gpu=all" in options  # every GPU, through CDI
    assert [f"--device=/dev/nvidia-fs{i}" for i in range(16)] == [o for o in options if "nvidia-fs" in o]
    assert "--env=CUFILE_ENV_PATH_JSON=/etc/cufile.json" in options
    # the process is the venv unit's, from the image's interpreter
    venv_argv, _ = unit_process(unit_file(plans["venv"], "vllm", "kvlab"))
    assert process == ["python3", *venv_argv[1:]]
    assert process[process.index("--host") + 1] == "127.0.0.1"  # binds as the lab-path rules say


def test_engine_container_gets_the_units_environment_and_the_key_by_file(plans):
    unit = unit_file(plans["image"], "vllm", "kvlab")
    options, _ = podman_run(unit)
    _, env = unit_process(unit)
    passed = dict(o.removeprefix("--env=").split("=", 1) for o in options if o.startswith("--env="))
    assert {k: passed.get(k) for k in env} == env
    (env_file,) = read_unit(unit)["EnvironmentFile"]
    assert f"--env-file={env_file}" in options
    assert not any("VLLM_API_KEY" in o for o in options)


def test_a_setup_binds_only_the_folders_it_names(plans):
    """A bind's source must exist: baseline binds no store, lmcache-gds its GDS folder only."""
    base, _ = podman_run(unit_file(plans["image"], "vllm", "baseline"))
    gds, _ = podman_run(unit_file(plans["image"], "vllm", "lmcache-gds"))
    always = {"/models/GLM-5.3-FP8", "/var/lib/kvlab", "/run/udev", "/etc/cufile.json"}
    assert set(volumes(base)) == always
    assert set(volumes(gds)) == always | {"/mnt/kvlab/nvmeof3/lmcache"}


def test_cache_server_runs_from_the_same_image_in_its_own_container(plans):
    setup = "lmcache-mp+kvlab-detached"
    engine, _ = podman_run(unit_file(plans["image"], "vllm", setup))
    cache, process = podman_run(unit_file(plans["image"], "cache", setup))
    assert (
        "--name=kvlab-cache-lmcache-mp_kvlab-detached" in cache
        and "--name=kvlab-vllm-lmcache-mp_kvlab-detached" in engine
    )
    assert process[:3] == ["python3", "-m", "lmcache.cli.main"]
    assert not any(o.startswith("--env-file=") for o in cache)  # the API key is the engine's
    # detached: the engine's unit wants the cache server, it does not bind it (outlives it)
    unit = read_unit(unit_file(plans["image"], "vllm", setup))
    assert unit["Wants"][-1] == "kvlab-cache-lmcache-mp_kvlab-detached.service" and "BindsTo" not in unit


def test_the_service_users_podman_keeps_containers_in_the_units_cgroup(plans):
    conf = plans["image"] / "var/lib/kvlab/.config/containers/containers.conf"
    assert 'cgroups = "disabled"' in conf.read_text()
    assert not (plans["venv"] / "var/lib/kvlab/.config/containers/containers.conf").exists()


@pytest.mark.parametrize(
    ("extra", "variable"),
    [
        (IMAGE_ARGS, "vllm_server_image_digest"),
        (
            ("-e", "vllm_server_runtime=image", "-e", f"vllm_server_image_digest={DIGEST}"),
            "vllm_server_image_archive",
        ),
    ],
    ids=["no-digest", "no-archive"],
)
def test_image_runtime_without_its_image_fails_naming_the_variable(tmp_path: Path, extra, variable: str):
    proc = subprocess.run(
        [str(ROOT / "scripts/plan"), "lab", str(tmp_path / "plan"), "--limit", HOST, *extra],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode != 0
    said = " ".join(proc.stdout.split())
    assert f"vllm_server_runtime is image and {variable} is" in said, said[-2000:]
    assert not list((tmp_path / "plan").rglob("kvlab-vllm-*.service"))


def test_a_digest_that_is_not_the_builds_manifest_fails_naming_both(tmp_path: Path):
    """make image's last line prints the archive's sha256: pasted as the image digest, it stops."""
    archive_sha = "sha256:" + "cd" * 32
    archive = build_store(tmp_path / "store", DIGEST)
    extra = ("-e", "vllm_server_runtime=image", "-e", f"vllm_server_image_archive={archive}")
    proc = subprocess.run(
        [str(ROOT / "scripts/plan"), "lab", str(tmp_path / "plan"), "--limit", HOST, *extra,
         "-e", f"vllm_server_image_digest={archive_sha}"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    said = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert (
        f"vllm_server_image_digest is {archive_sha}, but the build of {archive} wrote manifest {DIGEST}"
        in said
    )


# ---- delivery: podman load of the archive, its digest checked before the image is named -----
def oci_archive(path: Path, payload: bytes) -> str:
    """A one-layer OCI image archive; returns its manifest's digest."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest, len(data)

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        info = tarfile.TarInfo("payload")
        info.size = len(payload)
        t.addfile(info, io.BytesIO(payload))
    ld, ls = blob(layer.getvalue())
    cfg = {
        "architecture": "amd64",
        "os": "linux",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [ld]},
    }
    cd, cs = blob(json.dumps(cfg).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": ld, "size": ls}],
    }
    md, ms = blob(json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": manifest["mediaType"], "digest": md, "size": ms}],
    }
    files = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": json.dumps(index).encode()}
    files |= {f"blobs/sha256/{d.removeprefix('sha256:')}": b for d, b in blobs.items()}
    with tarfile.open(path, "w") as t:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return md


def load(tmp: Path, archive: Path, digest: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The role's image_load.yml, as this machine's user, into a podman store of its own."""
    store = tmp / "store"
    (tmp / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{store}/graph"\nrunroot = "{store}/run"\n'
    )
    pb = tmp / "play.yml"
    pb.write_text(yaml.safe_dump([{
        "name": "Load", "hosts": "localhost", "gather_facts": False, "connection": "local",
        "tasks": [{"name": "Load", "ansible.builtin.include_role": {"name": "vllm_server", "tasks_from": "image_load"}}],
    }]))  # fmt: skip
    extra = {
        "ansible_python_interpreter": sys.executable,
        "ansible_become_method": "su",  # root to itself: no sudo needed
        "vllm_server_user": os.environ.get("USER", "root"),
        "vllm_server_state_dir": str(tmp),
        "vllm_server_image_digest": digest,
        "vllm_server_image_archive": str(archive),
        "__vllm_server_image_file": str(archive),
        # the naming notifies the engine's restart: there is no engine here
        "__vllm_server_render_only": False,
        "vllm_server_start": False,
    }
    env = os.environ | {
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", "ANSIBLE_STRATEGY": "linear",
        "ANSIBLE_ROLES_PATH": str(ROOT / "roles"), "CONTAINERS_STORAGE_CONF": str(tmp / "storage.conf"),
    }  # fmt: skip
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", str(pb), "-e", json.dumps(extra)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    return proc, store


def podman_images(store: Path, tmp: Path) -> str:
    env = os.environ | {"CONTAINERS_STORAGE_CONF": str(tmp / "storage.conf")}
    return subprocess.run(
        ["podman", "images", "--digests", "--format", "{{.Repository}}:{{.Tag}} {{.Digest}}"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout  # fmt: skip


needs_podman = pytest.mark.skipif(
    shutil.which("podman") is None or os.geteuid() != 0,
    reason="needs podman (scripts/system-deps) and root (become: su to the service user)",
)


@needs_podman
def test_loaded_image_is_named_when_its_digest_is_the_builds(tmp_path: Path):
    archive = tmp_path / "serve.oci.tar"
    digest = oci_archive(archive, b"the build\n")
    proc, store = load(tmp_path, archive, digest)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"localhost/kvlab-serve:{digest[7:23]} {digest}" in podman_images(store, tmp_path)
    again, _ = load(tmp_path, archive, digest)  # present by digest: nothing loaded again
    assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout[-2000:]


@needs_podman
def test_an_archive_of_another_build_fails_naming_both_digests(tmp_path: Path):
    archive = tmp_path / "serve.oci.tar"
    loaded = oci_archive(archive, b"another build\n")
    proc, store = load(tmp_path, archive, DIGEST)
    said = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert f"loaded on localhost as {loaded}, but vllm_server_image_digest is {DIGEST}" in said, said[-2000:]
    assert "localhost/kvlab-serve" not in podman_images(store, tmp_path)  # never named
