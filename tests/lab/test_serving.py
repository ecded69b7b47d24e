"""Serving on a GPU node: the chosen setup's unit runs the registry's command line, the
connector's drives are mounted and O_DIRECT-writable, the cache server (where the setup has
one) is healthy, and a long prompt comes back from the external store after an engine restart."""

from __future__ import annotations

import json
import re

import pytest
from labhelpers import host_name

pytestmark = pytest.mark.lab

# Runs on the node with vLLM's Python: one long prompt, time to first token at the client.
TTFT = r"""
import json, os, random, sys, time, urllib.request
port, model, tokens = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rng = random.Random(20261129)
words = [''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(2, 9))) for _ in range(4000)]
prompt = ' '.join(rng.choice(words) for _ in range(tokens))
key = os.environ.get('VLLM_API_KEY', '')
req = urllib.request.Request(
    f'http://127.0.0.1:{port}/v1/completions',
    data=json.dumps({'model': model, 'prompt': prompt, 'max_tokens': 1, 'temperature': 0}).encode(),
    headers={'Content-Type': 'application/json', **({'Authorization': f'Bearer {key}'} if key else {})})
t0 = time.perf_counter()
with urllib.request.urlopen(req, timeout=900) as r:
    body = json.load(r)
print(json.dumps({'ttft_s': time.perf_counter() - t0, 'prompt_tokens': body['usage']['prompt_tokens']}))
"""


def unit_name(setup: str, kind: str = "vllm") -> str:
    """The vllm_server role's unit of a setup (systemd allows no "+": it writes "_")."""
    return f"kvlab-{kind}-{re.sub(r'[^A-Za-z0-9:_.-]', '_', setup)}.service"


def main_pid_argv(host, unit: str) -> list[str]:
    pid = host.check_output(f"systemctl show -p MainPID --value {unit}").strip()
    assert pid not in ("", "0"), f"{unit} has no main process"
    with host.sudo():
        raw = host.check_output(f"tr '\\0' '\\n' < /proc/{pid}/cmdline")
    return raw.splitlines()


def test_unit_of_the_chosen_setup_runs(gpu, lab, deployment):
    assert gpu.service(unit_name(lab["setup"])).is_running
    assert gpu.service(unit_name(lab["setup"])).is_enabled


def test_engine_runs_the_registrys_command_line(gpu, lab, deployment):
    """The running engine's argv is the deployment the role rendered from the setup registry,
    so its kv-transfer-config is the chosen setup's."""
    argv = main_pid_argv(gpu, unit_name(lab["setup"]))
    assert argv == deployment["engine"]["argv"]
    if deployment["kv_transfer_config"] is not None:
        assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == deployment["kv_transfer_config"]
    else:
        assert "--kv-transfer-config" not in argv


def test_store_drives_mounted_and_o_direct_writable(gpu, lab, store_paths):
    with gpu.sudo():
        for path in store_paths:
            fs = gpu.check_output(f"findmnt -n -o FSTYPE --target {path}").strip()
            assert fs in lab["fstypes"], f"{path} is on {fs}"
            probe = f"{path}/.kvlab-lab-odirect"
            gpu.check_output(
                f"runuser -u kvlab -- dd if=/dev/zero of={probe} bs=1M count=4 oflag=direct status=none && rm -f {probe}"
            )


def test_cache_server_healthy_where_deployed(gpu, lab, deployment):
    companion = deployment["companion"]
    if companion is None:
        pytest.skip(f"setup {lab['setup']!r} deploys no cache server on {host_name(gpu)}")
    unit = unit_name(lab["setup"], "cache")
    assert gpu.service(unit).is_running
    if companion.get("ready_port"):
        assert gpu.socket(f"tcp://{companion['ready_port']}").is_listening
    if companion.get("ready_url"):
        gpu.check_output(f"curl -fsS --max-time 10 {companion['ready_url']}")


def metric_total(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_long_prompt_restored_after_engine_restart(gpu, lab, deployment):
    """The pages of a long prompt come back from the external store after a restart: the store's
    counters (kvlab) or vLLM's external-cache hits cover most of the prompt."""
    kv = deployment["kv_transfer_config"]
    if kv is None:
        pytest.skip(f"setup {lab['setup']!r} keeps no KV outside the GPU: nothing survives a restart")
    unit, port = unit_name(lab["setup"]), lab["port"]
    env_file = f"{lab['config_dir']}/vllm-api.env"
    script = f"{lab['venv']}/bin/python - {port} {lab['served_model_name']} 32000 <<'EOF'\n{TTFT}\nEOF"
    run = f"set -a; . {env_file}; set +a; {script}"

    def ttft() -> dict:
        with gpu.sudo():
            return json.loads(gpu.check_output(f"bash -c {json.dumps(run)}").splitlines()[-1])

    def wait_ready() -> None:
        gpu.check_output(
            f"for i in $(seq 360); do curl -fsS -o /dev/null http://127.0.0.1:{port}/health && exit 0; sleep 5; done; exit 1"
        )

    def metrics() -> str:
        extra = kv.get("kv_connector_extra_config", {})
        url = (
            f"http://127.0.0.1:{extra['metrics_port']}/metrics"
            if "metrics_port" in extra
            else f"http://127.0.0.1:{port}/metrics"
        )
        return gpu.check_output(f"curl -fsS --max-time 30 {url}")

    wait_ready()
    first = ttft()  # computes, and the connector saves the pages
    with gpu.sudo():
        gpu.check_output(f"systemctl restart {unit}")
    wait_ready()
    before = metrics()
    second = ttft()
    after = metrics()
    assert second["prompt_tokens"] == first["prompt_tokens"] > 30000
    hits = metric_total(after, "kvlab_hit_tokens") - metric_total(before, "kvlab_hit_tokens")
    ext = metric_total(after, "vllm:external_prefix_cache_hits") - metric_total(
        before, "vllm:external_prefix_cache_hits"
    )
    # Most of the prompt came from the store (the TTFTs, first and second, are the campaign's
    # finding; a timing is no pass condition).
    assert max(hits, ext) >= second["prompt_tokens"] // 2, ("too little came from the external store "
                                                            "after the restart", hits, ext, first, second)
    if kv.get("kv_connector") == "KvlabConnector":
        # The engine itself, not just gdscheck: kvlab's connector says how it moved the pages.
        modes = [line for line in after.splitlines() if line.startswith("kvlab_io_mode_info{") and not line.endswith(" 0.0")]
        # Where the site allows compat mode (no nvidia-fs), io_engine auto stages KV in the
        # page-locked host ring ("...+h2d") and io_engine gds in kvikio's compat mode.
        used = [line.split('mode="', 1)[1].split('"', 1)[0] for line in modes]
        compat = lab["gds_allow_compat_mode"]
        assert any(m == "gds" or (compat and (m == "gds-compat" or m.endswith("+h2d"))) for m in used), (
            f"kvlab moved KV in {used or 'no reported mode'}, not gds"
            f"{' (or, compat mode allowed, gds-compat or the host ring)' if compat else ''}: kvikio is missing "
            "from vLLM's environment, or GDS is not on for the store's mounts (see test_gds_on_not_compat)"
        )
