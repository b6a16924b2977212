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
# the checkpointed workload. With runc and CRIU present it then runs the whole node path: the
# workload in a runc container (a root filesystem made of the workload, the driver library and
# their shared libraries; the host's /dev/nvidia* devices), `warmstart-agent checkpoint --stop`,
# a placeholder container, `warmstart-agent restore` into it, and the restored workload verifies
# its device memory and fresh CUDA calls. Prints the phase timings and the checkpoint's
# device→host throughput next to the plain copy's. Exits non-zero on any mismatch.
# With CRIU it then dumps the checkpointed workload (killing it), restores it with CRIU, restores
# and unlocks its GPU state and verifies every byte again: the restore path without containers.
# The CRIU restore leaves the workload stopped and its GPU state comes back with only the
# driver's restore thread woken (as the agent restores a tree), before it resumes.
# It prints the host's driver version and persistence mode, the GPUs and MIG instances as
# nvidia-smi and the agent name them, and the result codes the driver gives for a process that
# never initialised CUDA, for a caller that is not root, and for a lock that times out while a
# kernel spins on the GPU (the workload keeps GPU work in flight on SIGUSR2). The last
# line is `GPU CHECK: PASS` or `GPU CHECK: FAIL: <reason>`. With two GPUs or more and driver
# 13.0+ it also restores a workload checkpointed on the first GPU onto the second (remapping).
# Budget: < 8 minutes.
# `make gpu-bundle` packs it with the binaries and CRIU for a host with only the driver.
#
#   GPU_CHECK_CUDA_LIBRARY=/path/libcuda.so.1   the driver library (default: the loader's)
#   GPU_CHECK_CONTAINER=0                       skip the container round trip
set -euo pipefail

MIB=${GPU_CHECK_MIB:-4096}
LIBRARY=${GPU_CHECK_CUDA_LIBRARY:-libcuda.so.1}
export WARMSTART_CUDA_LIBRARY=$LIBRARY
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
RUNC_ROOT=$WORK/runc
CONTAINERS=()
cleanup() {
	[ -n "$WPID" ] && kill -9 "$WPID" 2>/dev/null || true
	for c in "${CONTAINERS[@]}"; do runc --root "$RUNC_ROOT" delete -f "$c" >/dev/null 2>&1 || true; done
	rm -rf "$WORK"
}
# Whatever ends the check, its last line says how.
finish() {
	local rc=$?
	cleanup
	[ "$rc" = 0 ] || [ -n "$FAILED" ] || echo "GPU CHECK: FAIL: stopped with status $rc (see above)"
}
trap finish EXIT
now_ms() { date +%s%3N; }
FAILED=
fail() { FAILED=1; echo "GPU CHECK: FAIL: $*"; exit 1; }
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
probe() { # runs a command expected to be refused; prints its exit status and every line it said
	local out rc=0
	out=$("$@" 2>&1) || rc=$?
	echo "    exit status $rc: ${out:-(nothing printed)}" | sed '2,$s/^/    /'
}

echo "== host"
echo "  kernel $(uname -r), $(ldd --version 2>&1 | head -n1)"
if [ -r /proc/driver/nvidia/version ]; then
	echo "  driver: $(head -n1 /proc/driver/nvidia/version)"
else
	echo "  driver: no /proc/driver/nvidia/version (no NVIDIA kernel module)"
fi
if command -v nvidia-smi >/dev/null; then
	nvidia-smi --query-gpu=index,name,uuid,persistence_mode,memory.total --format=csv,noheader |
		sed 's/^/  GPU /; s/$/ (index, name, uuid, persistence mode, memory)/'
else
	echo "  persistence mode: unknown (no nvidia-smi)"
fi
[ -r "${GPU_CHECK_BIN_DIR:-/nonexistent}/../MANIFEST" ] && sed -n '1,2s/^/  bundle: /p' "$GPU_CHECK_BIN_DIR/../MANIFEST"

echo "== GPUs and driver"
"$AGENT" cuda inventory || fail "the agent cannot list the GPUs"
"$AGENT" cuda inventory --json >"$WORK/inventory.json"
# MIG instances are named MIG-<uuid> by nvidia-smi and NVIDIA_VISIBLE_DEVICES; the agent reads
# them through cuDeviceGetUuid_v2 and must write them the same way.
if command -v nvidia-smi >/dev/null; then
	nvidia-smi -L | sed 's/^/  nvidia-smi: /'
	for mig in $(nvidia-smi -L | sed -n 's/.*UUID: \(MIG-[0-9a-fA-F-]*\)).*/\1/p'); do
		if grep -qi "\"$mig\"" "$WORK/inventory.json"; then
			echo "  MIG $mig: listed by the agent under the same UUID"
		else
			echo "  MIG $mig: NOT listed by the agent (it lists: $("$AGENT" cuda inventory | awk '$1 == "gpu" { printf "%s ", $3 }'))"
		fi
	done
fi

echo "== workload: $MIB MiB of device memory"
: >"$WORK/report"
setsid "$WORKLOAD" --library "$LIBRARY" --mib "$MIB" --piece-mib 1024 --report "$WORK/report" </dev/null >"$WORK/workload.out" 2>&1 &
WPID=$!
READY=$(line 1)
echo "  $READY"
case $READY in READY*) ;; *) fail "workload did not start: $READY" ;; esac
BYTES=$(field "$READY" bytes)
verify "start"

echo "== CUDA state of the workload"
"$AGENT" cuda state --pid "$WPID"
"$AGENT" cuda state --pid "$WPID" --json | grep -q '"running"' || fail "workload not seen as a running CUDA process"

echo "== what the driver answers"
: >"$WORK/idle-report"
setsid "$WORKLOAD" --library "$LIBRARY" --no-context --mib 1 --piece-mib 1 --report "$WORK/idle-report" </dev/null >"$WORK/idle.out" 2>&1 &
IDLE=$!
for _ in $(seq 1 100); do [ -s "$WORK/idle-report" ] && break; sleep 0.1; done
echo "  a process that maps libcuda but never initialised CUDA:"
probe "$AGENT" cuda state --pid "$IDLE"
kill -9 "$IDLE" 2>/dev/null || true
if command -v setpriv >/dev/null; then
	echo "  a caller that is not root (uid 65534), asking about the workload:"
	probe setpriv --reuid=65534 --regid=65534 --clear-groups -- "$AGENT" cuda state --pid "$WPID"
	echo "  a caller that is not root (uid 65534), locking the workload (the driver's own answer):"
	if setpriv --reuid=65534 --regid=65534 --clear-groups -- "$AGENT" cuda checkpoint --pid "$WPID" --lock-timeout 1 >"$WORK/nonroot.out" 2>&1; then
		echo "    exit status 0: the driver let a non-root caller lock and checkpoint a root process: $(cat "$WORK/nonroot.out")"
		"$AGENT" cuda release --pid "$WPID" | sed 's/^/    /' || fail "cannot give the workload back after the non-root checkpoint"
	else
		echo "    exit status $?: $(cat "$WORK/nonroot.out")"
	fi
fi
"$AGENT" cuda state --pid "$WPID" --json | grep -q '"running"' || fail "the workload is not running after the refused calls"

echo "== a lock while GPU work is in flight (a kernel spinning 5 s; lock timeout 1 s)"
n=$(($(wc -l <"$WORK/report") + 1))
kill -USR2 "$WPID"
got=$(line "$n")
echo "  $got"
case $got in "SPIN launched"*) ;; *) fail "the spin kernel did not start: $got" ;; esac
L0=$(now_ms)
if "$AGENT" cuda checkpoint --pid "$WPID" --lock-timeout 1 >"$WORK/locktimeout.out" 2>&1; then
	echo "  NOTE: the lock was granted after $(($(now_ms) - L0)) ms with the kernel in flight: $(cat "$WORK/locktimeout.out")"
	"$AGENT" cuda release --pid "$WPID" | sed 's/^/  /' || fail "cannot give the workload back after the lock"
else
	echo "  refused after $(($(now_ms) - L0)) ms: $(cat "$WORK/locktimeout.out")"
	"$AGENT" cuda state --pid "$WPID" --json | grep -q '"running"' ||
		fail "a lock that timed out did not leave the workload running (documented: RUNNING)"
	echo "  the workload is still running, as documented"
fi
got=$(line $((n + 1)))
echo "  $got"
case $got in "SPIN done"*) ;; *) fail "the spin kernel did not finish: $got" ;; esac

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
	printf "  host->device: restore %.2f GB/s\n", b / (rs > 0 ? rs : 1) / 1e6
}'

CRIU=${GPU_CHECK_CRIU:-criu}
if command -v "$CRIU" >/dev/null; then
	echo "== CRIU: dump the checkpointed workload (killing it), restore it, then its GPU state"
	"$AGENT" cuda checkpoint --pid "$WPID" >/dev/null || fail "second checkpoint"
	mkdir -p "$WORK/img"
	D0=$(now_ms)
	"$CRIU" dump -t "$WPID" -D "$WORK/img" --shell-job -o dump.log -v2 ||
		{ tail -20 "$WORK/img/dump.log" >&2; fail "CRIU could not dump the CUDA-checkpointed workload"; }
	D1=$(now_ms)
	kill -0 "$WPID" 2>/dev/null && fail "the workload still runs after the dump"
	echo "  dumped in $((D1 - D0)) ms, $(du -sh "$WORK/img" | cut -f1) of images; the workload is gone"
	# Left stopped, as the agent restores a tree: the GPU state comes back while only the
	# driver's restore thread runs.
	"$CRIU" restore -D "$WORK/img" --shell-job --restore-detached --leave-stopped -o restore.log -v2 ||
		{ tail -20 "$WORK/img/restore.log" >&2; fail "CRIU could not restore the workload"; }
	D2=$(now_ms)
	kill -0 "$WPID" 2>/dev/null || fail "no restored workload at pid $WPID"
	echo "  CRIU restore in $((D2 - D1)) ms, the workload left stopped"
	state_letter() { sed 's/.*) //' "/proc/$WPID/stat" | cut -d' ' -f1; }
	[ "$(state_letter)" = T ] || fail "the restored workload is not stopped (state $(state_letter))"
	"$AGENT" cuda state --pid "$WPID" --json | grep -q '"checkpointed"' || fail "the stopped workload is not in the checkpointed state"
	REST2=$("$AGENT" cuda restore --pid "$WPID") || fail "CUDA restore of the stopped workload (its restore thread woken alone)"
	echo "  $REST2 (its restore thread woken alone)"
	[ "$(state_letter)" = T ] || fail "the workload ran during its CUDA restore (state $(state_letter))"
	grep -q 'TracerPid:[[:space:]]*0$' "/proc/$WPID/status" || fail "the restore thread is still traced"
	echo "  the workload stayed stopped through its CUDA restore; resuming it"
	kill -CONT "$WPID"
	verify "the CRIU restore"
else
	echo "== (no CRIU here: the CRIU dump and restore of a CUDA process are not exercised)"
fi
kill -9 "$WPID" 2>/dev/null || true
WPID=

UUIDS=$("$AGENT" cuda inventory | awk '$1 == "gpu" { print $3 }')
NGPU=$(printf '%s\n' "$UUIDS" | grep -c . || true)
DRIVER=$("$AGENT" cuda inventory | awk '$1 == "driver" { gsub(/[()]/, "", $3); print $3 }')
if [ "$NGPU" -ge 2 ] && [ "${DRIVER:-0}" -ge 13000 ]; then
	FIRST=$(printf '%s\n' "$UUIDS" | sed -n 1p)
	SECOND=$(printf '%s\n' "$UUIDS" | sed -n 2p)
	echo "== remapped restore: checkpointed on $FIRST, restored onto $SECOND"
	: >"$WORK/report"
	setsid "$WORKLOAD" --library "$LIBRARY" --device 0 --mib "$MIB" --piece-mib 1024 --report "$WORK/report" </dev/null >"$WORK/remap.out" 2>&1 &
	WPID=$!
	READY=$(line 1)
	case $READY in READY*) ;; *) fail "the workload on $FIRST did not start: $READY" ;; esac
	verify "start on $FIRST"
	"$AGENT" cuda checkpoint --pid "$WPID" | sed 's/^/  /' || fail "checkpoint before the remap"
	M0=$(now_ms)
	REMAP=$("$AGENT" cuda restore --pid "$WPID" --gpu-map "$FIRST=$SECOND") || fail "restore onto $SECOND"
	echo "  $REMAP (wall $(($(now_ms) - M0)) ms)"
	verify "the restore onto $SECOND"
	if command -v nvidia-smi >/dev/null; then
		nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader | grep -w "$WPID" | sed 's/^/  nvidia-smi: /' || true
	fi
	kill -9 "$WPID" 2>/dev/null || true
	WPID=
else
	echo "== (remapped restore not exercised: $NGPU GPU(s), driver ${DRIVER:-unknown}; it needs two GPUs and driver 13.0+)"
fi

if [ "${GPU_CHECK_CONTAINER:-1}" = 0 ] || ! command -v runc >/dev/null || ! command -v "$CRIU" >/dev/null; then
	echo "== (no runc or CRIU, or GPU_CHECK_CONTAINER=0: container checkpoint/restore not exercised)"
	echo "GPU CHECK: PASS"
	exit 0
fi

echo "== container round trip: agent checkpoint --stop, restore into a placeholder"
# The driver library the loader would pick, as a path.
LIBPATH=$LIBRARY
case $LIBPATH in /*) ;; *) LIBPATH=$(ldconfig -p | awk -v l="$LIBRARY" '$1 == l { print $NF; exit }') ;; esac
[ -f "$LIBPATH" ] || fail "cannot find $LIBRARY as a file (set GPU_CHECK_CUDA_LIBRARY)"
ROOTFS=$WORK/rootfs
mkdir -p "$ROOTFS"/{proc,sys,dev,tmp,report,warmstart-control,bin}
copy_in() { # a file and the shared libraries ldd lists for it, at the same paths
	local f
	for f in "$1" $(ldd "$1" 2>/dev/null | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\//) print $i }'); do
		[ -f "$f" ] || continue
		mkdir -p "$ROOTFS$(dirname "$f")"
		cp -L "$f" "$ROOTFS$f"
	done
}
copy_in "$WORKLOAD"
copy_in "$LIBPATH"
copy_in "$(command -v sleep)"
# The stand-in driver of the tests keeps its state beside its library (<dir>/lib/libcuda.so.1):
# that directory is shared with the containers at the same path.
STATE_DIR=$(dirname "$(dirname "$LIBPATH")")
[ -e "$STATE_DIR/device.sock" ] || STATE_DIR=
SLEEP=$(command -v sleep)
DEVICES=
ALLOW='{"allow": false, "access": "rwm"}'
for dev in /dev/nvidia*; do
	[ -c "$dev" ] || continue
	DEVICES+="{\"path\": \"$dev\", \"type\": \"c\", \"major\": $((0x$(stat -c %t "$dev"))), \"minor\": $((0x$(stat -c %T "$dev"))), \"fileMode\": 438},"
	ALLOW+=", {\"allow\": true, \"type\": \"c\", \"major\": $((0x$(stat -c %t "$dev"))), \"minor\": $((0x$(stat -c %T "$dev"))), \"access\": \"rwm\"}"
done
# A restore needs a GPU control device in the placeholder; with the stand-in there is none on
# the host, so one is declared (nothing opens it).
case $DEVICES in *'"/dev/nvidiactl"'*) ;; *) DEVICES+='{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 438},' ;; esac
bundle() { # bundle() NAME ARGS-JSON CONTROL-DIR
	local dir=$WORK/bundle-$1 extra=
	mkdir -p "$dir" "$3"
	[ -n "$STATE_DIR" ] && extra=", {\"destination\": \"$STATE_DIR\", \"type\": \"bind\", \"source\": \"$STATE_DIR\", \"options\": [\"rbind\", \"rw\"]}"
	cat >"$dir/config.json" <<JSON
{
  "ociVersion": "1.0.2",
  "process": {"terminal": false, "user": {"uid": 0, "gid": 0}, "args": $2, "cwd": "/",
    "env": ["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=all"],
    "capabilities": {"bounding": ["CAP_KILL"], "effective": ["CAP_KILL"], "permitted": ["CAP_KILL"]},
    "noNewPrivileges": true},
  "root": {"path": "$ROOTFS", "readonly": true},
  "hostname": "gpu-check",
  "mounts": [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
    {"destination": "/report", "type": "bind", "source": "$WORK/creport", "options": ["rbind", "rw"]},
    {"destination": "/warmstart-control", "type": "bind", "source": "$3", "options": ["rbind", "rw"]}$extra
  ],
  "linux": {
    "devices": [${DEVICES%,}],
    "resources": {"devices": [$ALLOW]},
    "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]
  }
}
JSON
	echo "$dir"
}
mkdir -p "$WORK/creport"
: >"$WORK/creport/report"
SRC=gpu-check-src-$$
B=$(bundle src "[\"$WORKLOAD\", \"--library\", \"$LIBPATH\", \"--mib\", \"$MIB\", \"--piece-mib\", \"1024\", \"--report\", \"/report/report\"]" "$WORK/control-src")
CONTAINERS+=("$SRC")
# Standard output and error are pipes, as a container runtime gives them (CRIU dumps a pipe
# whose other end is outside; a file of the host it cannot reach).
runc --root "$RUNC_ROOT" run -d --bundle "$B" "$SRC" </dev/null > >(cat >"$WORK/src.out") 2>&1 ||
	fail "runc run: $(cat "$WORK/src.out")"
SRC_PID=$(runc --root "$RUNC_ROOT" state "$SRC" | awk -F'[:,]' '/"pid"/ { gsub(/ /, "", $2); print $2; exit }')
WPID=$SRC_PID
: >"$WORK/report"
ln -sf "$WORK/creport/report" "$WORK/report"
READY=$(line 1)
WPID=
echo "  in a container: $READY"
case $READY in READY*) ;; *) fail "containerised workload did not start: $READY" ;; esac
C0=$(now_ms)
"$AGENT" --runc-root "$RUNC_ROOT" checkpoint --stop --runc "$SRC" --output "$WORK/artifact" \
	| sed 's/^/  /' || fail "agent checkpoint"
echo "  checkpoint wall $(($(now_ms) - C0)) ms"
PH=gpu-check-ph-$$
B=$(bundle ph "[\"$SLEEP\", \"100000\"]" "$WORK/control-ph")
CONTAINERS+=("$PH")
runc --root "$RUNC_ROOT" run -d --bundle "$B" "$PH" </dev/null > >(cat >"$WORK/ph.out") 2>&1 ||
	fail "runc run placeholder: $(cat "$WORK/ph.out")"
R0=$(now_ms)
"$AGENT" --runc-root "$RUNC_ROOT" restore --into-runc "$PH" --artifact "$WORK/artifact" --log-dir "$WORK/restore-log" \
	| sed 's/^/  /' || fail "agent restore"
echo "  restore wall $(($(now_ms) - R0)) ms"
[ -f "$WORK/control-ph/restore-complete" ] || fail "no restore-complete"
PH_PID=$(runc --root "$RUNC_ROOT" state "$PH" | awk -F'[:,]' '/"pid"/ { gsub(/ /, "", $2); print $2; exit }')
WPID=
for pid in $(cat /proc/"$PH_PID"/task/*/children 2>/dev/null); do
	case $(tr '\0' ' ' </proc/"$pid"/cmdline) in *warmstart-cuda-workload*) WPID=$pid ;; esac
done
[ -n "$WPID" ] || fail "no restored workload below the placeholder"
verify "the restore into the placeholder"
WPID=
echo "GPU CHECK: PASS"
