#!/usr/bin/env bash
# The fuzz phase of the test command (ci/test.sh runs it; fuzz/README.md describes the
# targets): installs cargo-fuzz, builds every target of fuzz/ and runs each one from
# its committed seeds (fuzz/seeds/<target>/) for an equal share of KILN_FUZZ_SECONDS,
# KILN_FUZZ_JOBS targets at once (default: one per core, nproc).
# A crash, timeout or out-of-memory input fails the run, with the input's path printed.
#   KILN_CI_CACHE       cargo-fuzz and the fuzz build's target dir live here (ci/setup.sh's)
#   KILN_FUZZ_SECONDS   total fuzzing time over all targets, seconds (default 96: 8 s per
#                       target; the suite's time budget leaves no more, longer runs are
#                       for outside CI, see fuzz/README.md)
#   KILN_FUZZ_TARGETS   space-separated targets to run (default: all, `cargo fuzz list`)
# Only a stable toolchain is needed: RUSTC_BOOTSTRAP=1 lets it take the nightly flags
# (-Zsanitizer, sancov passes) cargo-fuzz passes. Builds without a sanitizer (-s none: the
# targets are safe Rust, and the build and the runs are about twice as fast), at opt-level 1
# (fuzz/Cargo.toml's release profile) in 16 codegen units, with
# debug assertions and overflow checks on.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS
log() { printf 'fuzz: [%ss] %s\n' "$((SECONDS - start))" "$*" >&2; }

KILN_CI_CACHE=${KILN_CI_CACHE:-/var/cache/kiln-ci}
total=${KILN_FUZZ_SECONDS:-96}
cargo_fuzz_version=0.13.2
tool_root=$KILN_CI_CACHE/cargo-fuzz-$cargo_fuzz_version
if ! "$tool_root/bin/cargo-fuzz" --version 2>/dev/null | grep -qx "cargo-fuzz $cargo_fuzz_version"; then
  log "installing cargo-fuzz $cargo_fuzz_version into $tool_root"
  # --debug: cargo-fuzz only drives cargo; an optimized build of it took 142 s of a cold
  # run on 2 cores and makes no fuzz run faster.
  cargo install --locked --debug cargo-fuzz --version "$cargo_fuzz_version" --root "$tool_root" \
    --target-dir "$KILN_CI_CACHE/cargo-fuzz-build"
fi
export PATH=$tool_root/bin:$PATH
export RUSTC_BOOTSTRAP=1
target_dir=$KILN_CI_CACHE/fuzz-target

cd fuzz
# cargo fuzz build has no --locked: check first that fuzz/Cargo.lock needs no change.
cargo metadata --locked --format-version 1 >/dev/null
log "building the fuzz targets into $target_dir"
# --codegen-units 16: cargo-fuzz's release default is 1 (for ThinLTO's inlining across
# sancov-instrumented code), which compiles each crate on one core.
cargo fuzz build -O -a -s none --codegen-units 16 --target-dir "$target_dir"
bin_dir=$target_dir/x86_64-unknown-linux-gnu/release

read -r -a targets <<<"${KILN_FUZZ_TARGETS:-$(cargo fuzz list | tr '\n' ' ')}"
share=$((total / ${#targets[@]}))
[ "$share" -ge 1 ] || share=1
# Each libFuzzer run is one process on one core: run one target per core at once.
jobs=${KILN_FUZZ_JOBS:-$(nproc)}
log "built; running ${#targets[@]} targets for ${share} s each, ${jobs} at a time"
results=$(mktemp -d)
# One target's run; its verdict goes to $results/<target>.fail or is logged as a pass.
run_target() {
  local t=$1 corpus=corpus/$1 artifacts=artifacts/$1 out=$results/$1.out rc=0 runs found
  mkdir -p "$corpus" "$artifacts"
  if [ -d "seeds/$t" ]; then cp -n "seeds/$t"/* "$corpus"/ 2>/dev/null || true; fi
  # -timeout: one input running 10 s is a hang; -rss_limit_mb: 2 GiB is an OOM.
  "$bin_dir/$t" -max_total_time="$share" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$PWD/$artifacts/" "$corpus" >"$out" 2>&1 || rc=$?
  runs=$(awk '/stat::number_of_executed_units:/ { print $2 }' "$out")
  if [ "$rc" -ne 0 ]; then
    tail -n 60 "$out" >&2
    found=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$out")
    log "$t FAILED (exit $rc) after ${runs:-?} runs; input: ${found:-none written (see above)}"
    echo "$t: ${found:-exit $rc}" >"$results/$t.fail"
  else
    log "$t: ${runs:-?} runs in ${share} s, corpus $(ls "$corpus" | wc -l) inputs"
  fi
}
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  run_target "$t" &
done
wait
failed=()
for f in "$results"/*.fail; do
  [ -e "$f" ] && failed+=("$(cat "$f")")
done
rm -rf "$results"
if [ "${#failed[@]}" -ne 0 ]; then
  log "${#failed[@]} target(s) failed; reproduce with $bin_dir/<target> <input>:"
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
log "done"
