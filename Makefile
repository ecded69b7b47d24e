# kvlab — `make help` lists every target. Area-specific targets live in mk/*.mk.
SHELL := /bin/bash
.DEFAULT_GOAL := help
.SHELLFLAGS := -eu -o pipefail -c

VENV ?= .venv
PY := $(VENV)/bin/python
KVLAB := $(VENV)/bin/kvlab
PYTEST := $(VENV)/bin/pytest
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help setup demo test test-deps test-unit test-engine lint lock clean

help: ## list every target
	@awk 'BEGIN{FS=":.*## "} /^[a-zA-Z0-9_.-]+:.*## /{printf "  %-18s %s\n", $$1, $$2}' $(MAKEFILE_LIST) | sort

setup: ## create .venv from requirements.lock (hashes checked) and install kvlab + kvlab-connector
	@scripts/setup-venv $(VENV)

demo: setup ## the main job on the embedded default: build the tiny model, run the embedded campaign
	$(KVLAB) model tiny
	$(KVLAB) campaign run campaigns/embedded.yml

# Each tier timed against its budget (scripts/test-tiers says why in this order).
test: ## set up, then every tier that runs here: unit+infra+lab, engine, the VM testbed; closing lines give each tier's minutes (lab skips without hardware)
	@scripts/test-tiers $(VENV)

test-deps: ## the system packages the tests need (fio; qemu, mmdebstrap for the testbed); apt-get as root, once
	@scripts/system-deps
	@scripts/testbed-deps

test-unit: setup ## unit tier only (seconds)
	$(PYTEST) tests/unit

test-engine: setup ## engine tier only (real vLLM CPU engine)
	$(PYTEST) tests/engine

lint: setup ## ruff on the Python code
	$(VENV)/bin/ruff check src connector tests

lock: ## re-resolve requirements.lock (hashes) from requirements.in
	@scripts/lock

clean: ## remove the venv and results of this checkout (caches outside it stay)
	rm -rf $(VENV) results/runs

-include mk/*.mk
