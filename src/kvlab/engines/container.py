"""`kvlab campaign run --engine container`: every engine (and LMCache cache server) of a campaign
runs from the serving image (images/serve, flavour cpu here) instead of the venv.

The image comes from the image store (kvlab.images.build.ensure: built once per set of inputs),
is loaded with `podman load` and its manifest digest checked against the build's, and each process
is the podman command kvlab.engines.podman.podman_argv renders from the setup's own ProcessSpec (the
argv and environment the venv engine gets, with `python3` the image's interpreter). The harness
starts and stops the `podman run` process by its PID, as it does a venv engine; stopping also
removes its container (`podman rm -f`), whatever state the process left it in.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvlab.engines import podman as container
from kvlab.engines.local import EngineError, EngineServer
from kvlab.setups import registry as setups


class ImageLoadError(EngineError):
    pass


def _inspect(ref: str, podman: str) -> dict | None:
    res = subprocess.run([podman, "image", "inspect", ref], capture_output=True, text=True,
                         env=container.podman_env(), check=False)  # fmt: skip
    return json.loads(res.stdout)[0] if res.returncode == 0 else None


def _holds(img: dict, manifest_digest: str) -> bool:
    return any(d and d.endswith(manifest_digest) for d in {img.get("Digest"), *img.get("RepoDigests", [])})


def load_image(
    archive: Path, manifest_digest: str, config_digest: str | None = None, podman: str = "podman"
) -> str:
    """`podman load` the archive; returns the loaded image's ID after checking that podman holds
    the manifest the build wrote (a node checks the same before it runs the image). An image that
    podman already holds under the build's config digest, with its manifest, is not loaded again
    (a 4 GB archive takes a minute or more)."""
    if config_digest:
        img = _inspect(config_digest.removeprefix("sha256:"), podman)
        if img is not None and _holds(img, manifest_digest):
            return img["Id"]
    res = subprocess.run([podman, "load", "--quiet", "--input", str(archive)], capture_output=True, text=True,
                         env=container.podman_env(), check=False)  # fmt: skip
    if res.returncode:
        raise ImageLoadError(f"podman load {archive} failed: {res.stderr.strip()[-500:]}")
    # podman load names the image by the archive's ref annotation: "Loaded image: NAME"
    name = res.stdout.strip().splitlines()[-1].split(":", 1)[1].strip()
    img = _inspect(name, podman)
    if img is None:
        raise ImageLoadError(f"podman image inspect {name}: no such image after podman load {archive}")
    if not _holds(img, manifest_digest):
        raise ImageLoadError(
            f"{archive}: podman loaded manifest {img.get('Digest')}, the build wrote {manifest_digest}; "
            "the archive is not the one built (copy it again)"
        )
    return img["Id"]


def mounts_for(params: setups.EngineParams) -> list[container.Mount]:
    """The model read-only; every folder a setup writes (stores, cache-server tiers) read-write."""
    rw = [*params.kv_store_paths, params.example_storage_path, params.cache_server_l2_path]
    out = [container.Mount(params.model, read_only=True)]
    for p in rw:
        if p:
            Path(p).mkdir(parents=True, exist_ok=True)  # podman binds only folders that exist
            out.append(container.Mount(p))
    return out


class ContainerEngineServer(EngineServer):
    """An EngineServer whose processes are `podman run`s; stop also removes their containers."""

    def __init__(self, deployment: setups.Deployment, log_dir: Path, names: list[str]):
        super().__init__(deployment, log_dir)
        self.names = names
        self._inner: dict[tuple[str, int], int] = {}

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.remove_containers()

    def restart(self, progress: bool = False, with_companion: bool | None = None) -> float:
        if with_companion is None:
            with_companion = not self.deployment.companion_survives_engine_restart
        self.engine.stop()
        self._rm(self.names[:1])
        if with_companion and self.companion:
            self.companion.stop()
            self._rm(self.names[1:])
        return self.start(progress)

    def memory(self) -> dict:
        """Each container's process tree: its processes are conmon's children, not the `podman
        run` process's, so the PID the harness started holds none of the engine's memory."""
        from kvlab.harness.memory import process_tree

        out = {}
        for (role, pid), name in zip(self.pids().items(), [*self.names, None], strict=False):
            inner = self._container_pid(name, pid) if pid is not None and name else None
            out[role] = process_tree(inner) if inner else None
        return out

    def _container_pid(self, name: str, podman_pid: int) -> int | None:
        key = (name, podman_pid)  # one lookup per life of the container
        if key not in self._inner:
            res = subprocess.run([*container.inspect_pid_argv(name)], env=container.podman_env(),
                                 capture_output=True, text=True, check=False)  # fmt: skip
            pid = int(res.stdout.strip() or 0) if res.returncode == 0 else 0
            if not pid:
                return None  # not started yet: ask again at the next sample
            self._inner[key] = pid
        return self._inner[key]

    def remove_containers(self) -> None:
        self._rm(self.names)

    @staticmethod
    def _rm(names: list[str]) -> None:
        for n in names:
            subprocess.run(container.rm_argv(n), env=container.podman_env(), capture_output=True, check=False)


class ContainerEngines:
    """Engines run from the CPU serving image (`--engine container`)."""

    def __init__(self, flavor: str = "cpu", shm_size: str = "2g"):
        from kvlab.images import build

        self.flavor = flavor
        self.shm_size = shm_size
        self.store = build.ensure("serve", flavor)
        manifest = build.manifest(self.store)
        prov = json.loads((self.store / build.PROVENANCE_FILE).read_text())
        meta = prov["builder"]["meta"]
        self.archive = self.store / manifest["artifact"]
        self.digest = build.digest(self.store)  # sha256:HEX of the archive
        self.manifest_digest = meta["manifest_digest"]
        self.image_id = load_image(self.archive, self.manifest_digest, meta["config_digest"])

    def deployment(self, setup: str, params: setups.EngineParams) -> setups.Deployment:
        params = params.with_(python="python3")  # the image's interpreter
        d = setups.render(setup, params)
        mounts = mounts_for(params)
        port = params.port

        def wrap(spec: setups.ProcessSpec | None, role: str) -> setups.ProcessSpec | None:
            if spec is None:
                return None
            argv = container.podman_argv(spec, image=self.image_id, name=f"kvlab-{setup}-{role}-{port}",
                                         mounts=mounts, shm_size=self.shm_size)  # fmt: skip
            # the podman process gets the spec's env too: readiness and dev-route checks read it
            return replace(
                spec,
                argv=tuple(argv),
                env=dict(spec.env) | {"CONTAINERS_CONF": str(container.CONTAINERS_CONF)},
            )

        return replace(d, engine=wrap(d.engine, "engine"), companion=wrap(d.companion, "cache-server"))

    def server(self, deployment: setups.Deployment, log_dir: Path) -> EngineServer:
        names = [_name_of(deployment.engine)]
        if deployment.companion:
            names.append(_name_of(deployment.companion))
        return ContainerEngineServer(deployment, log_dir, names)

    def image(self) -> dict[str, Any]:
        return {"name": "serve", "flavor": self.flavor, "digest": self.digest,
                "manifest_digest": self.manifest_digest, "image_id": self.image_id, "store": str(self.store)}  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {"kind": "container", "image": self.image()}


def _name_of(spec: setups.ProcessSpec) -> str:
    return next(a.removeprefix("--name=") for a in spec.argv if a.startswith("--name="))
