"""`kvlab-store fsck` and `kvlab-store bench --keep`: every kind of damage at rest is found and
named, --repair removes exactly the damaged objects (never a foreign file) and keeps the
ledger right, and the exit status says clean (0), damage (1) or could not check (2)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kvlab_connector.cli import main
from kvlab_connector.fsck import fsck
from kvlab_connector.ring import StagingRing
from kvlab_connector.store import ObjectShape, Store
from kvlab_connector.store.format import ROOT_NAME, STALE_MAGICS

NS = "f0" * 16
SHAPE = ObjectShape(n_sections=4, section_bytes=2 * 4096 + 100)


def key(i: int) -> str:
    return f"{i:08x}" + "a" * 24


@pytest.fixture
def drives(tmp_path: Path) -> list[Path]:
    return [tmp_path / "d0", tmp_path / "d1"]


def put(store: Store, i: int, fill: int = 0) -> None:
    ring = StagingRing(SHAPE.n_sections * SHAPE.stride, SHAPE.stride)
    w = store.begin_write(NS, key(i), SHAPE, num_tokens=7)
    for s in range(SHAPE.n_sections):
        slot = ring.acquire(timeout_s=10)
        ring.buffer(slot)[: SHAPE.section_bytes] = bytes([(i + s + fill) % 256]) * SHAPE.section_bytes
        w.submit_section(s, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
    assert w.done.result(timeout=30)
    ring.close()


def filled(drives: list[Path], n: int = 6) -> Store:
    store = Store(drives, capacity_bytes=1 << 30)
    for i in range(n):
        put(store, i)
    store.flush_usage()
    return store


def fragment(drives: list[Path], i: int, frag: int) -> Path:
    (p,) = [p for p in drives[frag].rglob(f"{key(i)}.{frag}-*")]
    return p


def age(drives: list[Path], seconds: float = 3600) -> None:
    for d in drives:
        for p in d.rglob("*"):
            st = p.stat()
            os.utime(p, (st.st_atime - seconds, st.st_mtime - seconds))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_a_clean_store_is_clean(drives: list[Path]) -> None:
    filled(drives)
    r = fsck(drives)
    assert (r.objects, r.damaged, r.damaged_keys, r.clean) == (6, 0, [], True)
    assert r.bytes == 6 * SHAPE.object_bytes
    assert r.namespaces == {NS: {"objects": 6, "bytes": 6 * SHAPE.object_bytes, "damaged": 0}}
    assert r.bytes_read >= r.bytes, "every byte of every object is read"


def _corrupt_payload(drives: list[Path]) -> None:
    flip(fragment(drives, 1, 0), 17)


def _corrupt_trailer(drives: list[Path]) -> None:
    p = fragment(drives, 1, 1)
    flip(p, p.stat().st_size - 4096 + 40)


def _truncated(drives: list[Path]) -> None:
    p = fragment(drives, 1, 0)
    os.truncate(p, p.stat().st_size - 4096)


def _fragment_missing(drives: list[Path]) -> None:
    fragment(drives, 1, 1).unlink()
    age(drives)


def _stale_format(drives: list[Path]) -> None:
    p = fragment(drives, 1, 0)
    with open(p, "r+b") as f:  # the last section's trailer, as format 1 wrote it
        f.seek(p.stat().st_size - 4096)
        f.write(STALE_MAGICS[0])


def _mixed_writes(drives: list[Path]) -> None:
    old = fragment(drives, 1, 1).read_bytes()
    store = Store(drives, capacity_bytes=1 << 30)
    put(store, 1, fill=9)  # written again: fragment 1 of the first write put back beside the second's
    fragment(drives, 1, 1).write_bytes(old)


@pytest.mark.parametrize(
    ("damage", "kind"),
    [
        (_corrupt_payload, "corrupt"),
        (_corrupt_trailer, "corrupt"),
        (_truncated, "partial"),
        (_fragment_missing, "partial"),
        (_stale_format, "stale_format"),
        (_mixed_writes, "mixed_writes"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_each_kind_of_damage_is_found_named_and_repaired(drives: list[Path], damage, kind: str) -> None:  # type: ignore[no-untyped-def]
    store = filled(drives)
    damage(drives)
    r = fsck(drives)
    assert (r.damaged, r.damaged_keys, r.damage[kind]) == (1, [key(1)], 1)
    assert sum(r.damage.values()) == 1 and not r.clean
    r = fsck(drives, repair=True)
    assert r.removed_objects == 1
    after = fsck(drives)
    assert (after.objects, after.damaged, after.clean) == (5, 0, True)
    assert not list(d for drive in drives for d in drive.rglob(f"{key(1)}*"))
    assert store.usage_bytes() == r.usage_bytes == 5 * SHAPE.object_bytes, "the ledger counts what stays"


def test_a_fragment_missing_for_a_moment_is_an_object_in_flight_not_damage(drives: list[Path]) -> None:
    filled(drives)
    fragment(drives, 2, 0).unlink()  # a running engine's commit (or eviction) under way
    r = fsck(drives, repair=True)
    assert (r.damaged, r.in_flight, r.removed_files) == (0, 1, 0)
    assert fragment(drives, 2, 1).exists()


def test_foreign_files_are_counted_and_never_removed(drives: list[Path]) -> None:
    filled(drives)
    foreign = [
        drives[0] / ROOT_NAME / NS / key(1)[:2] / "notes.txt",
        drives[1] / ROOT_NAME / "backup",
    ]
    for p in foreign:
        p.write_text("not the store's")
    r = fsck(drives, repair=True)
    assert r.foreign_files == 2 and not r.clean
    assert all(p.exists() for p in foreign)
    assert r.damaged == 0 and r.objects == 6


def test_orphaned_temporary_files_are_counted_and_removed(drives: list[Path]) -> None:
    filled(drives)
    d = drives[0] / ROOT_NAME / NS / key(1)[:2]
    dead = d / f".{key(1)}.0-2.{2 * SHAPE.stride}.999999999.deadbeef.tmp"  # no such PID
    live = d / f".{key(1)}.0-2.{2 * SHAPE.stride}.{os.getpid()}.cafebabe.tmp"  # a writer at work
    dead.write_bytes(b"x" * 4096)
    live.write_bytes(b"x" * 4096)
    r = fsck(drives, repair=True)
    assert (r.orphaned_files, r.removed_files, r.damaged) == (1, 1, 0)
    assert not dead.exists() and live.exists()


def test_the_cli_says_clean_damaged_or_could_not_check(
    drives: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    filled(drives)
    args = ["fsck", *[a for d in drives for a in ("--path", str(d))], "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["objects"] == 6
    flip(fragment(drives, 3, 0), 100)
    assert main(args) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["damaged"], out["damaged_keys"], out["damage"]["corrupt"]) == (1, [key(3)], 1)
    assert main(["fsck", "--path", str(tmp_path / "nothing-mounted")]) == 2
    assert "holds no store" in capsys.readouterr().err


def test_bench_keep_leaves_its_objects_in_a_namespace_of_their_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvlab_connector.bench import KEPT_NS

    d = tmp_path / "d0"
    assert main(["bench", "--path", str(d), "--size-mib", "16", "--ring-mib", "8", "--keep"]) == 0
    assert main(["bench", "--path", str(d), "--size-mib", "8", "--ring-mib", "8"]) == 0  # clears its own only
    capsys.readouterr()
    r = fsck([d])
    assert (r.objects, r.damaged, list(r.namespaces)) == (2, 0, [KEPT_NS])
    shutil.rmtree(d)
