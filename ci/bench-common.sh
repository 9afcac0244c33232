# Helpers shared by the ci/bench-*.sh scripts. Source it; it defines functions only.
#
#   bench_env             sources $KILN_CI_CACHE/env (the test servers' variables, from
#                         ci/setup.sh) and keeps a CARGO_TARGET_DIR the caller had set
#   bench_apt PKG...      installs the Debian packages among PKG that are not installed
#                         (ci/setup.sh's way: -qq, no recommends, update only when needed)
#   bench_kiln [PROFILE]  builds the kiln binary (cargo profile, default release) under
#                         nice and sets $kiln to its path; with KILN_BENCH_KILN set, uses
#                         that binary instead (e.g. an older build, for before/after figures)
#   bench_now             wall-clock seconds, fractional
# shellcheck shell=bash

bench_ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bench_repo=$(dirname "$bench_ci_dir")

bench_env() {
  local target_dir=${CARGO_TARGET_DIR:-}
  KILN_CI_CACHE=${KILN_CI_CACHE:-/var/cache/kiln-ci}
  # shellcheck disable=SC1091
  . "$KILN_CI_CACHE/env"
  [ -z "$target_dir" ] || export CARGO_TARGET_DIR=$target_dir
}

bench_apt() {
  local p missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  printf 'bench: installing %s\n' "${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
}

bench_kiln() {
  local profile=${1:-release} dir=debug
  if [ -n "${KILN_BENCH_KILN:-}" ]; then
    kiln=$KILN_BENCH_KILN
    return
  fi
  (cd "$bench_repo" && nice -n 19 cargo build -q --locked --profile "$profile" -p kiln)
  [ "$profile" = dev ] || dir=$profile
  kiln=${CARGO_TARGET_DIR:-$bench_repo/target}/$dir/kiln
}

bench_now() { date +%s.%N; }
