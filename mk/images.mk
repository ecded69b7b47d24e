# Images (testbed, target, serve), built Nix-style by one orchestrator (src/kvlab/images/build.py).
.PHONY: image

name ?= testbed
flavor ?=
# Secure Boot for the target appliance: a site's own db key and certificate, outside the checkout
# (never in the repo); ukify signs the UKI with them. Unset: an unsigned build.
SB_KEY ?=
SB_CERT ?=

image: setup ## build image name=testbed|target|serve [flavor=F] afresh; fails on any byte of difference from the cached build of the same inputs (diffoscope says where); last line: image NAME sha256:HEX path PATH sbom SBOM
	$(if $(SB_KEY),KVLAB_SB_KEY=$(abspath $(SB_KEY)) KVLAB_SB_CERT=$(abspath $(SB_CERT))) $(KVLAB) image build $(name) $(if $(flavor),--flavor $(flavor))
