#!/usr/bin/env bash
# Starts the tests' device plugin on the local cluster's node (root), unless it runs already:
# the test double of NVIDIA's device plugin (e2e/src/bin/warmstart-test-device-plugin.rs),
# through which the node advertises its stand-in GPUs as nvidia.com/gpu, so the kubelet
# allocates them to pods and reports them over its PodResources API. The form file
# $CLUSTER_DIR/device-plugin/form says how Allocate names them to a container (uuids, the
# default; cdi; cdi-annotations). cluster-down stops it.
#
# Usage: cluster-device-plugin.sh BINARY
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROG=cluster-device-plugin
# shellcheck source=cluster-lib.sh
source "$HERE/cluster-lib.sh"

require_root
cluster_lock
bin="${1:-}"
[[ -n "$bin" && -x "$bin" ]] \
  || fail "usage: $0 BINARY (build it: cargo build -p warmstart-e2e --bin warmstart-test-device-plugin)"
if pid="$(pid_of device-plugin)"; then
  say "already running (pid $pid)"
  exit 0
fi
[[ -S "$KUBELET_ROOT/device-plugins/kubelet.sock" ]] \
  || fail "$KUBELET_ROOT/device-plugins/kubelet.sock missing: is the cluster's kubelet up (make cluster-up)?"
dir="$CLUSTER_DIR/device-plugin"
mkdir -p "$dir" "$LOGS" "$PIDS"
# A copy: rebuilding the binary never changes the one that runs.
cp "$bin" "$dir/warmstart-test-device-plugin.tmp"
mv -f "$dir/warmstart-test-device-plugin.tmp" "$dir/warmstart-test-device-plugin"
: >"$LOGS/device-plugin.log"
# Its command line names $CLUSTER_DIR (the form file): `ours` knows it as this cluster's.
# Like the cluster's components, it keeps none of its starter's files open (a caller's lock).
(
  close_inherited_fds
  setsid "$dir/warmstart-test-device-plugin" --kubelet-root "$KUBELET_ROOT" --count "$GPU_COUNT" \
    --form-file "$dir/form" </dev/null >>"$LOGS/device-plugin.log" 2>&1 &
  echo $! >"$PIDS/device-plugin.pid"
)
registered() { grep -q '^registered ' "$LOGS/device-plugin.log"; }
deadline=$((SECONDS + 30))
until registered; do
  pid_of device-plugin >/dev/null || component_fail device-plugin "exited before registering with the kubelet"
  ((SECONDS < deadline)) || component_fail device-plugin "not registered with the kubelet after 30s"
  sleep 0.2
done
say "registered: the kubelet allocates nvidia.com/gpu from $GPU_COUNT stand-in GPUs (log: $LOGS/device-plugin.log)"
