# shellcheck shell=bash
# shellcheck disable=SC2034 # the settings are used by the scripts that source this file
# What scripts/cluster-up.sh, cluster-down.sh and cluster-load.sh share: the local cluster's
# paths, addresses and ports (each overridable from the environment), process tracking by PID
# file, and polling with deadlines. Sourced, not run.
#
# Two nodes by default (WARMSTART_CLUSTER_NODES=1 for one). Node 2 is its own containerd and
# kubelet on this machine, in a mount namespace of its own where node 2's directories
# ($NODE2_DIR/<name>) are bind-mounted over the paths both nodes name (NODE2_BINDS): the kubelet
# root, containerd's directory, the agent's state and the node cache. So one DaemonSet with the
# same hostPaths gets each node's own directories, while the artifact volume's hostPath stays one
# directory for both.

CLUSTER_DIR="${WARMSTART_CLUSTER_DIR:-/var/lib/warmstart-cluster}"
KUBELET_ROOT="${WARMSTART_KUBELET_ROOT:-/var/lib/kubelet}"
RUNTIME_PREFIX="${WARMSTART_CLUSTER_RUNTIME:-/opt/warmstart/containerd}"
NODE_NAME="${WARMSTART_CLUSTER_NODE:-warmstart-node}"
GPU_COUNT="${WARMSTART_CLUSTER_GPUS:-8}"

# Addresses: RFC 2544 benchmarking ranges only, on a bridge the cluster creates.
BRIDGE="${WARMSTART_CLUSTER_BRIDGE:-ws-br0}"
NODE_IP=198.18.0.1
POD_CIDR=198.18.0.0/24
# Each node's pods get addresses from its own part of POD_CIDR (one bridge, one subnet).
POD_RANGE_START=198.18.0.10
POD_RANGE_END=198.18.0.127
SERVICE_CIDR=198.19.0.0/24
# The `kubernetes` Service's ClusterIP (the first of SERVICE_CIDR).
API_SERVICE_IP=198.19.0.1
# Pods reach nothing else: no default route is given to them.
POD_ROUTE=198.18.0.0/15

ETCD_CLIENT_PORT="${WARMSTART_CLUSTER_ETCD_PORT:-2379}"
ETCD_PEER_PORT="${WARMSTART_CLUSTER_ETCD_PEER_PORT:-2380}"
API_PORT="${WARMSTART_CLUSTER_API_PORT:-6443}"
KUBELET_PORT=10250
KUBELET_HEALTHZ_PORT=10248

# Node 2.
NODES="${WARMSTART_CLUSTER_NODES:-2}"
NODE2_NAME="${NODE_NAME}-2"
NODE2_IP=198.18.0.2
NODE2_POD_RANGE_START=198.18.0.130
NODE2_POD_RANGE_END=198.18.0.254
NODE2_KUBELET_PORT=10350
NODE2_KUBELET_HEALTHZ_PORT=10348
CM_PORT=10257
SCHEDULER_PORT=10259

PKI="$CLUSTER_DIR/pki"
LOGS="$CLUSTER_DIR/logs"
PIDS="$CLUSTER_DIR/pids"
CONTAINERD_DIR="$CLUSTER_DIR/containerd"
CONTAINERD_SOCK="$CONTAINERD_DIR/containerd.sock"
CNI_DIR="$CLUSTER_DIR/cni"
ADMIN_KUBECONFIG="$CLUSTER_DIR/admin.kubeconfig"
# The agent's state and the node cache on a node (the local install's hostPaths).
AGENT_STATE_DIR="$CLUSTER_DIR/agent-state"
NODE_CACHE_DIR="$CLUSTER_DIR/cache"
# Node 2's own directories, as this machine (node 1, the host) sees them.
NODE2_DIR="$CLUSTER_DIR/node-2"
# PATH:NAME: NAME under NODE2_DIR is what node 2 sees at PATH.
NODE2_BINDS=("$KUBELET_ROOT:kubelet" "$CONTAINERD_DIR:containerd" "$AGENT_STATE_DIR:agent-state"
  "$NODE_CACHE_DIR:cache")
# Node 2's containerd socket, from here.
NODE2_CONTAINERD_SOCK="$NODE2_DIR/containerd/containerd.sock"
# The cgroup (in every v1 hierarchy) under which the kubelet puts its pods
# (KubeletConfiguration.cgroupRoot) and cluster-up puts containerd and its shims.
CGROUP_NAME="${WARMSTART_CLUSTER_CGROUP:-warmstart-cluster}"
# Node 2's kubelet's cgroupRoot, and its containerd's cgroup, below it (so the kubelets never
# share pod cgroups, and cluster-down finds node 2's processes with node 1's).
NODE2_CGROUP=node-2
# Our own nat chain: the `kubernetes` Service's ClusterIP to the API server (no kube-proxy).
NAT_CHAIN=WARMSTART-CLUSTER
# Host sysctls the kubelet sets (setupKernelTunables): saved by cluster-up, restored by
# cluster-down.
KUBELET_SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
# The image containerd runs pod sandboxes from, built here from busybox-static (nothing is
# pulled): also a general-purpose busybox for pods (imagePullPolicy: Never).
LOCAL_IMAGE=docker.io/warmstart/busybox:cluster

# Start order; cluster-down stops them in reverse.
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet)
# Node 2's: the holder of its mount namespace, its containerd and kubelet.
NODE2_COMPONENTS=(node-2-mounts containerd-2 kubelet-2)
if [[ "$NODES" == 2 ]]; then
  COMPONENTS+=("${NODE2_COMPONENTS[@]}")
elif [[ "$NODES" != 1 ]]; then
  echo "WARMSTART_CLUSTER_NODES=$NODES: 1 or 2" >&2
  exit 1
fi

PROG="${PROG:-cluster}"
say() { echo "$PROG: $*" >&2; }
fail() {
  echo "$PROG: error: $*" >&2
  exit 1
}

require_root() {
  [[ "$(id -u)" -eq 0 ]] || fail "must run as root (it starts a kubelet and containerd, creates a network bridge, cgroups and mounts); try: sudo make ${PROG}"
}

# log_tail COMPONENT: the last lines of its log, indented.
log_tail() {
  local log="$LOGS/$1.log"
  if [[ -s "$log" ]]; then
    echo "--- last lines of $log:"
    tail -n "${2:-25}" "$log" | sed 's/^/  | /'
  else
    echo "--- $log is empty or missing"
  fi
}

# component_fail COMPONENT MESSAGE: fails naming the component, with its log's tail.
component_fail() {
  echo "$PROG: error: $1: $2" >&2
  log_tail "$1" >&2
  exit 1
}

# ours PID: the process is alive and one of this cluster's (its command line names
# CLUSTER_DIR), so a recycled PID is never signalled.
ours() {
  local pid=$1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ -r "/proc/$pid/cmdline" ]] || return 1
  grep -qF -- "$CLUSTER_DIR" < <(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)
}

# pid_of COMPONENT: its PID if it runs (PID file present and the process ours), else fails.
pid_of() {
  local f="$PIDS/$1.pid" pid
  [[ -f "$f" ]] || return 1
  pid="$(cat "$f" 2>/dev/null)"
  ours "$pid" || return 1
  echo "$pid"
}

# stop_pid NAME PID [GRACE_SECONDS]: SIGTERM, then SIGKILL after the grace period; waits for it
# to be gone (a zombie of ours counts as gone).
stop_pid() {
  local name=$1 pid=$2 grace=${3:-10} deadline
  ours "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  deadline=$((SECONDS + grace))
  while ours "$pid" && ! zombie "$pid"; do
    if ((SECONDS >= deadline)); then
      say "$name (pid $pid) still running ${grace}s after SIGTERM: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      deadline=$((SECONDS + 10))
      while ours "$pid" && ! zombie "$pid"; do
        ((SECONDS < deadline)) || { say "$name (pid $pid) survives SIGKILL"; return 1; }
        sleep 0.1
      done
      return 0
    fi
    sleep 0.1
  done
}

zombie() { [[ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" == Z ]]; }

# poll DEADLINE_SECONDS COMMAND...: runs COMMAND every 0.2 s until it succeeds (0) or the
# deadline passes (1).
poll() {
  local deadline=$((SECONDS + $1))
  shift
  while :; do
    "$@" >/dev/null 2>&1 && return 0
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

cgroup2() { [[ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" == cgroup2fs ]]; }

# cgroup_dirs: this cluster's cgroup directory: in every mounted v1 hierarchy (and the empty
# unified one of a hybrid setup), or the one directory of a cgroup v2 machine.
cgroup_dirs() {
  local h
  if cgroup2; then
    echo "/sys/fs/cgroup/$CGROUP_NAME"
    return
  fi
  for h in /sys/fs/cgroup/*/; do
    [[ -d "$h" ]] || continue
    echo "${h%/}/$CGROUP_NAME"
  done
}

# cluster_lock: one cluster-up or cluster-down at a time (a second waits, then finds the first
# one's result). A nested call (cluster-up running cluster-down) inherits the lock.
cluster_lock() {
  [[ -n "${WARMSTART_CLUSTER_LOCKED:-}" ]] && return 0
  local lock=/run/lock/warmstart-cluster.lock
  mkdir -p "$(dirname "$lock")"
  exec 8>"$lock"
  if ! flock -n 8; then
    # No deadline: the holder may be building the components (minutes, the first time).
    say "another cluster-up or cluster-down is running (it holds $lock); waiting for it"
    flock 8
  fi
  export WARMSTART_CLUSTER_LOCKED=1
}

ctr_() { "$RUNTIME_PREFIX/usr/bin/ctr" --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }
# ctr_at SOCKET ARGS...: ctr against one node's containerd.
ctr_at() {
  local sock=$1
  shift
  "$RUNTIME_PREFIX/usr/bin/ctr" --address "$sock" --namespace k8s.io "$@"
}
# containerd_socks: the sockets of the nodes' containerds (from here), node 1's first; node 2's
# when its directory exists.
containerd_socks() {
  echo "$CONTAINERD_SOCK"
  if [[ -d "$NODE2_DIR/containerd" ]]; then echo "$NODE2_CONTAINERD_SOCK"; fi
}

# mounts_under DIR...: mount points at or below each DIR, deepest first.
mounts_under() {
  local d
  for d in "$@"; do
    awk -v d="$d" '{ m=$5; gsub(/\\040/, " ", m); if (m == d || index(m, d "/") == 1) print m }' /proc/self/mountinfo
  done | awk '{ print length($0) "\t" $0 }' | sort -rn -k1,1 | cut -f2- | uniq
}

# close_inherited_fds: closes every file descriptor above 2 of the current (sub)shell except
# bash's own script descriptor (255): run it in a subshell before starting a daemon.
close_inherited_fds() {
  local fd n
  for fd in /proc/"$BASHPID"/fd/*; do
    n="${fd##*/}"
    if ((n > 2 && n != 255)); then exec {n}>&-; fi
  done
}
