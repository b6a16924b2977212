# warmstart: developer and CI entry points. `make ci` is what .ci/run does.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
CARGO ?= cargo
# Where cargo builds (honours CARGO_TARGET_DIR, as cargo does).
TARGET_DIR ?= $(or $(CARGO_TARGET_DIR),target)

.PHONY: all setup fmt lint test sample-worker generate demo bench ci

all: lint test

# Installs runc, busybox-static, iptables, containerd, kubectl and CRIU 4.2.1 (root only; idempotent).
setup:
	bash scripts/setup.sh

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

test: sample-worker
	$(CARGO) test --workspace --no-fail-fast

# The sample worker as a static binary (static-pie, glibc), for images without a libc (busybox).
# A plain `cargo build` rebuilds target/debug/warmstart-sample-worker dynamically, so the static
# build is copied to target/static/.
sample-worker:
	$(CARGO) rustc -p warmstart-e2e --bin warmstart-sample-worker -- -C target-feature=+crt-static
	mkdir -p $(TARGET_DIR)/static
	cp $(TARGET_DIR)/debug/warmstart-sample-worker $(TARGET_DIR)/static/warmstart-sample-worker.tmp
	kind="$$(file -b $(TARGET_DIR)/static/warmstart-sample-worker.tmp)"; \
	case "$$kind" in *'static-pie linked'*) ;; \
	*) rm -f $(TARGET_DIR)/static/warmstart-sample-worker.tmp; echo "sample-worker: not static-pie: $$kind" >&2; exit 1;; esac
	mv $(TARGET_DIR)/static/warmstart-sample-worker.tmp $(TARGET_DIR)/static/warmstart-sample-worker

# Regenerates the CRD manifest from the Rust types (written only if the command succeeds).
generate:
	mkdir -p deploy/crd
	$(CARGO) run -q -p warmstart-controller -- crd > deploy/crd/checkpoint.yaml.tmp \
		|| { rm -f deploy/crd/checkpoint.yaml.tmp; exit 1; }
	mv deploy/crd/checkpoint.yaml.tmp deploy/crd/checkpoint.yaml

demo: setup sample-worker
	$(CARGO) build -q -p warmstart-agent -p warmstart-e2e --bin warmstart-agent --bin warmstart-demo
	$(TARGET_DIR)/debug/warmstart-demo

bench:
	@echo "no benchmarks yet"

# Sequential on purpose, also under `make -j`.
ci:
	$(MAKE) setup
	$(MAKE) lint
	$(MAKE) test
