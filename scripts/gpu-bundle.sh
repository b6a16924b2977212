#!/usr/bin/env bash
# Assembles the GPU check bundle: a tarball that runs scripts/gpu-check.sh on a GPU host with
# only the NVIDIA driver installed (root, no network, no toolchain, glibc 2.34 or newer: Ubuntu
# 22.04, RHEL 9, Debian 12 and later). It holds the agent and the CUDA workload (stripped, linked
# against the host's glibc only), CRIU 4.2.1 with its own glibc (the prefix make setup installs)
# behind a wrapper, and the check script:
#
#   tar xzf warmstart-gpu-check.tar.gz && sudo ./warmstart-gpu-check/gpu-check
#
# Usage: gpu-bundle.sh BIN_DIR OUT.tar.gz   (BIN_DIR holds warmstart-agent and
# warmstart-cuda-workload; `make gpu-bundle` builds them in release and calls this).
# Refuses a bundle over 64 MiB.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CRIU_PREFIX="${WARMSTART_CRIU_PREFIX:-/opt/warmstart/criu}"
LIMIT=$((64 * 1024 * 1024))
say() { echo "gpu-bundle: $*" >&2; }
fail() {
  echo "gpu-bundle: error: $*" >&2
  exit 1
}

[[ $# -eq 2 ]] || fail "usage: $0 BIN_DIR OUT.tar.gz"
bin_dir=$1
out=$2
for b in warmstart-agent warmstart-cuda-workload; do
  [[ -x "$bin_dir/$b" ]] || fail "$bin_dir/$b missing (cargo build --release -p warmstart-agent -p warmstart-cuda-standin)"
done
[[ -x "$CRIU_PREFIX/usr/sbin/criu" ]] || fail "no CRIU prefix at $CRIU_PREFIX (make setup installs it)"
[[ -e "$CRIU_PREFIX/usr/lib64/ld-linux-x86-64.so.2" ]] || fail "$CRIU_PREFIX has no loader usr/lib64/ld-linux-x86-64.so.2"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
name=warmstart-gpu-check
dir="$stage/$name"
mkdir -p "$dir/bin"

for b in warmstart-agent warmstart-cuda-workload; do
  # Only the host's glibc is needed: nothing else may be linked.
  extra="$(ldd "$bin_dir/$b" | awk '$1 !~ /^(linux-vdso|libc|libm|libgcc_s|libpthread|libdl|librt|\/lib64\/ld-linux-x86-64)\.so/ && $1 !~ /^\/lib64\/ld-linux/ {print $1}')"
  [[ -z "$extra" ]] || fail "$b needs more than glibc: $extra"
  glibc="$(objdump -T "$bin_dir/$b" | grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -n1)"
  [[ "$glibc" =~ ^GLIBC_2\.(2[0-9]|3[0-4])$ ]] || fail "$b needs $glibc (the bundle promises glibc 2.34)"
  strip -o "$dir/bin/$b" "$bin_dir/$b"
done
cp -a "$CRIU_PREFIX" "$dir/criu"
cat >"$dir/bin/criu" <<'SH'
#!/bin/sh
# CRIU of this bundle, run with its own glibc. exec keeps every file descriptor ('criu swrk').
d=$(cd "$(dirname "$0")/../criu" && pwd)
exec "$d/usr/lib64/ld-linux-x86-64.so.2" --library-path "$d/usr/lib/x86_64-linux-gnu" "$d/usr/sbin/criu" "$@"
SH
cp "$ROOT/scripts/gpu-check.sh" "$dir/gpu-check.sh"
cat >"$dir/gpu-check" <<'SH'
#!/bin/sh
# The GPU check of this bundle (root): see gpu-check.sh for what it does and its settings.
d=$(cd "$(dirname "$0")" && pwd)
export GPU_CHECK_BIN_DIR="$d/bin" GPU_CHECK_CRIU="$d/bin/criu" PATH="$d/bin:$PATH"
exec bash "$d/gpu-check.sh" "$@"
SH
chmod 0755 "$dir/bin/criu" "$dir/gpu-check" "$dir/gpu-check.sh"
{
  echo "warmstart $(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n1)"
  echo "criu $("$dir/bin/criu" --version | awk '/Version:/ {print $2}')"
  (cd "$dir" && find . -type f ! -name MANIFEST -print0 | sort -z | xargs -0 sha256sum)
} >"$dir/MANIFEST"

tmp_out="$out.tmp"
tar -C "$stage" -czf "$tmp_out" "$name"
size=$(stat -c %s "$tmp_out")
if ((size > LIMIT)); then
  rm -f "$tmp_out"
  fail "the bundle is $((size / 1048576)) MiB, over the 64 MiB limit"
fi
mv -f "$tmp_out" "$out"
say "$out: $((size / 1048576)) MiB ($(du -sh "$dir" | cut -f1) unpacked)"
