#!/usr/bin/env bash
# Clone benchmark (issues 8 and 35). Not a test: never run by `cargo test` or ci/test.sh.
#
#   ci/bench-clone.sh [--image busybox|debian] [--store URL|s3] [--memory-mib N]
#
#   --image       busybox: the busybox fixture, 64 MiB disk (default); debian: the Debian
#                 fixture (KILN_TEST_DEBIAN_OCI), 512 MiB disk. Both get the same start
#                 command and ready check.
#   --store       where the clones start from: a local directory (default: the build store
#                 in the work directory), s3://BUCKET/PREFIX, or `s3` for a fresh prefix in
#                 the local S3 server's test bucket (s3://$KILN_TEST_S3_BUCKET/bench-clone-…)
#   --memory-mib  guest RAM; default $KILN_BENCH_MEMORY_MIB, else 256
#
# e.g.  ci/bench-clone.sh --store s3                                   # busybox, 256 MiB
#       ci/bench-clone.sh --image debian --memory-mib 512 --store s3
#
# Same image, same run, every VM started by the kiln binary (release, `bench_kiln`):
#   - cold boot to READY (`kiln snapshot`: QEMU spawned → the ready check passed);
#   - lazy `kiln start` from the store, cold (empty snapshot and chunk caches) and warm (the
#     chunk server running), each as "answered" (QEMU spawned → the guest answered
#     `restore`) and the whole `kiln start` process; memory and disk the chunk server had
#     fetched when the clone answered and after one `kiln exec`, as shares of guest RAM and
#     of the disk's non-zero bytes (counted as kiln/tests/vm_lazy.rs counts them);
#   - `kiln start --materialize`, cold and warm; Rss vs Pss of 3 lazy clones at once.
# The measuring lives in tests/examples/bench_clone.rs (its doc says what each figure is).
# The accelerator is probed once by `kiln snapshot` (TCG on a PVM host) and handed to every
# start in KILN_ACCEL; KILN_ACCEL=tcg|kvm forces one.
#
#   KILN_BENCH_RUNS              runs of each; default 10
#   KILN_BENCH_MATERIALIZE_RUNS  cold --materialize starts; default 3
#   KILN_BENCH_PROFILE           cargo profile of kiln; default release
#   KILN_BENCH_KILN              a kiln binary to use instead of building one
#   KILN_BENCH_PREFETCH_RESTORES restores recording the prefetch list (kiln snapshot
#                                --prefetch-restores N); default: kiln's
#   KILN_BENCH_DIR               work directory; default $KILN_CI_CACHE/bench-clone
set -euo pipefail

ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$ci_dir")
# shellcheck source=ci/bench-common.sh
. "$ci_dir/bench-common.sh"
bench_env

image=busybox
store=
memory=${KILN_BENCH_MEMORY_MIB:-256}
while [ $# -gt 0 ]; do
  case $1 in
    --image) image=$2; shift 2 ;;
    --store) store=$2; shift 2 ;;
    --memory-mib) memory=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-clone: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case $image in busybox | debian) ;; *) echo "bench-clone: --image busybox|debian" >&2; exit 2 ;; esac
[ "$store" != s3 ] || store=s3://$KILN_TEST_S3_BUCKET/bench-clone-$(date +%s)-$$

bench_kiln "${KILN_BENCH_PROFILE:-release}"
export KILN_BENCH_KILN=$kiln KILN_BENCH_IMAGE=$image KILN_BENCH_MEMORY_MIB=$memory
export KILN_BENCH_DIR=${KILN_BENCH_DIR:-$KILN_CI_CACHE/bench-clone}
if [ -n "$store" ]; then export KILN_BENCH_STORE=$store; else unset KILN_BENCH_STORE; fi

cd "$repo"
echo "bench-clone: $image, ${memory} MiB, store ${store:-local}, kiln $kiln; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
cargo run -q -p kiln-tests --example bench_clone
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
