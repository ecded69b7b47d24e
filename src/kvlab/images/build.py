"""The one orchestrator of every image: `kvlab image build NAME [--flavor F]`.

A builder module (registered below by module path, so that nothing imports back) says what its
image is made of (inputs, tools) and builds it into a work folder; this module names the build
by the identity of those inputs, stores it at cache_dir()/images/<name>[-<flavor>]-<identity>/
(like a Nix store path) with its SBOM, provenance and manifest, and proves it reproducible:
a fresh build of an identity already in the store must match it byte for byte, and when it does
not, diffoscope says where.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from kvlab import paths
from kvlab.images import ImageError, sbom
from kvlab.images.identity import Built, identity, input_digests, sha256_file

REGISTRY: dict[str, str] = {
    "testbed": "kvlab.testbed.image",
    "target": "kvlab.images.target",
    "serve": "kvlab.images.serve",
}
# This orchestrator writes the SBOM and manifest into the store path: its code is an input too.
ORCHESTRATOR_FILES = (Path(__file__), Path(sbom.__file__))
SBOM_FILE = "sbom.cdx.json"
MANIFEST_FILE = "manifest.json"
PROVENANCE_FILE = "provenance.json"
# provenance.json records where and when a build ran: the one store file two builds may differ in
COMPARED_EXTRA = (SBOM_FILE, MANIFEST_FILE)
DIFFOSCOPE_TIMEOUT_S = 900
DIFFOSCOPE_HEAD_LINES = 40

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(f"image: {msg}", file=sys.stderr, flush=True)


def builder(name: str) -> ModuleType:
    if name not in REGISTRY:
        raise ImageError(f"image {name!r}: unknown; choose one of {', '.join(sorted(REGISTRY))}")
    try:
        return importlib.import_module(REGISTRY[name])
    except ModuleNotFoundError as e:
        if e.name and REGISTRY[name].startswith(e.name):
            raise ImageError(f"image {name!r}: its builder {REGISTRY[name]} is not in this checkout") from e
        raise


def check_flavor(name: str, mod: ModuleType, flavor: str) -> str:
    if flavor not in mod.FLAVORS:
        choices = ", ".join(repr(f) for f in mod.FLAVORS)
        hint = "" if any(mod.FLAVORS) else " (this image has no flavours: drop --flavor)"
        raise ImageError(f"image {name}: flavor {flavor!r} unknown; choose one of {choices}{hint}")
    return flavor


def default_flavor(name: str) -> str:
    """The first flavour an image lists (the one `make image name=X` builds without flavor=)."""
    return builder(name).FLAVORS[0]


def store_name(name: str, flavor: str, ident: str) -> str:
    return f"{name}-{flavor}-{ident}" if flavor else f"{name}-{ident}"


def images_dir() -> Path:
    return paths.cache_dir() / "images"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What an image of one name and flavour is made of, before anything is built."""

    name: str
    flavor: str
    module: ModuleType
    inputs: list[Path]
    tools: str
    identity: str

    @property
    def store(self) -> Path:
        return images_dir() / store_name(self.name, self.flavor, self.identity)


def plan(name: str, flavor: str | None = None) -> Plan:
    mod = builder(name)
    flavor = check_flavor(name, mod, mod.FLAVORS[0] if flavor is None else flavor)
    inputs = sorted({p.resolve() for p in [*mod.inputs(flavor), *ORCHESTRATOR_FILES]})
    tools = mod.tools(flavor)
    ident = identity(name, flavor, inputs, tools, paths.repo_root())
    return Plan(name, flavor, mod, inputs, tools, ident)


def cached(p: Plan) -> Path | None:
    return p.store if (p.store / MANIFEST_FILE).exists() else None


def manifest(store: Path) -> dict:
    return json.loads((store / MANIFEST_FILE).read_text())


def digest(store: Path) -> str:
    """The image digest, sha256:HEX of its artifact."""
    return manifest(store)["digest"]


def _git(*args: str) -> str:
    res = subprocess.run(
        ["git", "-C", str(paths.repo_root()), *args], capture_output=True, text=True, check=False
    )
    return res.stdout.strip() if res.returncode == 0 else ""


def _provenance(p: Plan, built: Built, seconds: float) -> dict:
    root = paths.repo_root()
    return {
        "name": p.name,
        "flavor": p.flavor,
        "identity": p.identity,
        "inputs": input_digests(p.inputs, root),
        "tools": p.tools,
        "git": {"commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain"))},
        "builder": {"module": p.module.__name__, "meta": built.meta},
        "build_host": {"node": platform.node(), "kernel": platform.release(), "machine": platform.machine()},
        "build_seconds": round(seconds, 1),
    }


def _store_files(p: Plan, built: Built, out: Path, log: Log) -> dict:
    """Move the builder's outputs into `out` and write the SBOM and manifest beside them."""
    if built.artifact not in built.files.values():
        raise ImageError(f"builder {p.module.__name__}: its artifact {built.artifact} is not among its files")
    out.mkdir()
    hashes = {}
    for key, src in sorted(built.files.items()):
        if "/" in key or key in (SBOM_FILE, MANIFEST_FILE, PROVENANCE_FILE):
            raise ImageError(f"builder {p.module.__name__}: output name {key!r} is not a plain file name")
        shutil.move(str(src), out / key)
        hashes[key] = sha256_file(out / key)
    artifact = next(k for k, v in built.files.items() if v == built.artifact)
    image_type = built.meta.get("sbom_type", "operating-system")
    sbom.write(out / SBOM_FILE, p.name, p.identity, hashes[artifact], built.components, image_type=image_type)
    m = {
        "name": p.name,
        "flavor": p.flavor,
        "identity": p.identity,
        "artifact": artifact,
        "digest": f"sha256:{hashes[artifact]}",
        "sha256": hashes,
    }
    (out / MANIFEST_FILE).write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    log(f"{p.name}: artifact {artifact} sha256:{hashes[artifact]}")
    return m


def differing(cached_store: Path, fresh: Path) -> list[str]:
    """The store files whose bytes differ between two builds of one identity (artifact first)."""
    old, new = manifest(cached_store), manifest(fresh)
    names = sorted(set(old["sha256"]) | set(new["sha256"]), key=lambda n: (n != new["artifact"], n))
    out = []
    for n in [*names, *COMPARED_EXTRA]:
        a, b = cached_store / n, fresh / n
        if not (a.exists() and b.exists()) or sha256_file(a) != sha256_file(b):
            out.append(n)
    return out


def diffoscope(a: Path, b: Path, report: Path) -> str:
    """diffoscope's text report on two files, saved to `report`; returns its head (or why none)."""
    if not shutil.which("diffoscope"):
        return "diffoscope not installed (run scripts/testbed-deps) to say where they differ"
    try:
        subprocess.run(
            ["diffoscope", "--text", str(report), "--max-text-report-size", "20000000",
             "--exclude-directory-metadata", "no", str(a), str(b)],
            capture_output=True, text=True, timeout=DIFFOSCOPE_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pass  # the report it wrote so far still says where
    if not report.exists() or not report.stat().st_size:
        return f"diffoscope wrote no report for {a.name} (the two files differ in bytes only it cannot place)"
    lines = report.read_text(errors="replace").splitlines()
    return "\n".join(lines[:DIFFOSCOPE_HEAD_LINES]) + (
        f"\n… ({len(lines)} lines in {report})" if len(lines) > DIFFOSCOPE_HEAD_LINES else ""
    )


def _mismatch(p: Plan, fresh: Path, files: list[str], log: Log) -> ImageError:
    """Keep the differing build beside the cached one, run diffoscope on each differing file."""
    kept = p.store.with_name(p.store.name + ".rebuild")
    shutil.rmtree(kept, ignore_errors=True)
    os.rename(fresh, kept)
    heads = []
    for f in files:
        if (p.store / f).exists() and (kept / f).exists():
            report = kept / f"diffoscope-{f}.txt"
            log(f"{p.name}: {f} differs; diffoscope {p.store / f} {kept / f}")
            heads.append(
                f"--- diffoscope {f} (report {report}):\n{diffoscope(p.store / f, kept / f, report)}"
            )
        else:
            heads.append(f"--- {f}: in only one of the two builds")
    return ImageError(
        f"not reproducible: image {store_name(p.name, p.flavor, p.identity)} rebuilt differs from the cached "
        f"build in {', '.join(files)} (cached {p.store}, rebuild {kept})\n" + "\n".join(heads)
    )


@contextlib.contextmanager
def _one_build_at_a_time(p: Plan, log: Log) -> Iterator[None]:
    """Hold the store path's lock while a build of it runs: a second `ensure` of the same identity
    (make test builds the images in the background while a tier may ask for one) waits for the
    first instead of building it again beside it, and two builds never race to rename into one
    store path. The lock file stays (removing it would let a third process lock a new inode)."""
    images_dir().mkdir(parents=True, exist_ok=True)
    with (images_dir() / f".{p.store.name}.lock").open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            log(f"{p.store.name}: waiting for its build in {holder}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(f"process {os.getpid()}\n")
        lock.flush()
        yield


def build(name: str, flavor: str | None = None, log: Log = _stderr_log) -> Path:
    """Build afresh; store it if its identity is new, else prove it equal to the stored build."""
    p = plan(name, flavor)
    with _one_build_at_a_time(p, log):
        return _build(p, log)


def _build(p: Plan, log: Log) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{p.store.name}-", dir=images_dir()))
    try:
        work = tmp / "work"
        work.mkdir()
        log(f"{p.name}{'-' + p.flavor if p.flavor else ''}: building identity {p.identity} in {tmp}")
        t0 = time.monotonic()
        # the caller's umask must never reach a mode in an image (files the build itself creates)
        umask = os.umask(0o022)
        try:
            built = p.module.build(p.flavor, work, log)
        finally:
            os.umask(umask)
        fresh = tmp / "out"
        _store_files(p, built, fresh, log)
        (fresh / PROVENANCE_FILE).write_text(
            json.dumps(_provenance(p, built, time.monotonic() - t0), indent=2, sort_keys=True) + "\n"
        )
        if cached(p):
            files = differing(p.store, fresh)
            if files:
                raise _mismatch(p, fresh, files, log)
            log(f"{p.name}: identical to the cached build {p.store}")
            return p.store
        shutil.rmtree(p.store, ignore_errors=True)  # a half-written store path (no manifest)
        os.rename(fresh, p.store)
        return p.store
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure(name: str, flavor: str | None = None, log: Log = _stderr_log) -> Path:
    """The cached build of this image (built if missing): what other code boots or loads."""
    p = plan(name, flavor)
    hit = cached(p)
    if hit:
        return hit
    with _one_build_at_a_time(p, log):
        hit = cached(p)  # built by the process this one waited for
        if hit:
            log(f"{p.store.name}: built meanwhile by the process this one waited for")
            return hit
        log(f"no cached image {p.store.name}: building it")
        return _build(p, log)


def final_line(name: str, store: Path) -> str:
    """The last stdout line of `kvlab image build`, for scripts."""
    return f"image {name} {digest(store)} path {store / manifest(store)['artifact']} sbom {store / SBOM_FILE}"
