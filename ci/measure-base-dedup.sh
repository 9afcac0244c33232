#!/usr/bin/env bash
# How much of an image that adds a package to a Debian base the store already holds from the
# same base plus one small file (issue 33, "dedup stays": "an image FROM debian:bookworm that
# adds jq holds 97.5% of the raw chunk bytes of the same base plus one small file"; a change
# to the store must keep this within one point). Builds, with kiln, into one fresh local store
# and in this order:
#   base-file   the base, then COPY one small file (/etc/kiln-note, 30 bytes)
#   jq          the base, then RUN apt-get install jq (from Debian's archive, over the
#               build's default network), apt's lists and caches removed after it
# "The base" is the Debian fixture, ci/fixtures.sh's debootstrap bookworm minbase in the test
# registry ($KILN_TEST_DEBIAN_REF, 127.0.0.1:5000/debian:bookworm; from $KILN_CI_CACHE/env
# when not set), with a first step common to both recipes (one cached layer) that makes it
# look like the official debian:bookworm image, which Docker Hub serves and this host cannot
# reach: that image ships no apt lists, and its /etc/apt/apt.conf.d/docker-clean keeps apt
# from writing /var/cache/apt/*.bin. The fixture has 55 MB of lists, and the two apt caches
# are 78 MB; with neither step the jq image shared 60.7% of its raw chunk bytes, nearly all
# of the rest being those caches (measured 2026-12-05).
# Measured 2026-12-06 with both steps, two runs of main at 34ba665 (packs, cuts on all cores)
# and one of a kiln built before packs: the jq image has 95.98% of its raw chunk bytes in the
# base-file image in all three (5.46 MB new, of 135.98 MB), the ceiling of whole 4 KiB blocks
# is 97.66%; both kilns cut the same jq.img into the same table (`kiln store import` gave one
# manifest digest).
# From the two images' chunk tables (`kiln inspect --json --chunks`), prints:
#   - of the jq image's raw (non-hole) chunk bytes, the share whose chunk the base-file image
#     has (reused) and the share that is new: the figure of the goal, read as "new bytes"
#     the way ci/measure-rebuild-dedup.sh reads its pairs;
#   - of the base-file image's raw chunk bytes, the share whose chunk the jq image holds (the
#     issue's wording read literally);
#   - the same share counted in whole 4 KiB blocks of the two ext4 images (from `kiln store
#     export`): the ceiling of any chunking (DESIGN.md), so that a drop can be told apart
#     from a layout change;
#   - chunk counts, raw bytes and build wall times.
#
# Needs: a kiln binary (KILN_BIN, default $CARGO_TARGET_DIR/release/kiln, else
# target/release/kiln), root (the builder's namespaces), python3, the test registry with the
# Debian fixture (ci/setup.sh), and Debian's archive reachable from this host (checked first).
# Not part of CI.
#
#   ci/measure-base-dedup.sh [WORKDIR]      # WORKDIR default: a new mktemp -d
#
# The store and the kiln cache live in WORKDIR and are removed at exit; a WORKDIR made by the
# script is removed too when the measurement succeeds (logs are kept on failure). Set
# KILN_MEASURE_KEEP=1 to keep everything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
KILN_BIN=${KILN_BIN:-${CARGO_TARGET_DIR:-target}/release/kiln}
. ci/measure-lib.sh
made_work=
[ -n "${1:-}" ] || made_work=1
measure_init "${1:-}"
[ -x "$kiln" ] || { echo "measure: no kiln binary at $kiln (set KILN_BIN)" >&2; exit 1; }
if [ -z "${KILN_TEST_DEBIAN_REF:-}" ]; then
  # shellcheck disable=SC1091
  . "${KILN_CI_CACHE:-/var/cache/kiln-ci}/env"
fi
deb=${KILN_TEST_DEBIAN_REF:?no KILN_TEST_DEBIAN_REF: run ci/setup.sh (it pushes the Debian fixture)}
store=$work/store
cache=$work/cache
ok=

cleanup() {
  [ -z "${KILN_MEASURE_KEEP:-}" ] || return 0
  rm -rf --one-file-system "$store" "$cache" "$work/file.img" "$work/jq.img"
  if [ -n "$ok" ] && [ -n "$made_work" ]; then rm -rf --one-file-system "$work"; fi
}
trap cleanup EXIT

# Preflight: the registry holds the base, and Debian's archive answers (the mirror apt uses
# here, which debootstrap wrote into the fixture's sources.list).
curl -sf -m 5 "http://${deb%%/*}/v2/" >/dev/null || {
  echo "measure: no registry at ${deb%%/*} (ci/setup.sh starts it)" >&2; exit 1; }
mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null |
  awk '$2 == "bookworm" { print $1; exit }')
mirror=${mirror:-http://deb.debian.org/debian/}
curl -sf -m 20 -o /dev/null "${mirror%/}/dists/bookworm/InRelease" || {
  echo "measure: Debian's archive ($mirror) does not answer from this host: the jq image cannot be built" >&2
  exit 1; }

mkdir -p "$work/base-file" "$work/jq"
printf 'one small file, kiln issue 33\n' >"$work/base-file/kiln-note"
# The common first step: the official image's apt cache setting, and no lists.
base_step=$(cat <<'EOF'
RUN printf 'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n' \
      >/etc/apt/apt.conf.d/docker-clean \
 && rm -rf /var/lib/apt/lists/*
EOF
)
printf 'FROM %s\n%s\nCOPY kiln-note /etc/kiln-note\n' "$deb" "$base_step" >"$work/base-file/Dockerfile"
cat >"$work/jq/Dockerfile" <<EOF
FROM $deb
$base_step
RUN apt-get update -qq \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends jq \\
 && apt-get clean \\
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
EOF

# build NAME TAG CONTEXT: one timed `kiln --json build` into the fresh store.
build() {
  local name=$1 tag=$2 ctx=$3 t0 t1
  t0=$(measure_secs)
  measure_run "$name" env KILN_STORE="$store" KILN_CACHE="$cache" "$kiln" --json build "$ctx" -t "$tag"
  t1=$(measure_secs)
  echo "$name $tag $(python3 -c "print(f'{$t1 - $t0:.2f}')")" >>"$work/times"
}
: >"$work/times"
build base-file base:file "$work/base-file"
build jq base:jq "$work/jq"
for t in file jq; do
  measure_run "inspect-$t" env KILN_CACHE="$cache" "$kiln" --json inspect "base:$t" --chunks --store "$store"
  measure_run "export-$t" env KILN_CACHE="$cache" "$kiln" store export "base:$t" "$work/$t.img" --store "$store"
done

python3 - "$work" <<'PY'
import hashlib, json, sys
work = sys.argv[1]

def blocks(name):  # the non-zero 4 KiB blocks of an exported image, by sha256
    out, zero = [], bytes(4096)
    with open(f"{work}/{name}.img", "rb") as f:
        while b := f.read(4096):
            if b != zero[:len(b)]:
                out.append(hashlib.sha256(b).digest())
    return out

def table(name):
    ev = [json.loads(l) for l in open(f"{work}/inspect-{name}.out") if l.strip()]
    info = next(e for e in ev if e.get("event") == "inspect")
    chunks = [(e["digest"], e["rawLen"]) for e in ev if e.get("event") == "chunk" and e.get("digest")]
    return info, chunks

fi, f = table("file")
ji, j = table("jq")
fset, jset = {d for d, _ in f}, {d for d, _ in j}
f_raw, j_raw = sum(n for _, n in f), sum(n for _, n in j)
j_shared = sum(n for d, n in j if d in fset)
f_held = sum(n for d, n in f if d in jset)
print(f"{'image':<34} {'chunks':>7} {'raw MB':>8} {'image MiB':>10}")
for what, info, c, raw in [("base + one small file (base:file)", fi, f, f_raw), ("base + jq (base:jq)", ji, j, j_raw)]:
    print(f"{what:<34} {len(c):>7} {raw/1e6:>8.2f} {info['size']/2**20:>10.0f}")
print()
print(f"jq image, raw chunk bytes the base-file image has: {j_shared/1e6:.2f} of {j_raw/1e6:.2f} MB "
      f"= {100.0*j_shared/j_raw:.2f}% (new: {100.0*(j_raw-j_shared)/j_raw:.2f}%)")
print(f"base-file image, raw chunk bytes the jq image holds: {f_held/1e6:.2f} of {f_raw/1e6:.2f} MB "
      f"= {100.0*f_held/f_raw:.2f}%")
print(f"chunks of the jq image already in the base-file image: {sum(1 for d, _ in j if d in fset)} of {len(j)}")
built = [json.loads(l) for l in open(f"{work}/jq.out") if '"built"' in l]
if built and "disk" in built[-1]:  # kiln's own report of the jq build, as a cross-check
    d = built[-1]["disk"]
    print(f"kiln build's own report for the jq image: new {d['new_bytes']/1e6:.2f} MB in {d['new_chunks']} chunks, "
          f"reused {d['reused_bytes']/1e6:.2f} MB in {d['reused_chunks']} chunks")
fb, jb = set(blocks("file")), blocks("jq")
print(f"ceiling, whole 4 KiB blocks: {sum(1 for b in jb if b in fb)} of the jq image's {len(jb)} non-zero blocks "
      f"are in the base-file image = {100.0*sum(1 for b in jb if b in fb)/len(jb):.2f}%")
print()
print(f"{'build':<10} {'tag':<10} {'wall s':>7}")
for l in open(f"{work}/times"):
    n, t, s = l.split()
    print(f"{n:<10} {t:<10} {s:>7}")
PY
ok=1
if [ -n "$made_work" ] && [ -z "${KILN_MEASURE_KEEP:-}" ]; then
  echo "(work directory $work removed; KILN_MEASURE_KEEP=1 keeps it)"
else
  echo "logs: $work"
fi
