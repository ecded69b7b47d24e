"""The serving image (images/serve): vLLM, LMCache and kvlab-connector as an OCI archive.

Three layers, by how often they change:
1. base: Debian bookworm (python3.11 and the shared libraries the wheels link against), unpacked
   by mmdebstrap at the versions of images/serve/base/packages.lock;
2. the Python environment: every wheel of images/serve/FLAVOR/requirements.lock, installed inside
   the base rootfs (chroot, so that paths and shebangs are the image's) with
   `pip install --no-index --require-hashes --no-compile --no-deps`, then byte-compiled with
   `compileall --invalidation-mode unchecked-hash` (no file times in a .pyc), one process, sorted
   (marshal's output depends on what the process compiled before: parallel workers would not
   give the same bytes), without site (-S): setuptools' distutils-precedence.pth would import
   _distutils_hack first, and its .pyc then differed between two builds (marshal's references
   depend on what the process already holds);
3. kvlab-connector, in /opt/kvlab/site (on PYTHONPATH), so that a connector change changes only
   this layer's bytes.

Wheels come from pip's configured index and are kept by hash in cache_dir()/wheels/<sha256>/, so a
rebuild does not need the index to still have them. kvlab.images.oci measures the layers as each
is done and writes them into the archive, from the rootfs, at the end; the digest a node checks
after `podman load` is the manifest's (meta["manifest_digest"]).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvlab import paths
from kvlab.images import ImageError, debian, oci
from kvlab.images.identity import Built, Component, sha256_file

FLAVORS = ("cpu", "cuda")
# pip itself is a build tool here, not a component: run from its wheel inside the chroot
PIP_WHEEL = (
    "pip-23.2.1-py3-none-any.whl",
    "7ccf472345f20d35bdc9d1841ff5f313260c2c33fe417f48c30ac46cccabf5be",
)
SITE = "usr/local/lib/python3.11/dist-packages"  # on Debian python3's sys.path
CONNECTOR_SITE = "opt/kvlab/site"
ARCHIVE = "serve.oci.tar"
IMAGE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONPATH": f"/{CONNECTOR_SITE}",
    "LANG": "C.UTF-8",
}

Log = Callable[[str], None]


def root() -> Path:
    return paths.repo_root() / "images" / "serve"


def _connector_files() -> list[Path]:
    c = paths.repo_root() / "connector"
    return [c / "pyproject.toml", *sorted(p for p in (c / "src").rglob("*.py"))]


def inputs(flavor: str) -> list[Path]:
    r = root()
    return [
        *debian.inputs(r / "base"),
        r / flavor / "requirements.in",
        r / flavor / "requirements.lock",
        Path(__file__),
        Path(oci.__file__),
        *_connector_files(),
    ]


def tools(flavor: str) -> str:
    return f"pip {PIP_WHEEL[1]}\n{debian.tools_fingerprint()}"


# ---- the wheel lock and the wheel cache -------------------------------------------------------
LOCK_LINE = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def parse_wheel_lock(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """A pip-compile --generate-hashes lock: {name: (version, (sha256, ...))}."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    name = None
    for line in text.splitlines():
        m = LOCK_LINE.match(line)
        if m:
            name = m.group(1).lower().replace("_", "-")
            out[name] = (m.group(2), ())
        for h in HASH.findall(line):
            if name is None:
                raise ImageError(f"requirements.lock: a hash before any requirement ({line.strip()!r})")
            v, hs = out[name]
            out[name] = (v, (*hs, h))
        if line and not line.startswith((" ", "#", "\t")) and not m and line.strip():
            name = None if line.startswith("-") else name
    for n, (v, hs) in out.items():
        if not hs:
            raise ImageError(f"requirements.lock: {n}=={v} has no --hash (re-lock with images/serve/lock)")
    return out


def wheels_dir() -> Path:
    return paths.cache_dir() / "wheels"


def cached_wheel(hashes: tuple[str, ...]) -> Path | None:
    for h in hashes:
        d = wheels_dir() / h
        if d.is_dir():
            found = sorted(d.glob("*.whl"))
            if found:
                return found[0]
    return None


def fetch_wheels(lock_file: Path, work: Path, log: Log) -> dict[str, Path]:
    """Every wheel of the lock from the hash-keyed cache, downloading (hash-checked) what is missing."""
    lock = parse_wheel_lock(lock_file.read_text())
    missing = [n for n, (_, hs) in lock.items() if cached_wheel(hs) is None]
    if missing:
        log(f"downloading {len(missing)} of {len(lock)} wheels (hash-checked) into {wheels_dir()}")
        dl = work / "wheel-download"  # kvlab.images.debian downloads .debs into work/download
        dl.mkdir()
        req = work / "missing.lock"
        keep = set(missing)
        blocks, cur = [], None
        for line in lock_file.read_text().splitlines():
            m = LOCK_LINE.match(line)
            if m:
                cur = m.group(1).lower().replace("_", "-")
            elif not line.startswith(" "):
                cur = None
            if cur in keep:
                blocks.append(line)
        req.write_text("\n".join(blocks) + "\n")
        res = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--require-hashes", "--no-deps",
             "--only-binary=:all:", "-r", str(req), "-d", str(dl)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if res.returncode:
            raise ImageError(f"pip download of the serving image's wheels failed:\n{res.stderr[-2000:]}")
        for f in sorted(dl.iterdir()):
            h = sha256_file(f)
            dest = wheels_dir() / h
            dest.mkdir(parents=True, exist_ok=True)
            os.replace(f, dest / f.name)
    out = {}
    for n, (v, hs) in lock.items():
        w = cached_wheel(hs)
        if w is None:
            raise ImageError(
                f"{n}=={v}: no wheel with a locked hash was downloaded (sdist only?); lock a wheel"
            )
        if sha256_file(w) not in hs:
            raise ImageError(
                f"{w}: its sha256 is not the lock's for {n}=={v}; remove {w.parent} and build again"
            )
        out[n] = w
    return out


def pip_wheel(work: Path) -> Path:
    name, h = PIP_WHEEL
    w = cached_wheel((h,))
    if w is None:
        res = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"pip=={name.split('-')[1]}",
             "-d", str(work)], capture_output=True, text=True, check=False,
        )  # fmt: skip
        got = work / name
        if res.returncode or not got.exists() or sha256_file(got) != h:
            raise ImageError(f"pip's wheel {name} (sha256 {h}) could not be fetched: {res.stderr[-500:]}")
        (wheels_dir() / h).mkdir(parents=True, exist_ok=True)
        os.replace(got, wheels_dir() / h / name)
        w = wheels_dir() / h / name
    return w


# ---- the build ---------------------------------------------------------------------------------
def _chroot(rootfs: Path, script: str, log_file: Path) -> None:
    env = {
        "PATH": IMAGE_ENV["PATH"],
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "PYTHONHASHSEED": "0",
        "SOURCE_DATE_EPOCH": str(_definition().source_date_epoch),
        "HOME": "/root",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        # no byte-code as a side effect (a .pth's import writes a timestamped .pyc): compileall
        # below writes every .pyc, and only it
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    with log_file.open("ab") as log:
        res = subprocess.run(["chroot", str(rootfs), "/bin/sh", "-euc", script], env=env, stdout=log,
                             stderr=subprocess.STDOUT, check=False)  # fmt: skip
    if res.returncode:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-20:])
        raise ImageError(f"in the image's rootfs: {script.splitlines()[0]} failed (log {log_file}):\n{tail}")


def _definition() -> debian.Definition:
    return debian.Definition.load(root() / "base")


def _hardlink_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def repin(flavor: str, log: Log) -> Path:
    """Rewrite base/packages.lock (versions and .deb hashes) from what the mirror resolves for the
    base's packages today (`kvlab image build serve --repin`); one base for every flavour."""
    return debian.repin(debian.Definition.load(root() / "base", with_lock=False), log)


def build(flavor: str, work: Path, log: Log) -> Built:
    defn = _definition()
    lock_file = root() / flavor / "requirements.lock"
    if not lock_file.exists():
        raise ImageError(f"{lock_file}: missing; resolve it with images/serve/lock {flavor}")
    epoch = defn.source_date_epoch
    out = work / "out"
    out.mkdir()
    log_file = work / "chroot.log"
    try:
        wheels = fetch_wheels(lock_file, work, log)
        pip = pip_wheel(work)
        # the Debian tree from the hash-checked .deb cache, normalised (kvlab.images.debian)
        tree = debian.rootfs(defn, work, log)
        rootfs = tree.path
        for d in ("dev", "proc", "sys", "run"):  # the runtime mounts these
            for p in sorted((rootfs / d).iterdir(), reverse=True) if (rootfs / d).is_dir() else ():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        layers = []
        skip_py = lambda rel: rel in (SITE, CONNECTOR_SITE, "opt/kvlab")  # noqa: E731
        # a file: the steps below write in its /tmp and /usr/local (the larger layers after it
        # are written into the archive from their trees, which nothing changes once they are done)
        base = oci.file_layer(rootfs, out / "layer-base.tar", epoch, "base: Debian " + defn.release, skip_py)
        layers.append(base)
        log(f"base layer sha256:{base.digest[:16]} {base.size >> 20} MiB")

        # the Python environment, inside the rootfs
        stage = rootfs / "tmp" / "kvlab-build"
        (stage / "wheels").mkdir(parents=True)
        for w in wheels.values():
            _hardlink_or_copy(w, stage / "wheels" / w.name)
        _hardlink_or_copy(pip, stage / pip.name)
        shutil.copyfile(lock_file, stage / "requirements.lock")
        (rootfs / SITE).mkdir(parents=True, exist_ok=True)
        log(f"environment: pip install {len(wheels)} wheels in the rootfs (log {log_file})")
        _chroot(
            rootfs,
            f"python3 /tmp/kvlab-build/{pip.name}/pip install --no-index --find-links /tmp/kvlab-build/wheels "
            f"--require-hashes --no-compile --no-deps --only-binary=:all: --target /{SITE} "
            "-r /tmp/kvlab-build/requirements.lock\n",
            log_file,
        )
        log("environment: compileall --invalidation-mode unchecked-hash (one process, sorted)")
        _chroot(rootfs, f"python3 -S -m compileall -q -f -j 1 --invalidation-mode unchecked-hash /{SITE} >/dev/null || true\n",
                log_file)  # fmt: skip
        layers.append(oci.tree_layer(rootfs, epoch, f"python: {lock_file.relative_to(paths.repo_root())}", (SITE,)))
        log(f"python layer sha256:{layers[-1].digest[:16]} {layers[-1].size >> 20} MiB")

        # kvlab-connector, on its own
        src = stage / "connector"
        shutil.copytree(paths.repo_root() / "connector", src, ignore=shutil.ignore_patterns(
            "__pycache__", "*.egg-info", "build", "dist"))  # fmt: skip
        _chroot(
            rootfs,
            f"python3 /tmp/kvlab-build/{pip.name}/pip install --no-index --no-deps --no-build-isolation "
            f"--no-compile --target /{CONNECTOR_SITE} /tmp/kvlab-build/connector\n"
            f"python3 -S -m compileall -q -f -j 1 --invalidation-mode unchecked-hash /{CONNECTOR_SITE} >/dev/null\n",
            log_file,
        )
        layers.append(oci.tree_layer(rootfs, epoch, "kvlab-connector", (CONNECTOR_SITE,)))
        log(f"connector layer sha256:{layers[-1].digest[:16]} {layers[-1].size >> 10} KiB")

        archive = out / ARCHIVE
        ref = f"kvlab-serve:{flavor}"
        log(f"archive: {len(layers)} layers, {sum(la.size for la in layers) >> 20} MiB, written from the tree")
        try:
            digests = oci.write_archive(
                layers, archive, epoch, {"Env": [f"{k}={v}" for k, v in IMAGE_ENV.items()], "Cmd": ["python3"],
                                         "WorkingDir": "/"}, ref,
            )  # fmt: skip
        except oci.LayerChanged as e:
            raise ImageError(f"{e}: a later step of the build wrote into that layer's folders") from e
        assert base.tar is not None
        base.tar.unlink()
        components = list(tree.components)
        lock = parse_wheel_lock(lock_file.read_text())
        components += [
            Component(kind="wheel", name=n, version=lock[n][0], sha256=sha256_file(w))
            for n, w in sorted(wheels.items())
        ]
        return Built(
            artifact=archive,
            files={ARCHIVE: archive},
            components=components,
            meta={"flavor": flavor, "ref": ref, "manifest_digest": digests["manifest"],
                  "config_digest": digests["config"], "layers": digests["layers"],
                  "release": defn.release, "sbom_type": "container"},
        )  # fmt: skip
    finally:
        debian.unmount_under(work)
        shutil.rmtree(work / "rootfs", ignore_errors=True)
        shutil.rmtree(work / "wheel-download", ignore_errors=True)
