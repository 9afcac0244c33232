#!/usr/bin/env bash
# Clone benchmark (issue 8). Not a test: never run by `cargo test` or ci/test.sh.
#
# Same image (busybox fixture + guest init, a start command and a ready check), same run:
#   - cold boot to READY (QEMU spawned → the guest's `ready`), median of KILN_BENCH_RUNS (10);
#   - clone start to answered (QEMU spawned with -incoming → migrate-incoming → cont → the
#     guest answered `restore`), one clone at a time, median of KILN_BENCH_RUNS;
#   - the snapshot's stored memory bytes against guest RAM; Rss vs Pss of 3 clones at once.
# The accelerator is probed (TCG on a PVM host); KILN_ACCEL=tcg|kvm forces one.
#
#   KILN_BENCH_RUNS        runs of each; default 10
#   KILN_BENCH_MEMORY_MIB  guest RAM; default 256
#   KILN_BENCH_DIR         work directory; default $KILN_CI_CACHE/bench-clone
set -euo pipefail

ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$ci_dir")
# shellcheck source=ci/bench-common.sh
. "$ci_dir/bench-common.sh"
bench_env
export KILN_BENCH_DIR=${KILN_BENCH_DIR:-$KILN_CI_CACHE/bench-clone}

cd "$repo"
cargo run -q -p kiln-tests --example bench_clone
