#!/usr/bin/env bash
# Seconds of layer apply (`kiln_builder::layer::apply_layer`, into a directory) and of the
# ext4 flattener's two passes (`kiln_builder::ext4::flatten`, to a file) over the Debian
# bookworm fixture's layers: the two users of the root-confined walk (builder/src/rootfs/)
# that run once per layer entry. Median and range of KILN_BENCH_RUNS runs (default 5).
# Not a test: never run by ci/test.sh.
#
#   ci/bench-apply.sh [BIN...]   (as root: apply keeps owners and device nodes)
#
# Each BIN is an `ext4_build` example binary (default: this tree's, built with PROFILE,
# default release); give two, built from two commits, to compare them in one run, runs
# interleaved so that the machine's other load falls on both alike.
set -euo pipefail
cd "$(dirname "$0")/.."
keep_target=${CARGO_TARGET_DIR:-}
[ -f /var/cache/kiln-ci/env ] && . /var/cache/kiln-ci/env
export CARGO_TARGET_DIR=${keep_target:-${CARGO_TARGET_DIR:-target}}
: "${KILN_TEST_DEBIAN_OCI:?run ci/setup.sh first (it builds the Debian fixture)}"
runs=${KILN_BENCH_RUNS:-5}
bins=("$@")
if [ ${#bins[@]} -eq 0 ]; then
    PROFILE=${PROFILE:-release}
    cargo build -q -p kiln-builder --example ext4_build --profile "$PROFILE"
    dir=debug; [ "$PROFILE" = dev ] || dir=$PROFILE
    bins=("$CARGO_TARGET_DIR/$dir/examples/ext4_build")
fi
read -r -a layers <<<"$(python3 - "$KILN_TEST_DEBIAN_OCI" <<'PY'
import json, sys
d = sys.argv[1]
idx = json.load(open(f"{d}/index.json"))
m = json.load(open(f"{d}/blobs/sha256/{idx['manifests'][0]['digest'][7:]}"))
print(" ".join(f"{d}/blobs/sha256/{l['digest'][7:]}" for l in m["layers"]))
PY
)"
work=$(mktemp -d /var/tmp/kiln-bench-apply.XXXXXX)
trap 'rm -rf "$work"' EXIT
results=$work/results
for ((r = 0; r < runs; r++)); do
    for i in "${!bins[@]}"; do
        rm -rf "$work/tree" "$work/flat.tar"
        sync
        a=$(APPLY_ONLY=1 "${bins[$i]}" "$work/tree" "${layers[@]}" | sed -n 's/^seconds=//p')
        f=$(FLATTEN_ONLY=1 "${bins[$i]}" "$work/flat.tar" "${layers[@]}" | sed -n 's/^seconds=//p')
        echo "$i $a $f" >>"$results"
    done
done
python3 - "$results" "${bins[@]}" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
bins = sys.argv[2:]
print(f"{'binary':<60} {'apply s (median, range)':>26} {'flatten s (median, range)':>28}")
for i, b in enumerate(bins):
    a = [float(r[1]) for r in rows if int(r[0]) == i]
    f = [float(r[2]) for r in rows if int(r[0]) == i]
    fmt = lambda v: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
    print(f"{b[-60:]:<60} {fmt(a):>26} {fmt(f):>28}")
PY
