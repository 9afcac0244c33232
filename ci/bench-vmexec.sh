#!/usr/bin/env bash
# Per-step cost of the microVM step executor against the namespace executor (issue 14 §1).
# Not a test: never run by `cargo test` or ci/test.sh.
#
# One Dockerfile of KILN_BENCH_STEPS (3) `RUN echo N > /N` steps over the busybox fixture,
# built with --no-cache --oci-only under `--isolation namespace` and `--isolation vm`,
# KILN_BENCH_RUNS (3) times each, alternating; prints each wall time, then the median per
# executor and (vm − namespace) / steps, the fixed cost a step pays for its VM. With
# RUST_LOG=kiln_pipeline=debug each VM step also logs booted= (QEMU start → the guest
# answered), ran= and total=.
#
#   KILN                 the kiln binary; default $CARGO_TARGET_DIR/debug/kiln
#   KILN_KERNEL, KILN_INITRAMFS   the guest kernel and initramfs (as ci/setup.sh exports
#                        them in KILN_TEST_KERNEL, KILN_TEST_INITRAMFS)
#   KILN_TEST_BUSYBOX_REF the base image (ci/setup.sh)
set -euo pipefail
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
# One build first, so that the base image and the lower disk images exist for both.
"$kiln" build "$work/ctx" --isolation vm --oci-only --progress plain >/dev/null 2>&1
declare -A times
for r in $(seq 1 "$runs"); do
  for iso in namespace vm; do
    t0=$(date +%s.%N)
    "$kiln" build "$work/ctx" --isolation "$iso" --no-cache --oci-only --progress plain \
      >/dev/null 2>"$work/err" || { cat "$work/err" >&2; exit 1; }
    t=$(echo "$(date +%s.%N) - $t0" | bc)
    echo "run $r $iso: ${t} s"
    times[$iso]="${times[$iso]:-} $t"
  done
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ns=$(echo "${times[namespace]}" | median)
vm=$(echo "${times[vm]}" | median)
echo "median: namespace ${ns} s, vm ${vm} s, $steps steps"
echo "fixed cost per step above the namespace executor: $(echo "scale=2; ($vm - $ns) / $steps" | bc) s"
