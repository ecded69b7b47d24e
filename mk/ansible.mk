# Provisioning and verification with Ansible: `make deploy inventory=NAME`, `make verify inventory=NAME`.
.PHONY: deploy verify lint-ansible

inventory ?= local
playbook ?= playbooks/site.yml
# inventory=NAME (a folder under inventories/) or the path of a folder holding hosts.yml
INVENTORY_DIR = $(if $(wildcard $(inventory)/hosts.yml),$(inventory),inventories/$(inventory))
INVENTORY_FILE = $(INVENTORY_DIR)/hosts.yml
ANSIBLE_ENV = ANSIBLE_CONFIG=$(CURDIR)/ansible.cfg ANSIBLE_NOCOLOR=1 PATH=$(abspath $(VENV))/bin:$$PATH
# What the local inventory is for: this machine is the embedded default's bench host, and nothing else.
LOCAL_RUNS = inventories/local runs playbooks/bench.yml only (make bench inventory=local campaign=campaigns/<c>.yml): this machine is the embedded default's bench host, in no fabric or GPU group, so site.yml has nothing to deploy here

deploy: setup ## provision inventory=NAME (lab, testbed; local says what it runs) with playbooks/site.yml (playbook=... to pick one)
	@test -f $(INVENTORY_FILE) || { echo "deploy: no $(INVENTORY_FILE)"; exit 2; }
	@if [[ $(INVENTORY_DIR) == inventories/local && $(playbook) != playbooks/bench.yml ]]; then echo "deploy: $(LOCAL_RUNS)"; exit 2; fi
	@case $(INVENTORY_DIR) in inventories/testbed) test -f $(INVENTORY_DIR)/group_vars/all/up.yml \
	  || { echo "deploy: the testbed is not up (make testbed writes $(INVENTORY_DIR)/group_vars/all/up.yml)"; exit 2; };; esac
	$(ANSIBLE_ENV) $(VENV)/bin/ansible-playbook -i $(INVENTORY_FILE) $(playbook) $(ARGS)

verify: setup ## prove inventory=NAME's datapath: tests/infra (storage fabric) and tests/lab (GPU nodes), each suite on >= 1 host
	@test -f $(INVENTORY_FILE) || { echo "verify: no $(INVENTORY_FILE)"; exit 2; }
	$(ANSIBLE_ENV) PYTHON=$(PY) scripts/verify $(INVENTORY_FILE) $(ARGS)

lint-ansible: setup ## ansible-lint (production profile, offline, no skips) over roles and playbooks
	$(ANSIBLE_ENV) $(VENV)/bin/ansible-lint

.PHONY: pin
pin: setup ## read the storage roles' exact package versions from inventory=NAME's nodes into inventories/NAME/group_vars/*/pins.yml
	@test -f $(INVENTORY_FILE) || { echo "pin: no $(INVENTORY_FILE)"; exit 2; }
	$(ANSIBLE_ENV) $(VENV)/bin/ansible-playbook -i $(INVENTORY_FILE) playbooks/pin.yml $(ARGS)
