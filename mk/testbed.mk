# The VM testbed: two qemu VMs (storage target + node) provisioned by the same roles as the lab.
.PHONY: testbed testbed-down testbed-status test-testbed test-appliance

transport ?= rdma

testbed: setup ## boot the VM testbed (transport=rdma|tcp) from the cached image; writes its SSH ports beside inventories/testbed/hosts.yml (ignored files)
	$(KVLAB) testbed up --transport $(transport)

testbed-down: setup ## stop the testbed VMs by PID (console logs are kept)
	$(KVLAB) testbed down

testbed-status: setup ## the testbed VMs and the node's NVMe-oF controllers (JSON)
	$(KVLAB) testbed status --json

test-testbed: setup ## testbed tier alone: VMs + site.yml x3 (apply, again, --check) + verify + faults (~20 min; image cached by inputs)
	$(PYTEST) tests/testbed -m "testbed and not appliance"

test-appliance: setup ## the target appliance in the testbed: its image, three TCG boots, the node over RDMA, broken seeds, site.yml on it (~12 min cold; not yet in make test)
	$(PYTEST) tests/testbed -m appliance
