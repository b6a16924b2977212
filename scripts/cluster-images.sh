#!/usr/bin/env bash
# Assembles warmstart's images without a registry or a container engine, from the binaries built
# here, and (with --load) loads them into the local cluster's containerd (scripts/cluster-load.sh):
#
#   docker.io/warmstart/controller:dev     deploy/images/controller.Containerfile's layout
#   docker.io/warmstart/agent:dev          deploy/images/agent.Containerfile's layout
#   docker.io/warmstart/sample-worker:dev  the e2e sample worker in a busybox image
#
# Each image is one layer written with tar, in the `docker save` format (manifest.json,
# config.json, layer.tar) that `ctr images import` reads. The agent image holds what its
# Containerfile puts there: the agent, the static warmstart-entrypoint, CRIU's private prefix
# (`make setup` installs it in /opt/warmstart/criu) run through deploy/images/criu-wrapper.sh,
# iptables (CRIU's network lock) and GNU tar and gzip (CRIU's tmpfs dumps), plus busybox for the
# init container's sh/cp/mv. Dynamically linked programs get their libraries (ldd) copied in at
# the same paths as on this machine, so the image runs what was built and tested here.
#
# Usage: scripts/cluster-images.sh [--load] [OUT_DIR]
#   OUT_DIR defaults to $CARGO_TARGET_DIR/cluster-images (target/cluster-images).
#   WARMSTART_IMAGE_PROFILE=debug|release picks the agent's and controller's build (debug).
#   WARMSTART_IMAGE_TAG sets the tag (dev).
# Needs: cargo build -p warmstart-agent -p warmstart-controller, and make static.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
PROG=cluster-images
# shellcheck source=cluster-lib.sh
source "$HERE/cluster-lib.sh"

load=""
if [[ "${1:-}" == --load ]]; then
  load=1
  shift
fi
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
OUT="${1:-$TARGET/cluster-images}"
PROFILE="${WARMSTART_IMAGE_PROFILE:-debug}"
TAG="${WARMSTART_IMAGE_TAG:-dev}"
CRIU_PREFIX="${WARMSTART_CRIU_PREFIX:-/opt/warmstart/criu}"
BUSYBOX=/bin/busybox

AGENT_BIN="$TARGET/$PROFILE/warmstart-agent"
CONTROLLER_BIN="$TARGET/$PROFILE/warmstart-controller"
ENTRYPOINT_BIN="$TARGET/static/warmstart-entrypoint"
WORKER_BIN="$TARGET/static/warmstart-sample-worker"

for f in "$AGENT_BIN" "$CONTROLLER_BIN"; do
  [[ -x "$f" ]] || fail "$f missing: cargo build${PROFILE/debug/} -p warmstart-agent -p warmstart-controller"
done
for f in "$ENTRYPOINT_BIN" "$WORKER_BIN"; do
  [[ -x "$f" ]] || fail "$f missing: make static"
  grep -qE 'static(-pie)? linked' < <(file -b "$f") || fail "$f is not statically linked: make static"
done
[[ -x "$CRIU_PREFIX/usr/sbin/criu" ]] || fail "CRIU prefix $CRIU_PREFIX missing: sudo make setup"
[[ -x "$BUSYBOX" ]] || fail "$BUSYBOX missing (Debian's busybox-static): sudo make setup"
for tool in tar gzip sha256sum ldd file xtables-nft-multi; do
  command -v "$tool" >/dev/null || fail "$tool not found"
done

mkdir -p "$OUT"
WORK="$(mktemp -d "$OUT/.build-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# busybox_root DIR: a busybox root filesystem (the e2e fixture's layout, e2e/src/fixture/image.rs).
busybox_root() {
  local r=$1 a
  mkdir -p "$r"/{bin,sbin,usr/bin,usr/sbin,usr/local/bin,etc,proc,sys,dev,var,root,tmp}
  chmod 1777 "$r/tmp"
  chmod 0700 "$r/root"
  cp "$BUSYBOX" "$r/bin/busybox"
  for a in $("$BUSYBOX" --list); do
    [[ "$a" == busybox ]] || ln -sf busybox "$r/bin/$a"
  done
  printf '%s\n' 'root:x:0:0:root:/root:/bin/sh' 'nobody:x:65534:65534:nobody:/nonexistent:/bin/false' >"$r/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nogroup:x:65534:' >"$r/etc/group"
}

# copy_in ROOT FILE [DEST]: FILE (symlinks resolved) at DEST (default: FILE's own path) in ROOT,
# with every library ldd names for it at the same path as here.
copy_in() {
  local r=$1 src=$2 dest=${3:-$2} lib
  install -D -m "$(stat -Lc %a "$src")" "$(readlink -f "$src")" "$r$dest"
  while read -r lib; do
    [[ -e "$r$lib" ]] || install -D -m 0755 "$(readlink -f "$lib")" "$r$lib"
  done < <(ldd "$src" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
}

# pack NAME ROOT CONFIG_JSON: OUT/NAME.tar, the image docker.io/warmstart/NAME:TAG of ROOT.
pack() {
  local name=$1 r=$2 config=$3 dir="$WORK/$1-image" diff_id ref="docker.io/warmstart/$1:$TAG"
  mkdir -p "$dir"
  tar --numeric-owner --owner=0 --group=0 --sort=name --mtime=@0 -C "$r" -cf "$dir/layer.tar" .
  diff_id="sha256:$(sha256sum "$dir/layer.tar" | cut -d' ' -f1)"
  cat >"$dir/config.json" <<EOF
{"architecture":"amd64","os":"linux","config":$config,"rootfs":{"type":"layers","diff_ids":["$diff_id"]},"history":[{"created_by":"warmstart scripts/cluster-images.sh"}]}
EOF
  echo "[{\"Config\":\"config.json\",\"RepoTags\":[\"$ref\"],\"Layers\":[\"layer.tar\"]}]" >"$dir/manifest.json"
  tar -C "$dir" -cf "$OUT/.$name.tar.tmp" manifest.json config.json layer.tar
  mv -f "$OUT/.$name.tar.tmp" "$OUT/$name.tar"
  say "$ref -> $OUT/$name.tar ($(du -h "$OUT/$name.tar" | cut -f1))"
}

PATH_ENV='"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"'

# The controller: its binary and libraries, user 65532 (distroless' nonroot), no shell.
r="$WORK/controller"
mkdir -p "$r"/{etc,tmp,proc,sys,dev}
chmod 1777 "$r/tmp"
printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' 'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$r/etc/passwd"
printf '%s\n' 'root:x:0:' 'nonroot:x:65532:' >"$r/etc/group"
copy_in "$r" "$CONTROLLER_BIN" /usr/local/bin/warmstart-controller
pack controller "$r" "{\"User\":\"65532:65532\",\"Entrypoint\":[\"/usr/local/bin/warmstart-controller\"],\"Cmd\":[\"run\"],\"Env\":[$PATH_ENV]}"

# The agent.
r="$WORK/agent"
busybox_root "$r"
copy_in "$r" "$AGENT_BIN" /usr/local/bin/warmstart-agent
install -D -m 0755 "$ENTRYPOINT_BIN" "$r/usr/local/bin/warmstart-entrypoint"
mkdir -p "$r/opt/warmstart"
cp -a "$CRIU_PREFIX" "$r/opt/warmstart/criu"
install -D -m 0755 "$ROOT/deploy/images/criu-wrapper.sh" "$r/usr/local/bin/criu"
# GNU tar and gzip (CRIU passes options busybox's tar lacks), iptables-nft as Debian lays it out.
copy_in "$r" "$(command -v tar)" /usr/bin/tar
copy_in "$r" "$(command -v gzip)" /usr/bin/gzip
xt="$(readlink -f "$(command -v xtables-nft-multi)")"
copy_in "$r" "$xt" /usr/sbin/xtables-nft-multi
for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
  ln -sf xtables-nft-multi "$r/usr/sbin/$t"
done
xtlib=/usr/lib/x86_64-linux-gnu/xtables
if [[ -d "$xtlib" ]]; then
  mkdir -p "$r$xtlib"
  cp -a "$xtlib/." "$r$xtlib/"
fi
# The wrapper, loader and libraries work together, as the Containerfile's smoke check runs.
chroot "$r" /usr/local/bin/criu --version >/dev/null || fail "criu --version fails inside the agent image"
chroot "$r" /usr/local/bin/warmstart-entrypoint --version >/dev/null || fail "warmstart-entrypoint --version fails inside the agent image"
chroot "$r" /usr/local/bin/warmstart-agent --version >/dev/null || fail "warmstart-agent --version fails inside the agent image"
chroot "$r" /usr/sbin/iptables-restore --version >/dev/null || fail "iptables-restore --version fails inside the agent image"
pack agent "$r" "{\"Entrypoint\":[\"/usr/local/bin/warmstart-agent\"],\"Cmd\":[\"run\"],\"Env\":[$PATH_ENV]}"

# The sample worker (binaries::WORKER_IN_IMAGE).
r="$WORK/sample-worker"
busybox_root "$r"
install -D -m 0755 "$WORKER_BIN" "$r/usr/local/bin/warmstart-sample-worker"
pack sample-worker "$r" "{\"Entrypoint\":[\"/usr/local/bin/warmstart-sample-worker\"],\"Env\":[$PATH_ENV]}"

if [[ -n "$load" ]]; then
  bash "$HERE/cluster-load.sh" "$OUT/controller.tar" "$OUT/agent.tar" "$OUT/sample-worker.tar"
fi
