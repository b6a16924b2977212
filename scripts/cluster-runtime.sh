#!/usr/bin/env bash
# Installs the local cluster's container runtime into a private prefix
# (${WARMSTART_CLUSTER_RUNTIME:-/opt/warmstart/containerd}): containerd 1.7 (containerd,
# containerd-shim-runc-v2, ctr) and the CNI plugins (bridge, host-local, loopback, ...) from
# Debian trixie, unpacked from their packages as CRIU is (scripts/setup.sh). The system's
# containerd (Debian 12's 1.6, which the e2e tests' containerd fixture is written for) is left
# as it is: Kubernetes 1.35 wants containerd 1.7 or 2.x, and only the cluster uses this one.
# runc stays the system's. Needs the trixie source that `make setup` configures (pinned at
# priority 50, so nothing else is taken from it).
# Idempotent: a complete prefix with the wanted versions is left alone. Prints the prefix.
set -euo pipefail

PREFIX="${WARMSTART_CLUSTER_RUNTIME:-/opt/warmstart/containerd}"
SUITE=trixie
CONTAINERD_SERIES="1.7."
PKGS=(containerd containernetworking-plugins)
NEEDED=(usr/bin/containerd usr/bin/containerd-shim-runc-v2 usr/bin/ctr
  usr/lib/cni/bridge usr/lib/cni/host-local usr/lib/cni/loopback)

say() { echo "cluster-runtime: $*" >&2; }
fail() {
  echo "cluster-runtime: error: $*" >&2
  exit 1
}

complete() {
  local f
  for f in "${NEEDED[@]}"; do [[ -x "$PREFIX/$f" ]] || return 1; done
  [[ -f "$PREFIX/.warmstart-packages" ]] || return 1
  grep -q "^containerd $CONTAINERD_SERIES" "$PREFIX/.warmstart-packages"
}

if complete; then
  echo "$PREFIX"
  exit 0
fi

[[ "$(id -u)" -eq 0 ]] || fail "must run as root to install containerd 1.7 into $PREFIX; try: sudo make cluster-up"
command -v apt-get >/dev/null || fail "apt-get not found: the cluster's containerd comes from Debian trixie's package"

# apt_version PKG: the version apt offers.
apt_version() { apt-cache show "$1/$SUITE" 2>/dev/null | awk '/^Version:/ && !v {v=$2} END {print v}' || true; }
ver="$(apt_version containerd)"
if [[ -z "$ver" ]]; then
  say "Debian $SUITE not known to apt yet; running apt-get update"
  apt-get update -q >/dev/null 2>&1 || fail "apt-get update failed"
  ver="$(apt_version containerd)"
fi
[[ -n "$ver" ]] || fail "containerd/$SUITE not available from apt: run 'sudo make setup' first (it adds Debian $SUITE, pinned so nothing else is taken from it)"
[[ "$ver" == "$CONTAINERD_SERIES"* ]] \
  || fail "Debian $SUITE now offers containerd $ver, not $CONTAINERD_SERIES*: Kubernetes 1.35 with cgroup v1 needs containerd 1.7; update scripts/cluster-runtime.sh after checking"

work="$(mktemp -d /tmp/warmstart-cluster-runtime.XXXXXX)"
trap 'rm -rf "$work" "$PREFIX.new"' EXIT
mkdir "$work/debs"
# apt downloads as user _apt: let it write there.
if id -u _apt >/dev/null 2>&1; then chown _apt "$work/debs"; chmod 0755 "$work"; fi
args=()
for p in "${PKGS[@]}"; do args+=("$p/$SUITE"); done
(cd "$work/debs" && apt-get download -q "${args[@]}" >"$work/apt.log" 2>&1) \
  || fail "apt-get download ${args[*]} failed: $(tail -n 5 "$work/apt.log")"

rm -rf "$PREFIX.new"
mkdir -p "$PREFIX.new"
manifest=""
for p in "${PKGS[@]}"; do
  deb="$(find "$work/debs" -maxdepth 1 -name "${p}_*.deb" | head -n1)"
  [[ -n "$deb" ]] || fail "package $p was not downloaded from $SUITE"
  dpkg-deb -x "$deb" "$PREFIX.new" || fail "dpkg-deb -x failed for $deb"
  manifest+="$p $(dpkg-deb -f "$deb" Version)"$'\n'
done
printf '%s' "$manifest" >"$PREFIX.new/.warmstart-packages"
for f in "${NEEDED[@]}"; do
  [[ -x "$PREFIX.new/$f" ]] || fail "$f missing from the unpacked packages"
done
# The binaries need glibc >= 2.34 (the packages' dependency); Debian 12 has 2.36.
"$PREFIX.new/usr/bin/containerd" --version >/dev/null 2>&1 \
  || fail "the unpacked containerd does not run here: $("$PREFIX.new/usr/bin/containerd" --version 2>&1 | head -n 3)"

rm -rf "$PREFIX.old"
[[ -e "$PREFIX" ]] && mv "$PREFIX" "$PREFIX.old"
mv "$PREFIX.new" "$PREFIX"
rm -rf "$PREFIX.old"
say "installed $(tr '\n' ' ' <"$PREFIX/.warmstart-packages")from Debian $SUITE into $PREFIX"
echo "$PREFIX"
