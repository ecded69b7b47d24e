"""make verify's judgements (kvlab.verify_checks) fed the broken states a lab meets: each check
fails on its broken input, naming what it found and what it expected, and passes on a good one."""

from __future__ import annotations

import pytest

from kvlab import verify_checks as vc

pytestmark = pytest.mark.unit

NQN = "nqn.2026-01.io.kvlab.testbed:store0"
TARGETS = [{"traddr": "10.77.0.1", "trsvcid": 4420, "subsystems": [NQN]},
           {"traddr": "10.78.0.1", "trsvcid": 4420, "subsystems": [NQN]}]  # fmt: skip


def ctrl(name, addr, state="live", nqn=NQN):
    return {"name": name, "subsysnqn": nqn, "state": state,
            "address": f"traddr={addr},trsvcid=4420,src_addr=10.0.0.2"}  # fmt: skip


def test_both_paths_live_pass():
    assert vc.missing_paths(TARGETS, [ctrl("nvme0", "10.77.0.1"), ctrl("nvme1", "10.78.0.1")]) == []


def test_a_down_second_path_fails_though_the_subsystem_is_live():
    problems = vc.missing_paths(
        TARGETS, [ctrl("nvme0", "10.77.0.1"), ctrl("nvme1", "10.78.0.1", "connecting")]
    )
    assert problems == [
        f"{NQN}: no live path to 10.78.0.1:4420 (found nvme1 connecting; expected a live controller)"
    ]


def test_a_missing_path_fails_naming_it():
    [p] = vc.missing_paths(TARGETS, [ctrl("nvme0", "10.77.0.1")])
    assert "10.78.0.1:4420" in p and "no controller" in p


def test_a_path_to_another_subsystem_does_not_count():
    problems = vc.missing_paths(
        TARGETS, [ctrl("nvme0", "10.77.0.1"), ctrl("nvme1", "10.78.0.1", nqn="nqn.x:other")]
    )
    assert len(problems) == 1 and "10.78.0.1" in problems[0]


def test_iopolicy_read_back():
    assert vc.iopolicy_problems([NQN], {NQN: "round-robin\n"}, "round-robin") == []
    assert vc.iopolicy_problems([NQN], {NQN: "numa"}, "round-robin") == [
        f"{NQN}: iopolicy numa, expected round-robin"
    ]
    assert "no NVMe subsystem" in vc.iopolicy_problems([NQN], {}, "round-robin")[0]


def test_auto_iopolicy_is_queue_depth_from_6_11():
    assert vc.expected_iopolicy("auto", "6.12.118+deb13-amd64") == "queue-depth"
    assert vc.expected_iopolicy("auto", "6.8.0-45-generic") == "round-robin"
    assert vc.expected_iopolicy("round-robin", "6.12.0") == "round-robin"


def test_ping_pairs_match_subnets_and_the_command_is_full_size_do_not_fragment():
    netdevs = [{"name": "eth1", "address": "10.77.0.2/24"}, {"name": "eth2", "address": "10.78.0.2/24"}]
    assert vc.ping_pairs(netdevs, ["10.77.0.1", "10.78.0.1", "192.168.1.1"]) == [
        ("10.77.0.2", "10.77.0.1"), ("10.78.0.2", "10.78.0.1")]  # fmt: skip
    assert vc.ping_command("10.77.0.2", "10.77.0.1", 9000).startswith("ping -M do -s 8972 ")


def test_a_1500_byte_hop_fails_the_path_mtu():
    ok = {
        "src": "10.77.0.2",
        "dst": "10.77.0.1",
        "mtu": 9000,
        "rc": 0,
        "output": "2 packets transmitted, 2 received",
    }
    hop = {
        "src": "10.78.0.2",
        "dst": "10.78.0.1",
        "mtu": 9000,
        "rc": 1,
        "output": "ping: local error: message too long, mtu=1500\n2 packets transmitted, 0 received",
    }
    dropped = dict(hop, output="2 packets transmitted, 0 received, 100% packet loss")
    assert vc.path_mtu_problems([ok]) == []
    assert vc.path_mtu_problems([ok, hop]) == [
        "10.78.0.2 -> 10.78.0.1: a 9000-byte don't-fragment ping failed: a hop's MTU is 1500; expected 9000 end to end"
    ]
    assert "no reply" in vc.path_mtu_problems([dropped])[0]


RXE_BEFORE = {
    "rxe0/ports/1/hw_counters/sent_pkts": 100,
    "rxe0/ports/1/hw_counters/rcvd_pkts": 90,
    "rxe0/ports/1/hw_counters/retry_exceeded_err": 0,
    "rxe0/ports/1/hw_counters/rcvd_seq_err": 0,
}


def test_soft_roce_counters_moved_pass():
    after = dict(RXE_BEFORE, **{"rxe0/ports/1/hw_counters/sent_pkts": 5000})
    assert vc.counter_problems(RXE_BEFORE, after, None, 10) == []


def test_a_still_counter_fails():
    [p] = vc.counter_problems(RXE_BEFORE, dict(RXE_BEFORE), None, 10)
    assert "did not move under load" in p and "expected an increase" in p


def test_a_transport_error_under_load_fails():
    after = dict(RXE_BEFORE, **{"rxe0/ports/1/hw_counters/sent_pkts": 5000,
                               "rxe0/ports/1/hw_counters/retry_exceeded_err": 3})  # fmt: skip
    [p] = vc.counter_problems(RXE_BEFORE, after, None, 10)
    assert "retry_exceeded_err" in p and "expected 0" in p


MLX_BEFORE = {
    "eth1/rx_prio3_bytes": 0,
    "eth1/tx_prio3_bytes": 0,
    "eth1/rx_prio3_pause": 0,
    "eth1/rx_prio0_pause": 0,
    "eth1/rx_prio3_pause_duration": 0,
    "eth1/tx_pause_storm_error_events": 0,
}


def test_roce_priority_counters_and_pause():
    good = dict(MLX_BEFORE, **{"eth1/rx_prio3_bytes": 10**9, "eth1/rx_prio3_pause": 10,
                               "eth1/rx_prio3_pause_duration": 1000})  # fmt: skip
    assert vc.counter_problems(MLX_BEFORE, good, 3, 10) == []
    # traffic on another priority only: the RoCE priority is still
    wrong_prio = dict(MLX_BEFORE, **{"eth1/rx_prio0_bytes": 10**9})
    assert "did not move" in vc.counter_problems(MLX_BEFORE, wrong_prio, 3, 10)[0]
    storm = dict(good, **{"eth1/tx_pause_storm_error_events": 1, "eth1/rx_prio0_pause": 5,
                          "eth1/rx_prio3_pause_duration": 8_000_000})  # fmt: skip
    problems = vc.counter_problems(MLX_BEFORE, storm, 3, 10)
    assert len(problems) == 3, problems
    assert any("pause storm events" in p for p in problems)
    assert any("priorities other than 3" in p for p in problems)
    assert any("paused 8.0 s of a 10 s load" in p for p in problems)


def test_mlnx_qos_read_back():
    text = (
        "DCBX mode: OS controlled\nPriority trust state: dscp\n"
        "PFC configuration:\n\tpriority    0   1   2   3   4   5   6   7\n\tenabled     0   0   0   1   0   0   0   0\n"
    )
    found = vc.parse_mlnx_qos(text)
    assert found == {"dcbx": "OS controlled", "trust": "dscp", "pfc": {i: i == 3 for i in range(8)}}
    assert vc.qos_problems(dict(found, tos=106), "dscp", 3, 26) == []
    bad = {"dcbx": "firmware controlled", "trust": "pcp", "pfc": {0: True, 3: True}, "tos": 0}
    problems = vc.qos_problems(bad, "dscp", 3, 26)
    assert len(problems) == 4, problems
    assert "expected DSCP 26 (traffic class 104)" in problems[-1]


SUBS = [
    {"nqn": NQN, "allowed_hosts": ["nqn.2014-08.org.nvmexpress:uuid:a", "nqn.2014-08.org.nvmexpress:uuid:b"]}
]


def test_every_allowed_host_has_a_dhchap_key():
    keyed = {"nqn.2014-08.org.nvmexpress:uuid:a": True, "nqn.2014-08.org.nvmexpress:uuid:b": True}
    assert vc.hosts_without_key(SUBS, keyed) == []


def test_an_unauthenticated_host_fails():
    problems = vc.hosts_without_key(SUBS, {"nqn.2014-08.org.nvmexpress:uuid:a": True,
                                           "nqn.2014-08.org.nvmexpress:uuid:b": False})  # fmt: skip
    assert problems == [
        f"{NQN}: allowed host nqn.2014-08.org.nvmexpress:uuid:b has no dhchap_key: any host "
        "presenting its NQN gets in (expected a DH-HMAC-CHAP key)"
    ]
    assert "no host entry" in vc.hosts_without_key(SUBS, {"nqn.2014-08.org.nvmexpress:uuid:a": True})[0]


GPU_ROW = "0, 00000000:1B:00.0, Enabled, 0, No, No, 0, 5, 5, 16, 16"


def rows(*lines):
    return vc.parse_csv_rows("\n".join(lines), vc.GPU_HEALTH_FIELDS)


def test_healthy_gpu_passes_every_gpu_check():
    r = rows(GPU_ROW)
    assert vc.ecc_problems(r) == vc.remap_problems(r) == vc.pcie_link_problems(r, 5) == []


def test_ecc_off_or_uncorrected_errors_fail():
    assert vc.ecc_problems(rows("0, 00000000:1B:00.0, Disabled, 0, No, No, 0, 5, 5, 16, 16")) == [
        "GPU 0: ECC mode Disabled, expected Enabled"
    ]
    assert "2 uncorrected ECC errors" in vc.ecc_problems(rows("0, b, Enabled, 2, No, No, 0, 5, 5, 16, 16"))[0]


def test_pending_or_failed_row_remap_fails():
    problems = vc.remap_problems(rows("1, b, Enabled, 0, Yes, Yes, 1, 5, 5, 16, 16"))
    assert len(problems) == 2 and "pending" in problems[0] and "failed" in problems[1]


def test_a_downtrained_pcie_link_fails():
    problems = vc.pcie_link_problems(rows("2, 00000000:9A:00.0, Enabled, 0, No, No, 0, 4, 5, 8, 16"))
    assert problems == ["GPU 2 (00000000:9A:00.0): PCIe Gen4, expected Gen5",
                        "GPU 2 (00000000:9A:00.0): PCIe x8, expected x16"]  # fmt: skip


def test_hardware_xids_fail_application_xids_do_not():
    journal = (
        "NVRM: Xid (PCI:0000:1b:00): 13, pid=42, Graphics Exception\n"
        "NVRM: Xid (PCI:0000:1b:00): 79, pid=0, GPU has fallen off the bus.\n"
        "NVRM: Xid (PCI:0000:1b:00): 79, pid=0, GPU has fallen off the bus.\n"
    )
    assert vc.xid_problems(journal) == [
        "Xid 79 on GPU 0000:1b:00 (2x in this boot's kernel log), expected none"
    ]
    assert vc.xid_problems("NVRM: Xid (PCI:0000:1b:00): 13, pid=42\nnothing else") == []


TOPO = """\
\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tPXB\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tSYS\tPXB\t56-111,168-223\t1\t\tN/A
NIC0\tPXB\tSYS\t X \tSYS
NIC1\tSYS\tPXB\tSYS\t X

Legend:
  X    = Self

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""


def test_topology_gpu_next_to_its_nic_on_its_numa_node():
    topo = vc.parse_topo(TOPO)
    assert topo["GPU0"]["numa"] == "0" and topo["GPU1"]["links"]["NIC1"] == "PXB"
    assert vc.topo_problems(topo, ["mlx5_0", "mlx5_1"], {"mlx5_0": "0", "mlx5_1": "1"}) == []


def test_topology_a_gpu_whose_nic_is_across_the_cpu_fails():
    across = TOPO.replace("GPU1\tNV18\t X \tSYS\tPXB", "GPU1\tNV18\t X \tSYS\tSYS")
    [p] = vc.topo_problems(vc.parse_topo(across), ["mlx5_0", "mlx5_1"], {"mlx5_0": "0", "mlx5_1": "1"})
    assert p.startswith("GPU1: none of the inventory's RDMA NICs") and "expected PIX or PXB" in p
    # the NIC on the GPU's switch is not the inventory's storage NIC
    assert len(vc.topo_problems(vc.parse_topo(TOPO), ["mlx5_0"], {"mlx5_0": "0"})) == 1
    # a NIC on another NUMA node than its GPU
    [p] = vc.topo_problems(vc.parse_topo(TOPO), ["mlx5_0", "mlx5_1"], {"mlx5_0": "0", "mlx5_1": "0"})
    assert p.startswith("GPU1: NUMA node 1")


def test_drive_on_another_numa_node_than_its_nics_fails():
    assert vc.numa_problems({"nvme0n1": "0"}, {"eth1": "0"}) == []
    assert vc.numa_problems({"nvme0n1": "1"}, {"eth1": "0"}) == [
        "drive nvme0n1: NUMA node 1, its fabric NICs {'eth1': '0'} on node(s) ['0']"
    ]
    assert vc.numa_problems({"nvme0n1": "1"}, {"eth1": "-1"}) == []  # the platform does not say


SMART_OK = {
    "critical_warning": 0,
    "media_errors": 0,
    "avail_spare": 100,
    "spare_thresh": 10,
    "percent_used": 3,
}


def test_drive_health_and_wear():
    assert vc.smart_problems("/dev/nvme0n1", SMART_OK) == []
    bad = dict(SMART_OK, critical_warning=4, media_errors=2, avail_spare=9, percent_used=91)
    problems = vc.smart_problems("/dev/nvme0n1", bad)
    assert problems == ["/dev/nvme0n1: critical_warning 4, expected 0", "/dev/nvme0n1: 2 media errors, expected 0",
                        "/dev/nvme0n1: available spare 9% at or below its threshold 10%",
                        "/dev/nvme0n1: 91% of its rated endurance used, expected under 80%"]  # fmt: skip
    # nvme-cli names wear percentage_used in some versions
    assert "endurance" in vc.smart_problems("d", {"percentage_used": 85})[0]


def test_time_sync():
    assert vc.time_sync_problems("NTPSynchronized=yes\n", "") == []
    assert vc.time_sync_problems("NTPSynchronized=no\n", "Reference ID : A\nLeap status     : Normal\n") == []
    [p] = vc.time_sync_problems("NTPSynchronized=no\n", "Leap status     : Not synchronised\n")
    assert "NTPSynchronized=no" in p and "Not synchronised" in p and "expected chrony" in p
