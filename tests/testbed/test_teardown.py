"""Last on the testbed: the storage teardown of playbooks/teardown.yml, asked for in so many words
(-e kvlab_teardown_storage=true), leaves no mount, no NVMe-oF connection and no subsystem behind;
what another user put in the target's configfs stays."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(1800)]

STORE_NQN = "nqn.2026-01.io.kvlab.testbed:store0"
MOUNT = "/mnt/kvstore0"
THEIRS = "nqn.2020-01.org.example:someone-else"


def test_storage_teardown_leaves_nothing_of_kvlabs_behind(testbed, deployed):
    # another user's subsystem on the shared target: the teardown must not touch it
    testbed.target.succeed(f"mkdir /sys/kernel/config/nvmet/subsystems/{THEIRS}")
    res = testbed.ansible("playbooks/teardown.yml", "-e", "kvlab_teardown_storage=true")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    testbed.node.fail(f"mountpoint -q {MOUNT}")
    testbed.node.fail(f"grep -qs ' {MOUNT} ' /etc/fstab")
    testbed.node.fail(f"grep -ls {STORE_NQN} /sys/class/nvme/nvme*/subsysnqn")
    testbed.node.fail("test -e /etc/nvme/config.json")
    testbed.node.fail("systemctl is-enabled --quiet kvlab-nvmeof-connect")
    subsystems = testbed.target.succeed("ls /sys/kernel/config/nvmet/subsystems").split()
    assert subsystems == [THEIRS], subsystems
    assert testbed.target.succeed("ls /sys/kernel/config/nvmet/ports").split() == []
    testbed.target.fail("test -e /var/lib/kvlab/nvmet-owned.json")
    testbed.target.fail("systemctl is-enabled --quiet kvlab-nvmet")
    testbed.target.succeed(f"rmdir /sys/kernel/config/nvmet/subsystems/{THEIRS}")
