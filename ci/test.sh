#!/usr/bin/env bash
# The test command: sets up the environment (ci/setup.sh), then checks formatting and lints,
# fuzzes every target of fuzz/ for a bounded time (ci/fuzz.sh) and runs the whole test suite.
# CI runs exactly this (see .ci/run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. ci/setup.sh
# Each phase line carries the machine's CPU seconds so far, busy and idle over all cores
# (/proc/stat, proc(5)), so that a log shows how well each phase used the cores.
cpu() { awk -v hz="$(getconf CLK_TCK)" '/^cpu / { printf "cpu busy %.0fs idle %.0fs", ($2+$3+$4+$7+$8)/hz, ($5+$6)/hz }' /proc/stat; }
echo "== cargo fmt --check [${SECONDS}s, $(cpu)]"
cargo fmt --all -- --check
echo "== cargo clippy --all-targets -- -D warnings [${SECONDS}s, $(cpu)]"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The machine comes with cargo-nextest; a machine without it gets the same version.
if ! command -v cargo-nextest >/dev/null; then
  echo "== installing cargo-nextest [${SECONDS}s, $(cpu)]"
  cargo install --locked cargo-nextest --version 0.9.143
fi
echo "== cargo test --doc [${SECONDS}s, $(cpu)]"
cargo test --workspace --locked --doc
echo "== fuzz: every target of fuzz/ from its seeds (ci/fuzz.sh) [${SECONDS}s, $(cpu)]"
bash ci/fuzz.sh
# One test more than the machine has cores: the main job (readme_main_job) spends a large
# share of its minutes waiting on the package archives (39% of a quiet 2-core machine's CPU
# time was idle while it ran alone, `perf record -a -- bash ci/main-job.sh`), and tests that
# wait on their servers leave a core idle too; one more test fills those gaps.
threads=$(($(nproc) + 1))
echo "== cargo nextest run --test-threads $threads (settings: .config/nextest.toml) [${SECONDS}s, $(cpu)]"
cargo nextest run --workspace --locked --test-threads "$threads" "$@"
echo "== done [${SECONDS}s, $(cpu)]"
