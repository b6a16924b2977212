#!/usr/bin/env bash
# Checks a running local cluster end to end (root): the node is Ready and advertises its GPU,
# a busybox pod (the locally built image, imagePullPolicy Never) becomes Ready behind an httpGet
# readiness probe, serves HTTP on its 198.18.0.x address to the node, reaches the API server
# through the `kubernetes` Service's ClusterIP, and its logs come back through the kubelet.
# The pod is deleted afterwards (also when a step fails).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROG=cluster-check
# shellcheck source=cluster-lib.sh
source "$HERE/cluster-lib.sh"

require_root
[[ -f "$ADMIN_KUBECONFIG" ]] || fail "$ADMIN_KUBECONFIG missing: start the cluster first (sudo make cluster-up)"
K=(kubectl --kubeconfig "$ADMIN_KUBECONFIG" --request-timeout=10s)
NS=default
POD="cluster-check-$$"
trap '"${K[@]}" -n "$NS" delete pod "$POD" --ignore-not-found --grace-period=0 --force >/dev/null 2>&1 || true' EXIT

ready="$("${K[@]}" get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')"
[[ "$ready" == True ]] || fail "node $NODE_NAME is not Ready ($ready)"
gpus="$("${K[@]}" get node "$NODE_NAME" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')"
[[ -n "$gpus" && "$gpus" != 0 ]] || fail "node $NODE_NAME advertises no nvidia.com/gpu"
say "node $NODE_NAME Ready, nvidia.com/gpu: $gpus"

"${K[@]}" -n "$NS" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $POD
spec:
  terminationGracePeriodSeconds: 1
  nodeSelector:
    nvidia.com/gpu.present: "true"
  containers:
    - name: web
      image: $LOCAL_IMAGE
      imagePullPolicy: Never
      command: ["/bin/sh", "-c"]
      args:
        - |
          mkdir -p /www && echo "hello from \$(hostname)" >/www/index.html
          echo "api: \$(nc -w 3 \$KUBERNETES_SERVICE_HOST \$KUBERNETES_SERVICE_PORT </dev/null >/dev/null 2>&1 && echo reachable || echo unreachable)"
          exec httpd -f -p 8080 -h /www
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
[[ "$ip" == 198.18.0.* ]] || fail "pod $POD has IP '$ip', not one of 198.18.0.0/24"
body="$(curl -sf --max-time 5 "http://$ip:8080/index.html")" || fail "pod $POD at $ip:8080 does not answer HTTP"
say "pod $POD Ready at $ip; http://$ip:8080/ says: $body"
logs_ok() { "${K[@]}" -n "$NS" logs "$POD" | grep -q 'api: reachable'; }
poll 10 logs_ok || fail "pod $POD's log (through the kubelet) does not show the API server reachable at the kubernetes Service: $("${K[@]}" -n "$NS" logs "$POD" 2>&1 | head -n 5)"
say "pod $POD reached the API server at \$KUBERNETES_SERVICE_HOST; its logs come back through the kubelet"
say "ok"
