#!/usr/bin/env bash
# Per-step cost of the microVM step executor against the namespace executor (issues 14 §1
# and 32). Not a test: never run by `cargo test` or ci/test.sh.
#
# One Dockerfile of KILN_BENCH_STEPS (3) `RUN echo N > /N` steps over the busybox fixture,
# built with --no-cache --oci-only under `--isolation namespace`, `--isolation vm` (steps
# restored from the per-host builder snapshot) and, unless KILN_BENCH_COLD=0, `--isolation
# vm` with KILN_VM_STEP_SNAPSHOT=0 (`vm-cold`: a cold boot per step), KILN_BENCH_RUNS (3)
# times each, alternating. Prints each wall time; then per executor the median and the
# spread (min–max) of the runs, and (vm − namespace) / steps, the fixed cost a step pays
# for its VM, as the median of the runs' own figures with their spread (each run's vm
# build against the same run's namespace build); then, from each VM step's
# `microVM step done` log line (kiln_pipeline at info), the median and spread in ms of
# its phases: disks (upper disk, lower images, mount disks), start (restore or boot:
# QEMU's start to the guest's answer), exec (the command), diff (the changes to the
# host), and how many steps were restored or booted.
#
#   KILN                 the kiln binary; default $CARGO_TARGET_DIR/debug/kiln
#   KILN_KERNEL, KILN_INITRAMFS   the guest kernel and initramfs (as ci/setup.sh exports
#                        them in KILN_TEST_KERNEL, KILN_TEST_INITRAMFS)
#   KILN_TEST_BUSYBOX_REF the base image (ci/setup.sh)
set -euo pipefail
# shellcheck source=ci/bench-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/bench-common.sh"
steps=${KILN_BENCH_STEPS:-3}
runs=${KILN_BENCH_RUNS:-3}
kiln=${KILN:-${CARGO_TARGET_DIR:-target}/debug/kiln}
export KILN_KERNEL=${KILN_KERNEL:-${KILN_TEST_KERNEL:?set KILN_KERNEL or KILN_TEST_KERNEL}}
export KILN_INITRAMFS=${KILN_INITRAMFS:-${KILN_TEST_INITRAMFS:?set KILN_INITRAMFS}}
work=$(mktemp -d /tmp/kiln-bench-vmexec-XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir "$work/ctx"
{
  echo "FROM ${KILN_TEST_BUSYBOX_REF:?}"
  for i in $(seq 1 "$steps"); do echo "RUN echo $i > /$i"; done
} >"$work/ctx/Dockerfile"
export KILN_STORE=$work/store
# One build first, so that the base image, the lower disk images and the builder snapshot
# exist for all.
"$kiln" build "$work/ctx" --isolation vm --oci-only --progress plain >/dev/null 2>&1
executors="namespace vm"
[ "${KILN_BENCH_COLD:-1}" = 0 ] || executors="$executors vm-cold"
declare -A times fixed
: >"$work/phases"
for r in $(seq 1 "$runs"); do
  for ex in $executors; do
    iso=${ex%-cold}
    snap=1
    [ "$ex" = vm-cold ] && snap=0
    t0=$(date +%s.%N)
    KILN_VM_STEP_SNAPSHOT=$snap KILN_LOG=warn,kiln_pipeline::vmexec=info \
      "$kiln" build "$work/ctx" --isolation "$iso" --no-cache --oci-only --progress plain \
      >/dev/null 2>"$work/err" || { cat "$work/err" >&2; exit 1; }
    t=$(echo "$(date +%s.%N) - $t0" | bc)
    echo "run $r $ex: ${t} s"
    times[$ex]="${times[$ex]:-} $t"
    [ "$ex" = namespace ] && ns_t=$t
    if [ "$ex" != namespace ]; then
      fixed[$ex]="${fixed[$ex]:-} $(echo "scale=3; ($t - $ns_t) / $steps" | bc)"
      bench_vm_steps "$work/err" | sed "s/^/$ex /" >>"$work/phases"
    fi
  done
done
for ex in $executors; do
  echo "$ex: median $(echo "${times[$ex]}" | bench_median) s (runs $(echo "${times[$ex]}" | bench_spread) s), $steps steps"
done
for ex in $executors; do
  [ "$ex" = namespace ] && continue
  echo "$ex: fixed cost per step above the namespace executor: median $(echo "${fixed[$ex]}" | bench_median) s (runs $(echo "${fixed[$ex]}" | bench_spread) s)"
  { grep -a "^$ex " "$work/phases" || true; } | bench_vm_phases
done
