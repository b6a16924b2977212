#!/usr/bin/env bash
# Removes everything scripts/cluster-up.sh made (root), of both nodes: the pods' containers and
# sandboxes, the kubelets, the containerds and their shims, node 2's mount namespace (its
# holder), the control plane and etcd (each by its PID file, and only
# if the process is this cluster's), every process left in the cluster's cgroups, the mounts
# under the kubelet root and the cluster dir, the cgroups, the bridge and the nat rule, the
# host sysctls the kubelet changed, and the kubelet's and etcd's state. Works after a crash
# (stale PID files, processes already gone) and when nothing is there. Exits non-zero if
# something could not be removed, naming it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROG=cluster-down
# shellcheck source=cluster-lib.sh
source "$HERE/cluster-lib.sh"

require_root
cluster_lock
quiet="${WARMSTART_CLUSTER_QUIET:-}"
problems=()
found=""
if [[ -e "$CLUSTER_DIR" || -e "$KUBELET_ROOT/.warmstart-cluster" ]] || ip link show "$BRIDGE" >/dev/null 2>&1; then
  found=1
fi

# 1. The tests' device plugins (when they were started), then the kubelets, so they restart
# nothing while the pods go. Node 2's whatever WARMSTART_CLUSTER_NODES says now.
for c in device-plugin device-plugin-2; do
  if pid="$(pid_of "$c")"; then
    stop_pid "$c" "$pid" 5 || problems+=("$c (pid $pid) did not stop")
  fi
done
for c in kubelet kubelet-2; do
  if pid="$(pid_of "$c")"; then
    stop_pid "$c" "$pid" 15 || problems+=("$c (pid $pid) did not stop")
  fi
done

# 2. Every container and sandbox, through each containerd while it still runs: tasks killed and
# deleted (the shim unmounts their rootfs), containers deleted.
# remove_containers COMPONENT SOCKET
remove_containers() {
  local c=$1 sock=$2 id deadline ids
  pid_of "$c" >/dev/null && ctr_at "$sock" version >/dev/null 2>&1 || return 0
  mapfile -t ids < <(ctr_at "$sock" containers list -q 2>/dev/null || true)
  for id in "${ids[@]}"; do
    ctr_at "$sock" tasks kill --all --signal SIGKILL "$id" >/dev/null 2>&1 || true
  done
  for id in "${ids[@]}"; do
    deadline=$((SECONDS + 10))
    until ctr_at "$sock" tasks delete --force "$id" >/dev/null 2>&1 || ! grep -qx "$id" < <(ctr_at "$sock" tasks list -q 2>/dev/null); do
      ((SECONDS < deadline)) || { problems+=("$c task $id could not be deleted"); break; }
      sleep 0.2
    done
    ctr_at "$sock" containers delete "$id" >/dev/null 2>&1 || true
  done
}
remove_containers containerd "$CONTAINERD_SOCK"
remove_containers containerd-2 "$NODE2_CONTAINERD_SOCK"

# 3. The containerds and node 2's mount namespace holder, then whatever is still in the
# cluster's cgroups (shims, container processes of a crashed containerd; node 2's are below
# them): those are this cluster's by construction. With its last process node 2's mount
# namespace goes, and every mount in it.
for c in containerd containerd-2 node-2-mounts; do
  if pid="$(pid_of "$c")"; then
    stop_pid "$c" "$pid" 10 || problems+=("$c (pid $pid) did not stop")
  fi
done
cgroup_procs() {
  local d
  while read -r d; do
    [[ -d "$d" ]] && find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null
  done < <(cgroup_dirs)
}
deadline=$((SECONDS + 10))
while :; do
  mapfile -t left < <(cgroup_procs | sort -un)
  ((${#left[@]} == 0)) && break
  if ((SECONDS >= deadline)); then
    problems+=("processes left in the cluster's cgroups: ${left[*]}")
    break
  fi
  kill -KILL "${left[@]}" 2>/dev/null || true
  sleep 0.2
done

# 4. The control plane and etcd, in reverse start order.
for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
  c="${COMPONENTS[$i]}"
  [[ "$c" == kubelet* || "$c" == containerd* || "$c" == node-2-* ]] && continue
  if pid="$(pid_of "$c")"; then
    stop_pid "$c" "$pid" 10 || problems+=("$c (pid $pid) did not stop")
  fi
done

# 5. Mounts under the kubelet root and the cluster dir (pod volumes, rootfs, network
# namespaces, and the shared bind mounts themselves), deepest first.
unmount_all() {
  local m
  while read -r m; do
    [[ -n "$m" ]] || continue
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done < <(mounts_under "$@")
}
for _ in 1 2 3; do
  unmount_all "$KUBELET_ROOT" "$CLUSTER_DIR"
  [[ -z "$(mounts_under "$KUBELET_ROOT" "$CLUSTER_DIR")" ]] && break
done
left_mounts="$(mounts_under "$KUBELET_ROOT" "$CLUSTER_DIR")"
[[ -z "$left_mounts" ]] || problems+=("mounts left: ${left_mounts//$'\n'/, }")

# 6. cgroups, deepest first (rmdir only: a cgroup with a process in it stays, and is reported).
while read -r d; do
  [[ -d "$d" ]] || continue
  find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  [[ ! -d "$d" ]] || problems+=("cgroup $d could not be removed")
done < <(cgroup_dirs)

# 7. Network: the bridge (pod veths went with their namespaces) and the nat chain.
if ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link delete "$BRIDGE" type bridge 2>/dev/null || problems+=("bridge $BRIDGE could not be deleted")
fi
for hook in PREROUTING OUTPUT; do
  while iptables -w -t nat -C "$hook" -d "$SERVICE_CIDR" -j "$NAT_CHAIN" 2>/dev/null; do
    iptables -w -t nat -D "$hook" -d "$SERVICE_CIDR" -j "$NAT_CHAIN" || break
  done
done
if iptables -w -t nat -S "$NAT_CHAIN" >/dev/null 2>&1; then
  iptables -w -t nat -F "$NAT_CHAIN" && iptables -w -t nat -X "$NAT_CHAIN" || problems+=("iptables nat chain $NAT_CHAIN could not be removed")
fi

# 8. The host sysctls the kubelet changed, as they were before cluster-up.
if [[ -f "$CLUSTER_DIR/sysctls.saved" ]]; then
  while IFS='=' read -r k v; do
    if [[ -n "$k" ]]; then sysctl -qw "$k=$v" >/dev/null 2>&1 || true; fi
  done <"$CLUSTER_DIR/sysctls.saved"
fi

# The kubelet's container log links to pods of this cluster.
if [[ -d /var/log/containers ]]; then
  find /var/log/containers -maxdepth 1 -type l -lname "$CLUSTER_DIR/*" -delete 2>/dev/null || true
fi
# A shim that was killed (after a crash) leaves its socket in /run/containerd/s, named
# sha256(<containerd address>/<namespace>/<id>) by containerd 1.7: those of this cluster's
# tasks go. /run/containerd itself goes if cluster-up's containerd created it and it is empty.
# Node 2's containerd has the same address (in its mount namespace).
for task in "$CONTAINERD_DIR"/state/io.containerd.runtime.v2.task/*/* "$NODE2_DIR"/containerd/state/io.containerd.runtime.v2.task/*/*; do
  [[ -d "$task" ]] || continue
  id="$(basename "$task")"
  ns="$(basename "$(dirname "$task")")"
  sock="/run/containerd/s/$(printf '%s' "$CONTAINERD_SOCK/$ns/$id" | sha256sum | cut -d' ' -f1)"
  [[ -S "$sock" ]] && rm -f "$sock"
done
if [[ -f "$CLUSTER_DIR/created-run-containerd" && -d /run/containerd ]]; then
  find /run/containerd -depth -type d -empty -delete 2>/dev/null || true
fi
if [[ -f "$CLUSTER_DIR/created-var-log-containers" ]]; then
  rmdir /var/log/containers 2>/dev/null || true
fi

# 9. The state.
# A kubelet root without cluster-up's marker is not this cluster's: left alone.
# (Node 2's kubelet root is in $CLUSTER_DIR.)
if [[ -e "$KUBELET_ROOT/.warmstart-cluster" && -z "$(mounts_under "$KUBELET_ROOT")" ]]; then
  rm -rf "$KUBELET_ROOT"
fi
[[ ! -e "$KUBELET_ROOT/.warmstart-cluster" ]] || problems+=("$KUBELET_ROOT could not be removed")
if [[ -e "$CLUSTER_DIR" && -z "$(mounts_under "$CLUSTER_DIR")" ]]; then
  rm -rf "$CLUSTER_DIR"
fi
[[ ! -e "$CLUSTER_DIR" ]] || problems+=("$CLUSTER_DIR could not be removed")

if ((${#problems[@]})); then
  for p in "${problems[@]}"; do echo "$PROG: error: $p" >&2; done
  exit 1
fi
if [[ -z "$found" ]]; then
  [[ -n "$quiet" ]] || say "no cluster found ($CLUSTER_DIR, $BRIDGE): nothing to remove"
else
  [[ -n "$quiet" ]] || say "removed (processes, mounts, cgroups, $BRIDGE, nat chain $NAT_CHAIN, $KUBELET_ROOT, $CLUSTER_DIR)"
fi
