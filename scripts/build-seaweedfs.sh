#!/usr/bin/env bash
# Builds SeaweedFS's `weed` (the S3-compatible server the object-store tests start on loopback)
# from the Go module in cluster/seaweedfs (the version its go.mod pins) and caches it outside the
# clone: ${WARMSTART_CACHE:-/var/cache/warmstart}/seaweedfs/<key>/weed, where <key> names the
# module version, the Go version and a hash of go.mod and go.sum. A cached build is reused; a new
# one is built in a temporary directory and renamed into place.
#
# Prints the path of the weed binary on stdout (the last line); progress goes to stderr.
# With --cached-only nothing is built: a missing cache entry is an error.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOD="$ROOT/cluster/seaweedfs"
MODULE=github.com/seaweedfs/seaweedfs
CACHE_ROOT="${WARMSTART_CACHE:-/var/cache/warmstart}/seaweedfs"
NICE="${WARMSTART_BUILD_NICE:-19}"

say() { echo "build-seaweedfs: $*" >&2; }
fail() {
  echo "build-seaweedfs: error: $*" >&2
  exit 1
}

if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi
command -v go >/dev/null || fail "go not found on PATH (Go >= $(sed -n 's/^go //p' "$MOD/go.mod") builds SeaweedFS)"
export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0

version="$(cd "$MOD" && go list -m -f '{{.Version}}' "$MODULE")" ||
  fail "cannot resolve $MODULE in $MOD/go.mod (is the Go toolchain older than the go line there?)"
sum="$(cat "$MOD/go.mod" "$MOD/go.sum" | sha256sum | cut -c1-16)"
dest="$CACHE_ROOT/${version}_$(go env GOVERSION)_$sum"

if [[ -x "$dest/weed" ]]; then
  say "cached: $dest/weed (seaweedfs $version)"
  echo "$dest/weed"
  exit 0
fi
[[ "${1:-}" != --cached-only ]] || fail "no cached build at $dest: run \`make s3-build\` first"
mkdir -p "$CACHE_ROOT" || fail "cannot create $CACHE_ROOT (run as root, or set WARMSTART_CACHE)"
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [[ -x "$dest/weed" ]]; then
  echo "$dest/weed"
  exit 0
fi
tmp="$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
say "building seaweedfs $version into $tmp (a cold build downloads its modules and takes minutes)"
start=$SECONDS
(cd "$MOD" && nice -n "$NICE" go build -trimpath -ldflags "-s -w" -o "$tmp/weed" "$MODULE/weed") ||
  fail "go build of $MODULE/weed $version failed (see the output above)"
got="$("$tmp/weed" version 2>&1)" || fail "the built weed does not run: $got"
[[ "$got" == *version* ]] || fail "weed version says '$got', expected a version line"
chmod 0755 "$tmp"
mv -T "$tmp" "$dest" || fail "cannot rename $tmp to $dest"
trap - EXIT
say "built seaweedfs $version in $((SECONDS - start))s: $dest/weed"
echo "$dest/weed"
