#!/usr/bin/env bash
# Checks a running local cluster end to end (root), on each node (both, unless
# WARMSTART_CLUSTER_NODES=1): the node is Ready and advertises its GPU, a busybox pod on it (the
# locally built image, imagePullPolicy Never) becomes Ready behind an httpGet readiness probe,
# gets an address of the node's own range, serves HTTP on it to the host, reaches the API server
# through the `kubernetes` Service's ClusterIP, and its logs come back through the node's
# kubelet. On node 2, the pod sees node 2's kubelet root at /var/lib/kubelet (a hostPath with
# HostToContainer propagation), not node 1's. A privileged pod's mount below a hostPath volume
# with Bidirectional propagation shows on its node (in node 2's mount namespace for node 2, and
# not on this machine's). The pods are deleted and that mount removed afterwards (also when a
# step fails).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROG=cluster-check
# shellcheck source=cluster-lib.sh
source "$HERE/cluster-lib.sh"

require_root
[[ -f "$ADMIN_KUBECONFIG" ]] || fail "$ADMIN_KUBECONFIG missing: start the cluster first (sudo make cluster-up)"
K=(kubectl --kubeconfig "$ADMIN_KUBECONFIG" --request-timeout=10s)
NS=default
PODS=()
# The directory the Bidirectional checks mount below (one subdirectory per node).
PROPAGATION_DIR="$CLUSTER_DIR/propagation-check"
cleanup() {
  local p
  for p in "${PODS[@]}"; do
    "${K[@]}" -n "$NS" delete pod "$p" --ignore-not-found --grace-period=0 --force >/dev/null 2>&1 || true
  done
  # A Bidirectional mount outlives its pod: removed in each node's mount namespace.
  umount "$PROPAGATION_DIR/$NODE_NAME" 2>/dev/null || true
  if pid="$(pid_of node-2-mounts)"; then
    nsenter --mount="/proc/$pid/ns/mnt" -- umount "$PROPAGATION_DIR/$NODE2_NAME" 2>/dev/null || true
  fi
  rm -rf "$PROPAGATION_DIR"
}
trap cleanup EXIT

# in_node NODE COMMAND...: COMMAND in NODE's mount namespace.
in_node() {
  local node=$1 pid
  shift
  if [[ "$node" == "$NODE2_NAME" ]]; then
    pid="$(pid_of node-2-mounts)" || fail "node 2's mount namespace holder (node-2-mounts) is not running"
    nsenter --mount="/proc/$pid/ns/mnt" -- "$@"
  else
    "$@"
  fi
}

# check_bidirectional NODE: a privileged pod on NODE mounts a tmpfs below a hostPath volume
# with Bidirectional propagation; the node sees it (in its own mount namespace).
check_bidirectional() {
  local node=$1 pod="cluster-check-$$-bidi-${1##*-}" dir="$PROPAGATION_DIR/$1"
  PODS+=("$pod")
  mkdir -p "$dir"
  "${K[@]}" -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $pod
spec:
  terminationGracePeriodSeconds: 1
  nodeSelector:
    kubernetes.io/hostname: $node
  volumes:
    - name: shared
      hostPath:
        path: $PROPAGATION_DIR
        type: Directory
  containers:
    - name: mounter
      image: $LOCAL_IMAGE
      imagePullPolicy: Never
      securityContext:
        privileged: true
      command: ["/bin/sh", "-c"]
      args:
        - mount -t tmpfs -o size=1m cluster-check /shared/$node && echo $pod >/shared/$node/marker && exec sleep 3600
      volumeMounts:
        - name: shared
          mountPath: /shared
          mountPropagation: Bidirectional
EOF
  seen() { [[ "$(in_node "$node" cat "$dir/marker" 2>/dev/null)" == "$pod" ]]; }
  if ! poll 60 seen; then
    "${K[@]}" -n "$NS" describe pod "$pod" >&2 || true
    fail "node $node: the tmpfs pod $pod mounted with Bidirectional propagation does not show at $dir on the node"
  fi
  if [[ "$node" == "$NODE2_NAME" && -e "$dir/marker" ]]; then
    fail "node 2's pod mount at $dir shows on this machine (node 1) too: node 2's mount namespace leaks"
  fi
  say "pod $pod's mount (Bidirectional) shows on $node at $dir"
}

# check NODE IP_PREFIX_REGEX MARKER: the checks on one node; MARKER is a file its kubelet root
# must hold (node 2's own, which node 1's lacks), or empty.
check() {
  local node=$1 range=$2 marker=$3
  local POD="cluster-check-$$-${node##*-}"
  PODS+=("$POD")
  ready="$("${K[@]}" get node "$node" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')"
  [[ "$ready" == True ]] || fail "node $node is not Ready ($ready)"
  gpus="$("${K[@]}" get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')"
  [[ -n "$gpus" && "$gpus" != 0 ]] || fail "node $node advertises no nvidia.com/gpu"
  say "node $node Ready, nvidia.com/gpu: $gpus"

  "${K[@]}" -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $POD
spec:
  terminationGracePeriodSeconds: 1
  nodeSelector:
    nvidia.com/gpu.present: "true"
    kubernetes.io/hostname: $node
  volumes:
    - name: kubelet-root
      hostPath:
        path: $KUBELET_ROOT
        type: Directory
  containers:
    - name: web
      image: $LOCAL_IMAGE
      imagePullPolicy: Never
      command: ["/bin/sh", "-c"]
      args:
        - |
          mkdir -p /www && echo "hello from \$(hostname)" >/www/index.html
          echo "api: \$(nc -w 3 \$KUBERNETES_SERVICE_HOST \$KUBERNETES_SERVICE_PORT </dev/null >/dev/null 2>&1 && echo reachable || echo unreachable)"
          echo "node-2 marker: \$(test -e /host-kubelet/.warmstart-node-2 && echo present || echo absent)"
          exec httpd -f -p 8080 -h /www
      volumeMounts:
        - name: kubelet-root
          mountPath: /host-kubelet
          mountPropagation: HostToContainer
      ports:
        - containerPort: 8080
      readinessProbe:
        httpGet:
          path: /index.html
          port: 8080
        periodSeconds: 1
      resources:
        limits:
          nvidia.com/gpu: "1"
EOF
  pod_ready() {
    [[ "$("${K[@]}" -n "$NS" get pod "$POD" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]]
  }
  if ! poll 90 pod_ready; then
    "${K[@]}" -n "$NS" describe pod "$POD" >&2 || true
    fail "pod $POD not Ready within 90s"
  fi
  ip="$("${K[@]}" -n "$NS" get pod "$POD" -o jsonpath='{.status.podIP}')"
  [[ "$ip" =~ $range ]] || fail "pod $POD on $node has IP '$ip', not one of its node's range ($range)"
  body="$(curl -sf --max-time 5 "http://$ip:8080/index.html")" || fail "pod $POD at $ip:8080 does not answer HTTP"
  say "pod $POD Ready at $ip; http://$ip:8080/ says: $body"
  logs_ok() { grep -q 'api: reachable' < <("${K[@]}" -n "$NS" logs "$POD"); }
  poll 10 logs_ok || fail "pod $POD's log (through the kubelet) does not show the API server reachable at the kubernetes Service: $("${K[@]}" -n "$NS" logs "$POD" 2>&1 | head -n 5)"
  say "pod $POD reached the API server at \$KUBERNETES_SERVICE_HOST; its logs come back through the kubelet"
  local want=absent
  [[ -n "$marker" ]] && want=present
  marker_ok() { grep -q "node-2 marker: $want" < <("${K[@]}" -n "$NS" logs "$POD"); }
  poll 10 marker_ok || fail "pod $POD on $node: node 2's kubelet root marker is not $want in $KUBELET_ROOT as the pod sees it: $("${K[@]}" -n "$NS" logs "$POD" 2>&1 | tail -n 3)"
  say "pod $POD sees $node's own kubelet root"
}

# Pod addresses: node 1 198.18.0.10-127, node 2 198.18.0.130-254.
check "$NODE_NAME" '^198\.18\.0\.([1-9][0-9]|1[01][0-9]|12[0-7])$' ""
if [[ "$NODES" == 2 ]]; then
  touch "$NODE2_DIR/kubelet/.warmstart-node-2"
  check "$NODE2_NAME" '^198\.18\.0\.(1[3-9][0-9]|2[0-4][0-9]|25[0-4])$' "$NODE2_DIR/kubelet/.warmstart-node-2"
fi
check_bidirectional "$NODE_NAME"
[[ "$NODES" == 2 ]] && check_bidirectional "$NODE2_NAME"
say "ok"
