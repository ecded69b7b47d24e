# Provisioning and verification with Ansible: `make deploy inventory=NAME`, `make verify inventory=NAME`.
.PHONY: deploy verify lint-ansible

inventory ?= local
playbook ?= playbooks/site.yml
INVENTORY_FILE = inventories/$(inventory)/hosts.yml
ANSIBLE_ENV = ANSIBLE_CONFIG=$(CURDIR)/ansible.cfg ANSIBLE_NOCOLOR=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH

deploy: setup ## provision inventory=NAME (lab, local, testbed) with playbooks/site.yml (playbook=... to pick one)
	@test -f $(INVENTORY_FILE) || { echo "deploy: no $(INVENTORY_FILE) (for the testbed run 'make testbed' first)"; exit 2; }
	$(ANSIBLE_ENV) $(VENV)/bin/ansible-playbook -i $(INVENTORY_FILE) $(playbook) $(ARGS)

verify: setup ## prove inventory=NAME's datapath with the testinfra suites in tests/infra
	@test -f $(INVENTORY_FILE) || { echo "verify: no $(INVENTORY_FILE) (for the testbed run 'make testbed' first)"; exit 2; }
	$(ANSIBLE_ENV) $(PYTEST) tests/infra -m infra --ansible-inventory=$(INVENTORY_FILE) $(ARGS)

lint-ansible: setup ## ansible-lint (production profile, offline, no skips) over roles and playbooks
	$(ANSIBLE_ENV) $(VENV)/bin/ansible-lint
