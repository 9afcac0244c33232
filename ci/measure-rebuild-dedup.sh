#!/usr/bin/env bash
# How much of a rebuilt image is new, and how long a no-change rebuild takes (issue 16,
# "rebuilds that upload only what changed"). Builds into one fresh local store, with the
# peer baseline's cases (../shared/peer/cases, base images on 127.0.0.1:5100 from
# ../shared/peer/make-base-images.sh, run first):
#   apt-1            cases/apt
#   apt-2            cases/apt with --build-arg VARIANT=2 (one more 14-byte file, last RUN)
#   apt-again        cases/apt unchanged: a no-change rebuild (every step cached); timed
#   apt-nc-1/2       cases/apt twice with --no-cache and SOURCE_DATE_EPOCH, no change
#   small-1          a copy of cases/small
#   small-2          the same with one line added to a context file (app/main.py)
#   small-again      small unchanged again: a no-change rebuild; timed
# Prints, per pair, the share of the second image's raw (non-hole) chunk bytes that no
# image built before it had, read from the store's own image manifests (chunk tables), so
# any kiln version can be measured; and the wall times of the builds.
#
# Needs: a kiln binary (KILN_BIN, default target/release/kiln), root (the builder's
# namespaces), python3, the peer registry. Not part of CI.
#
#   ci/measure-rebuild-dedup.sh [WORKDIR]      # WORKDIR default: a new mktemp -d
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. ci/measure-lib.sh
measure_init "${1:-}"
peer=${PEER_DIR:-$(pwd)/../shared/peer}
[ -d "$peer/cases/apt" ] || { echo "measure: no peer cases in $peer (set PEER_DIR)" >&2; exit 1; }
curl -sf -m 5 http://127.0.0.1:5100/v2/ >/dev/null || {
  echo "measure: no registry on 127.0.0.1:5100: run $peer/make-base-images.sh" >&2; exit 1; }
store=$work/store
epoch=1700000000

# build NAME TAG CONTEXT [kiln build flags...]: one timed `kiln --json build`.
build() {
  local name=$1 tag=$2 ctx=$3
  shift 3
  local t0 t1
  t0=$(measure_secs)
  measure_run "$name" env KILN_STORE="$store" "$kiln" --json build "$ctx" -t "$tag" "$@"
  t1=$(measure_secs)
  echo "$name $tag $(python3 -c "print(f'{$t1 - $t0:.2f}')")" >>"$work/times"
}

: >"$work/times"
build apt-1 apt:1 "$peer/cases/apt"
build apt-2 apt:2 "$peer/cases/apt" --build-arg VARIANT=2
build apt-again apt:again "$peer/cases/apt"
build apt-nc-1 apt:nc1 "$peer/cases/apt" --no-cache --build-arg SOURCE_DATE_EPOCH=$epoch
build apt-nc-2 apt:nc2 "$peer/cases/apt" --no-cache --build-arg SOURCE_DATE_EPOCH=$epoch
small=$work/small
rm -rf "$small"
cp -r "$peer/cases/small" "$small"
chmod -R u+w "$small"
build small-1 small:1 "$small"
echo "# one more line" >>"$small/app/main.py"
build small-2 small:2 "$small"
build small-again small:again "$small"

python3 - "$store" "$work/times" <<'PY'
import json, os, sys
store, times = sys.argv[1], sys.argv[2]

def manifest(tag):
    name, t = tag.split(":")
    ref = json.load(open(os.path.join(store, "tags", name, t)))
    hexd = ref["manifest"].split(":", 1)[1]
    return json.load(open(os.path.join(store, "manifests", "sha256", hexd)))

def chunks(tag):
    return [(e["digest"], e["rawLen"]) for e in manifest(tag)["disk"]["entries"] if "digest" in e]

order = [l.split()[1] for l in open(times)]
pairs = [("apt, VARIANT=2 (one more file)", "apt:2"),
         ("apt, no change (cached)", "apt:again"),
         ("apt, no change, --no-cache + SDE", "apt:nc2"),
         ("small, one line added", "small:2"),
         ("small, no change (cached)", "small:again")]
print(f"{'pair':<36} {'image MB':>9} {'new MB':>8} {'new %':>7}")
for what, tag in pairs:
    before = set()
    for t in order[:order.index(tag)]:
        before.update(d for d, _ in chunks(t))
    c = chunks(tag)
    total = sum(n for _, n in c)
    new = sum(n for d, n in c if d not in before)
    print(f"{what:<36} {total/1e6:>9.2f} {new/1e6:>8.2f} {100.0*new/total:>6.2f}%")
print()
print(f"{'build':<14} {'tag':<12} {'wall s':>7}")
for l in open(times):
    n, t, s = l.split()
    print(f"{n:<14} {t:<12} {s:>7}")
PY
echo "logs and store: $work"
