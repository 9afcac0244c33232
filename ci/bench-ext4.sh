#!/usr/bin/env bash
# MB/s of kiln's layers → flattened tar → `mke2fs -d -` path against `mke2fs -d DIR` on the
# same tree unpacked to disk, in the same run, for (1) the Debian bookworm fixture and (2) a
# tree of more than 1 GB (the Debian layer plus a generated 1.1 GB layer).
#
#   ci/bench-ext4.sh [WORKDIR]        (as root: unpacking keeps owners and device nodes)
#
# "kiln" times ext4::build end to end: both passes over the (gzip) layers, the tar stream
# into mke2fs, xattrs, and the e2fsck -fn check. "mke2fs -d DIR" times mke2fs alone on the
# tree already on disk, with the same options and size; e2fsck on its image is timed
# separately so the two can be compared with or without the check, and so is unpacking the
# flattened tar with GNU tar (what a DIR-based path would add). MB/s = file data bytes
# of the tree / seconds. The machine's other load is not controlled: compare within a run.
set -euo pipefail
cd "$(dirname "$0")/.."
keep_target=${CARGO_TARGET_DIR:-}
[ -f /var/cache/kiln-ci/env ] && . /var/cache/kiln-ci/env
export CARGO_TARGET_DIR=${keep_target:-${CARGO_TARGET_DIR:-target}}
PROFILE=${PROFILE:-dev}
cargo build -q -p kiln-builder --example ext4_build --profile "$PROFILE"
dir=debug; [ "$PROFILE" = dev ] || dir=$PROFILE
BIN=$CARGO_TARGET_DIR/$dir/examples/ext4_build
WORK=${1:-$(mktemp -d /var/tmp/kiln-bench-ext4.XXXXXX)}
mkdir -p "$WORK"
: "${KILN_TEST_DEBIAN_OCI:?run ci/setup.sh first (it builds the Debian fixture)}"

debian_layers() {
    python3 - "$KILN_TEST_DEBIAN_OCI" <<'PY'
import json, sys
d = sys.argv[1]
idx = json.load(open(f"{d}/index.json"))
m = json.load(open(f"{d}/blobs/sha256/{idx['manifests'][0]['digest'][7:]}"))
print(" ".join(f"{d}/blobs/sha256/{l['digest'][7:]}" for l in m["layers"]))
PY
}

# timed OUTFILE CMD...: runs CMD (stdout to OUTFILE), prints "wall cpu" seconds (cpu = user +
# system of CMD and its children, e.g. mke2fs under kiln; less sensitive to other load).
timed() {
    python3 - "$@" <<'PY'
import resource, subprocess, sys, time
out = open(sys.argv[1], "w")
t = time.time()
subprocess.run(sys.argv[2:], check=True, stdout=out)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"{time.time() - t:.3f} {r.ru_utime + r.ru_stime:.3f}")
PY
}

bench() { # name layers...
    local name=$1; shift
    local img=$WORK/$name.kiln.ext4 tree=$WORK/$name.tree dimg=$WORK/$name.dir.ext4
    sync
    local ours; ours=$(timed "$WORK/out" "$BIN" "$img" "$@")
    local out; out=$(cat "$WORK/out")
    local mib data args
    mib=$(sed -n 's/.* mib=\([^ ]*\).*/\1/p' <<<"$out")
    data=$(sed -n 's/.*data_bytes=\([^ ]*\).*/\1/p' <<<"$out")
    args=$(sed -n 's/.* args=\(.*\)$/\1/p' <<<"$out")
    # The same tree on disk: the flattened tar unpacked as root.
    rm -rf "$tree" && mkdir -p "$tree"
    FLATTEN_ONLY=1 "$BIN" "$WORK/$name.flat.tar" "$@" >/dev/null
    sync
    local unpack
    unpack=$(timed /dev/null tar --numeric-owner --xattrs --xattrs-include='*' -xpf "$WORK/$name.flat.tar" -C "$tree")
    rm -f "$WORK/$name.flat.tar" "$dimg" && : >"$dimg"
    sync
    local mk fsck
    # shellcheck disable=SC2086 # the recorded options are words
    mk=$(timed /dev/null env -i PATH="$PATH" E2FSPROGS_FAKE_TIME=1704067200 mke2fs $args -d "$tree" "$dimg" "${mib}M")
    fsck=$(timed /dev/null e2fsck -fn "$dimg")
    # shellcheck disable=SC2086 # "wall cpu" pairs
    python3 - "$name" "$data" "$mib" $ours $mk $fsck $unpack <<'PY'
import sys
name, data, mib = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ow, oc, mw, mc, fw, fc, uw, uc = map(float, sys.argv[4:12])
mb = data / 1e6
print(f"{name}: {mb:.0f} MB of file data, {mib} MiB image (wall s, MB/s by wall; cpu s)")
def row(label, w, c):
    print(f"  {label:44} {w:7.2f} s {mb / w:7.1f} MB/s   cpu {c:6.2f} s")
row("kiln layers -> tar -> mke2fs -d - + e2fsck", ow, oc)
row("mke2fs -d DIR (tree already on disk)", mw, mc)
row("mke2fs -d DIR + e2fsck", mw + fw, mc + fc)
row("tar -x (flattened tar) + the above", uw + mw + fw, uc + mc + fc)
PY
    rm -rf "$tree" "$img" "$dimg"
}

DEB=$(debian_layers)
# shellcheck disable=SC2086
bench debian $DEB

# A generated layer: 1024 files of 1 MiB (random, incompressible) and 8192 small files of
# 1-8 KiB, gzip -1, on top of the Debian layer.
BIG=$WORK/big-src
if [ ! -f "$WORK/big.tar.gz" ]; then
    rm -rf "$BIG" && mkdir -p "$BIG/data/big" "$BIG/data/small"
    python3 - "$BIG" <<'PY'
import os, sys, random
root = sys.argv[1]
rnd = random.Random(1)
for i in range(1024):
    with open(f"{root}/data/big/f{i:04}", "wb") as f:
        f.write(os.urandom(1 << 20))
for i in range(8192):
    d = f"{root}/data/small/d{i % 64:02}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/s{i:05}", "wb") as f:
        f.write(os.urandom(rnd.randint(1024, 8192)))
PY
    tar --numeric-owner -C "$BIG" -cf - . | gzip -1 >"$WORK/big.tar.gz"
    rm -rf "$BIG"
fi
# shellcheck disable=SC2086
bench big $DEB "$WORK/big.tar.gz"
