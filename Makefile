# warmstart: developer and CI entry points. `make ci` is what .ci/run does.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
CARGO ?= cargo
# Cargo's target directory: $CARGO_TARGET_DIR when set, as cargo itself does.
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)

.PHONY: all setup fmt lint test static sample-worker entrypoint generate demo cluster-demo bench ci \
	k8s-build helm-build s3-build gpu-bundle cluster-up cluster-down cluster-load cluster-images

all: lint test

# Installs runc, busybox-static, iptables, containerd, kubectl and CRIU 4.2.1 (root only; idempotent).
setup:
	bash scripts/setup.sh

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# The workspace's tests (root for most of them): every test binary built once, then run several
# at a time by scripts/run-tests.sh (the local cluster's binary in a lane of its own; other lanes
# with WARMSTART_TEST_JOBS, default 2); each binary's log in $(TARGET_DIR)/test-logs. Arguments
# for every test binary with TEST_ARGS (a filter, --nocapture). One binary alone, as cargo runs
# it: cargo test -p <package> --test <name>.
test: static k8s-build helm-build s3-build
	CARGO_TARGET_DIR=$(TARGET_DIR) bash scripts/run-tests.sh -- $(TEST_ARGS)

# The programs that run inside busybox test containers, as static binaries (static-pie,
# glibc) for images without a libc. A plain `cargo build` rebuilds $(TARGET_DIR)/debug/<bin>
# dynamically, so each static build is copied to $(TARGET_DIR)/static/.
static: sample-worker entrypoint

sample-worker:
	$(call static-bin,warmstart-sample-worker,warmstart-sample-worker)

# warmstart-entrypoint: also what the agent image ships (built there with the same flags).
entrypoint:
	$(call static-bin,warmstart-entrypoint,warmstart-entrypoint)

# $(call static-bin,<package>,<bin>)
define static-bin
	$(CARGO) rustc -p $(1) --bin $(2) -- -C target-feature=+crt-static
	mkdir -p $(TARGET_DIR)/static
	cp $(TARGET_DIR)/debug/$(2) $(TARGET_DIR)/static/$(2).tmp
	kind="$$(file -b $(TARGET_DIR)/static/$(2).tmp)"; \
	case "$$kind" in *'static-pie linked'*) ;; \
	*) rm -f $(TARGET_DIR)/static/$(2).tmp; echo "$(2): not static-pie: $$kind" >&2; exit 1;; esac
	mv $(TARGET_DIR)/static/$(2).tmp $(TARGET_DIR)/static/$(2)
endef

# Regenerates the CRD manifest from the Rust types (written only if the command succeeds), for
# kustomize (deploy/crd) and the Helm chart (its crds/).
generate:
	mkdir -p deploy/crd
	$(CARGO) run -q -p warmstart-controller -- crd > deploy/crd/checkpoint.yaml.tmp \
		|| { rm -f deploy/crd/checkpoint.yaml.tmp; exit 1; }
	cp deploy/crd/checkpoint.yaml.tmp deploy/helm/warmstart/crds/checkpoint.yaml
	mv deploy/crd/checkpoint.yaml.tmp deploy/crd/checkpoint.yaml

demo: setup sample-worker
	$(CARGO) build -q -p warmstart-agent -p warmstart-e2e --bin warmstart-agent --bin warmstart-demo
	$(TARGET_DIR)/debug/warmstart-demo

# The whole loop on a real Kubernetes on this machine (root): the local cluster of cluster-up
# (reused when up; one it starts is torn down at the end, unless WARMSTART_KEEP_CLUSTER=1),
# warmstart installed from deploy/, a Checkpoint, then a restore pod's timeline next to a cold
# start of the same pod.
cluster-demo: setup static k8s-build
	$(CARGO) build -q -p warmstart-agent -p warmstart-controller -p warmstart-e2e --bin warmstart-agent --bin warmstart-controller --bin warmstart-cluster-demo
	$(TARGET_DIR)/debug/warmstart-cluster-demo

# Checkpoint and restore speed against runc and the storage's cold read, and the artifact made
# ready on a node from the artifact volume, the object store (SeaweedFS on loopback, hence
# s3-build) through a cold and a warm node cache, eight at once, and with zstd, in one run (root;
# release build; sizes with WARMSTART_BENCH_SIZES=256,1024,4096, zstd level with
# WARMSTART_BENCH_ZSTD_LEVEL). Table on stdout, JSON in $(TARGET_DIR)/bench.json.
bench: setup s3-build
	$(CARGO) rustc --release -p warmstart-sample-worker --bin warmstart-sample-worker -- -C target-feature=+crt-static
	mkdir -p $(TARGET_DIR)/static-release
	cp $(TARGET_DIR)/release/warmstart-sample-worker $(TARGET_DIR)/static-release/warmstart-sample-worker
	$(CARGO) build --release -p warmstart-agent -p warmstart-e2e --bin warmstart-agent --bin warmstart-bench
	$(TARGET_DIR)/release/warmstart-bench --json $(TARGET_DIR)/bench.json

# The GPU check for a GPU host with only the NVIDIA driver (root, no network, glibc >= 2.34):
# $(TARGET_DIR)/warmstart-gpu-check.tar.gz, under 64 MiB, with the agent, the CUDA workload,
# CRIU and scripts/gpu-check.sh. On the host: tar xzf it, then ./warmstart-gpu-check/gpu-check.
gpu-bundle: setup
	$(CARGO) build --release -p warmstart-agent -p warmstart-cuda-standin --bin warmstart-agent --bin warmstart-cuda-workload
	bash scripts/gpu-bundle.sh $(TARGET_DIR)/release $(TARGET_DIR)/warmstart-gpu-check.tar.gz

# The local Kubernetes's upstream components (built from cluster/k8s, cached under
# $WARMSTART_CACHE/k8s, default /var/cache/warmstart/k8s): builds or reuses them, prints the bin dir.
k8s-build:
	bash scripts/build-k8s.sh

# Helm (the version cluster/helm pins), built once and cached beside the Kubernetes components
# ($WARMSTART_CACHE/helm): the tests lint, render and install the chart in deploy/helm with it.
helm-build:
	bash scripts/build-helm.sh

# SeaweedFS's `weed` (the version cluster/seaweedfs pins), built once and cached beside them
# ($WARMSTART_CACHE/seaweedfs): the object-store tests run it as a real S3 server on loopback.
s3-build:
	bash scripts/build-seaweedfs.sh

# Starts the local cluster, two nodes (warmstart-node at 198.18.0.1, warmstart-node-2 at
# 198.18.0.2, each its own containerd and kubelet; WARMSTART_CLUSTER_NODES=1 for one) (root;
# state in /var/lib/warmstart-cluster, node 2's own directories in
# /var/lib/warmstart-cluster/node-2, admin kubeconfig /var/lib/warmstart-cluster/admin.kubeconfig,
# printed). A second run changes nothing.
cluster-up:
	bash scripts/cluster-up.sh

# Removes everything cluster-up made, of both nodes, also after a crash (root).
cluster-down:
	bash scripts/cluster-down.sh

# Loads an image tarball into each node's containerd: make cluster-load IMAGE=<image.tar>.
cluster-load:
	@[[ -n "$(IMAGE)" ]] || { echo "usage: make cluster-load IMAGE=<image.tar>" >&2; exit 1; }
	bash scripts/cluster-load.sh $(IMAGE)

# warmstart's images (docker.io/warmstart/{controller,agent,sample-worker}:dev) assembled from
# the built binaries without a registry, in $(TARGET_DIR)/cluster-images, loaded into the
# running cluster (root).
cluster-images: static
	$(CARGO) build -p warmstart-agent -p warmstart-controller --bin warmstart-agent --bin warmstart-controller
	CARGO_TARGET_DIR=$(TARGET_DIR) bash scripts/cluster-images.sh --load

# Sequential on purpose, also under `make -j`.
ci:
	$(MAKE) setup
	$(MAKE) k8s-build
	$(MAKE) helm-build
	$(MAKE) s3-build
	$(MAKE) lint
	$(MAKE) test
