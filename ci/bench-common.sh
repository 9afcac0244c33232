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
#   bench_median, bench_spread   the median, and `min–max`, of the numbers on stdin
#                         (separated by spaces or newlines)
#   bench_vm_steps FILE   the `microVM step done` lines (colours stripped) of a kiln run's
#                         stderr in FILE, logged with KILN_LOG=...,kiln_pipeline::vmexec=info
#   bench_vm_phases       from such lines on stdin: per phase (disks, start, exec, diff,
#                         total) `  PHASE: median N ms (LO–HI ms)`, then how many steps were
#                         restored and how many booted
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

bench_median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
bench_spread() { tr ' ' '\n' | grep . | sort -n | awk 'NR==1{lo=$1} {hi=$1} END {print lo "–" hi}'; }

bench_vm_steps() { grep -a 'microVM step done' "$1" | sed 's/\x1b\[[0-9;]*m//g' || true; }

bench_vm_phases() {
  local lines phase v
  lines=$(cat)
  for phase in disks start exec diff total; do
    v=$(printf '%s\n' "$lines" | grep -o "${phase}_ms=[0-9]*" | cut -d= -f2 | tr '\n' ' ' || true)
    [ -n "${v// /}" ] && echo "  $phase: median $(echo "$v" | bench_median) ms ($(echo "$v" | bench_spread) ms)"
  done
  echo "  steps: $(printf '%s\n' "$lines" | grep -c 'start="\?restored') restored, $(printf '%s\n' "$lines" | grep -c 'start="\?booted') booted"
}
