"""Every lab node's clock synchronised (chrony or systemd-timesyncd): campaign records, journals
and the target's and nodes' logs are compared by time. Run on the GPU nodes and the targets
(`scripts/verify`). The judgement is kvlab.verify_checks.time_sync_problems (unit-tested with an
unsynchronised clock)."""

from __future__ import annotations

import pytest
from labhelpers import host_name

from kvlab import verify_checks as vc

pytestmark = pytest.mark.lab


def test_time_sync_chrony_or_timesyncd_synchronised(host):
    if host.backend.NAME != "ansible":
        pytest.skip(
            f"{host_name(host)} is not an inventory host: run with --hosts=ansible://<group> --ansible-inventory=..."
        )
    timedatectl = host.run("timedatectl show -p NTPSynchronized 2>/dev/null").stdout
    chrony = host.run("chronyc -n tracking 2>/dev/null").stdout if host.exists("chronyc") else ""
    if not timedatectl and not chrony:
        pytest.fail(
            f"{host_name(host)}: neither timedatectl nor chronyc answers (no time synchronisation at all)"
        )
    problems = vc.time_sync_problems(timedatectl, chrony)
    assert not problems, f"{host_name(host)}: " + "\n".join(problems)
