#!/usr/bin/env bash
# Runs the workspace's tests (`make test`): what `cargo test --workspace --no-fail-fast` runs, the
# test binaries built once, then run several at a time instead of one after another. Most of a
# test binary's time is spent waiting on real processes (API servers, containers, CRIU), so two
# or three binaries side by side fill the machine where one leaves it idle.
#
# Lanes: the local cluster's binary (real_cluster) runs in a lane of its own, followed by the
# binaries that must not overlap it (cri_containerd: both start containerds whose shims share
# /run/containerd/s, and the cluster's teardown removes empty directories there). The others
# share $WARMSTART_TEST_JOBS lanes (default 2), longest first. Tests within a binary run as
# cargo runs them (its threads, its filters).
#
# Each binary runs as cargo would run it: in its package's directory, with CARGO_MANIFEST_DIR.
# Its output goes to $TARGET/test-logs/<binary>.log and is printed whole when it ends; at the
# end, a table of every binary's time and counts, and the closing line `tests: N passed, N
# failed`. Exits non-zero when any binary failed (or ran and was killed).
#
# Arguments after `--` go to every test binary (for example a filter, or --nocapture).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CARGO="${CARGO:-cargo}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
JOBS="${WARMSTART_TEST_JOBS:-2}"
LOGS="$TARGET/test-logs"

say() { echo "run-tests: $*" >&2; }
fail() {
  echo "run-tests: error: $*" >&2
  exit 1
}

[[ "$JOBS" =~ ^[1-9][0-9]?$ ]] || fail "WARMSTART_TEST_JOBS must be a number from 1 to 99, not '$JOBS'"
command -v jq >/dev/null || fail "jq not found (make setup installs it)"
if [[ "${1:-}" == -- ]]; then shift; fi
TEST_ARGS=("$@")

# The binaries that must not run beside the cluster's (see the header), run after it in its lane.
CLUSTER_LANE=(real_cluster cri_containerd)
# Longest first (seconds each took run alone on 2 cores, rounded): a lane that starts a long
# binary last finishes last. A binary missing here counts as short.
declare -A WEIGHT=(
  [real_cluster]=370 [object_store]=140 [controller]=95 [agent_cluster]=70 [agent_loop]=65
  [node_simulator]=25 [gpu_containers]=25 [apiserver_conformance]=22 [gpu_bundle]=20
  [warmstart_agent]=17 [cuda_standin]=12 [restore_refusals]=11 [entrypoint]=11 [node_engine]=6
  [source_rules]=5 [pod_security]=5 [control_plane]=5 [fixture]=4
)

rm -rf "$LOGS"
mkdir -p "$LOGS/results"

say "building the test binaries (cargo test --workspace --no-run)"
"$CARGO" test --workspace --no-run --message-format=json-render-diagnostics >"$LOGS/artifacts.json" ||
  fail "the test binaries do not build (see the output above)"
# One line per test binary: name, executable, package directory.
jq -r 'select(.reason == "compiler-artifact" and .profile.test == true and .executable != null)
  | [.target.name, .executable, (.manifest_path | sub("/Cargo.toml$"; ""))] | @tsv' \
  "$LOGS/artifacts.json" | sort -u >"$LOGS/binaries.tsv"
[[ -s "$LOGS/binaries.tsv" ]] || fail "cargo built no test binary"

# The CUDA stand-in is built by the tests that need it, once per process, into a target
# directory of its own: built here once, so they do not queue on cargo's lock to build it.
say "building the CUDA stand-in (target/cuda-standin)"
CARGO_TARGET_DIR="$TARGET/cuda-standin" "$CARGO" build --quiet -p warmstart-cuda-standin ||
  fail "the CUDA stand-in does not build"

# The same name may be two binaries (a package's lib and bin unit tests, cli.rs in two packages):
# each gets a unique log name.
declare -A SEEN=()
: >"$LOGS/other.tsv"
: >"$LOGS/cluster.tsv"
while IFS=$'\t' read -r name exe dir; do
  id="$name"
  n=1
  while [[ -n "${SEEN[$id]:-}" ]]; do
    n=$((n + 1))
    id="$name-$n"
  done
  SEEN[$id]=1
  line="$(printf '%s\t%s\t%s\t%s' "${WEIGHT[$name]:-3}" "$id" "$exe" "$dir")"
  if [[ " ${CLUSTER_LANE[*]} " == *" $name "* ]]; then
    echo "$line" >>"$LOGS/cluster.tsv"
  else
    echo "$line" >>"$LOGS/other.tsv"
  fi
done <"$LOGS/binaries.tsv"
# The documentation tests, as cargo test runs them after the binaries (rustdoc builds them).
printf '%s\t%s\t%s\t%s\n' "${WEIGHT[doc-tests]:-3}" doc-tests "$CARGO" "$ROOT" >>"$LOGS/other.tsv"

# run_one ID EXE DIR: runs one test binary, its output to its log, its status and time to
# results/ID, then prints the log whole (one binary's output at a time).
run_one() {
  local id="$1" exe="$2" dir="$3" start rc
  start=$SECONDS
  set +e
  # No test reads this script's input: in the cluster lane that is the list of binaries to run.
  if [[ "$id" == doc-tests ]]; then
    "$CARGO" test --workspace --doc --no-fail-fast -- "${TEST_ARGS[@]}" </dev/null >"$LOGS/$id.log" 2>&1
  else
    (cd "$dir" && CARGO_MANIFEST_DIR="$dir" "$exe" "${TEST_ARGS[@]}") </dev/null >"$LOGS/$id.log" 2>&1
  fi
  rc=$?
  set -e
  printf '%s %s\n' "$rc" "$((SECONDS - start))" >"$LOGS/results/$id"
  {
    flock 9
    printf '\n==== %s (%s, %ss, exit %s) ====\n' "$id" "${exe#"$ROOT"/}" "$((SECONDS - start))" "$rc"
    cat "$LOGS/$id.log"
  } 9>"$LOGS/.print"
}

# lane LIST: runs the binaries of LIST (weight, id, exe, dir) one after another.
lane() {
  local weight id exe dir
  while IFS=$'\t' read -r weight id exe dir; do
    run_one "$id" "$exe" "$dir"
  done <"$1"
}

# The shared lanes take the next binary from one queue, longest first.
sort -t$'\t' -k1,1nr "$LOGS/other.tsv" >"$LOGS/queue.tsv"
: >"$LOGS/.taken"
next_in_queue() {
  local i
  {
    flock 8
    i=$(($(wc -l <"$LOGS/.taken") + 1))
    echo >>"$LOGS/.taken"
  } 8>"$LOGS/.queue-lock"
  sed -n "${i}p" "$LOGS/queue.tsv"
}
shared_lane() {
  local line weight id exe dir
  while line="$(next_in_queue)" && [[ -n "$line" ]]; do
    IFS=$'\t' read -r weight id exe dir <<<"$line"
    run_one "$id" "$exe" "$dir"
  done
}

total="$(cat "$LOGS/cluster.tsv" "$LOGS/other.tsv" | wc -l)"
say "running $total test binaries: the cluster lane and $JOBS shared lanes"
started=$SECONDS
pids=()
sort -t$'\t' -k1,1nr "$LOGS/cluster.tsv" >"$LOGS/cluster-queue.tsv"
lane "$LOGS/cluster-queue.tsv" &
pids+=($!)
for ((j = 0; j < JOBS; j++)); do
  shared_lane &
  pids+=($!)
done
# A lane's own failure (not a test's) is an error of this script.
for pid in "${pids[@]}"; do
  wait "$pid" || fail "a lane of the test run failed (pid $pid)"
done

# The summary: each binary's time, counts and status; the totals.
# counts LOG: the passed and failed counts of libtest's (and libtest-mimic's) closing lines,
# "test result: ok. N passed; N failed; ...", summed over the log.
counts() {
  sed -n 's/^test result: [a-zA-Z]*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\1 \2/p' "$1" |
    awk '{p += $1; f += $2} END {print p + 0, f + 0}'
}
passed=0
failed=0
broken=()
: >"$LOGS/summary.txt"
for result in "$LOGS"/results/*; do
  id="$(basename "$result")"
  read -r rc secs <"$result"
  read -r p f < <(counts "$LOGS/$id.log")
  passed=$((passed + p))
  failed=$((failed + f))
  if [[ "$rc" != 0 ]]; then
    broken+=("$id")
    # A binary that failed without a failing test counted (killed, or its harness panicked).
    ((f > 0)) || failed=$((failed + 1))
  fi
  printf '%-28s %7s %7s %7s %5s\n' "$id" "$secs" "$p" "$f" "$rc" >>"$LOGS/summary.txt"
done
printf '\n==== test binaries (%ss in all) ====\n' "$((SECONDS - started))"
printf '%-28s %7s %7s %7s %5s\n' binary seconds passed failed exit
sort -k2,2nr "$LOGS/summary.txt"
if ((${#broken[@]})); then
  echo "run-tests: failed: ${broken[*]} (logs in $LOGS)" >&2
fi
echo "tests: $passed passed, $failed failed"
((${#broken[@]} == 0))
