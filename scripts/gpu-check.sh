#!/usr/bin/env bash
# GPU check for a node with an NVIDIA GPU and driver (r570+), no internet, possibly no CUDA
# toolkit. Uses two binaries built elsewhere and carried here (or built here when cargo is
# present): warmstart-agent and warmstart-cuda-workload (driver API only, from libcuda.so.1).
#
#   scripts/gpu-check.sh            # 4 GiB workload
#   GPU_CHECK_MIB=8192 scripts/gpu-check.sh
#
# It starts the workload (allocates GPU_CHECK_MIB of device memory in pieces, fills a
# position-dependent pattern, keeps its context, times a plain cuMemcpyDtoH of everything),
# checks it, then with the agent: lists the GPUs, finds the workload's CUDA state, locks and
# checkpoints it (device memory moves to host memory), checks the process holds no device
# memory, restores and unlocks it, and has the workload verify every byte and make fresh CUDA
# calls. With CRIU present (GPU_CHECK_CRIU, default `criu` on PATH) it also proves CRIU dumps
# the checkpointed workload. Prints the phase timings and the checkpoint's device→host
# throughput next to the plain copy's. Exits non-zero on any mismatch. Budget: < 8 minutes.
set -euo pipefail

MIB=${GPU_CHECK_MIB:-4096}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PROFILE_DIR=${GPU_CHECK_BIN_DIR:-}
find_bin() {
	local name=$1
	for dir in "$PROFILE_DIR" "$ROOT/target/release" "${CARGO_TARGET_DIR:-/nonexistent}/release" \
		"$ROOT/target/debug" "${CARGO_TARGET_DIR:-/nonexistent}/debug"; do
		[ -n "$dir" ] && [ -x "$dir/$name" ] && { echo "$dir/$name"; return 0; }
	done
	return 1
}
AGENT=$(find_bin warmstart-agent || true)
WORKLOAD=$(find_bin warmstart-cuda-workload || true)
if { [ -z "$AGENT" ] || [ -z "$WORKLOAD" ]; } && command -v cargo >/dev/null; then
	(cd "$ROOT" && cargo build --release --offline -p warmstart-agent -p warmstart-cuda-standin --bin warmstart-cuda-workload)
	AGENT=$(find_bin warmstart-agent)
	WORKLOAD=$(find_bin warmstart-cuda-workload)
fi
[ -n "$AGENT" ] && [ -n "$WORKLOAD" ] || {
	echo "gpu-check: need warmstart-agent and warmstart-cuda-workload (set GPU_CHECK_BIN_DIR)" >&2
	exit 2
}
[ "$(id -u)" = 0 ] || echo "gpu-check: not root: the checkpoint API usually answers 304 (OPERATING_SYSTEM)" >&2

WORK=$(mktemp -d)
WPID=
cleanup() {
	[ -n "$WPID" ] && kill -9 "$WPID" 2>/dev/null || true
	rm -rf "$WORK"
}
trap cleanup EXIT
now_ms() { date +%s%3N; }
fail() { echo "gpu-check: FAIL: $*" >&2; exit 1; }
line() { # wait for line N (1-based) of the report, 120 s at most
	local n=$1 i
	for i in $(seq 1 1200); do
		if [ "$(wc -l <"$WORK/report")" -ge "$n" ]; then sed -n "${n}p" "$WORK/report"; return 0; fi
		kill -0 "$WPID" 2>/dev/null || fail "workload exited: $(cat "$WORK/report")"
		sleep 0.1
	done
	fail "no answer from the workload"
}
verify() { # ask the workload to check its memory; expects OK
	local n
	n=$(($(wc -l <"$WORK/report") + 1))
	kill -USR1 "$WPID"
	local got
	got=$(line "$n")
	echo "  $got"
	case $got in OK*) ;; *) fail "verification after $1: $got" ;; esac
}
field() { echo "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }

echo "== GPUs and driver"
"$AGENT" cuda inventory
"$AGENT" cuda inventory --json >"$WORK/inventory.json"

echo "== workload: $MIB MiB of device memory"
: >"$WORK/report"
setsid "$WORKLOAD" --mib "$MIB" --piece-mib 1024 --report "$WORK/report" </dev/null >"$WORK/workload.out" 2>&1 &
WPID=$!
READY=$(line 1)
echo "  $READY"
case $READY in READY*) ;; *) fail "workload did not start: $READY" ;; esac
BYTES=$(field "$READY" bytes)
verify "start"

echo "== CUDA state of the workload"
"$AGENT" cuda state --pid "$WPID"
"$AGENT" cuda state --pid "$WPID" --json | grep -q '"running"' || fail "workload not seen as a running CUDA process"

echo "== lock + checkpoint"
T0=$(now_ms)
CKPT=$("$AGENT" cuda checkpoint --pid "$WPID")
T1=$(now_ms)
echo "  $CKPT (wall $((T1 - T0)) ms)"
"$AGENT" cuda state --pid "$WPID" --json | grep -q '"checkpointed"' || fail "not checkpointed"
if command -v nvidia-smi >/dev/null; then
	if nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -qw "$WPID"; then
		fail "nvidia-smi still lists the checkpointed workload on a GPU"
	fi
	echo "  nvidia-smi: the workload holds no GPU"
fi

CRIU=${GPU_CHECK_CRIU:-criu}
if command -v "$CRIU" >/dev/null; then
	echo "== CRIU dump of the checkpointed workload (leave running)"
	mkdir -p "$WORK/img"
	D0=$(now_ms)
	if "$CRIU" dump -t "$WPID" -D "$WORK/img" --leave-running --shell-job -o dump.log -v2; then
		echo "  dump ok in $(($(now_ms) - D0)) ms, $(du -sh "$WORK/img" | cut -f1)"
	else
		tail -20 "$WORK/img/dump.log" >&2
		fail "CRIU could not dump the CUDA-checkpointed workload"
	fi
else
	echo "== (no CRIU here: process dump/restore into a placeholder not exercised)"
fi

echo "== restore + unlock"
R0=$(now_ms)
REST=$("$AGENT" cuda restore --pid "$WPID")
R1=$(now_ms)
echo "  $REST (wall $((R1 - R0)) ms)"
"$AGENT" cuda state --pid "$WPID" --json | grep -q '"running"' || fail "not running after restore"
verify "restore"

CK_MS=$(field "$CKPT" checkpoint_ms)
awk -v b="$BYTES" -v ck="$CK_MS" -v plain="$(field "$READY" dtoh_gbps)" -v lock="$(field "$CKPT" lock_ms)" \
	-v rs="$(field "$REST" restore_ms)" -v ul="$(field "$REST" unlock_ms)" 'BEGIN {
	printf "== timings\n  lock %d ms, checkpoint %d ms, restore %d ms, unlock %d ms\n", lock, ck, rs, ul
	printf "  device->host: checkpoint %.2f GB/s, plain cuMemcpyDtoH %.2f GB/s (%d MiB)\n", b / (ck > 0 ? ck : 1) / 1e6, plain, b / 1048576
}'
echo "gpu-check: PASS"
