"""site.yml's GPU and serving plays on the node VM, a GPU node without a GPU.

What needs neither a GPU nor vLLM's multi-GB environment runs for real: kvlab_connector installs
into the environment from the controller's hash-checked wheels (the VM reaches no index), proves
the NVMe-oF mount takes O_DIRECT and runs the store benchmark there; vllm_server renders every
setup's unit and deployment from the registry and checks them with systemd-analyze. The GPU roles
and vLLM's environment stop, saying why.
"""

from __future__ import annotations

import json

import pytest

from kvlab.setups import cli as setup_cli
from kvlab.setups import registry as setups

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(3600)]

VENV = "/opt/kvlab/venv"
STORE = "/mnt/kvstore0/kvlab"
# roles/kvlab_connector/files/kvlab-connector-deps.lock: the wheel's, not Debian's 2.2.4
LOCKED_NUMPY = "2.2.6"


def test_gpu_roles_say_no_gpu_and_serving_renders_only(deployed):
    if deployed is None:
        pytest.skip("attached testbed: deployed by make deploy")
    out = deployed.stdout
    assert "no NVIDIA GPU found on node" in out, out[-4000:]
    assert "vllm_server on node: render only: no NVIDIA GPU found" in out, out[-4000:]


def test_connector_installed_from_the_locked_wheels(testbed, deployed):
    got = testbed.node.succeed(
        f"{VENV}/bin/python -c 'import numpy, xxhash, kvlab_connector; print(numpy.__version__, numpy.__file__)'"
    ).split()
    assert got[0] == LOCKED_NUMPY and got[1].startswith(f"{VENV}/"), got
    # nothing vLLM-sized came with it
    assert testbed.node.fail(f"{VENV}/bin/python -c 'import vllm'")


def test_store_benchmark_ran_verified_on_the_nvmeof_mount(testbed, deployed):
    [path] = testbed.node.succeed("ls /var/lib/kvlab/store-bench/*.json").split()
    report = json.loads(testbed.node.succeed(f"cat {path}"))
    assert report["paths"] == [STORE] and report["verified"] is True, report
    assert report["io_mode"] == "posix-odirect" and report["bytes"] == 128 << 20, report
    assert testbed.node.succeed(f"findmnt -n -o FSTYPE --target {STORE}").strip() == "xfs"


def test_units_rendered_from_the_registry_and_verified(testbed, deployed):
    """Each deployment on the node is what the registry renders here for its parameters."""
    names = testbed.node.succeed("ls /etc/kvlab/setups").split()
    deployments = sorted(n[: -len(".json")] for n in names if not n.endswith(".kv-transfer-config.json"))
    assert deployments == sorted(["baseline", "kvlab", "vllm-example", "lmcache-mp", "lmcache-mp+kvlab"])
    kvlab = json.loads(testbed.node.succeed("cat /etc/kvlab/setups/kvlab.json"))
    assert kvlab["kv_transfer_config"]["kv_connector_extra_config"]["paths"] == [STORE], kvlab
    params = setup_cli.params_from_mapping({
        "model": "/models/kvlab-tiny", "python": f"{VENV}/bin/python", "served_model_name": "kvlab-tiny",
        "host": "127.0.0.1", "port": 8000, "tensor_parallel_size": 1, "enable_prefix_caching": True,
        "device": "cuda", "kv_store_paths": [STORE], "example_storage_path": "/mnt/kvstore0/vllm-example",
    })  # fmt: skip
    assert kvlab["engine"]["argv"] == list(setups.render("kvlab", params).engine.argv)
    units = [f"/etc/systemd/system/kvlab-vllm-{n.replace('+', '_')}.service" for n in deployments]
    testbed.node.succeed("systemd-analyze verify " + " ".join(units))
    # render only: nothing was started
    for unit in units:
        rc, state = testbed.node.execute(f"systemctl is-active {unit.rsplit('/', 1)[1]}")
        assert state.strip() == "inactive", (unit, state)
