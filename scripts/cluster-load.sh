#!/usr/bin/env bash
# Loads an image tarball (OCI layout or `docker save` format) into the local cluster's
# containerd (root), where pods find it under the names it carries (docker.io/library/... for
# short names): use them with imagePullPolicy Never or IfNotPresent, since nothing is pulled.
# Usage: scripts/cluster-load.sh IMAGE.tar...
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROG=cluster-load
# shellcheck source=cluster-lib.sh
source "$HERE/cluster-lib.sh"

(($# > 0)) || fail "usage: $0 IMAGE.tar... (make cluster-load IMAGE=IMAGE.tar)"
require_root
if ! pid_of containerd >/dev/null || ! ctr_ version >/dev/null 2>&1; then
  fail "the cluster's containerd is not running ($CONTAINERD_SOCK): start the cluster with 'sudo make cluster-up'"
fi
for image in "$@"; do
  [[ -f "$image" ]] || fail "$image: no such file"
  out="$(ctr_ images import "$image" 2>&1)" || fail "ctr images import $image failed: $out"
  # ctr prints "unpacking NAME (sha256:...)...done" per image.
  names="$(awk '/^unpacking / {print $2}' <<<"$out")"
  [[ -n "$names" ]] || fail "$image: imported, but it names no image (an archive without a tag: tag it before saving)"
  say "loaded $image: ${names//$'\n'/ }"
done
