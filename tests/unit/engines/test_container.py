"""kvlab.engines.podman: a setup's process spec becomes the podman command that runs it from the image."""

from __future__ import annotations

import configparser

import pytest

from kvlab.engines import podman as container
from kvlab.setups import registry as setups

pytestmark = pytest.mark.unit


def kvlab_engine() -> setups.Deployment:
    p = setups.EngineParams(model="/models/tiny", python="python3", kv_store_paths=("/mnt/a", "/mnt/b"))
    return setups.render("kvlab", p)


def test_argv_runs_the_rendered_command_unchanged_after_the_image():
    d = kvlab_engine()
    argv = container.podman_argv(d.engine, image="sha256:abc", name="kvlab-engine-kvlab")
    i = argv.index("sha256:abc")
    assert argv[i + 1 :] == list(d.engine.argv)
    assert argv[:2] == ["podman", "run"]
    assert "--network=host" in argv[:i] and "--rm" in argv[:i] and "--pull=never" in argv[:i]
    # every variable of the spec, sorted, and nothing the harness's own environment holds
    envs = [a.removeprefix("--env=") for a in argv[:i] if a.startswith("--env=")]
    assert envs == [f"{k}={v}" for k, v in sorted(d.engine.env.items())]


def test_mounts_bind_at_the_same_path_model_read_only():
    d = kvlab_engine()
    argv = container.podman_argv(
        d.engine,
        image="img",
        name="e",
        mounts=[
            container.Mount("/mnt/b"),
            container.Mount("/models/tiny", read_only=True),
            container.Mount("/mnt/a"),
        ],
        shm_size="4g",
    )
    assert [a for a in argv if a.startswith("--volume=")] == [
        "--volume=/mnt/a:/mnt/a:rw",
        "--volume=/mnt/b:/mnt/b:rw",
        "--volume=/models/tiny:/models/tiny:ro",
    ]
    assert "--shm-size=4g" in argv


def test_gpu_handoff_cdi_gds_devices_and_cufile():
    d = kvlab_engine()
    gpus = container.GpuHandoff(
        devices=("/dev/nvidia-fs0", "/dev/nvidia-fs1"), cufile_json="/etc/kvlab/cufile.json"
    )
    argv = container.podman_argv(d.engine, image="img", name="e", gpus=gpus, env_file="/etc/kvlab/engine.env")
    i = argv.index("img")
    head = argv[:i]
    assert "--device=nvidia.com/gpu=all" in head
    assert "--device=/dev/nvidia-fs0" in head and "--device=/dev/nvidia-fs1" in head
    assert "--volume=/etc/kvlab/cufile.json:/etc/cufile.json:ro" in head
    assert "--env=CUFILE_ENV_PATH_JSON=/etc/cufile.json" in head
    assert "--env-file=/etc/kvlab/engine.env" in head
    # no GPU arguments at all without a handoff (the CPU image here)
    plain = container.podman_argv(d.engine, image="img", name="e")
    assert not [a for a in plain if a.startswith("--device")]


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"image": ""}, "image"), ({"name": "a b"}, "container name"), ({"name": "x/y"}, "container name")],
)
def test_bad_parameters_name_the_field(kw, field):
    args = {"image": "img", "name": "e"} | kw
    with pytest.raises(container.ContainerError, match=field):
        container.podman_argv(kvlab_engine().engine, **args)


def test_rm_and_the_projects_containers_conf():
    assert container.rm_argv("e")[:3] == ["podman", "rm", "--force"]
    env = container.podman_env({"PATH": "/usr/bin"})
    assert env == {"PATH": "/usr/bin", "CONTAINERS_CONF": str(container.CONTAINERS_CONF)}
    conf = configparser.ConfigParser()
    conf.read_string(container.CONTAINERS_CONF.read_text())
    assert conf["containers"]["default_ulimits"] == "[]"
    assert conf["engine"]["runtime"] == '"runc"'


def test_engine_container_refuses_an_endpoint_and_a_plan_loads_no_image():
    import argparse

    from kvlab.cli import UserError
    from kvlab.harness import cli

    with pytest.raises(UserError, match="--endpoint is for --engine systemd"):
        cli._engines(argparse.Namespace(engine="container", endpoint="http://127.0.0.1:8000", dry_run=False))
    assert cli._engines(argparse.Namespace(engine="container", endpoint=None, dry_run=True)) is None
