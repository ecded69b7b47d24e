"""The connector's store benchmark inside the node VM, on the NVMe-oF mount, with verification.

The connector ships as a wheel built here (`pip wheel --no-deps connector/`); its dependencies
(numpy, xxhash) come from Debian in the image. The wheel is pure Python: unpacking it is enough.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlab import paths

# The first test also waits for the session's VMs and first deploy.
pytestmark = [pytest.mark.testbed, pytest.mark.timeout(3600)]

MOUNT = "/mnt/kvstore0"


@pytest.fixture(scope="module")
def connector_wheel(tmp_path_factory):
    src = paths.repo_root() / "connector"
    if not (src / "src" / "kvlab_connector" / "cli.py").exists():
        pytest.fail(
            "connector/src/kvlab_connector/cli.py is missing: the store benchmark has no entry point yet"
        )
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    [wheel] = out.glob("kvlab_connector-*.whl")
    return wheel


def test_store_bench_verifies_on_the_nvmeof_mount(testbed, deployed, connector_wheel):
    node = testbed.node
    key = testbed.state.key
    port = node.state.ssh_port
    subprocess.run(
        ["scp", "-q", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-i", key,
         "-P", str(port), str(connector_wheel), f"root@127.0.0.1:/tmp/{connector_wheel.name}"],
        check=True, timeout=60,
    )  # fmt: skip
    node.succeed(
        f"rm -rf /opt/kvlab-connector && python3 -m zipfile -e /tmp/{connector_wheel.name} /opt/kvlab-connector"
    )
    node.succeed(f"mountpoint -q {MOUNT} && mkdir -p {MOUNT}/bench")
    out = node.succeed(
        f"cd /tmp && PYTHONPATH=/opt/kvlab-connector python3 -m kvlab_connector.cli bench "
        f"--path {MOUNT}/bench --size-mib 64 --verify --json",
        timeout=600,
    )
    report = None
    for line in out.splitlines():
        if line.strip().startswith("{"):
            try:
                report = json.loads(line)
            except ValueError:
                continue
    assert report is not None, f"no JSON report from the bench:\n{out[-2000:]}"
    flat = json.dumps(report).lower()
    assert "verif" in flat, f"the bench report says nothing about verification: {report}"
    for key_name in ("verified", "verify_ok", "ok"):
        if key_name in report:
            assert report[key_name] is True, report
    for key_name in ("errors", "mismatches", "verify_errors", "corrupt"):
        if key_name in report:
            assert not report[key_name], report
    print(json.dumps(report, indent=1))
