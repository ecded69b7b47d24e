"""Filters that render vLLM's systemd units from kvlab's setup registry (and, for the image
runtime, kvlab.engines.podman's podman command that runs the same process from the serving image).

The registry (src/kvlab/setups/registry.py) is the one source of engine command lines: the role
never restates a flag. These filters run on the controller, from the checkout the role
lives in, so a plan or a deploy renders exactly what `kvlab setup render` prints there.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

_SRC = Path(__file__).resolve().parents[3] / "src"
# systemd splits ExecStart= on whitespace, expands %specifiers and $VARIABLES: anything
# beyond these characters is double-quoted with C escapes.
_BARE = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")


def _checkout_first() -> None:
    # The registry of this checkout, not whatever kvlab another environment installed.
    if _SRC.is_dir() and str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))


def _registry():
    _checkout_first()
    try:
        from kvlab.setups import cli as setup_cli
        from kvlab.setups import registry as setups
    except ImportError as e:  # pragma: no cover - a broken checkout
        raise AnsibleFilterError(
            f"kvlab_setup_render: cannot import kvlab's setup registry from {_SRC} ({e}): "
            "run Ansible from the repository's .venv (make setup)"
        ) from None
    return setups, setup_cli


def kvlab_setup_render(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The Deployment of setup `name` for engine parameters `params`, as a plain dict."""
    setups, setup_cli = _registry()
    try:
        deployment = setups.render(str(name), setup_cli.params_from_mapping(dict(params)))
    except setups.SetupError as e:
        raise AnsibleFilterError(f"vllm_server_setups: {e}") from None
    except TypeError as e:
        raise AnsibleFilterError(f"vllm_server engine parameters: {e}") from None
    return dataclasses.asdict(deployment)


def kvlab_setup_names(_: Any = None) -> list[str]:
    """Every setup the registry knows (for validation messages)."""
    setups, _cli = _registry()
    return sorted(setups.REGISTRY)


def systemd_escape_arg(value: Any) -> str:
    """One argument or assignment as systemd reads it back verbatim."""
    text = str(value).replace("%", "%%").replace("$", "$$")
    if _BARE.match(text):
        return text
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{text}"'


def systemd_unit_safe(name: str) -> str:
    """A setup name as a unit name may spell it (systemd allows A-Z a-z 0-9 : _ . - only):
    'lmcache-mp+kvlab' -> 'lmcache-mp_kvlab'."""
    return re.sub(r"[^A-Za-z0-9:_.-]", "_", str(name))


def systemd_exec(argv: list[Any]) -> str:
    """An ExecStart= value for argv: argv[0] must be an absolute path."""
    if not argv or not str(argv[0]).startswith("/"):
        raise AnsibleFilterError(
            f"systemd_exec: the first argument must be an absolute path, got {argv[:1]!r}: "
            "set vllm_server_venv to an absolute folder"
        )
    return " ".join(systemd_escape_arg(a) for a in argv)


def _container():
    _checkout_first()
    from kvlab.engines import podman as container
    from kvlab.setups import registry as setups

    return container, setups


def kvlab_setup_folders(spec: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """The one list of data folders a rendered process (a Deployment's engine or companion, as a
    dict) reads and writes: each engine parameter that names a folder (kvlab's store paths, which
    are also LMCache's L2 where kvlab serves it; ExampleConnector's folder; LMCache's disk, GDS and
    MP fs L2 folder) where the process's command line or environment names it. A container binds
    each, a unit requires the mount under each (RequiresMountsFor)."""
    named = json.dumps(spec)
    folders = [
        *params.get("kv_store_paths", ()),
        params.get("example_storage_path"),
        params.get("cache_server_l2_path"),
    ]
    out: list[str] = []
    for p in folders:
        p = str(p or "").rstrip("/")
        if p and p in named and p not in out:
            out.append(p)
    return out


def _mounts(spec: dict[str, Any], params: dict[str, Any], options: dict[str, Any]) -> list[Any]:
    """What the process reads and writes on the node, bound at the same path: the model
    read-only and the state folder (its working folder) read-write; each data folder it names
    (kvlab_setup_folders: a bind's source must exist, a setup that uses none needs none); then
    the site's own (vllm_server_image_mounts)."""
    container, _ = _container()
    mounts = [
        container.Mount(str(params["model"]), read_only=True),
        container.Mount(str(options["state_dir"])),
    ]
    mounts += [container.Mount(p) for p in kvlab_setup_folders(spec, params)]
    for i, m in enumerate(options.get("mounts", [])):
        if not isinstance(m, dict) or not str(m.get("path", "")).startswith("/"):
            raise AnsibleFilterError(
                f"vllm_server_image_mounts[{i}] is {m!r}: give {{path: /absolute/folder, read_only: true|false}}"
            )
        mounts.append(container.Mount(str(m["path"]), read_only=bool(m.get("read_only", False))))
    return mounts


def kvlab_container_exec(
    spec: dict[str, Any], env: dict[str, Any], name: str, params: dict[str, Any], options: dict[str, Any]
) -> str:
    """ExecStart= of a rendered process (a Deployment's engine or companion, as a dict) run from
    the serving image: kvlab.engines.podman.podman_argv, the function `kvlab campaign run --engine
    container` starts containers with. `env` is what the unit's Environment= lines set (the
    site's and the setup's); podman hands each to the container, the API key through its file."""
    container, setups = _container()
    process = setups.ProcessSpec(argv=tuple(spec["argv"]), env={str(k): str(v) for k, v in env.items()})
    handoff = None
    if options["cdi_devices"] or options["devices"]:
        handoff = container.GpuHandoff(
            cdi_devices=tuple(options["cdi_devices"]),
            devices=tuple(options["devices"]),
            cufile_json=options["cufile_json"] or None,
        )
    try:
        argv = container.podman_argv(
            process,
            image=str(options["image"]),
            name=str(name),
            mounts=_mounts(spec, params, options),
            shm_size=str(options["shm_size"]),
            gpus=handoff,
            env_file=options["env_file"] or None,
            podman=str(options["podman"]),
            workdir=options["workdir"] or None,
        )
    except container.ContainerError as e:
        raise AnsibleFilterError(f"vllm_server image runtime: {e}") from None
    return systemd_exec(argv)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "kvlab_setup_render": kvlab_setup_render,
            "kvlab_setup_names": kvlab_setup_names,
            "kvlab_container_exec": kvlab_container_exec,
            "kvlab_setup_folders": kvlab_setup_folders,
            "systemd_escape_arg": systemd_escape_arg,
            "systemd_exec": systemd_exec,
            "systemd_unit_safe": systemd_unit_safe,
        }
