# The lab: render without hardware (plan), run campaigns on it (bench), check one GPU (gpu-check).
.PHONY: plan bench gpu-check gpu-check-wheels

plan: ## render every GPU/serving template for inventory=NAME's GPU nodes into build/plan/NAME (no host contacted; ARGS: ansible-playbook arguments, e.g. -e vllm_server_runtime=image ...)
	scripts/plan $(inventory) build/plan/$(inventory) $(ARGS)

# inventory=local runs it on this machine with the embedded default (engines started by the
# harness, this checkout's .venv; inventories/local/group_vars/bench.yml).
bench: setup ## run campaign=FILE on inventory=NAME's bench hosts (local: this machine) and fetch results into results/runs/
	@test -n "$(campaign)" || { echo "bench: give campaign=campaigns/<name>.yml"; exit 2; }
	@test -f $(INVENTORY_FILE) || { echo "bench: no $(INVENTORY_FILE)"; exit 2; }
	$(ANSIBLE_ENV) $(VENV)/bin/ansible-playbook -i $(INVENTORY_FILE) \
	  playbooks/bench.yml -e bench_runner_campaign=$(abspath $(campaign)) $(ARGS)

GPU_CHECK_WHEELS := .whl
gpu-check-wheels: ## download the few wheels gpu-check brings to a GPU machine (cp312 manylinux x86_64, <= 64 MiB) into .whl/
	scripts/gpu-check-wheels $(GPU_CHECK_WHEELS)
	touch $(GPU_CHECK_WHEELS)/.complete

# On the GPU machine (no network) the wheels come along in .whl/: download only where missing.
gpu-check: ## one GPU (Python 3.12 + torch + CUDA, no vLLM): GDS store and engine round trips byte for byte, damage caught, GB/s vs pinned copy
	@test -f $(GPU_CHECK_WHEELS)/.complete || $(MAKE) --no-print-directory gpu-check-wheels
	scripts/gpu-check --wheels $(GPU_CHECK_WHEELS) $(ARGS)
