#!/usr/bin/env bash
# Builds the upstream components of the local cluster (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet and etcd) from the Go module in cluster/k8s, and caches them outside
# the clone: ${WARMSTART_CACHE:-/var/cache/warmstart}/k8s/<key>/bin, where <key> names the
# Kubernetes and etcd versions, the Go version and a hash of cluster/k8s (go.mod, go.sum, etcd's
# main). A cached build is reused as is; a new one is built in a temporary directory and renamed
# into place, so an interrupted build never leaves a half-filled cache entry.
#
# Prints the bin directory on stdout (the last line); progress goes to stderr.
# Environment: WARMSTART_CACHE (cache root), WARMSTART_BUILD_JOBS (go build -p, default 2),
# WARMSTART_BUILD_NICE (nice level of the build, default 19).
# With --cached-only nothing is built: a missing cache entry is an error (the tests' control
# plane asks this way, so a test never starts a 30-minute build).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOD="$ROOT/cluster/k8s"
CACHE_ROOT="${WARMSTART_CACHE:-/var/cache/warmstart}/k8s"
JOBS="${WARMSTART_BUILD_JOBS:-2}"
NICE="${WARMSTART_BUILD_NICE:-19}"
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubelet)

say() { echo "build-k8s: $*" >&2; }
fail() {
  echo "build-k8s: error: $*" >&2
  exit 1
}

# A Go installed from go.dev/dl is often not on a root shell's PATH.
if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi
command -v go >/dev/null || fail "go not found on PATH (Go >= 1.25 builds the components; Debian: apt-get install golang-go from trixie, or go.dev/dl)"
[[ -f "$MOD/go.mod" && -f "$MOD/go.sum" ]] || fail "$MOD/go.mod or go.sum missing"

# Never let the go command fetch another toolchain, edit go.mod or go.sum.
export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0

go_version="$(go env GOVERSION)"
# module_version MODULE: the version go.mod selects for MODULE.
module_version() {
  (cd "$MOD" && go list -m -f '{{.Version}}' "$1") || fail "cannot resolve $1 in $MOD/go.mod"
}
k8s_version="$(module_version k8s.io/kubernetes)"
etcd_version="$(module_version go.etcd.io/etcd/server/v3)"
[[ "$k8s_version" =~ ^v([0-9]+)\.([0-9]+)\.[0-9]+$ ]] || fail "unexpected k8s.io/kubernetes version '$k8s_version' (want a release vX.Y.Z)"
k8s_major="${BASH_REMATCH[1]}"
k8s_minor="${BASH_REMATCH[2]}"

sum="$(cd "$MOD" && cat go.mod go.sum cmd/etcd/main.go | sha256sum | cut -c1-16)"
key="k8s-${k8s_version}_etcd-${etcd_version}_${go_version}_${sum}"
dest="$CACHE_ROOT/$key"

cache_complete() {
  local c
  for c in "${COMPONENTS[@]}" etcd; do [[ -x "$1/bin/$c" ]] || return 1; done
  [[ -f "$1/versions" ]]
}

if cache_complete "$dest"; then
  say "cached: $dest (k8s $k8s_version, etcd $etcd_version, $go_version)"
  echo "$dest/bin"
  exit 0
fi

[[ "${1:-}" != --cached-only ]] || fail "no cached build at $dest: run \`make k8s-build\` first"
mkdir -p "$CACHE_ROOT" || fail "cannot create $CACHE_ROOT (run as root, or set WARMSTART_CACHE to a writable directory)"
# One build at a time per cache: a second caller waits, then finds the first one's result.
exec 9>"$CACHE_ROOT/.lock"
if ! flock -n 9; then
  say "another build holds $CACHE_ROOT/.lock; waiting for it"
  flock 9
fi
if cache_complete "$dest"; then
  say "cached: $dest"
  echo "$dest/bin"
  exit 0
fi

tmp="$(mktemp -d "$CACHE_ROOT/.build-$key.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin"

# The release date of the pinned module (from the Go module proxy's metadata) stands for the
# build date, so two builds of one release are byte-identical.
info="$(cd "$MOD" && go mod download -json k8s.io/kubernetes)" || fail "go mod download k8s.io/kubernetes failed"
build_date="$(jq -r '.Info' <<<"$info" | xargs jq -r '.Time')"
[[ "$build_date" =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T ]] || build_date="1970-01-01T00:00:00Z"

ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$k8s_major -X $pkg.gitMinor=$k8s_minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

pkgs=()
for c in "${COMPONENTS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
pkgs+=("./cmd/etcd")

say "building k8s $k8s_version (${COMPONENTS[*]}) and etcd $etcd_version with $go_version into $tmp (go build -p $JOBS, nice $NICE)"
start=$SECONDS
timer=()
[[ -x /usr/bin/time ]] && timer=(/usr/bin/time -v -o "$tmp/time.txt")
if ! (cd "$MOD" && "${timer[@]}" nice -n "$NICE" go build -p "$JOBS" -trimpath -ldflags "$ldflags" -o "$tmp/bin/" "${pkgs[@]}"); then
  fail "go build failed (see the output above)"
fi
elapsed=$((SECONDS - start))
peak=""
[[ -f "$tmp/time.txt" ]] && peak="$(awk -F': ' '/Maximum resident set size/ {printf "%.1f GiB", $2/1048576}' "$tmp/time.txt")"

for c in "${COMPONENTS[@]}"; do
  # The whole output, then its first line: `| head -n1` can end the pipe while the program still
  # writes, and under pipefail its SIGPIPE failed the build now and then.
  got="$("$tmp/bin/$c" --version 2>&1)" || true
  got="${got%%$'\n'*}"
  [[ "$got" == *"$k8s_version"* ]] || fail "$c --version says '$got', expected $k8s_version"
done
got="$("$tmp/bin/etcd" --version 2>&1)" || true
got="${got%%$'\n'*}"
[[ "$got" == *"${etcd_version#v}"* ]] || fail "etcd --version says '$got', expected $etcd_version"

{
  echo "kubernetes $k8s_version"
  echo "etcd $etcd_version"
  echo "go $go_version"
  echo "go.mod+go.sum sha256 $sum"
  echo "build seconds $elapsed"
  [[ -n "$peak" ]] && echo "build peak rss (largest process) $peak"
} >"$tmp/versions"
[[ -f "$tmp/time.txt" ]] && mv "$tmp/time.txt" "$tmp/build-time.txt"
chmod 0755 "$tmp"
mv -T "$tmp" "$dest" || fail "cannot rename $tmp to $dest"
trap - EXIT
say "built in ${elapsed}s${peak:+, peak RSS $peak}: $dest"
echo "$dest/bin"
