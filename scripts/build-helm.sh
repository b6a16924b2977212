#!/usr/bin/env bash
# Builds Helm from the Go module in cluster/helm (the version its go.mod pins) and caches it
# outside the clone: ${WARMSTART_CACHE:-/var/cache/warmstart}/helm/<key>/bin/helm, where <key>
# names Helm's version, the Go version and a hash of go.mod and go.sum. A cached build is reused;
# a new one is built in a temporary directory and renamed into place.
#
# Prints the path of the helm binary on stdout (the last line); progress goes to stderr.
# With --cached-only nothing is built: a missing cache entry is an error.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOD="$ROOT/cluster/helm"
CACHE_ROOT="${WARMSTART_CACHE:-/var/cache/warmstart}/helm"
NICE="${WARMSTART_BUILD_NICE:-19}"

say() { echo "build-helm: $*" >&2; }
fail() {
  echo "build-helm: error: $*" >&2
  exit 1
}

if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi
command -v go >/dev/null || fail "go not found on PATH (Go >= 1.26 builds Helm)"
export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0

version="$(cd "$MOD" && go list -m -f '{{.Version}}' helm.sh/helm/v4)" || fail "cannot resolve helm.sh/helm/v4 in $MOD/go.mod"
sum="$(cat "$MOD/go.mod" "$MOD/go.sum" | sha256sum | cut -c1-16)"
dest="$CACHE_ROOT/helm-${version}_$(go env GOVERSION)_$sum"

if [[ -x "$dest/bin/helm" ]]; then
  say "cached: $dest/bin/helm (helm $version)"
  echo "$dest/bin/helm"
  exit 0
fi
[[ "${1:-}" != --cached-only ]] || fail "no cached build at $dest: run \`make helm-build\` first"
mkdir -p "$CACHE_ROOT" || fail "cannot create $CACHE_ROOT (run as root, or set WARMSTART_CACHE)"
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ -x "$dest/bin/helm" ]]; then
  echo "$dest/bin/helm"
  exit 0
fi
tmp="$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
say "building helm $version into $tmp"
start=$SECONDS
(cd "$MOD" && nice -n "$NICE" go build -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$version" \
  -o "$tmp/bin/helm" helm.sh/helm/v4/cmd/helm) || fail "go build failed (see the output above)"
got="$("$tmp/bin/helm" version --short 2>&1)"
[[ "$got" == "$version"* ]] || fail "helm version says '$got', expected $version"
chmod 0755 "$tmp"
mv -T "$tmp" "$dest" || fail "cannot rename $tmp to $dest"
trap - EXIT
say "built helm $version in $((SECONDS - start))s: $dest/bin/helm"
echo "$dest/bin/helm"
