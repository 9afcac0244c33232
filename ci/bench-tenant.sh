#!/usr/bin/env bash
# A realistic tenant recipe under the microVM step executor against the namespace executor
# (issue 32's last goal). Not a test: never run by `cargo test` or ci/test.sh.
#
# The recipe is ci/tenant-recipe/Dockerfile (read its header): the tools fixture, an apt
# install of three packages, a pip install, a WORKDIR, a COPY of the context's app/, an npm
# install and the app's check; eight steps, four of them RUN steps. The packages come from
# local servers on 127.0.0.1 (tests/examples/bench_tenant_servers.rs, which serves
# kiln_tests::pkgs::PackageServers) under the names apt.test, pypi.test and npm.test; their
# ports are --build-arg values.
#
# How both executors reach them, doing the same work: both builds get the egress issue's
# settings for tests, `--egress-allow-private-for-tests --egress-host-for-tests
# NAME=127.0.0.1` for each name, and the build-wide allow-list `--network-allow '*.test'`.
# Every RUN step then goes through kiln's egress proxy on the host, the same proxy for both:
# a namespace step reaches it on 127.0.0.1:3128 of its network namespace (its `default`
# network, slirp4netns, cannot reach the host's loopback), a microVM step on 127.0.0.1:3128
# of the guest, carried over the VM's egress port. Each timed build's log is checked for the
# app's output (the three apt packages, the pip and the npm package).
#
# Each of KILN_BENCH_RUNS runs builds the recipe with --no-cache --oci-only (every step
# runs) under `--isolation namespace`, then `--isolation vm` (steps restored from the
# per-host builder snapshot), then measures the fixed cost per step with ci/bench-vmexec.sh
# (one run, as many `RUN echo` steps as the recipe has RUN steps, no cold boots): (vm −
# namespace) / steps for trivial steps, the same run's figure. One VM build first, untimed,
# makes the base image, its lower disk images and the builder snapshot.
#
# Output: each run's wall times and fixed cost; then the medians with their spread (min–max)
# of: the namespace build, the VM build, the fixed cost per step, the VM build with the
# fixed cost of its RUN steps subtracted (each run's vm − steps × that run's fixed cost),
# and that against the namespace build (a ratio: the steps' own work in the VM against the
# same work in namespaces; under TCG the guest's work is emulated, so this part is slower:
# it is reported, not a goal). Last, per RUN step of the VM builds, the phases the VM
# executor logs (`microVM step done`: disks, start, exec, diff, total; ms), each RUN step
# named by kiln's step index (ARG and ENV make no step) and its Dockerfile line.
#
#   KILN                 the kiln binary; default: built by bench_kiln (release, under nice)
#                        unless KILN_BENCH_KILN names one
#   KILN_BENCH_RUNS      runs; default 3
#   KILN_KERNEL, KILN_INITRAMFS   the guest kernel and initramfs; default KILN_TEST_KERNEL,
#                        KILN_TEST_INITRAMFS (ci/setup.sh makes them with kiln-test-guest-assets;
#                        an initramfs older than the guest init's `kiln.step=wait` makes the
#                        VM executor boot every step cold: its log says so)
#   KILN_TEST_TOOLS_REF, KILN_TEST_BUSYBOX_REF   the base images (ci/setup.sh)
set -euo pipefail
export LC_ALL=C

ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$ci_dir")
# shellcheck source=ci/bench-common.sh
. "$ci_dir/bench-common.sh"
bench_env
runs=${KILN_BENCH_RUNS:-3}
if [ -n "${KILN:-}" ]; then kiln=$KILN; else bench_kiln; fi
export KILN=$kiln
export KILN_KERNEL=${KILN_KERNEL:-${KILN_TEST_KERNEL:?set KILN_KERNEL or KILN_TEST_KERNEL}}
export KILN_INITRAMFS=${KILN_INITRAMFS:-${KILN_TEST_INITRAMFS:?set KILN_INITRAMFS or KILN_TEST_INITRAMFS}}
recipe=$ci_dir/tenant-recipe
steps=$(grep -c '^RUN ' "$recipe/Dockerfile")

(cd "$repo" && cargo build -q --locked -p kiln-tests --example bench_tenant_servers)
servers_bin=${CARGO_TARGET_DIR:-$repo/target}/debug/examples/bench_tenant_servers

work=$(mktemp -d /tmp/kiln-bench-tenant-XXXXXX)
servers_pid=
cleanup() {
  exec 9>&- || true
  [ -z "$servers_pid" ] || wait "$servers_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# The servers serve until their stdin (this script's fd 9) ends.
mkfifo "$work/hold"
"$servers_bin" "$work/pkgs" <"$work/hold" >"$work/ports" 2>"$work/servers.err" &
servers_pid=$!
exec 9>"$work/hold"
for _ in $(seq 1 300); do
  [ -s "$work/ports" ] && break
  kill -0 "$servers_pid" 2>/dev/null || { cat "$work/servers.err" >&2; exit 1; }
  sleep 0.1
done
read -r -a ports <"$work/ports"
args=(--no-cache --oci-only --progress plain --build-arg "BASE=${KILN_TEST_TOOLS_REF:?}"
  --egress-allow-private-for-tests --network-allow '*.test')
for p in "${ports[@]}"; do args+=(--build-arg "$p"); done
for h in apt.test pypi.test npm.test; do args+=(--egress-host-for-tests "$h=127.0.0.1"); done
echo "servers: ${ports[*]}; recipe $recipe: $steps RUN steps"

export KILN_STORE=$work/store
# The app's check output, which every timed build must show.
checked() {
  local want
  for want in "apt kiln-hello: " "apt kiln-hello-data: " "apt kiln-hello-doc: " \
    "python: installed through the proxy" "node: installed through the proxy"; do
    grep -aq "$want" "$1" || { echo "bench-tenant: $2: no \"$want\" in its log:" >&2; cat "$1" >&2; exit 1; }
  done
}
build() { # isolation output-file
  KILN_LOG=warn,kiln_pipeline::vmexec=info "$kiln" build "$recipe" --isolation "$1" "${args[@]}" \
    >"$2" 2>&1 || { cat "$2" >&2; exit 1; }
}
build vm "$work/warm"
checked "$work/warm" "the first build"

declare -A times
fixed="" less="" ratio=""
: >"$work/phases"
for r in $(seq 1 "$runs"); do
  for ex in namespace vm; do
    t0=$(bench_now)
    build "$ex" "$work/out"
    t=$(printf '%.3f' "$(echo "$(bench_now) - $t0" | bc)")
    checked "$work/out" "run $r $ex"
    echo "run $r $ex: ${t} s"
    times[$ex]="${times[$ex]:-} $t"
    [ "$ex" = namespace ] && ns_t=$t
    [ "$ex" = vm ] && vm_t=$t && bench_vm_steps "$work/out" >>"$work/phases"
  done
  KILN_BENCH_RUNS=1 KILN_BENCH_COLD=0 KILN_BENCH_STEPS=$steps "$ci_dir/bench-vmexec.sh" >"$work/trivial"
  f=$(sed -n 's/^vm: fixed cost per step above the namespace executor: median \([-0-9.]*\) s.*/\1/p' "$work/trivial")
  [ -n "$f" ] || { echo "bench-tenant: no fixed cost in ci/bench-vmexec.sh's output:" >&2; cat "$work/trivial" >&2; exit 1; }
  f=$(printf '%.3f' "$f")
  l=$(printf '%.3f' "$(echo "$vm_t - $steps * $f" | bc)")
  fixed="$fixed $f" less="$less $l" ratio="$ratio $(printf '%.2f' "$(echo "scale=4; $l / $ns_t" | bc)")"
  echo "run $r fixed cost per step (ci/bench-vmexec.sh, $steps RUN echo steps): $f s; vm − $steps × fixed: $l s"
done

for ex in namespace vm; do
  echo "$ex: median $(echo "${times[$ex]}" | bench_median) s (runs $(echo "${times[$ex]}" | bench_spread) s), $steps RUN steps"
done
echo "fixed cost per step above the namespace executor: median $(echo "$fixed" | bench_median) s (runs $(echo "$fixed" | bench_spread) s)"
echo "vm − $steps × fixed cost: median $(echo "$less" | bench_median) s (runs $(echo "$less" | bench_spread) s)"
echo "(vm − $steps × fixed cost) / namespace: median $(echo "$ratio" | bench_median) (runs $(echo "$ratio" | bench_spread)): the steps' own work in the VM (under TCG, emulated) against namespaces"
for i in $(grep -o 'step=[0-9]*' "$work/phases" | sort -t= -k2 -n -u | cut -d= -f2); do
  # The step's recipe line and instruction, from the build's progress heading (`#i [stage …]`).
  what=$(sed -n "s/^#$i \[stage [0-9]*\] [^ ]*:\([0-9]*\) \(.*\)/line \1: \2/p" "$work/warm" | awk 'NR == 1' |
    sed 's|^\(line [0-9]*: RUN\) /bin/sh -c |\1 |' | cut -c1-72)
  echo "vm step $i ($what):"
  grep "step=$i " "$work/phases" | bench_vm_phases
done
