"""RoCE under load, on every initiator: a bounded read over the fabric (its store mounts), the
RoCE counters read before and after. The RoCE priority's counters must move (soft-RoCE, which has
no priorities: the RDMA packet counters), no transport error counter and no pause storm may
(kvlab.verify_checks.counter_problems, unit-tested with a still counter, an error, a storm)."""

from __future__ import annotations

import json
import time

import pytest

from kvlab import verify_checks as vc

pytestmark = pytest.mark.infra
testinfra_hosts = ["ansible://nvmeof_initiators"]


COUNTERS = (
    "for f in /sys/class/infiniband/*/ports/*/counters/* /sys/class/infiniband/*/ports/*/hw_counters/*; do "
    '[ -r "$f" ] && printf \'%s %s\\n\' "$f" "$(cat $f 2>/dev/null)"; done; true'
)


def read_counters(host, netdevs: list[str]) -> dict[str, int]:
    """The RDMA ports' counters, and each QoS netdev's ethtool statistics (PFC, pause, per priority)."""
    counters = {}
    for line in host.check_output(COUNTERS).splitlines():
        path, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            counters[path.removeprefix("/sys/class/infiniband/")] = int(value)
    for nd in netdevs:
        for line in host.run(f"ethtool -S {nd}").stdout.splitlines():
            k, _, v = line.strip().partition(":")
            if v.strip().lstrip("-").isdigit():
                counters[f"{nd}/{k.strip()}"] = int(v)
    return counters


LOAD_MIB = 64


def load_command(path: str) -> str:
    """A bounded read load over the fabric on one store mount: fio where installed, else dd
    (O_DIRECT both, so every byte crosses the fabric)."""
    f = f"{path}/.kvlab-verify-load"
    return (
        f"set -e; dd if=/dev/urandom of={f} bs=1M count={LOAD_MIB} oflag=direct conv=fsync status=none; "
        f"if command -v fio >/dev/null; then fio --name=kvlab-verify --filename={f} --rw=randread --bs=128k "
        f"--direct=1 --iodepth=8 --ioengine=libaio --runtime=10 --time_based --output-format=terse >/dev/null; "
        f"else timeout 60 dd if={f} of=/dev/null bs=1M iflag=direct status=none; fi; rm -f {f}"
    )


def test_roce_counters_move_under_load_without_errors(host, inv, record_dir):
    """Under a bounded read over the fabric (an initiator's store mounts), the RoCE priority's
    counters move (soft-RoCE: the RDMA packet counters; it has no priorities) and no transport
    error counter nor pause storm does. Counters before and after are recorded."""
    mounts = [fs["path"] for fs in inv["initiator_filesystems"]]
    assert mounts, "no NVMe-oF filesystem on an initiator to load"
    ll = inv["lossless"]
    nics = vc.qos_devices(ll, inv["netdevs"]) if ll.get("enabled") and inv["lossless_apply"] else []
    priority = int(ll.get("pfc_priority", 3)) if nics else None
    before = read_counters(host, nics)
    t0 = time.monotonic()
    for path in mounts:
        host.check_output(load_command(path))
    duration = time.monotonic() - t0
    after = read_counters(host, nics)
    name = host.backend.get_hostname()
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    (record_dir / f"{name}-roce-counters.json").write_text(
        json.dumps({"before": before, "after": after, "moved": delta, "load_s": round(duration, 1)},
                   indent=1, sort_keys=True))  # fmt: skip
    problems = vc.counter_problems(before, after, priority, duration)
    assert not problems, "\n".join(problems)
    print(
        f"{name}: under {len(mounts) * LOAD_MIB} MiB of reads ({duration:.0f} s), counters moved: "
        f"{dict(sorted(delta.items()))}"
    )
