#!/usr/bin/env bash
# Starts the tests' device plugin on each of the local cluster's nodes (root), unless it runs
# already there:
# the test double of NVIDIA's device plugin (e2e/src/bin/warmstart-test-device-plugin.rs),
# through which the node advertises its stand-in GPUs as nvidia.com/gpu, so the kubelet
# allocates them to pods and reports them over its PodResources API. The form file
# $CLUSTER_DIR/device-plugin/form says how Allocate names them to a container (uuids, the
# default; cdi; cdi-annotations), one file for both nodes. Node 1's plugin logs to
# $LOGS/device-plugin.log, node 2's to $LOGS/device-plugin-2.log. cluster-down stops them.
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
dir="$CLUSTER_DIR/device-plugin"
mkdir -p "$dir" "$LOGS" "$PIDS"

# start NAME KUBELET_ROOT: the plugin of the node whose kubelet root is KUBELET_ROOT (as seen
# from here: node 2's socket directory is under $NODE2_DIR), unless it runs.
start() {
  local name=$1 root=$2 pid
  if pid="$(pid_of "$name")"; then
    say "$name already running (pid $pid)"
    return 0
  fi
  [[ -S "$root/device-plugins/kubelet.sock" ]] \
    || fail "$root/device-plugins/kubelet.sock missing: is the cluster's kubelet up (make cluster-up)?"
  # A copy: rebuilding the binary never changes the one that runs.
  if [[ ! -x "$dir/warmstart-test-device-plugin" ]] || ! cmp -s "$bin" "$dir/warmstart-test-device-plugin"; then
    cp "$bin" "$dir/warmstart-test-device-plugin.tmp"
    mv -f "$dir/warmstart-test-device-plugin.tmp" "$dir/warmstart-test-device-plugin"
  fi
  : >"$LOGS/$name.log"
  # Its command line names $CLUSTER_DIR (the form file): `ours` knows it as this cluster's.
  # Like the cluster's components, it keeps none of its starter's files open (a caller's lock).
  (
    close_inherited_fds
    setsid "$dir/warmstart-test-device-plugin" --kubelet-root "$root" --count "$GPU_COUNT" \
      --form-file "$dir/form" </dev/null >>"$LOGS/$name.log" 2>&1 &
    echo $! >"$PIDS/$name.pid"
  )
  local deadline=$((SECONDS + 30))
  until grep -q '^registered ' "$LOGS/$name.log"; do
    pid_of "$name" >/dev/null || component_fail "$name" "exited before registering with the kubelet"
    ((SECONDS < deadline)) || component_fail "$name" "not registered with the kubelet after 30s"
    sleep 0.2
  done
  say "$name registered: the kubelet allocates nvidia.com/gpu from $GPU_COUNT stand-in GPUs (log: $LOGS/$name.log)"
}
start device-plugin "$KUBELET_ROOT"
if pid_of kubelet-2 >/dev/null; then
  start device-plugin-2 "$NODE2_DIR/kubelet"
fi
