"""One process of a setup, run from the serving image (images/serve) with podman.

`podman_argv` is the one place that turns a kvlab.setups.registry.ProcessSpec into the podman command that
runs it in a container: `kvlab campaign run --engine container` starts it here, and the lab's
vllm_server role renders its systemd unit from the same function (`vllm_server_runtime: image`),
so the two differ only in their parameters, never in the flags.

The signature is a contract with the role's filter plugin: add keyword parameters with defaults,
never change or remove one.

- `--network host`: the engine binds the address its setup renders (127.0.0.1 here, the lab-path
  rules there), so readiness checks, ports and dev routes work as for a venv engine.
- The model is mounted read-only at its own path, and every store, results or state folder
  read-write at its own path: the argv the setup rendered names host paths and stays valid.
- A sized /dev/shm (vLLM and LMCache's cache server move tensors through it).
- The environment goes on the command line as `--env NAME=VALUE`, except secrets: those come in
  `env_file` (the API key reaches vLLM as VLLM_API_KEY from the service's environment file and
  never appears on a command line).
- GPUs (lab only): CDI devices (`nvidia-ctk cdi generate` writes nvidia.com/gpu=all), the GDS
  devices /dev/nvidia-fs*, and cufile.json mounted read-only where CUFILE_ENV_PATH_JSON points.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvlab.setups.registry import ProcessSpec

# What this machine's podman needs (crun refuses the hybrid cgroup layout, rlimits cannot be set
# here): runc, cgroupfs and no default ulimits, in the project's containers.conf, never /etc's.
CONTAINERS_CONF = Path(__file__).with_name("containers.conf")
CUFILE_IN_CONTAINER = "/etc/cufile.json"


@dataclass(frozen=True)
class Mount:
    """A host folder or file bound at the same path (target None) or at `target`."""

    source: str
    target: str | None = None
    read_only: bool = False

    def arg(self) -> str:
        opts = "ro" if self.read_only else "rw"
        return f"--volume={self.source}:{self.target or self.source}:{opts}"


@dataclass(frozen=True)
class GpuHandoff:
    """What a GPU node hands to the container; the driver stays on the host."""

    cdi_devices: tuple[str, ...] = ("nvidia.com/gpu=all",)
    # GPUDirect Storage: /dev/nvidia-fs0.. (the nvidia-fs module's devices), one --device each
    devices: tuple[str, ...] = ()
    cufile_json: str | None = None  # host path of cufile.json (GDS configuration)


class ContainerError(ValueError):
    """A parameter that cannot become a podman command line; the message names it."""


def podman_argv(
    spec: ProcessSpec,
    *,
    image: str,
    name: str,
    mounts: Sequence[Mount] = (),
    shm_size: str = "2g",
    gpus: GpuHandoff | None = None,
    env_file: str | None = None,
    podman: str = "podman",
    workdir: str | None = None,
) -> list[str]:
    """The podman command that runs `spec` from `image` as container `name`.

    `image`: an image ID or reference the node's podman has loaded (`podman load` of the build's
    archive). `name`: the container's name; `--replace` removes a stale one of the same name (a
    unit restarted after a crash). The container is removed when it exits (`--rm`); the caller
    still runs `podman rm -f NAME` when it stops it (kvlab.engines.podman.rm_argv).
    """
    if not spec.argv:
        raise ContainerError(f"container {name}: the process spec has no argv")
    if not image:
        raise ContainerError(f"container {name}: image is empty (give the loaded image's ID or reference)")
    if not name or any(c.isspace() or c == "/" for c in name):
        raise ContainerError(f"container name {name!r}: use letters, digits, '-', '_' or '.'")
    argv = [
        podman,
        "run",
        "--rm",
        "--replace",
        f"--name={name}",
        "--network=host",
        "--pull=never",
        f"--shm-size={shm_size}",
        "--init",  # a PID 1 that reaps the engine's workers and forwards signals
    ]
    if workdir:
        argv.append(f"--workdir={workdir}")
    for m in sorted(set(mounts), key=lambda m: (m.target or m.source, m.source)):
        argv.append(m.arg())
    if gpus is not None:
        argv += [f"--device={d}" for d in gpus.cdi_devices]
        argv += [f"--device={d}" for d in gpus.devices]
        if gpus.cufile_json:
            argv.append(Mount(gpus.cufile_json, CUFILE_IN_CONTAINER, read_only=True).arg())
            argv.append(f"--env=CUFILE_ENV_PATH_JSON={CUFILE_IN_CONTAINER}")
    if env_file:
        argv.append(f"--env-file={env_file}")
    for key in sorted(spec.env):
        if "=" in key or not key:
            raise ContainerError(f"container {name}: environment name {key!r} is not a variable name")
        argv.append(f"--env={key}={spec.env[key]}")
    argv.append(image)
    argv += list(spec.argv)
    return argv


def rm_argv(name: str, podman: str = "podman") -> list[str]:
    """Removes the container whatever its state (the stop path's `finally`)."""
    return [podman, "rm", "--force", "--ignore", "--time=10", name]


def inspect_pid_argv(name: str, podman: str = "podman") -> list[str]:
    """Prints the host PID of the container's first process (0 while it is not running)."""
    return [podman, "inspect", "--type=container", "--format={{.State.Pid}}", name]


def podman_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every podman call of kvlab runs in: the project's containers.conf."""
    return dict(os.environ if base is None else base, CONTAINERS_CONF=str(CONTAINERS_CONF))
