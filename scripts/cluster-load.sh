#!/usr/bin/env bash
# Loads an image tarball (OCI layout or `docker save` format) into the containerd of each of the
# local cluster's nodes (root), where pods find it under the names it carries (docker.io/library/... for
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
nodes=("containerd $CONTAINERD_SOCK")
if pid_of containerd-2 >/dev/null; then
  ctr_at "$NODE2_CONTAINERD_SOCK" version >/dev/null 2>&1 \
    || fail "node 2's containerd does not answer ($NODE2_CONTAINERD_SOCK): restart the cluster (sudo make cluster-down cluster-up)"
  nodes+=("containerd-2 $NODE2_CONTAINERD_SOCK")
fi
for image in "$@"; do
  [[ -f "$image" ]] || fail "$image: no such file"
  for node in "${nodes[@]}"; do
    read -r c sock <<<"$node"
    out="$(ctr_at "$sock" images import "$image" 2>&1)" || fail "ctr images import $image into $c failed: $out"
    # ctr prints "unpacking NAME (sha256:...)...done" per image.
    names="$(awk '/^unpacking / {print $2}' <<<"$out")"
    [[ -n "$names" ]] || fail "$image: imported, but it names no image (an archive without a tag: tag it before saving)"
  done
  say "loaded $image into ${#nodes[@]} node(s): ${names//$'\n'/ }"
done
