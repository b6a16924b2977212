# warmstart: developer and CI entry points. `make ci` is what .ci/run does.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
CARGO ?= cargo

.PHONY: all setup fmt lint test generate demo bench ci

all: lint test

# Installs runc, busybox-static, iptables, containerd, kubectl and CRIU 4.2.1 (root only; idempotent).
setup:
	bash scripts/setup.sh

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

test:
	$(CARGO) test --workspace

# Regenerates the CRD manifest from the Rust types (written only if the command succeeds).
generate:
	mkdir -p deploy/crd
	$(CARGO) run -q -p warmstart-controller -- crd > deploy/crd/checkpoint.yaml.tmp \
		|| { rm -f deploy/crd/checkpoint.yaml.tmp; exit 1; }
	mv deploy/crd/checkpoint.yaml.tmp deploy/crd/checkpoint.yaml

demo: setup
	$(CARGO) build -q -p warmstart-controller
	@echo "identity hash of deploy/examples/checkpoint.yaml:"
	@target/debug/warmstart-controller identity-hash deploy/examples/checkpoint.yaml
	@echo "the checkpoint Job the controller would create for it:"
	@target/debug/warmstart-controller render-job -f deploy/examples/checkpoint.yaml \
		--uid 00000000-0000-4000-8000-000000000000

bench:
	@echo "no benchmarks yet"

# Sequential on purpose, also under `make -j`.
ci:
	$(MAKE) setup
	$(MAKE) lint
	$(MAKE) test
