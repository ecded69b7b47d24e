"""Debian root filesystems from an image definition (images/<name>/image.yml + packages.lock).

Every builder that needs a Debian tree (the testbed VM, the target appliance, the serving image's
base, the trixie tools tree) calls `rootfs()`:

1. Every .deb in packages.lock (`name=version sha256=HEX`) is made present in the hash-keyed cache
   cache_dir()/debs/<sha256>.deb: what is missing is downloaded with apt from the release's signed
   suites (mmdebstrap sets apt up with only the pinned release keys), then checked against the lock.
2. A local repository is made of exactly those files, and mmdebstrap installs the tree from it
   alone: a build whose .debs are all cached no longer needs the mirror to still carry them.
3. The definition's overlay and customize.sh are applied, the builder's own hooks run, and whatever
   differs between two builds (logs, caches, keys, IDs) is removed; SOURCE_DATE_EPOCH, LC_ALL, TZ
   fixed. The tree comes out as a folder, or as mmdebstrap's sorted, clamped tar.

`repin()` re-resolves the lock from the mirror and records each installed .deb's sha256.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import yaml

from kvlab import paths
from kvlab.images import ImageError
from kvlab.images.identity import Component, sha256_file

Log = Callable[[str], None]
LOCK_FILE = "packages.lock"
HOST_TOOLS = (["mmdebstrap", "--version"], ["dpkg-deb", "--version"])
# Removed from every tree before it is packed: each differs between two builds or must not ship.
VOLATILE = (
    "var/log/**/*",
    "var/cache/apt/**/*",
    "var/lib/apt/lists/**/*",
    "var/cache/debconf/*-old",
    "var/lib/dpkg/*-old",
    "var/cache/ldconfig/aux-cache",
    "var/lib/systemd/random-seed",
    "etc/ssh/ssh_host_*",
    "etc/nvme/hostnqn",
    "etc/nvme/hostid",
    "var/lib/dbus/machine-id",
    "etc/*-",
    "var/cache/man/**/*",
    "root/.bash_history",
    "tmp/*",
    "var/tmp/*",
    "var/lib/systemd/catalog/database",
    "var/lib/initramfs-tools/*",
)


@dataclasses.dataclass(frozen=True)
class Pin:
    version: str
    sha256: str  # of the .deb


@dataclasses.dataclass(frozen=True)
class Definition:
    root: Path  # images/<name>
    name: str
    release: str
    arch: str
    sources: tuple[str, ...]
    keyring: Path
    key_fingerprints: tuple[str, ...]
    source_date_epoch: int
    packages: tuple[str, ...]
    lock: dict[str, Pin]  # every package in the tree, at its exact version and .deb hash
    spec: dict  # the whole image.yml, for the builder's own fields

    @classmethod
    def load(cls, root: Path, *, with_lock: bool = True) -> Definition:
        """The definition in `root`; with_lock=False skips packages.lock (a re-pin rewrites it)."""
        spec_file = root / "image.yml"
        try:
            spec = yaml.safe_load(spec_file.read_text())
        except FileNotFoundError as e:
            raise ImageError(f"{spec_file}: no image definition there") from e
        lock_file = root / LOCK_FILE
        lock = parse_lock(lock_file.read_text(), lock_file, root) if with_lock and lock_file.exists() else {}
        try:
            return cls(
                root=root,
                name=spec["name"],
                release=spec["release"],
                arch=spec["arch"],
                sources=tuple(spec["sources"]),
                keyring=Path(spec["keyring"]),
                key_fingerprints=tuple(spec["key_fingerprints"]),
                source_date_epoch=int(spec["source_date_epoch"]),
                packages=tuple(spec["packages"]),
                lock=lock,
                spec=spec,
            )
        except KeyError as e:
            raise ImageError(f"{spec_file}: field {e.args[0]} missing") from e

    def field(self, key: str):
        """A builder's own field of image.yml; a missing one is named."""
        if key not in self.spec:
            raise ImageError(f"{self.root / 'image.yml'}: field {key} missing")
        return self.spec[key]


def pinning_image(root: Path) -> str:
    """The image whose `--repin` writes root's lock: the one its image.yml names in `pinned_by` (a
    tools tree or a base layer has no image of its own), else the folder's name."""
    spec_file = root / "image.yml"
    spec = yaml.safe_load(spec_file.read_text()) if spec_file.exists() else None
    return (spec or {}).get("pinned_by") or root.name


def repin_command(root: Path) -> str:
    rel = root.relative_to(paths.repo_root()) if root.is_relative_to(paths.repo_root()) else root
    return f"kvlab image build {pinning_image(root)} --repin   (then commit {rel}/{LOCK_FILE})"


_LOCK_LINE = re.compile(
    r"(?P<name>[a-z0-9][a-z0-9+.-]*)=(?P<version>\S+)(?:\s+sha256=(?P<sha>[0-9a-f]{64}))?"
)


def parse_lock(text: str, where: Path | str = LOCK_FILE, root: Path | None = None) -> dict[str, Pin]:
    """packages.lock: one `name=version sha256=HEX` a line (the .deb's sha256); `#` comments."""
    lock: dict[str, Pin] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LOCK_LINE.fullmatch(line)
        if not m:
            raise ImageError(f"{where}:{n}: {raw!r} is not `name=version sha256=HEX`")
        if not m["sha"]:
            fix = repin_command(root) if root else "kvlab image build NAME --repin"
            raise ImageError(
                f"{where}:{n}: {m['name']}={m['version']} has no sha256= (a lock from before .deb hashes); "
                f"re-pin with: {fix}"
            )
        lock[m["name"]] = Pin(m["version"], m["sha"])
    return lock


def lock_versions(text: str) -> dict[str, str]:
    """name -> version of any lock, old (no sha256) or new: what a re-pin compares against."""
    out = {}
    for raw in text.splitlines():
        m = _LOCK_LINE.fullmatch(raw.split("#", 1)[0].strip())
        if m:
            out[m["name"]] = m["version"]
    return out


def format_lock(pins: dict[str, Pin]) -> str:
    lines = [
        "# Every package in the image at its exact version, with its .deb's sha256;",
        "# written by `kvlab image build NAME --repin`.",
    ]
    lines += [f"{n}={p.version} sha256={p.sha256}" for n, p in sorted(pins.items())]
    return "\n".join(lines) + "\n"


def tools_fingerprint(commands: Sequence[Sequence[str]] = HOST_TOOLS) -> str:
    """The first line of each host tool's version output (what a builder's tools() reports)."""
    out = []
    for cmd in commands:
        try:
            res = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
            text = res.stdout + res.stderr
            out.append(text.splitlines()[0] if text else cmd[0])
        except FileNotFoundError:
            out.append(f"{cmd[0]} missing")
    return "\n".join(out)


def inputs(defn_root: Path) -> list[Path]:
    """What a definition contributes to an image's identity: its files and this module."""
    from kvlab.images.identity import files_under

    return [*files_under(defn_root), Path(__file__)]


def env(defn: Definition) -> dict[str, str]:
    return dict(
        os.environ,
        SOURCE_DATE_EPOCH=str(defn.source_date_epoch),
        LC_ALL="C.UTF-8",
        TZ="UTC",
        PYTHONHASHSEED="0",
    )


def deb_cache() -> Path:
    return paths.cache_dir() / "debs"


def pinned_keyring(defn: Definition, out: Path) -> Path:
    """A keyring holding only the pinned release keys; fails if the host keyring lacks one."""
    keyring = out / "release-keys.gpg"
    home = Path(tempfile.mkdtemp(prefix="gnupg-", dir=out))
    try:
        res = subprocess.run(
            ["gpg", "--homedir", str(home), "--no-default-keyring", "--keyring", str(defn.keyring),
             "--export", *defn.key_fingerprints],
            capture_output=True, check=False,
        )  # fmt: skip
        if res.returncode or not res.stdout:
            raise ImageError(
                f"{defn.keyring}: cannot export the pinned release keys ({res.stderr.decode().strip()})"
            )
        listed = subprocess.run(
            ["gpg", "--homedir", str(home), "--with-colons", "--show-keys"],
            input=res.stdout, capture_output=True, check=True,
        ).stdout.decode()  # fmt: skip
    finally:
        shutil.rmtree(home, ignore_errors=True)
    have = {line.split(":")[9] for line in listed.splitlines() if line.startswith("fpr:")}
    missing = [f for f in defn.key_fingerprints if f not in have]
    if missing:
        raise ImageError(
            f"{defn.keyring}: release key(s) {', '.join(missing)} missing (install debian-archive-keyring)"
        )
    keyring.write_bytes(res.stdout)
    return keyring


def _mmdebstrap(defn: Definition, args: list[str], log_file: Path) -> None:
    cmd = [
        "mmdebstrap",
        "--mode=root",
        f"--architectures={defn.arch}",
        '--aptopt=Acquire::Languages "none"',
        *args,
    ]
    res = subprocess.run(cmd, env=env(defn), capture_output=True, text=True, check=False)
    log_file.write_text(shlex.join(cmd) + "\n" + res.stdout + res.stderr)
    if res.returncode:
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-15:])
        gone = [
            ln for ln in tail.splitlines() if "was not found" in ln or "has no installation candidate" in ln
        ]
        if gone:
            raise ImageError(
                f"a pinned package version has left the mirror ({gone[0].strip()}); re-pin with:\n  "
                + repin_command(defn.root)
            )
        raise ImageError(f"mmdebstrap failed (log {log_file}):\n{tail}")


def deb_fields(deb: Path, *fields: str) -> list[str]:
    out = subprocess.run(
        ["dpkg-deb", "--showformat=" + "\\n".join(f"${{{f}}}" for f in fields) + "\\n", "--show", str(deb)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.splitlines()[: len(fields)]


def _download(defn: Definition, want: dict[str, Pin], work: Path, log: Log) -> dict[str, Path]:
    """The .debs of `want` from the release's signed suites (apt checks them against the signed
    indices); name -> downloaded file. mmdebstrap only sets apt up here (nothing is installed)."""
    dl = work / "download"
    dl.mkdir()
    keyring = pinned_keyring(defn, work)
    pins = " ".join(shlex.quote(f"{n}={p.version}") for n, p in sorted(want.items()))
    hook = (
        f"cd {shlex.quote(str(dl))} && export APT_CONFIG=$MMDEBSTRAP_APT_CONFIG && "
        f"apt-get update -q >/dev/null && apt-get download -q {pins} >/dev/null"
    )
    log(f"downloading {len(want)} .deb(s) from {defn.release} (log {work}/download.log)")
    _mmdebstrap(
        defn,
        ["--variant=custom", f"--keyring={keyring}", "--format=null", f"--setup-hook={hook}",
         defn.release, "/dev/null", *defn.sources],
        work / "download.log",
    )  # fmt: skip
    got = {}
    for deb in dl.glob("*.deb"):
        name, _version = deb_fields(deb, "Package", "Version")
        got[name] = deb
    return got


def ensure_debs(defn: Definition, work: Path, log: Log) -> dict[str, Path]:
    """Every locked .deb in the hash-keyed cache, each checked against the lock; name -> file."""
    cache = deb_cache()
    cache.mkdir(parents=True, exist_ok=True)
    have, missing = {}, {}
    for name, pin in sorted(defn.lock.items()):
        f = cache / f"{pin.sha256}.deb"
        if f.exists() and sha256_file(f) == pin.sha256:
            have[name] = f
        else:
            f.unlink(missing_ok=True)  # a damaged or partial file is fetched again
            missing[name] = pin
    if missing:
        for name, deb in _download(defn, missing, work, log).items():
            pin = missing.get(name)
            if pin is None:
                continue
            sha = sha256_file(deb)
            if sha != pin.sha256:
                raise ImageError(
                    f"{defn.root / LOCK_FILE}: {name}={pin.version} has sha256 {sha} on the mirror, the lock "
                    f"says {pin.sha256} (a rebuilt package under the same version); check, then re-pin with: "
                    + repin_command(defn.root)
                )
            dest = cache / f"{sha}.deb"
            # The cache is shared by every image's build, and two may run at once (make test
            # builds its images side by side): each stages under a name of its own.
            part = dest.with_suffix(f".{os.getpid()}.part")
            shutil.move(str(deb), part)
            os.replace(part, dest)
            have[name] = dest
        absent = sorted(set(missing) - set(have))
        if absent:
            raise ImageError(
                f"the mirror gave no .deb for {', '.join(absent)}; re-pin with: {repin_command(defn.root)}"
            )
    else:
        log(f"all {len(have)} .debs of {defn.name} are in the cache {cache}")
    return have


def local_repo(debs: dict[str, Path], repo: Path, suite: str = "") -> Path:
    """A flat apt repository (Packages index written here) holding exactly these files. With
    `suite`, a Release file names it that suite: mmdebstrap picks a non-apt variant's Essential
    set with `?narrow(?or(?archive(^SUITE$),?codename(^SUITE$)),...)`, which matches nothing in
    a repository without one."""
    repo.mkdir(parents=True)
    stanzas = []
    for _name, src in sorted(debs.items()):
        dest = repo / src.name
        try:
            os.link(src, dest)
        except OSError:
            shutil.copyfile(src, dest)
        control = subprocess.run(
            ["dpkg-deb", "--field", str(dest)], capture_output=True, text=True, check=True
        ).stdout.rstrip("\n")
        stanzas.append(
            f"{control}\nFilename: ./{dest.name}\nSize: {dest.stat().st_size}\nSHA256: {src.stem}\n"
        )
    index = repo / "Packages"
    index.write_text("\n".join(stanzas))
    if suite:
        # unsigned ([trusted=yes]), but apt still checks the index against the Release's hash
        (repo / "Release").write_text(
            f"Suite: {suite}\nCodename: {suite}\nSHA256:\n {sha256_file(index)} {index.stat().st_size} Packages\n"
        )
    return repo


def dpkg_status(status: Path) -> dict[str, tuple[str, str]]:
    """Installed packages in a dpkg status file: name -> (version, architecture)."""
    out = {}
    for stanza in status.read_text().split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" ")
        )
        if fields.get("Status", "").endswith(" installed"):
            out[fields["Package"]] = (fields["Version"], fields.get("Architecture", ""))
    return out


def components(defn: Definition, status: Path) -> list[Component]:
    """The tree's packages (from its dpkg status) with their .deb hashes; the set must be the lock's."""
    installed = dpkg_status(status)
    found = {n: v for n, (v, _a) in installed.items()}
    locked = {n: p.version for n, p in defn.lock.items()}
    if found != locked:
        diff = sorted(set(found.items()) ^ set(locked.items()))
        raise ImageError(
            f"the tree holds a different package set than {defn.root / LOCK_FILE} ({diff[:5]} …); re-pin with:\n  "
            + repin_command(defn.root)
        )
    return [Component("deb", n, v, defn.lock[n].sha256, a) for n, (v, a) in sorted(installed.items())]


@dataclasses.dataclass(frozen=True)
class Tree:
    path: Path  # the folder, or the tar
    status: Path  # a copy of its dpkg status
    components: list[Component]


def _hook_normalize(defn: Definition) -> str:
    """A customize hook that runs normalize() below on the tree ($1), outside the chroot."""
    src = Path(__file__).resolve().parents[2]
    return (
        f"PYTHONPATH={shlex.quote(str(src))} {shlex.quote(sys.executable)} -m kvlab.images.debian "
        f'normalize "$1" {defn.source_date_epoch}'
    )


def overlay_copy(src: Path, out: Path) -> Path:
    """The overlay with the modes git means (0755 if executable, else 0644), whatever the umask
    of the checkout: copy-in keeps modes, and they are bytes of the image."""
    shutil.copytree(src, out, symlinks=True, copy_function=shutil.copyfile)
    for dirpath, _dirs, names in os.walk(out):
        os.chmod(dirpath, 0o755)
        for n in names:
            p = Path(dirpath) / n
            if not p.is_symlink():
                orig = src / p.relative_to(out)
                os.chmod(p, 0o755 if orig.stat().st_mode & 0o100 else 0o644)
    return out


def rootfs(
    defn: Definition,
    work: Path,
    log: Log,
    *,
    fmt: str = "directory",
    hooks: Sequence[str] = (),
    customize_env: Mapping[str, str] | None = None,
    variant: str = "apt",
    dpkg_opts: Sequence[str] = (
        "path-exclude=/usr/share/doc/*",
        "path-include=/usr/share/doc/*/copyright",
        "path-exclude=/usr/share/man/*",
        "path-exclude=/usr/share/locale/*",
    ),
) -> Tree:
    """The definition's tree, installed from the hash-checked cache only.

    fmt "directory" gives work/rootfs/; "tar" gives work/rootfs.tar, mmdebstrap's tar (entries
    sorted, times clamped to SOURCE_DATE_EPOCH). `hooks` are more mmdebstrap customize hooks, run
    after the overlay and customize.sh and before the tree is normalised; `customize_env` is
    what customize.sh is given from the builder (facts of the lock or image.yml it needs)."""
    if not defn.lock:
        raise ImageError(f"{defn.root / LOCK_FILE} is empty; pin with:\n  {repin_command(defn.root)}")
    if fmt not in ("directory", "tar"):
        raise ValueError(f"fmt {fmt!r}: directory or tar")
    debs = ensure_debs(defn, work, log)
    # [trusted=yes]: this repository is unsigned, and needs no signature: every file in it was
    # checked against packages.lock's sha256 just above (and, when downloaded, by apt against the
    # release's signed indices).
    repo = local_repo(debs, work / "repo", defn.release)
    sources = work / "sources.list"
    sources.write_text("".join(f"{s}\n" for s in defn.sources))
    status = work / "dpkg-status"
    customize = []
    if (defn.root / "overlay").is_dir():
        customize.append(f"copy-in {overlay_copy(defn.root / 'overlay', work / 'overlay')}/. /")
    if (defn.root / "customize.sh").exists():
        env_args = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted((customize_env or {}).items()))
        customize.append(
            f'chroot "$1" env {env_args} /bin/sh -eu < {shlex.quote(str(defn.root / "customize.sh"))}'
        )
    customize += list(hooks)
    customize += [
        # the tree's apt points at the release's mirror, not at this build's local repository
        f"upload {sources} /etc/apt/sources.list",
        f'rm -f "$1"/etc/apt/sources.list.d/*; cp "$1/var/lib/dpkg/status" {shlex.quote(str(status))}',
        _hook_normalize(defn),
    ]
    out = work / ("rootfs" if fmt == "directory" else "rootfs.tar")
    log(
        f"mmdebstrap {defn.release}: {len(debs)} packages from the local repository (log {work}/mmdebstrap.log)"
    )
    try:
        _mmdebstrap(
            defn,
            [
                f"--variant={variant}",
                f"--format={fmt}",
                *(f"--dpkgopt={o}" for o in dpkg_opts),
                f"--include={','.join(f'{n}={p.version}' for n, p in sorted(defn.lock.items()))}",
                *(f"--customize-hook={h}" for h in customize),
                defn.release,
                str(out),
                # copy://: apt copies each file into the chroot's archives (file:// would need the
                # repository bind-mounted inside the chroot for dpkg to reach it)
                f"deb [trusted=yes] copy://{repo} ./",
            ],
            work / "mmdebstrap.log",
        )
    finally:
        unmount_under(work)
    return Tree(out, status, components(defn, status))


def repin(defn: Definition, log: Log, *, variant: str = "apt") -> Path:
    """Re-resolve packages.lock from the mirror for the top-level packages: each installed
    package's version and its .deb's sha256, the .debs kept in the cache. `variant` is the one
    the builder's rootfs() uses (an appliance without apt: "essential")."""
    paths.cache_dir().mkdir(parents=True, exist_ok=True)  # a fresh KVLAB_CACHE has no folder yet
    work = Path(tempfile.mkdtemp(prefix=".repin-", dir=paths.cache_dir()))
    try:
        keyring = pinned_keyring(defn, work)
        archives, status = work / "archives", work / "dpkg-status"
        archives.mkdir()
        log(f"mmdebstrap {defn.release}: resolving {len(defn.packages)} packages (log {work}/mmdebstrap.log)")
        _mmdebstrap(
            defn,
            [
                f"--variant={variant}",
                f"--keyring={keyring}",
                "--format=null",
                "--skip=download/empty",
                "--skip=essential/unlink",  # the essential set's .debs too
                f"--include={','.join(defn.packages)}",
                f"--customize-hook=sync-out /var/cache/apt/archives {archives}",
                f'--customize-hook=cp "$1/var/lib/dpkg/status" {status}',
                defn.release,
                "/dev/null",
                *defn.sources,
            ],
            work / "mmdebstrap.log",
        )
        installed = dpkg_status(status)
        files = {}
        for deb in archives.glob("*.deb"):
            name, version = deb_fields(deb, "Package", "Version")
            if installed.get(name, ("",))[0] == version:
                files[name] = deb
        absent = sorted(set(installed) - set(files))
        if absent:
            raise ImageError(f"repin: mmdebstrap kept no .deb for {', '.join(absent)}")
        cache = deb_cache()
        cache.mkdir(parents=True, exist_ok=True)
        pins = {}
        for name, deb in sorted(files.items()):
            sha = sha256_file(deb)
            shutil.move(str(deb), cache / f"{sha}.deb")
            pins[name] = Pin(installed[name][0], sha)
        lock_file = defn.root / LOCK_FILE
        old = lock_versions(lock_file.read_text()) if lock_file.exists() else {}
        lock_file.write_text(format_lock(pins))
        changed = sorted(
            n for n in set(old) | set(pins) if old.get(n) != (pins[n].version if n in pins else None)
        )
        log(
            f"wrote {lock_file} ({len(pins)} packages, {len(changed)} not at the old lock's version"
            + (f": {', '.join(changed[:10])}" if changed else "")
            + "); build again to use it"
        )
        return defn.root / LOCK_FILE
    finally:
        unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)


def normalize(tree: Path, epoch: int) -> None:
    """Remove what differs between two builds or must not ship (keys, IDs, logs, caches)."""
    for pattern in VOLATILE:
        for p in sorted(tree.glob(pattern), reverse=True):
            if p.is_symlink() or p.is_file():
                p.unlink()  # folders stay: services expect them
    machine_id = tree / "etc/machine-id"
    if machine_id.exists() or (tree / "etc").is_dir():
        machine_id.write_text("")  # systemd writes a fresh one on first boot
    # shadow's "last password change" is the build day: clamp it to the epoch's
    shadow = tree / "etc/shadow"
    if shadow.exists():
        day = str(epoch // 86400)
        rows = []
        for line in shadow.read_text().splitlines():
            f = line.split(":")
            if len(f) > 2 and f[2]:
                f[2] = day
            rows.append(":".join(f))
        shadow.write_text("\n".join(rows) + "\n")
        os.chmod(shadow, 0o640)


def unmount_under(root: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[str]:
    """Unmount what an interrupted mmdebstrap left mounted in the build folder (/proc, /sys,
    /dev/pts of the chroot), deepest first, so that removing the folder never walks into them."""
    prefix = str(root.resolve()) + "/"
    points = []
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        # mountinfo escapes blanks in paths as octal (\040)
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point.startswith(prefix):
            points.append(point)
    points.sort(key=len, reverse=True)
    for point in points:
        subprocess.run(["umount", "--lazy", point], check=False, capture_output=True)
    return points


if __name__ == "__main__":  # the normalize customize hook (see _hook_normalize)
    if len(sys.argv) != 4 or sys.argv[1] != "normalize":
        sys.exit("usage: python -m kvlab.images.debian normalize TREE EPOCH")
    normalize(Path(sys.argv[2]), int(sys.argv[3]))
