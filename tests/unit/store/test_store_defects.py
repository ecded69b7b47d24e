"""The store defects that a fault campaign found (issue 27), each reproduced here: a racing
eviction that failed saves, a missing mount that sent the store onto the root disk, the L2
adapter's configuration, and begin_write's arguments checked at the boundary."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from kvlab_connector.ring import StagingRing
from kvlab_connector.store import ObjectShape, Store

NS = "cd" * 16
TINY = ObjectShape(n_sections=1, section_bytes=4096)
SAVES = 1500


def _save_and_remove(drive: str, first: int, start: mp.Event, q: mp.Queue) -> None:
    """Save then remove objects whose keys share one key directory, as fast as it goes: the
    removal takes the key directory with the object (it is left empty), as eviction does."""
    store = Store([drive], capacity_bytes=1 << 40)
    ring = StagingRing(2 * TINY.stride, TINY.stride)
    start.wait(60)
    failed = []
    for i in range(SAVES):
        k = f"00{first + i:030x}"
        w = store.begin_write(NS, k, TINY, num_tokens=1)
        slot = ring.acquire(timeout_s=10)
        w.submit_section(0, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
        if not w.done.result(timeout=30):
            failed.append(k)
        store.remove(NS, k)
    store.close()
    q.put(len(failed))


def test_a_save_survives_another_process_removing_its_key_directory(tmp_path: Path) -> None:
    # pathlib's mkdir(exist_ok=True) raised FileExistsError when the directory went between
    # its mkdir and its re-check; the writer retried FileNotFoundError only.
    drive = str(tmp_path / "d0")
    Store([drive], capacity_bytes=1 << 40).close()
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    start = ctx.Event()
    procs = [ctx.Process(target=_save_and_remove, args=(drive, n * SAVES, start, q)) for n in range(2)]
    for p in procs:
        p.start()
    start.set()
    failed = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert failed == [0, 0], f"saves lost to a racing removal of the key directory: {failed} of {SAVES} each"


def test_the_store_never_makes_a_drive_paths_missing_parents(tmp_path: Path) -> None:
    # An unmounted drive's mount point: the store made the whole path on the root filesystem.
    gone = tmp_path / "mnt" / "nvme0" / "kvlab"
    with pytest.raises(ValueError, match=r"paths: .*nvme0/kvlab.* does not exist"):
        Store([tmp_path / "d0", gone], capacity_bytes=1 << 30)
    assert not (tmp_path / "mnt").exists()
    Store([tmp_path / "d1"], capacity_bytes=1 << 30).close()  # a drive's own directory is still made
    assert (tmp_path / "d1" / "kvlab-v1").is_dir()


def test_a_writer_never_makes_a_vanished_drives_directory(tmp_path: Path) -> None:
    import shutil

    drive = tmp_path / "d0"
    store = Store([drive], capacity_bytes=1 << 30)
    ring = StagingRing(2 * TINY.stride, TINY.stride)
    shutil.rmtree(drive)  # unmounted under the running store
    w = store.begin_write(NS, "0" * 32, TINY, num_tokens=1)
    slot = ring.acquire(timeout_s=10)
    w.submit_section(0, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
    assert w.done.result(timeout=30) is False
    assert not drive.exists()
    store.close()


def _on_root_filesystem(path: Path) -> bool:
    from kvlab_connector.store.store import mount_point

    return mount_point(path) == Path("/")


def test_require_mount_refuses_a_path_where_nothing_is_mounted(tmp_path: Path) -> None:
    if not _on_root_filesystem(tmp_path):
        pytest.skip(
            f"{tmp_path} is on a mounted filesystem of its own: no path here sits on the root filesystem"
        )
    with pytest.raises(ValueError, match=rf"require_mount: nothing is mounted at '{tmp_path}/d0'"):
        Store([tmp_path / "d0"], capacity_bytes=1 << 30, require_mount=True)
    assert not (tmp_path / "d0").exists(), "nothing is made on the root filesystem"
    Store([tmp_path / "d0"], capacity_bytes=1 << 30).close()  # the default: unaffected


def test_require_mount_takes_a_path_on_a_mounted_filesystem(tmp_path: Path) -> None:
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a filesystem")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("this kernel refuses a tmpfs mount here")
    try:
        Store([mnt / "kvlab"], capacity_bytes=1 << 30, require_mount=True).close()
        assert (mnt / "kvlab" / "kvlab-v1").is_dir()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
    if _on_root_filesystem(tmp_path):
        with pytest.raises(ValueError, match="require_mount"):
            Store([mnt / "kvlab"], capacity_bytes=1 << 30, require_mount=True)


def test_require_mount_is_a_setting_of_the_connector_and_the_l2_adapter() -> None:
    from kvlab_connector.config import ConfigError, ConnectorConfig
    from kvlab_connector.lmcache_l2.config import KvlabL2AdapterConfig

    assert ConnectorConfig.from_extra({"paths": ["/x"], "require_mount": True}).require_mount is True
    assert ConnectorConfig.from_extra({"paths": ["/x"]}).require_mount is False
    with pytest.raises(ConfigError, match="require_mount"):
        ConnectorConfig.from_extra({"paths": ["/x"], "require_mount": "yes"})
    assert KvlabL2AdapterConfig.from_dict({"paths": ["/x"], "require_mount": True}).require_mount is True
    assert KvlabL2AdapterConfig.from_dict({"paths": ["/x"]}).require_mount is False


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"paths": ["/x"], "capacity_tb": 1}, "'capacity_tb'"),
        ({"paths": ["/x"], "slot_timeout_s": -1}, "'slot_timeout_s'"),
        ({"paths": ["/x"], "slot_timeout_s": float("nan")}, "'slot_timeout_s'"),
        ({"paths": ["/x"], "slot_timeout_s": "30"}, "'slot_timeout_s'"),
        ({"paths": ["/x", "/y", "/x"]}, "'paths' lists '/x' twice"),
        ({"paths": ["/x"], "capacity_gb": -1}, "'capacity_gb'"),
        ({"paths": ["/x"], "capacity_gb": 1, "capacity_bytes": 1 << 30}, "'capacity_bytes' or 'capacity_gb'"),
        ({"paths": ["/x"], "ring_bytes": -5}, "'ring_bytes'"),
        ({"paths": ["/x"], "section_bytes": 0}, "'section_bytes'"),
        ({"paths": ["/x"], "require_mount": 1}, "'require_mount'"),
    ],
)
def test_the_l2_adapters_configuration_refuses_nonsense_naming_the_key(params: dict, named: str) -> None:
    from kvlab_connector.lmcache_l2.config import KvlabL2AdapterConfig

    with pytest.raises(ValueError, match=named):
        KvlabL2AdapterConfig.from_dict(params)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"num_tokens": -1}, "num_tokens"),
        ({"num_tokens": 2**32}, "num_tokens"),
        ({"num_tokens": 1.5}, "num_tokens"),
        ({"num_tokens": 1, "tag": 2**64}, "tag"),
        ({"num_tokens": 1, "tag": -1}, "tag"),
    ],
)
def test_begin_write_refuses_what_a_trailer_cannot_hold_naming_it(
    tmp_path: Path, args: dict, named: str
) -> None:
    # The first submit_section failed with "struct.error: argument out of range", naming neither.
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    with pytest.raises(ValueError, match=rf"kvlab store: {named} must be an integer in 0\.\.2\*\*(32|64)-1"):
        store.begin_write(NS, "0" * 32, TINY, **args)
    store.close()


def test_begin_write_takes_the_largest_values_a_trailer_holds(tmp_path: Path) -> None:
    store = Store([tmp_path / "d0"], capacity_bytes=1 << 30)
    ring = StagingRing(2 * TINY.stride, TINY.stride)
    w = store.begin_write(NS, "0" * 32, TINY, num_tokens=2**32 - 1, tag=2**64 - 1)
    slot = ring.acquire(timeout_s=10)
    w.submit_section(0, ring.buffer(slot), lambda ok, slot=slot: ring.release(slot))
    assert w.done.result(timeout=30)
    store.close()
