# Images (testbed, target, serve), built Nix-style by one orchestrator (src/kvlab/images/build.py).
.PHONY: image

name ?= testbed
flavor ?=

image: setup ## build image name=testbed|target|serve [flavor=F] afresh; fails on any byte of difference from the cached build of the same inputs (diffoscope says where); last line: image NAME sha256:HEX path PATH sbom SBOM
	$(KVLAB) image build $(name) $(if $(flavor),--flavor $(flavor))
