#!/usr/bin/env bash
# Chunking measurement for disk images (issue 3): which chunking should the store use for ext4
# images? Builds two Debian bookworm minbase trees with debootstrap that differ by one package,
# makes deterministic `mke2fs -d` images of each in several layouts, and runs
# `store/examples/measure_chunking.rs` on each pair: share of the second image's chunks already
# present from the first, cost of a random 4 KiB read, objects per GiB.
#
# Not a test and not part of CI: run by hand, as root (debootstrap), on a machine where
# `ci/setup.sh` has run (e2fsprogs >= 1.47.1 with libarchive13, debootstrap, zstd).
#
#   KILN_MEASURE_DIR   work directory (trees, images); default $KILN_CI_CACHE/chunking
#   KILN_MEASURE_PKG   the one package the second tree adds; default `less` (313 KiB installed)
#   KILN_MEASURE_SIZE  image size given to mke2fs; default 1G
#   KILN_MEASURE_LAYOUTS  which layouts to measure; default all four (see "Layouts" below)
#
# Output: one table per layout on stdout (Markdown), also kept in $KILN_MEASURE_DIR/figures.md.
set -euo pipefail

KILN_CI_CACHE=${KILN_CI_CACHE:-/var/cache/kiln-ci}
work=${KILN_MEASURE_DIR:-$KILN_CI_CACHE/chunking}
pkg=${KILN_MEASURE_PKG:-less}
size=${KILN_MEASURE_SIZE:-1G}
ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$ci_dir")
mkdir -p "$work/debs"

log() { printf 'measure-chunking: %s\n' "$*" >&2; }

# The mirror apt already uses for bookworm (never written into a file).
mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null |
  awk '$2 == "bookworm" { print $1; exit }')
[ -n "$mirror" ] || { log "cannot find the mirror apt uses for bookworm"; exit 1; }

tree() { # name [extra debootstrap args]
  local name=$1
  shift
  if [ -f "$work/$name.done" ]; then return; fi
  rm -rf "${work:?}/$name"
  log "debootstrap $name $*"
  local t0=$SECONDS
  debootstrap --variant=minbase --cache-dir="$work/debs" "$@" bookworm "$work/$name" "$mirror" \
    >"$work/$name.log" 2>&1 || { tail -20 "$work/$name.log" >&2; exit 1; }
  log "debootstrap $name took $((SECONDS - t0)) s"
  touch "$work/$name.done"
}
tree a
tree b --include="$pkg"

# Deterministic mke2fs: fixed UUID, hash seed and clock.
export E2FSPROGS_FAKE_TIME=1700000000 SOURCE_DATE_EPOCH=1700000000
mkfs() { # input image
  rm -f "$2"
  mke2fs -q -F -t ext4 -b 4096 -U 6b696c6e-0000-4000-8000-000000000001 \
    -E hash_seed=6b696c6e-0000-4000-8000-000000000002 -d "$1" "$2" "$size"
}

# mke2fs 1.47.2 clamps inode times to SOURCE_DATE_EPOCH but keeps older ones, and reading a
# tree moves its atimes (relatime): set every atime to now, so all are clamped alike.
find "$work/a" "$work/b" -exec touch -a -h {} +

# Layouts. dir: mke2fs walks the directory itself (readdir order). tar-name: a tarball sorted
# by name. tar-layer: base files first (the names tree a has, sorted), then the files only the
# second tree has (sorted), the order a layered build would give when the package is a later
# layer. tar-writer: as tar-layer, but files the second tree changed (content, mode, owner or
# mtime differ) also move to the end: each file sits with the last layer that wrote it.
tar_list() { # tree listfile -> tar
  tar --numeric-owner --xattrs --no-recursion -C "$work/$1" -T "$2" -cf "$work/$1.$3.tar"
}
(cd "$work/a" && find . -mindepth 1 | LC_ALL=C sort) >"$work/a.names"
(cd "$work/b" && find . -mindepth 1 | LC_ALL=C sort) >"$work/b.names"
LC_ALL=C comm -12 "$work/a.names" "$work/b.names" >"$work/b.common"
LC_ALL=C comm -13 "$work/a.names" "$work/b.names" >"$work/b.new"
cat "$work/b.common" "$work/b.new" >"$work/b.layer"
python3 - "$work" <<'PY' >"$work/b.writer"
import filecmp, os, sys
work = sys.argv[1]
common = open(f"{work}/b.common").read().splitlines()
new = open(f"{work}/b.new").read().splitlines()
epoch = int(os.environ["SOURCE_DATE_EPOCH"])
def same(p):
    # Directories stay in place: a tarball must name a directory before its entries.
    a, b = os.path.join(work, "a", p), os.path.join(work, "b", p)
    sa, sb = os.lstat(a), os.lstat(b)
    if os.path.isdir(a) and not os.path.islink(a):
        return True
    # mke2fs clamps times to SOURCE_DATE_EPOCH, so compare clamped times.
    ma, mb = min(int(sa.st_mtime), epoch), min(int(sb.st_mtime), epoch)
    if (sa.st_mode, sa.st_uid, sa.st_gid, ma) != (sb.st_mode, sb.st_uid, sb.st_gid, mb):
        return False
    if os.path.islink(a):
        return os.readlink(a) == os.readlink(b)
    if os.path.isfile(a):
        return filecmp.cmp(a, b, shallow=False)
    return True
kept = [p for p in common if same(p)]
changed = [p for p in common if not same(p)]
print(f"{len(changed)} changed paths: {' '.join(changed[:12])}", file=sys.stderr)
print("\n".join(kept + changed + new))
PY
log "tree b has $(wc -l <"$work/b.new") paths tree a lacks, and lacks $(LC_ALL=C comm -23 "$work/a.names" "$work/b.names" | wc -l) of its paths"

for t in a b; do
  mkfs "$work/$t" "$work/$t.dir.img"
  tar_list "$t" "$work/$t.names" name
  mkfs "$work/$t.name.tar" "$work/$t.tar-name.img"
done
cp "$work/a.tar-name.img" "$work/a.tar-layer.img"
tar_list b "$work/b.layer" layer
mkfs "$work/b.layer.tar" "$work/b.tar-layer.img"
cp "$work/a.tar-name.img" "$work/a.tar-writer.img"
tar_list b "$work/b.writer" writer
mkfs "$work/b.writer.tar" "$work/b.tar-writer.img"

# Determinism check: the same input twice gives the same bytes.
mkfs "$work/a" "$work/a.again.img"
cmp -s "$work/a.dir.img" "$work/a.again.img" || { log "mke2fs output is not deterministic"; exit 1; }
rm -f "$work/a.again.img"

log "building the measuring tool"
(cd "$repo" && cargo build -q --release -p kiln-store --example measure_chunking)
tool=${CARGO_TARGET_DIR:-$repo/target}/release/examples/measure_chunking

{
  echo "# chunking figures: debootstrap bookworm minbase, second tree adds \`$pkg\`"
  echo
  echo "image size $size, mke2fs $(mke2fs -V 2>&1 | head -1 | awk '{print $2}'), $(date -u +%F)"
  du -sb "$work/a" "$work/b" | awk '{printf "tree %s: %d bytes\n\n", $2, $1}'
  for layout in ${KILN_MEASURE_LAYOUTS:-dir tar-name tar-layer tar-writer}; do
    echo "## layout: $layout"
    echo
    "$tool" "$work/a.$layout.img" "$work/b.$layout.img"
    echo
  done
} | tee "$work/figures.md"
