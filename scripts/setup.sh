#!/usr/bin/env bash
# Installs what warmstart's builds and tests need on a Debian 12 (bookworm) machine:
#   runc, busybox-static, iptables, python3 (an unmodified server for the entrypoint tests), jq, file and
#   util-linux (flock; the build and test scripts use them), containerd (installed, not started), kubectl (with kustomize), promtool (trixie),
#   and CRIU 4.2.1 from Debian testing (forky) in a private prefix (see README, "Prerequisites").
# Idempotent: a second run checks each component and changes nothing.
# Must run as root. Environment overrides: WARMSTART_CRIU_PREFIX, WARMSTART_DEBIAN_MIRROR.
set -euo pipefail

CRIU_WANT="4.2.1"
CRIU_PREFIX="${WARMSTART_CRIU_PREFIX:-/opt/warmstart/criu}"
CRIU_WRAPPER="/usr/local/bin/criu"
MIRROR="${WARMSTART_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SOURCES_FILE="/etc/apt/sources.list.d/warmstart-testing.sources"
PREFS_FILE="/etc/apt/preferences.d/warmstart-testing"
# criu, libcompel1 and their shared-library closure, all taken from forky (glibc >= 2.38).
CRIU_PKGS=(
  criu libcompel1
  libc6 libgnutls30t64 libnettle8t64 libhogweed6t64 libp11-kit0 libunistring5 libprotobuf-c1
  libnl-3-200 libnet9 libnftables1 libbsd0 libuuid1 libidn2-0 libtasn1-6 libffi8 libjansson4
  libxtables12 libmnl0 libnftnl11 libgmp10 libmd0 libzstd1 libedit2 libtinfo6 libgcc-s1
)
# Debian 12's own versions are fine for these.
# protobuf-compiler: the CRI client crate (k8s-cri) compiles its protobuf at build time.
BASE_PKGS=(runc busybox-static iptables containerd protobuf-compiler python3 jq file util-linux)

export DEBIAN_FRONTEND=noninteractive
APT_OPTS=(-y -q --no-install-recommends -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)

if [[ "$(id -u)" -ne 0 ]]; then
  echo "setup: error: must run as root (it installs Debian packages and CRIU into $CRIU_PREFIX); try: sudo make setup" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  echo "setup: error: apt-get/dpkg not found: this script supports Debian 12 only" >&2
  exit 1
fi

LOG="$(mktemp /tmp/warmstart-setup.XXXXXX.log)"
WORKDIR=""
CREATED_POLICY_RC=0
cleanup() {
  local rc=$?
  [[ -n "$WORKDIR" ]] && rm -rf "$WORKDIR"
  [[ -n "${CRIU_PREFIX:-}" ]] && rm -rf "${CRIU_PREFIX}.new" "${CRIU_PREFIX}.old"
  if ((CREATED_POLICY_RC)); then rm -f /usr/sbin/policy-rc.d; fi
  if ((rc == 0)); then rm -f "$LOG"; fi
  exit "$rc"
}
trap cleanup EXIT

say() { echo "setup: $*"; }
# fail MESSAGE: stop with a clear message. die MESSAGE: the same, plus the tail of apt's log.
fail() {
  echo "setup: error: $*" >&2
  exit 1
}
die() {
  echo "setup: error: $*" >&2
  if [[ -s "$LOG" ]]; then
    echo "setup: last lines of $LOG:" >&2
    tail -n 25 "$LOG" | sed 's/^/  | /' >&2
  fi
  exit 1
}

# ---------------------------------------------------------------- apt helpers

UPDATED=0
apt_update() {
  ((UPDATED)) && return 0
  say "apt-get update ..."
  apt-get update -q >>"$LOG" 2>&1 || die "apt-get update failed"
  UPDATED=1
}

# write_if_changed PATH: replaces PATH with stdin only if its content differs. Returns 0 if written.
write_if_changed() {
  local path=$1 tmp
  tmp="$(mktemp)"
  cat >"$tmp"
  if [[ -f "$path" ]] && cmp -s "$tmp" "$path"; then
    rm -f "$tmp"
    return 1
  fi
  install -D -m 0644 "$tmp" "$path"
  rm -f "$tmp"
  return 0
}

SUITES_CHANGED=0
ensure_testing_suites() {
  # Trixie (for kubectl) and forky (for CRIU 4.2.1), pinned low so nothing is ever upgraded
  # to them by accident: they are only used when asked for by name (pkg/trixie, pkg/forky).
  if write_if_changed "$SOURCES_FILE" <<EOF
# Added by warmstart scripts/setup.sh: used only for kubectl (trixie) and CRIU (forky).
Types: deb
URIs: $MIRROR
Suites: trixie forky
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  then SUITES_CHANGED=1; fi
  if write_if_changed "$PREFS_FILE" <<'EOF'
# Added by warmstart scripts/setup.sh: never take packages from these suites unless asked by name.
Package: *
Pin: release n=trixie
Pin-Priority: 50

Package: *
Pin: release n=forky
Pin-Priority: 50
EOF
  then SUITES_CHANGED=1; fi
  [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] \
    || die "/usr/share/keyrings/debian-archive-keyring.gpg missing (package debian-archive-keyring)"
}

# Lists for a suite are missing or older than a day (testing moves daily).
suite_lists_stale() {
  local suite=$1 f
  f="$(find /var/lib/apt/lists -maxdepth 1 -name "*_dists_${suite}_InRelease" -mmin -1440 2>/dev/null | head -n1)"
  [[ -z "$f" ]]
}

prepare_suite() {
  local suite=$1
  ensure_testing_suites
  if ((SUITES_CHANGED)) || suite_lists_stale "$suite"; then apt_update; fi
}

# lookup SUITE|"" PKG...: fills VER[pkg]=version with what apt offers (from SUITE if given).
# One apt-cache call for all packages: this machine's apt has no binary cache, so each call
# re-reads every list (about 1.5 s).
declare -A VER=()
lookup() {
  local suite=$1 p name ver args=()
  shift
  for p in "$@"; do args+=("$p${suite:+/$suite}"); done
  VER=()
  while read -r name ver; do
    [[ -n "${VER[$name]:-}" ]] || VER[$name]=$ver
  done < <(apt-cache show "${args[@]}" 2>/dev/null | awk '/^Package:/ {p=$2} /^Version:/ {print p, $2}' || true)
}

# require_available SUITE|"" PKG...: every package must be known to apt (one apt-get update
# allowed); leaves their versions in VER.
require_available() {
  local suite=$1 p missing=()
  shift
  lookup "$suite" "$@"
  for p in "$@"; do [[ -n "${VER[$p]:-}" ]] || missing+=("$p"); done
  if ((${#missing[@]})) && ((!UPDATED)); then
    apt_update
    lookup "$suite" "$@"
    missing=()
    for p in "$@"; do [[ -n "${VER[$p]:-}" ]] || missing+=("$p"); done
  fi
  ((${#missing[@]} == 0)) || fail "package(s) not available from Debian ${suite:-(configured sources)}: ${missing[*]}"
}

installed() { [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" == "installed" ]]; }

# apt_install PKG...: installs, retrying once after apt-get update (stale lists give 404s).
apt_install() {
  # Do not start services (containerd) from maintainer scripts.
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 0755 /usr/sbin/policy-rc.d
    CREATED_POLICY_RC=1
  fi
  if ! apt-get install "${APT_OPTS[@]}" "$@" >>"$LOG" 2>&1; then
    ((UPDATED)) && die "apt-get install failed: $*"
    apt_update
    apt-get install "${APT_OPTS[@]}" "$@" >>"$LOG" 2>&1 || die "apt-get install failed: $*"
  fi
  if ((CREATED_POLICY_RC)); then rm -f /usr/sbin/policy-rc.d; CREATED_POLICY_RC=0; fi
}

# ---------------------------------------------------------------- base packages

missing=()
for p in "${BASE_PKGS[@]}"; do installed "$p" || missing+=("$p"); done
if ((${#missing[@]})); then
  require_available "" "${missing[@]}"
  apt_install "${missing[@]}"
  for p in "${missing[@]}"; do installed "$p" || die "package $p did not install"; done
  say "installed ${missing[*]}"
fi
for p in "${BASE_PKGS[@]}"; do
  say "$p $(dpkg-query -W -f='${Version}' "$p") ok"
done
command -v runc >/dev/null || die "runc not on PATH after install"
command -v iptables >/dev/null || command -v /usr/sbin/iptables >/dev/null || die "iptables missing after install"
[[ -x /bin/busybox ]] || die "busybox-static did not provide /bin/busybox"

# ---------------------------------------------------------------- kubectl

kubectl_ok() {
  local out
  out="$(kubectl version --client 2>/dev/null)" || return 1
  grep -q '^Client Version:' <<<"$out" && grep -q '^Kustomize Version:' <<<"$out"
}
if ! kubectl_ok; then
  prepare_suite trixie
  require_available trixie kubectl
  kubectl_version="${VER[kubectl]}"
  # --allow-downgrades: a broken kubectl from another source may carry a higher epoch.
  apt_install --allow-downgrades kubectl/trixie
  hash -r
  kubectl_ok || die "kubectl from trixie installed but 'kubectl version --client' fails or lacks kustomize ($(command -v kubectl || echo 'not on PATH'))"
  say "installed kubectl $kubectl_version from trixie"
fi
say "kubectl $(kubectl version --client 2>/dev/null | awk '/^Client Version:/ {print $3}') ok ($(command -v kubectl), kustomize $(kubectl version --client 2>/dev/null | awk '/^Kustomize Version:/ {print $3}'))"

# ---------------------------------------------------------------- promtool

# Checks and unit-tests the Helm chart's alert rules (Debian's promtool package: the tool
# alone, no Prometheus server).
if ! promtool --version >/dev/null 2>&1; then
  prepare_suite trixie
  require_available trixie promtool
  apt_install promtool/trixie
  hash -r
  promtool --version >/dev/null 2>&1 || die "promtool ${VER[promtool]} from trixie installed but 'promtool --version' fails"
  say "installed promtool ${VER[promtool]} from trixie"
fi
say "promtool $(promtool --version 2>&1 | awk 'NR==1 {print $3}') ok ($(command -v promtool))"

# ---------------------------------------------------------------- CRIU 4.2.1

wrapper_text() { # PREFIX LOADER LIBPATH
  cat <<EOF
#!/bin/sh
# CRIU $CRIU_WANT from Debian forky, run with its own glibc (installed by warmstart scripts/setup.sh).
# exec keeps every file descriptor, so 'criu swrk <fd>' works.
exec $2 --library-path $3 $1/usr/sbin/criu "\$@"
EOF
}

# find_loader PREFIX: prints the loader path inside PREFIX.
find_loader() {
  local p
  for p in usr/lib64/ld-linux-x86-64.so.2 lib64/ld-linux-x86-64.so.2 \
           usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 lib/x86_64-linux-gnu/ld-linux-x86-64.so.2; do
    [[ -e "$1/$p" ]] && { echo "$1/$p"; return 0; }
  done
  return 1
}

# lib_path PREFIX: the prefix's library directories that exist, ':'-separated.
lib_path() {
  local d out=()
  for d in usr/lib/x86_64-linux-gnu lib/x86_64-linux-gnu; do
    [[ -d "$1/$d" ]] && out+=("$1/$d")
  done
  ((${#out[@]})) || return 1
  (IFS=:; echo "${out[*]}")
}

# criu_libs_inside PREFIX: every shared library of criu resolves inside PREFIX.
criu_libs_inside() {
  local prefix=$1 loader libs out bad
  loader="$(find_loader "$prefix")" || return 1
  libs="$(lib_path "$prefix")" || return 1
  out="$("$loader" --library-path "$libs" --list "$prefix/usr/sbin/criu" 2>&1)" || { echo "$out"; return 1; }
  bad="$(grep '=>' <<<"$out" | grep -v "=> $prefix/" || true)"
  [[ -z "$bad" ]] || { echo "$bad"; return 1; }
}

criu_version() { "$@" --version 2>/dev/null | awk '/^Version:/ {print $2; exit}'; }
criu_check() { "$@" check 2>&1; }

criu_installed_ok() {
  [[ -x "$CRIU_WRAPPER" && -x "$CRIU_PREFIX/usr/sbin/criu" ]] || return 1
  local loader libs
  loader="$(find_loader "$CRIU_PREFIX")" || return 1
  libs="$(lib_path "$CRIU_PREFIX")" || return 1
  [[ "$(wrapper_text "$CRIU_PREFIX" "$loader" "$libs")" == "$(cat "$CRIU_WRAPPER")" ]] || return 1
  [[ "$(criu_version "$CRIU_WRAPPER")" == "$CRIU_WANT" ]] || return 1
  grep -q 'Looks good' <<<"$(criu_check "$CRIU_WRAPPER")"
}

install_criu() {
  prepare_suite forky
  require_available forky "${CRIU_PKGS[@]}"
  local v="${VER[criu]}"
  [[ "$v" == "$CRIU_WANT"-* ]] \
    || die "Debian forky now offers criu $v, not $CRIU_WANT (warmstart requires $CRIU_WANT); update CRIU_WANT in scripts/setup.sh after checking it"

  WORKDIR="$(mktemp -d /tmp/warmstart-criu.XXXXXX)"
  mkdir "$WORKDIR/debs"
  # apt downloads as user _apt: let it write there (avoids the "unsandboxed" warning).
  if id -u _apt >/dev/null 2>&1; then chown _apt "$WORKDIR/debs"; chmod 0755 "$WORKDIR"; fi
  local args=() p
  for p in "${CRIU_PKGS[@]}"; do args+=("$p/forky"); done
  if ! (cd "$WORKDIR/debs" && apt-get download -q "${args[@]}" >>"$LOG" 2>&1); then
    ((UPDATED)) && die "apt-get download from forky failed"
    apt_update
    (cd "$WORKDIR/debs" && apt-get download -q "${args[@]}" >>"$LOG" 2>&1) || die "apt-get download from forky failed"
  fi

  local new="${CRIU_PREFIX}.new" deb name ver manifest=""
  rm -rf "$new" "${CRIU_PREFIX}.old"
  mkdir -p "$new"
  for p in "${CRIU_PKGS[@]}"; do
    deb="$(find "$WORKDIR/debs" -maxdepth 1 -name "${p}_*.deb" | head -n1)"
    [[ -n "$deb" ]] || die "package $p was not downloaded from forky"
    name="$(dpkg-deb -f "$deb" Package)"
    ver="$(dpkg-deb -f "$deb" Version)"
    [[ "$name" == "$p" && "$ver" == "${VER[$p]}" ]] \
      || die "downloaded $deb is not $p ${VER[$p]} from forky"
    dpkg -x "$deb" "$new" || die "dpkg -x failed for $p"
    manifest+="$p $ver"$'\n'
  done
  printf '%s' "$manifest" >"$new/.warmstart-packages"

  [[ -x "$new/usr/sbin/criu" ]] || die "criu binary not found in the forky package (expected usr/sbin/criu)"
  find_loader "$new" >/dev/null || die "ld-linux-x86-64.so.2 not found in the unpacked libc6"
  local unresolved
  unresolved="$(criu_libs_inside "$new")" \
    || die "criu needs libraries missing from the unpacked closure (add their packages to CRIU_PKGS):"$'\n'"$unresolved"

  # Swap the new prefix in, then (re)write the wrapper pointing at the final paths.
  if [[ -e "$CRIU_PREFIX" ]]; then mv "$CRIU_PREFIX" "${CRIU_PREFIX}.old"; fi
  mv "$new" "$CRIU_PREFIX"
  rm -rf "${CRIU_PREFIX}.old"
  local loader libs tmp
  loader="$(find_loader "$CRIU_PREFIX")"
  libs="$(lib_path "$CRIU_PREFIX")"
  tmp="$(mktemp)"
  wrapper_text "$CRIU_PREFIX" "$loader" "$libs" >"$tmp"
  install -D -m 0755 "$tmp" "$CRIU_WRAPPER"
  rm -f "$tmp"
  say "installed criu $v from forky into $CRIU_PREFIX (${#CRIU_PKGS[@]} packages, list in $CRIU_PREFIX/.warmstart-packages)"
}

if ! criu_installed_ok; then
  install_criu
fi
hash -r
got="$(criu_version "$CRIU_WRAPPER")"
[[ "$got" == "$CRIU_WANT" ]] || die "$CRIU_WRAPPER --version says '${got:-nothing}', expected $CRIU_WANT"
check_out="$(criu_check "$CRIU_WRAPPER" || true)"
grep -q 'Looks good' <<<"$check_out" \
  || die "'$CRIU_WRAPPER check' does not say 'Looks good':"$'\n'"  | ${check_out//$'\n'/$'\n'  | }"
resolved="$(command -v criu || true)"
[[ "$resolved" == "$CRIU_WRAPPER" ]] \
  || die "'criu' on PATH resolves to '${resolved:-nothing}', not $CRIU_WRAPPER (put /usr/local/bin before /usr/sbin in PATH; Debian 12's criu 3.17 does not work here)"
say "criu $got ok ($CRIU_WRAPPER -> $CRIU_PREFIX, criu check: Looks good)"

# ---------------------------------------------------------------- summary

say "runc: $(runc --version 2>/dev/null | head -n1)"
say "kubectl: $(kubectl version --client 2>/dev/null | head -n1)"
say "done"
