#!/usr/bin/env bash
# Starts a two-node Kubernetes on this machine from upstream components (root):
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler (built by scripts/build-k8s.sh,
# cached), and per node a containerd 1.7 of its own (scripts/cluster-runtime.sh) and a kubelet
# whose node registers Ready, labelled nvidia.com/gpu.present=true and advertising
# nvidia.com/gpu capacity. Pods get addresses from 198.18.0.0/24 on a bridge the cluster creates
# (node warmstart-node is 198.18.0.1 on it, its pods .10-.127; warmstart-node-2 is 198.18.0.2,
# its pods .130-.254), Services 198.19.0.0/24; no image is pulled (load them with
# scripts/cluster-load.sh, which loads every node). Writes an admin kubeconfig to
# $CLUSTER_DIR/admin.kubeconfig and prints it. WARMSTART_CLUSTER_NODES=1: node 1 alone.
#
# Node 2 runs in a mount namespace of its own (held by the node-2-mounts process), where its
# directories under $CLUSTER_DIR/node-2 are bind-mounted (shared, for mount propagation) over
# the paths both nodes use: /var/lib/kubelet, $CLUSTER_DIR/containerd, $CLUSTER_DIR/agent-state
# and $CLUSTER_DIR/cache. Its kubelet listens on 198.18.0.2:10350 (healthz 127.0.0.1:10348), its
# pods' cgroups are under /warmstart-cluster/node-2.
#
# A second run while the cluster is up changes nothing; a run after a crash (stale PID files,
# leftover state) first removes what is left (scripts/cluster-down.sh). Every wait polls with
# a deadline; a component that fails is named with the tail of its log.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
PROG=cluster-up
# shellcheck source=cluster-lib.sh
source "$HERE/cluster-lib.sh"

require_root
cluster_lock
started=""
trap 'rc=$?; if ((rc != 0)) && [[ -n "$started" ]]; then say "logs in $LOGS; remove what was started: sudo make cluster-down"; fi' EXIT

# ---------------------------------------------------------------- tools

for tool in openssl curl ip iptables ss kubectl tar sha256sum base64 /bin/busybox; do
  command -v "$tool" >/dev/null || fail "$tool not found (run 'sudo make setup'; openssl, curl, iproute2 and iptables are Debian packages)"
done
RUNC="$(command -v runc || true)"
[[ -n "$RUNC" ]] || fail "runc not found (run 'sudo make setup')"
if ! cgroup2; then
  [[ -d /sys/fs/cgroup/memory && -d /sys/fs/cgroup/cpu && -d /sys/fs/cgroup/pids ]] \
    || fail "cgroup v1 hierarchies memory, cpu and pids must be mounted under /sys/fs/cgroup"
fi

# ---------------------------------------------------------------- already up, or leftovers

# cluster_healthy: every component runs, the API server answers and the nodes are Ready (and a
# node 2 runs only when asked for).
cluster_healthy() {
  local c
  for c in "${COMPONENTS[@]}"; do pid_of "$c" >/dev/null || return 1; done
  if [[ "$NODES" == 1 ]]; then
    for c in "${NODE2_COMPONENTS[@]}"; do ! pid_of "$c" >/dev/null || return 1; done
  fi
  [[ -f "$ADMIN_KUBECONFIG" ]] || return 1
  node_ready
  [[ "$NODES" == 1 ]] || node_ready "$NODE2_NAME"
}
node_ready() {
  [[ "$(kubectl --kubeconfig "$ADMIN_KUBECONFIG" --request-timeout=5s get node "${1:-$NODE_NAME}" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

print_summary() {
  echo "$PROG: cluster up${1:+ in ${1}s}: node $NODE_NAME Ready at $NODE_IP; API server https://$NODE_IP:$API_PORT" >&2
  if [[ "$NODES" == 2 ]]; then
    echo "$PROG: node $NODE2_NAME Ready at $NODE2_IP (its directories: $NODE2_DIR)" >&2
  fi
  echo "$PROG: admin kubeconfig: $ADMIN_KUBECONFIG   (export KUBECONFIG=$ADMIN_KUBECONFIG)" >&2
  echo "$PROG: load an OCI/docker image tarball: sudo make cluster-load IMAGE=<file.tar>; stop: sudo make cluster-down" >&2
  cat "$ADMIN_KUBECONFIG"
}

if cluster_healthy; then
  say "already running (state in $CLUSTER_DIR)"
  print_summary
  exit 0
fi
if [[ -e "$CLUSTER_DIR" || -e "$KUBELET_ROOT/.warmstart-cluster" ]] || ip link show "$BRIDGE" >/dev/null 2>&1; then
  say "found what an earlier cluster left ($CLUSTER_DIR; a crash, a cluster not Ready, or one of another number of nodes): removing it first"
  WARMSTART_CLUSTER_QUIET=1 bash "$HERE/cluster-down.sh" || fail "could not remove the earlier cluster's leftovers (see above)"
fi

# ---------------------------------------------------------------- binaries

up_start=$SECONDS

BIN="$(bash "$ROOT/scripts/build-k8s.sh" | tail -n1)" || fail "building the Kubernetes components failed (see above)"
for c in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet; do
  [[ -x "$BIN/$c" ]] || fail "$BIN/$c missing after scripts/build-k8s.sh"
done
bash "$HERE/cluster-runtime.sh" >/dev/null || fail "installing containerd 1.7 failed (see above)"
CONTAINERD_BIN="$RUNTIME_PREFIX/usr/bin"

# ---------------------------------------------------------------- preflight

# port_taken ADDR PORT: something listens on PORT at ADDR or at the wildcard address.
port_taken() {
  grep -qE "^(\*|0\.0\.0\.0|\[::\]|\[::ffff:0\.0\.0\.0\]|${1//./\\.}):$2\$" \
    < <(ss -Hltn "sport = :$2" 2>/dev/null | awk '{print $4}')
}
for check in "127.0.0.1 $ETCD_CLIENT_PORT etcd(client)" "127.0.0.1 $ETCD_PEER_PORT etcd(peer)" \
  "$NODE_IP $API_PORT kube-apiserver" "$NODE_IP $KUBELET_PORT kubelet" \
  "127.0.0.1 $KUBELET_HEALTHZ_PORT kubelet(healthz)" "127.0.0.1 $CM_PORT kube-controller-manager" \
  "127.0.0.1 $SCHEDULER_PORT kube-scheduler" "0.0.0.0 $NODE2_KUBELET_PORT kubelet-2" \
  "127.0.0.1 $NODE2_KUBELET_HEALTHZ_PORT kubelet-2(healthz)"; do
  read -r addr port what <<<"$check"
  if port_taken "$addr" "$port"; then
    fail "port $port ($what) is taken: $(ss -Hltnp "sport = :$port" | awk '{print $4, $6}' | head -n1); stop that process (or another cluster: sudo make cluster-down)"
  fi
done
if [[ -e "$KUBELET_ROOT" ]]; then
  fail "$KUBELET_ROOT exists and is not this cluster's: another kubelet may use it; remove it, or set WARMSTART_KUBELET_ROOT"
fi
if grep -qE '^198\.1[89]\.' < <(ip -o -4 addr show | awk '{print $4}'); then
  fail "an interface already has an address in 198.18.0.0/15 ($(ip -o -4 addr show | awk '$4 ~ /^198\.1[89]\./ {print $2, $4}' | head -n1)): the cluster needs that range for itself"
fi

# ---------------------------------------------------------------- state, network, cgroups, mounts

started=1
mkdir -p "$CLUSTER_DIR"
chmod 0700 "$CLUSTER_DIR"
mkdir -p "$PKI" "$LOGS" "$PIDS" "$CONTAINERD_DIR" "$CNI_DIR/net.d" "$CNI_DIR/ipam" \
  "$CLUSTER_DIR/etcd" "$CLUSTER_DIR/pod-logs" "$CLUSTER_DIR/images" "$AGENT_STATE_DIR" "$NODE_CACHE_DIR"
chmod 0700 "$CLUSTER_DIR/etcd"
if [[ "$NODES" == 2 ]]; then
  for bind in "${NODE2_BINDS[@]}"; do mkdir -p "$NODE2_DIR/${bind##*:}"; done
  mkdir -p "$NODE2_DIR/cni/net.d" "$NODE2_DIR/cni/ipam" "$NODE2_DIR/pod-logs"
  touch "$NODE2_DIR/kubelet/.warmstart-cluster"
fi
mkdir -p "$KUBELET_ROOT"
touch "$KUBELET_ROOT/.warmstart-cluster"

# The kubelet root and the cluster dir (containerd's rootfs and netns mounts) as shared mounts,
# so hostPath volumes with mountPropagation (HostToContainer, Bidirectional) work; '/' stays as
# it is.
for d in "$KUBELET_ROOT" "$CLUSTER_DIR"; do
  mount --bind "$d" "$d" || fail "mount --bind $d failed"
  mount --make-rshared "$d" || fail "mount --make-rshared $d failed"
done

for s in "${KUBELET_SYSCTLS[@]}"; do
  v="$(sysctl -n "$s" 2>/dev/null)" && echo "$s=$v"
done >"$CLUSTER_DIR/sysctls.saved"

ip link add name "$BRIDGE" type bridge || fail "cannot create bridge $BRIDGE"
echo 1 >"/proc/sys/net/ipv6/conf/$BRIDGE/disable_ipv6" 2>/dev/null || true
ip addr add "$NODE_IP/24" dev "$BRIDGE" || fail "cannot add $NODE_IP/24 to $BRIDGE"
if [[ "$NODES" == 2 ]]; then
  ip addr add "$NODE2_IP/24" dev "$BRIDGE" || fail "cannot add $NODE2_IP/24 to $BRIDGE"
fi
ip link set "$BRIDGE" up || fail "cannot bring $BRIDGE up"

# The `kubernetes` Service without kube-proxy: its ClusterIP goes to the API server, from pods
# (PREROUTING) and from the node (OUTPUT). Only this cluster's addresses are involved.
iptables -w -t nat -N "$NAT_CHAIN" 2>/dev/null || iptables -w -t nat -F "$NAT_CHAIN"
iptables -w -t nat -A "$NAT_CHAIN" -d "$API_SERVICE_IP/32" -p tcp --dport 443 \
  -j DNAT --to-destination "$NODE_IP:$API_PORT" || fail "iptables: cannot add the DNAT rule for $API_SERVICE_IP:443"
for hook in PREROUTING OUTPUT; do
  iptables -w -t nat -C "$hook" -d "$SERVICE_CIDR" -j "$NAT_CHAIN" 2>/dev/null \
    || iptables -w -t nat -I "$hook" 1 -d "$SERVICE_CIDR" -j "$NAT_CHAIN" || fail "iptables: cannot hook $NAT_CHAIN into nat $hook"
done

# The cgroup the kubelet puts pods under (cgroupRoot), and one for containerd and its shims.
# Node 2's pods' (cgroupRoot) and its containerd's below it.
cgroup_subdirs=(runtime)
[[ "$NODES" == 2 ]] && cgroup_subdirs+=("$NODE2_CGROUP" "$NODE2_CGROUP/runtime")
while read -r d; do
  for sub in "${cgroup_subdirs[@]}"; do
    mkdir -p "$d/$sub" || fail "cannot create cgroup $d/$sub"
  done
  if [[ "$d" == /sys/fs/cgroup/cpuset/* ]]; then
    # A v1 cpuset cgroup takes no task until its cpus and mems are set (parents first).
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"$d/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"$d/cpuset.mems"
    for sub in "${cgroup_subdirs[@]}"; do
      cat "$d/cpuset.cpus" >"$d/$sub/cpuset.cpus"
      cat "$d/cpuset.mems" >"$d/$sub/cpuset.mems"
    done
  fi
done < <(cgroup_dirs)
if cgroup2; then
  # cgroup v2: the kubelet's pod cgroups below ours need the controllers delegated to them
  # (untested here: this machine has cgroup v1).
  d="/sys/fs/cgroup/$CGROUP_NAME"
  read -ra ctls <"$d/cgroup.controllers"
  for ctl in "${ctls[@]}"; do
    echo "+$ctl" >"$d/cgroup.subtree_control" 2>/dev/null || true
  done
fi

# ---------------------------------------------------------------- certificates

# cert NAME CN O SANS USAGES: a key (P-256) and a certificate signed by the cluster CA.
cert() {
  local name=$1 cn=$2 o=$3 sans=$4 usage=$5 subj ext
  subj="/CN=$cn"
  [[ -n "$o" ]] && subj="/O=$o$subj"
  openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/$name.key" 2>/dev/null
  openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
  ext="$PKI/$name.ext"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [[ -n "$sans" ]] && echo "subjectAltName=$sans"
  } >"$ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/${6:-ca}.crt" -CAkey "$PKI/${6:-ca}.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days 825 -sha256 -extfile "$ext" \
    -out "$PKI/$name.crt" 2>"$PKI/$name.err" || fail "openssl: cannot sign $name: $(cat "$PKI/$name.err")"
  rm -f "$PKI/$name.csr" "$ext" "$PKI/$name.err"
}
ca() {
  openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/$1.key" 2>/dev/null
  openssl req -x509 -new -key "$PKI/$1.key" -subj "/CN=$2" -days 3650 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$PKI/$1.crt" 2>/dev/null || fail "openssl: cannot create CA $1"
}
say "certificates in $PKI"
(
  umask 077
  ca ca warmstart-cluster-ca
  ca front-proxy-ca warmstart-cluster-front-proxy-ca
  cert apiserver kube-apiserver "" \
    "IP:$NODE_IP,IP:$API_SERVICE_IP,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" serverAuth
  cert apiserver-kubelet-client kube-apiserver-kubelet-client "" "" clientAuth
  cert admin kubernetes-admin system:masters "" clientAuth
  cert controller-manager system:kube-controller-manager "" "" clientAuth
  cert scheduler system:kube-scheduler "" "" clientAuth
  cert kubelet-client "system:node:$NODE_NAME" system:nodes "" clientAuth
  cert kubelet "$NODE_NAME" "" "IP:$NODE_IP,DNS:$NODE_NAME" serverAuth
  cert kubelet-2-client "system:node:$NODE2_NAME" system:nodes "" clientAuth
  cert kubelet-2 "$NODE2_NAME" "" "IP:$NODE2_IP,DNS:$NODE2_NAME" serverAuth
  cert front-proxy-client front-proxy-client "" "" clientAuth front-proxy-ca
  openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
  openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
) || fail "certificate generation failed"

# kubeconfig FILE USER CERT: a kubeconfig for USER with client certificate CERT.
kubeconfig() {
  local b64='base64 -w0'
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: warmstart
    cluster:
      server: https://$NODE_IP:$API_PORT
      certificate-authority-data: $($b64 <"$PKI/ca.crt")
users:
  - name: $2
    user:
      client-certificate-data: $($b64 <"$PKI/$3.crt")
      client-key-data: $($b64 <"$PKI/$3.key")
contexts:
  - name: warmstart
    context:
      cluster: warmstart
      user: $2
current-context: warmstart
EOF
  chmod 0600 "$1"
}
kubeconfig "$ADMIN_KUBECONFIG" kubernetes-admin admin
kubeconfig "$CLUSTER_DIR/controller-manager.kubeconfig" system:kube-controller-manager controller-manager
kubeconfig "$CLUSTER_DIR/scheduler.kubeconfig" system:kube-scheduler scheduler
kubeconfig "$CLUSTER_DIR/kubelet.kubeconfig" "system:node:$NODE_NAME" kubelet-client
kubeconfig "$CLUSTER_DIR/kubelet-2.kubeconfig" "system:node:$NODE2_NAME" kubelet-2-client
KUBECTL=(kubectl --kubeconfig "$ADMIN_KUBECONFIG" --request-timeout=10s)

# ---------------------------------------------------------------- configuration files

cat >"$CLUSTER_DIR/audit-policy.yaml" <<'EOF'
# Every request, with who made it, the verb, the object and the response code.
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
EOF

# containerd_config FILE CNI_CONF_DIR: a node's containerd configuration. Both nodes' name
# $CONTAINERD_DIR: node 2's containerd sees its own directory there (its mount namespace).
containerd_config() {
  cat >"$1" <<EOF
# containerd of the warmstart local cluster (scripts/cluster-up.sh): everything under $CONTAINERD_DIR.
version = 2
root = "$CONTAINERD_DIR/root"
state = "$CONTAINERD_DIR/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"
[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = "$CONTAINERD_DIR/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$LOCAL_IMAGE"
  # No CAP_SYS_RESOURCE on some machines: keep oom_score_adj at or above containerd's own.
  restrict_oom_score_adj = true
  # Pod network namespaces under the state dir, not /run/netns: cluster-down finds them all.
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$RUNC"
        # runc's state of this cluster's containers apart from any other containerd's.
        Root = "$CONTAINERD_DIR/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$RUNTIME_PREFIX/usr/lib/cni"
    conf_dir = "$2"
    max_conf_num = 1
EOF
}
containerd_config "$CONTAINERD_DIR/config.toml" "$CNI_DIR/net.d"

# cni_config DIR GATEWAY IS_GATEWAY RANGE_START RANGE_END: a node's CNI configuration (in
# DIR/net.d, its address state in DIR/ipam): one bridge and subnet for both nodes, each with its
# own range. Node 2's gateway (its address) is put on the bridge by cluster-up: the bridge
# plugin refuses a second IPv4 address of its own.
cni_config() {
  cat >"$1/net.d/10-warmstart.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "warmstart",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": $3,
      "isDefaultGateway": false,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$1/ipam",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$2", "rangeStart": "$4", "rangeEnd": "$5"}]],
        "routes": [{"dst": "$POD_ROUTE"}]
      }
    }
  ]
}
EOF
}
cni_config "$CNI_DIR" "$NODE_IP" true "$POD_RANGE_START" "$POD_RANGE_END"

# kubelet_config FILE IP PORT HEALTHZ_PORT CERT CGROUP_ROOT POD_LOGS: a node's kubelet.
kubelet_config() {
  cat >"$1" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $2
port: $3
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $4
tlsCertFile: $PKI/$5.crt
tlsPrivateKeyFile: $PKI/$5.key
rotateCertificates: false
serverTLSBootstrap: false
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: $PKI/ca.crt
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
cgroupDriver: cgroupfs
cgroupRoot: $6
cgroupsPerQOS: true
enforceNodeAllocatable: ["pods"]
failCgroupV1: false
# Swap is tolerated (a laptop's); pods get none (swapBehavior NoSwap, the default).
failSwapOn: false
clusterDomain: cluster.local
# No cluster DNS, and not the host's resolvers either.
resolvConf: ""
podLogsDir: $7
# Nothing can be pulled again: never collect images.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
serializeImagePulls: false
maxPods: 110
EOF
}
kubelet_config "$CLUSTER_DIR/kubelet-config.yaml" "$NODE_IP" "$KUBELET_PORT" "$KUBELET_HEALTHZ_PORT" \
  kubelet "/$CGROUP_NAME" "$CLUSTER_DIR/pod-logs"
if [[ "$NODES" == 2 ]]; then
  containerd_config "$NODE2_DIR/containerd/config.toml" "$NODE2_DIR/cni/net.d"
  cni_config "$NODE2_DIR/cni" "$NODE2_IP" false "$NODE2_POD_RANGE_START" "$NODE2_POD_RANGE_END"
  kubelet_config "$NODE2_DIR/kubelet-config.yaml" "$NODE2_IP" "$NODE2_KUBELET_PORT" \
    "$NODE2_KUBELET_HEALTHZ_PORT" kubelet-2 "/$CGROUP_NAME/$NODE2_CGROUP" "$NODE2_DIR/pod-logs"
fi

# ---------------------------------------------------------------- processes

# launch COMPONENT CGROUP|"" COMMAND...: starts COMMAND in its own session (in cgroup CGROUP of
# every hierarchy when given), its output in $LOGS/COMPONENT.log, its PID in $PIDS.
launch() {
  local c=$1 cg=$2
  shift 2
  : >"$LOGS/$c.log"
  if [[ -n "$cg" ]]; then
    cgroup_dirs | sed "s|\$|/$cg|" >"$CLUSTER_DIR/$c.cgroups"
  fi
  (
    # The components outlive this script: they must not keep its caller's files open (a lock
    # the caller holds with flock would stay held as long as the cluster runs).
    close_inherited_fds
    if [[ -n "$cg" ]]; then
      # shellcheck disable=SC2016
      setsid bash -c 'while read -r d; do echo $$ >"$d/cgroup.procs" || exit 97; done <"$0"; exec "$@"' \
        "$CLUSTER_DIR/$c.cgroups" "$@" </dev/null >>"$LOGS/$c.log" 2>&1 &
    else
      setsid "$@" </dev/null >>"$LOGS/$c.log" 2>&1 &
    fi
    echo $! >"$PIDS/$c.pid"
  )
}

# await COMPONENT SECONDS WHAT COMMAND...: polls COMMAND until it succeeds; fails naming the
# component (with its log) if it exits or the deadline passes.
await() {
  local c=$1 secs=$2 what=$3 deadline pid
  shift 3
  pid="$(cat "$PIDS/$c.pid")"
  deadline=$((SECONDS + secs))
  while ! "$@" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null || zombie "$pid"; then
      wait "$pid" 2>/dev/null && rc=0 || rc=$?
      component_fail "$c" "exited (status $rc) before $what"
    fi
    ((SECONDS < deadline)) || component_fail "$c" "not $what after ${secs}s"
    sleep 0.2
  done
}

CURL_ADMIN=(curl -sf --max-time 3 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key")

say "starting etcd"
launch etcd "" "$BIN/etcd" --name warmstart --data-dir "$CLUSTER_DIR/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "warmstart=http://127.0.0.1:$ETCD_PEER_PORT" --initial-cluster-state new \
  --unsafe-no-fsync --log-level warn
etcd_healthy() { grep -q '"health":"true"' < <(curl -sf --max-time 2 "http://127.0.0.1:$ETCD_CLIENT_PORT/health"); }
await etcd 30 "healthy" etcd_healthy

say "starting kube-apiserver"
launch kube-apiserver "" "$BIN/kube-apiserver" \
  --advertise-address="$NODE_IP" --bind-address="$NODE_IP" --secure-port="$API_PORT" \
  --etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --service-cluster-ip-range="$SERVICE_CIDR" \
  --allow-privileged=true \
  --enable-aggregator-routing=true \
  --authorization-mode=Node,RBAC \
  --enable-admission-plugins=NodeRestriction \
  --client-ca-file="$PKI/ca.crt" \
  --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
  --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
  --kubelet-certificate-authority="$PKI/ca.crt" --kubelet-preferred-address-types=InternalIP \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
  --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" \
  --requestheader-allowed-names=front-proxy-client \
  --requestheader-extra-headers-prefix=X-Remote-Extra- --requestheader-group-headers=X-Remote-Group \
  --requestheader-username-headers=X-Remote-User \
  --proxy-client-cert-file="$PKI/front-proxy-client.crt" --proxy-client-key-file="$PKI/front-proxy-client.key" \
  --audit-policy-file="$CLUSTER_DIR/audit-policy.yaml" --audit-log-path="$LOGS/audit.log" \
  --audit-log-maxsize=200 --audit-log-maxbackup=2 \
  --cert-dir="$PKI/apiserver-generated" \
  --profiling=false
api_ready() { [[ "$("${CURL_ADMIN[@]}" "https://$NODE_IP:$API_PORT/readyz")" == ok ]]; }
await kube-apiserver 120 "ready (/readyz)" api_ready

# The API server calls kubelets (logs, exec, port-forward) as this user.
"${KUBECTL[@]}" apply -f - >/dev/null <<'EOF' || fail "cannot bind kube-apiserver-kubelet-client to system:kubelet-api-admin"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: warmstart-cluster:apiserver-kubelet-client
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: system:kubelet-api-admin
subjects:
  - apiGroup: rbac.authorization.k8s.io
    kind: User
    name: kube-apiserver-kubelet-client
EOF

say "starting kube-controller-manager and kube-scheduler"
launch kube-controller-manager "" "$BIN/kube-controller-manager" \
  --kubeconfig="$CLUSTER_DIR/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$CLUSTER_DIR/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$CLUSTER_DIR/controller-manager.kubeconfig" \
  --bind-address=127.0.0.1 --secure-port="$CM_PORT" --cert-dir="$PKI/controller-manager-generated" \
  --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
  --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
  --use-service-account-credentials=true \
  --service-cluster-ip-range="$SERVICE_CIDR" --allocate-node-cidrs=false \
  --leader-elect=false --profiling=false
launch kube-scheduler "" "$BIN/kube-scheduler" \
  --kubeconfig="$CLUSTER_DIR/scheduler.kubeconfig" \
  --authentication-kubeconfig="$CLUSTER_DIR/scheduler.kubeconfig" \
  --authorization-kubeconfig="$CLUSTER_DIR/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 --secure-port="$SCHEDULER_PORT" \
  --leader-elect=false --profiling=false
healthz() { [[ "$(curl -sf --max-time 2 -k "https://127.0.0.1:$1/healthz")" == ok ]]; }
await kube-controller-manager 60 "healthy (/healthz)" healthz "$CM_PORT"
await kube-scheduler 60 "healthy (/healthz)" healthz "$SCHEDULER_PORT"

# containerd 1.7 puts its shims' sockets in /run/containerd/s whatever its state dir:
# cluster-down removes what is left there only if /run/containerd was not there before.
[[ -e /run/containerd ]] || touch "$CLUSTER_DIR/created-run-containerd"
say "starting containerd ($("$CONTAINERD_BIN/containerd" --version | awk '{print $3}'))"
# containerd finds its shim (1.7's, not the system's) on PATH.
launch containerd runtime env PATH="$CONTAINERD_BIN:$PATH" "$CONTAINERD_BIN/containerd" --config "$CONTAINERD_DIR/config.toml"
containerd_up() { ctr_ version; }
await containerd 30 "answering on $CONTAINERD_SOCK" containerd_up
if grep -q 'failed to load plugin io.containerd.grpc.v1.cri' "$LOGS/containerd.log"; then
  component_fail containerd "its CRI plugin did not load"
fi

# The local image (sandbox image, and busybox for pods): /bin/busybox and its applets.
build_local_image() {
  local work="$CLUSTER_DIR/images/build" rootfs layer diff_id a
  rm -rf "$work"
  rootfs="$work/rootfs"
  mkdir -p "$rootfs/bin" "$rootfs/etc" "$rootfs/tmp" "$rootfs/proc" "$rootfs/sys" "$rootfs/dev"
  cp /bin/busybox "$rootfs/bin/busybox"
  for a in $(/bin/busybox --list); do
    [[ "$a" == busybox ]] || ln -sf busybox "$rootfs/bin/$a"
  done
  echo 'root:x:0:0:root:/:/bin/sh' >"$rootfs/etc/passwd"
  echo 'root:x:0:' >"$rootfs/etc/group"
  layer="$work/layer.tar"
  tar --numeric-owner --owner=0 --group=0 -C "$rootfs" -cf "$layer" .
  diff_id="sha256:$(sha256sum "$layer" | cut -d' ' -f1)"
  cat >"$work/config.json" <<EOF
{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/bin/sleep","2147483647"],"Env":["PATH=/bin"],"WorkingDir":"/"},"rootfs":{"type":"layers","diff_ids":["$diff_id"]},"history":[{"created_by":"warmstart cluster-up: busybox-static"}]}
EOF
  echo "[{\"Config\":\"config.json\",\"RepoTags\":[\"$LOCAL_IMAGE\"],\"Layers\":[\"layer.tar\"]}]" >"$work/manifest.json"
  tar -C "$work" -cf "$CLUSTER_DIR/images/busybox.tar" manifest.json config.json layer.tar
  rm -rf "$work"
}
build_local_image
ctr_ images import "$CLUSTER_DIR/images/busybox.tar" >"$LOGS/image-import.log" 2>&1 \
  || component_fail image-import "ctr images import of $LOCAL_IMAGE failed"

# The kubelet links container logs in /var/log/containers, creating it if needed.
[[ -e /var/log/containers ]] || touch "$CLUSTER_DIR/created-var-log-containers"
say "starting kubelet (node $NODE_NAME, $NODE_IP)"
launch kubelet "" "$BIN/kubelet" \
  --config="$CLUSTER_DIR/kubelet-config.yaml" \
  --kubeconfig="$CLUSTER_DIR/kubelet.kubeconfig" \
  --root-dir="$KUBELET_ROOT" \
  --cert-dir="$PKI/kubelet-generated" \
  --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" \
  --node-labels=nvidia.com/gpu.present=true \
  --v=1
kubelet_healthy() { [[ "$(curl -sf --max-time 2 "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz")" == ok ]]; }
await kubelet 60 "healthy (/healthz)" kubelet_healthy
await kubelet 120 "Ready (node $NODE_NAME)" node_ready

# The GPU: the node advertises it (the documented way of advertising an extended resource);
# the device itself stays the stand-in's.
"${KUBECTL[@]}" patch node "$NODE_NAME" --subresource=status --type=merge \
  -p "{\"status\":{\"capacity\":{\"nvidia.com/gpu\":\"$GPU_COUNT\"},\"allocatable\":{\"nvidia.com/gpu\":\"$GPU_COUNT\"}}}" >/dev/null \
  || fail "cannot patch node $NODE_NAME's capacity with nvidia.com/gpu"
gpu_allocatable() {
  [[ "$("${KUBECTL[@]}" get node "$NODE_NAME" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" == "$GPU_COUNT" ]]
}
await kubelet 30 "advertising nvidia.com/gpu: $GPU_COUNT" gpu_allocatable

# ---------------------------------------------------------------- node 2

if [[ "$NODES" == 2 ]]; then
  # Its mount namespace: a copy of this one (private: nothing node 1 mounts later shows there,
  # nothing node 2 mounts shows here), where what node 1 has mounted at the shared paths is
  # dropped and node 2's directories are bind-mounted there instead, shared within node 2 (for
  # HostToContainer and Bidirectional), as is the cluster dir (containerd accepts a
  # HostToContainer volume only on a shared or slave mount). The holder keeps it while node 2
  # runs; cluster-down kills it with node 2's containerd (its cgroup).
  say "starting node $NODE2_NAME ($NODE2_IP): its mount namespace"
  binds=()
  for bind in "${NODE2_BINDS[@]}"; do binds+=("${bind%:*}" "$NODE2_DIR/${bind##*:}"); done
  # shellcheck disable=SC2016
  launch node-2-mounts "$NODE2_CGROUP/runtime" unshare --mount --propagation private -- bash -c '
    set -eu
    dir=$1 cluster=$2
    shift 2
    while (($#)); do
      target=$1 src=$2
      shift 2
      awk -v d="$target" "{ if (\$5 == d || index(\$5, d \"/\") == 1) print length(\$5) \" \" \$5 }" /proc/self/mountinfo \
        | sort -rn | cut -d" " -f2- | while read -r m; do umount -l "$m"; done
      mount --bind "$src" "$target"
      mount --make-rshared "$target"
    done
    mount --make-rshared "$cluster"
    touch "$dir/.mounts-ready"
    while :; do sleep 3600; done
  ' "$NODE2_DIR" "$NODE2_DIR" "$CLUSTER_DIR" "${binds[@]}"
  mounts_ready() { [[ -e "$NODE2_DIR/.mounts-ready" ]]; }
  await node-2-mounts 10 "its binds mounted" mounts_ready
  NODE2_NS="/proc/$(cat "$PIDS/node-2-mounts.pid")/ns/mnt"

  say "starting node $NODE2_NAME's containerd"
  launch containerd-2 "$NODE2_CGROUP/runtime" nsenter --mount="$NODE2_NS" -- \
    env PATH="$CONTAINERD_BIN:$PATH" "$CONTAINERD_BIN/containerd" --config "$NODE2_DIR/containerd/config.toml"
  containerd2_up() { ctr_at "$NODE2_CONTAINERD_SOCK" version; }
  await containerd-2 30 "answering on $NODE2_CONTAINERD_SOCK" containerd2_up
  if grep -q 'failed to load plugin io.containerd.grpc.v1.cri' "$LOGS/containerd-2.log"; then
    component_fail containerd-2 "its CRI plugin did not load"
  fi
  ctr_at "$NODE2_CONTAINERD_SOCK" images import "$CLUSTER_DIR/images/busybox.tar" >"$LOGS/image-import-2.log" 2>&1 \
    || component_fail image-import-2 "ctr images import of $LOCAL_IMAGE into node 2 failed"

  say "starting kubelet (node $NODE2_NAME, $NODE2_IP)"
  launch kubelet-2 "" nsenter --mount="$NODE2_NS" -- "$BIN/kubelet" \
    --config="$NODE2_DIR/kubelet-config.yaml" \
    --kubeconfig="$CLUSTER_DIR/kubelet-2.kubeconfig" \
    --root-dir="$KUBELET_ROOT" \
    --cert-dir="$PKI/kubelet-2-generated" \
    --hostname-override="$NODE2_NAME" --node-ip="$NODE2_IP" \
    --node-labels=nvidia.com/gpu.present=true \
    --v=1
  kubelet2_healthy() { [[ "$(curl -sf --max-time 2 "http://127.0.0.1:$NODE2_KUBELET_HEALTHZ_PORT/healthz")" == ok ]]; }
  await kubelet-2 60 "healthy (/healthz)" kubelet2_healthy
  node2_ready() { node_ready "$NODE2_NAME"; }
  await kubelet-2 120 "Ready (node $NODE2_NAME)" node2_ready
  "${KUBECTL[@]}" patch node "$NODE2_NAME" --subresource=status --type=merge \
    -p "{\"status\":{\"capacity\":{\"nvidia.com/gpu\":\"$GPU_COUNT\"},\"allocatable\":{\"nvidia.com/gpu\":\"$GPU_COUNT\"}}}" >/dev/null \
    || fail "cannot patch node $NODE2_NAME's capacity with nvidia.com/gpu"
  gpu2_allocatable() {
    [[ "$("${KUBECTL[@]}" get node "$NODE2_NAME" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" == "$GPU_COUNT" ]]
  }
  await kubelet-2 30 "advertising nvidia.com/gpu: $GPU_COUNT" gpu2_allocatable
fi
# With the tests' device plugin, the kubelet allocates those GPUs and reports them over its
# PodResources API, as on a GPU node (the real-cluster tests start it when it does not run).
if [[ -n "${WARMSTART_DEVICE_PLUGIN:-}" ]]; then
  bash "$HERE/cluster-device-plugin.sh" "$WARMSTART_DEVICE_PLUGIN" \
    || fail "cannot start the tests' device plugin (see above)"
fi
# Pods wait for their namespace's ServiceAccount (made by the controller-manager).
default_sa() { "${KUBECTL[@]}" -n default get serviceaccount default; }
await kube-controller-manager 60 "done creating ServiceAccount default/default" default_sa

print_summary "$((SECONDS - up_start))"
