#!/usr/bin/env bash
# Side-by-side benchmark (issue 16): `kiln build` against the peer pipeline of standard tools
# (buildah bud → buildah mount → mke2fs -d → e2fsck → 2 MiB chunks with sha256 + zstd; its
# scripts and cases are in ../shared/peer, called as they are). Not a test: never run by
# `cargo test` or ci/test.sh.
#
#   ci/bench-pipeline.sh [PAIRS]     (as root; PAIRS default 3)
#
# For each case (small, apt, multistage) PAIRS pairs of cold runs, alternating which of the
# two goes first from one pair to the next:
#   - peer: `peer-pipeline.sh CASE` (it empties buildah's storage first). Cold build = its
#     `total` line (pull + build + export + mkfs + store-chunks); no-change rebuild = its
#     `rebuild` phase (buildah bud again, all steps cached) + export + mkfs + store-chunks.
#   - kiln: the release build, `kiln build -f CASE/Dockerfile CASE` into a new store with a
#     new cache directory and an empty config file; cold build = the command's wall time;
#     no-change rebuild = the wall time of the same command again into the same store.
#     The host's shared layer directory (`KILN_LAYER_DIR`, issue 34: a base is unpacked
#     once per host, whatever the store) is KEPT between cold runs by default, as on a
#     host that has built before: a cold kiln build then has a new store and a new cache
#     directory but finds its base already unpacked. The first run on a new machine (or
#     with KILN_BENCH_LAYERS=fresh, which empties it before every cold run) unpacks the
#     base as part of the cold build. Each kiln line of the log says how many unpacked
#     layers the directory held before the cold run. (A kiln older than issue 34 ignores
#     the variable and unpacks into the new store every time.)
#     Peak RSS: kiln's own (VmHWM, read from /proc every 50 ms while it runs) and the
#     largest of kiln and the processes it waited for (wait4's ru_maxrss, what
#     `/usr/bin/time -f %M` prints), both in MiB, the largest over the pairs.
# Then a markdown table: per case the medians, kiln / peer (median of the pairs' ratios) and
# the spread (min–max over the pairs).
#
#   KILN_PEER_DIR     the peer's folder; default ../shared/peer beside the repository
#   KILN_BENCH_CASES  cases; default "small apt multistage"
#   KILN_BENCH_DIR    work directory (stores, logs, raw figures); default
#                     /var/tmp/kiln-bench-pipeline, emptied at the start
#   KILN_BENCH_LAYER_DIR  kiln's shared layer directory; default /var/tmp/kiln-bench-layers,
#                     outside KILN_BENCH_DIR so that it outlives one run of this script
#   KILN_BENCH_LAYERS kept (default) or fresh: keep it between cold runs, or empty it first
#   KILN_BENCH_NETWORK  the steps' network on each side (issue 34: the apt case's network
#                     share of the gap, measured with the same mode on both sides):
#                     as-is (default): each pipeline's own default, the peer's
#                       `--network host` (peer-pipeline.sh) and kiln's slirp4netns;
#                     host: both in the host's network namespace (kiln `--network host
#                       --allow network.host`, a trusted CLI build's opt-in, as
#                       `docker build --network host`). (Both through slirp4netns is not
#                       offered: buildah 1.28 as root takes `slirp4netns` for the name of a
#                       network and fails, "network not found".)
# The base images come from the peer's make-base-images.sh (registry on 127.0.0.1:5100;
# its first run bootstraps Debian, about a minute). Do not run it beside a compile.
set -euo pipefail

ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$ci_dir")
# shellcheck source=ci/bench-common.sh
. "$ci_dir/bench-common.sh"
pairs=${1:-3}
peer=${KILN_PEER_DIR:-$(dirname "$repo")/shared/peer}
cases=${KILN_BENCH_CASES:-small apt multistage}
work=${KILN_BENCH_DIR:-/var/tmp/kiln-bench-pipeline}
layer_dir=${KILN_BENCH_LAYER_DIR:-/var/tmp/kiln-bench-layers}
layers_mode=${KILN_BENCH_LAYERS:-kept}
case $layers_mode in kept | fresh) ;; *) echo "KILN_BENCH_LAYERS: kept or fresh, not $layers_mode" >&2; exit 1 ;; esac
network=${KILN_BENCH_NETWORK:-as-is}
kiln_net=()
case $network in
  as-is) ;;
  host) kiln_net=(--network host --allow network.host) ;;
  *) echo "KILN_BENCH_NETWORK: as-is or host, not $network" >&2; exit 1 ;;
esac
log() { printf 'bench-pipeline: %s\n' "$*" >&2; }

[ -x "$peer/peer-pipeline.sh" ] || { log "no peer pipeline at $peer (set KILN_PEER_DIR)"; exit 1; }
# The peer's runtime and builder (Debian bookworm packages); peer-pipeline.sh checks the rest.
bench_apt buildah runc
bench_env
bench_kiln release
rm -rf "$work" && mkdir -p "$work/raw"
log "base images: $peer/make-base-images.sh"
PEER_WORK=$work/peer "$peer/make-base-images.sh" >"$work/base-images.log"

# measure OUT CMD...: runs CMD (stdout and stderr to OUT); prints "wall_s hwm_kib tree_kib".
measure() {
  python3 - "$@" <<'PY'
import resource, subprocess, sys, time
out = open(sys.argv[1], "w")
t = time.time()
p = subprocess.Popen(sys.argv[2:], stdout=out, stderr=subprocess.STDOUT)
hwm = 0
while p.poll() is None:
    try:
        for line in open(f"/proc/{p.pid}/status"):
            if line.startswith("VmHWM:"):
                hwm = max(hwm, int(line.split()[1]))
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    time.sleep(0.05)
wall = time.time() - t
if p.returncode != 0:
    sys.exit(f"{sys.argv[2:]} failed with status {p.returncode}; see {sys.argv[1]}")
print(f"{wall:.3f} {hwm} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}")
PY
}

run_peer() { # CASE PAIR
  local out=$work/raw/peer.$1.$2.txt
  PEER_WORK=$work/peer "$peer/peer-pipeline.sh" "$1" >"$out"
  log "pair $2 $1 peer: $(grep -E '^(total|rebuild)' "$out" | tr -s ' ' | tr '\n' ' ')"
}
run_kiln() { # CASE PAIR
  local store=$work/kiln-store cfg=$work/kiln-config.toml out=$work/raw/kiln.$1.$2
  rm -rf "$store" "$work/kiln-cache" && : >"$cfg"
  if [ "$layers_mode" = fresh ]; then rm -rf "$layer_dir"; fi
  local held=0
  if [ -d "$layer_dir" ]; then
    held=$(find "$layer_dir" -mindepth 1 -maxdepth 1 -type d -regextype egrep -regex '.*/[0-9a-f]{64}' | wc -l)
  fi
  local -a cmd=(env -u KILN_STORE -u KILN_BUILD_DIR KILN_CONFIG="$cfg" KILN_CACHE="$work/kiln-cache"
    KILN_LAYER_DIR="$layer_dir" KILN_LOG=warn "$kiln" build --progress plain --store "$store" "${kiln_net[@]}"
    -t "bench-$1:latest" -f "$peer/cases/$1/Dockerfile" "$peer/cases/$1")
  measure "$out.cold.log" "${cmd[@]}" >"$out.cold"
  measure "$out.rebuild.log" "${cmd[@]}" >"$out.rebuild"
  log "pair $2 $1 kiln: cold $(cut -d' ' -f1 "$out.cold") s, rebuild $(cut -d' ' -f1 "$out.rebuild") s; shared layer dir ($layers_mode) held $held layers before"
  rm -rf "$store" "$work/kiln-cache"
}

for i in $(seq "$pairs"); do
  for c in $cases; do
    if [ $((i % 2)) = 1 ]; then
      run_peer "$c" "$i"; run_kiln "$c" "$i"
    else
      run_kiln "$c" "$i"; run_peer "$c" "$i"
    fi
  done
done

# shellcheck disable=SC2086 # the case list is split on purpose
python3 - "$work/raw" "$pairs" "$layers_mode" "$network" $cases <<'PY'
import re, statistics, sys
raw, pairs, layers_mode, network, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]

def phase(text, name):
    return float(re.search(rf"^{name} +([0-9.]+) s", text, re.M).group(1))

def spread(v, unit=" s", fmt="{:.2f}"):
    return f"{fmt.format(statistics.median(v))}{unit} ({fmt.format(min(v))}–{fmt.format(max(v))})"

rows = []
for kind in ("cold", "rebuild"):
    for c in cases:
        peer, kiln, hwm, tree = [], [], [], []
        for i in range(1, pairs + 1):
            t = open(f"{raw}/peer.{c}.{i}.txt").read()
            if kind == "cold":
                peer.append(phase(t, "total"))
            else:
                peer.append(sum(phase(t, p) for p in ("rebuild", "export", "mkfs", "store-chunks")))
            w, h, r = open(f"{raw}/kiln.{c}.{i}.{kind}").read().split()
            kiln.append(float(w))
            hwm.append(int(h) / 1024)
            tree.append(int(r) / 1024)
        ratios = [k / p for k, p in zip(kiln, peer)]
        label = c if kind == "cold" else f"no-change rebuild, {c}"
        rows.append((label, spread(peer), spread(kiln), spread(ratios, "", "{:.2f}"),
                     f"{max(hwm):.0f} / {max(tree):.0f}"))
print(f"kiln build vs the peer pipeline, {pairs} cold pair(s) per case: median (min–max)")
print(f"kiln's shared layer directory: {layers_mode} between cold runs (see the script's header)")
print(f"the steps' network: {network} (KILN_BENCH_NETWORK, see the script's header)")
print()
print("| case | peer | kiln | kiln / peer | kiln peak RSS MiB (own / with children) |")
print("| --- | ---: | ---: | ---: | ---: |")
for r in rows:
    print("| " + " | ".join(r) + " |")
PY
