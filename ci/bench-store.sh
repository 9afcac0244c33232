#!/usr/bin/env bash
# Store benchmark (issue 3). Not a test: never run by `cargo test` or ci/test.sh.
#
# Measures, on one >= 1 GiB artifact and in the same run:
#   - the single-core limits on that file: `sha256sum` and `zstd -3` MB/s;
#   - the standard tools one after the other on it, `openssl dgst -sha256 FILE` then
#     `zstd -3 -T0 FILE` (all cores), against `kiln store import` of it into a new local
#     store: both times and kiln's speed as a ratio to the tools' (issue 16: >= 1.0);
#   - import (chunk, hash, compress, write) into a local store and into S3 (moto), MB/s;
#   - `kiln store push` local -> S3 and `kiln store pull` S3 -> a fresh local store, MB/s;
#   - a second `kiln store push` of the same tag, every object already there: its time and
#     the objects it checked;
#   - export (materialize: read, verify, decompress, write a sparse file) MB/s;
#   - the dedup ratio of a second, near-identical artifact (the first with 1000 bytes inserted
#     in the middle and 1 MiB overwritten) imported after the first.
# MB = 10^6 bytes. Needs the servers of ci/setup.sh (sources $KILN_CI_CACHE/env).
#
#   KILN_BENCH_DIR    work directory; default $KILN_CI_CACHE/bench-store
#   KILN_BENCH_SIZE   artifact size in MiB; default 1024
#   KILN_BENCH_SOURCE directory whose tarball makes the artifact's bytes; default /usr
#   KILN_BENCH_FILE   an existing file to use as the artifact instead (e.g. an ext4 image
#                     from `kiln store export`); the dedup twin is then not measured
set -euo pipefail

ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=ci/bench-common.sh
. "$ci_dir/bench-common.sh"
bench_env
work=${KILN_BENCH_DIR:-$KILN_CI_CACHE/bench-store}
size_mib=${KILN_BENCH_SIZE:-1024}
source_dir=${KILN_BENCH_SOURCE:-/usr}
mkdir -p "$work"

log() { printf 'bench-store: %s\n' "$*" >&2; }

bench_apt zstd openssl
bench_kiln release

# The artifact: real bytes (a tarball of $source_dir, cut to size), and its near twin.
a=$work/a.bin
b=$work/b.bin
if [ -n "${KILN_BENCH_FILE:-}" ]; then
  a=$KILN_BENCH_FILE
  b=
elif [ ! -f "$a" ] || [ "$(stat -c %s "$a")" -ne $((size_mib << 20)) ]; then
  log "making a ${size_mib} MiB artifact from a tarball of $source_dir"
  tar -C "$source_dir" -cf - . 2>/dev/null | head -c $((size_mib << 20)) >"$a" || true
  [ "$(stat -c %s "$a")" -eq $((size_mib << 20)) ] || { log "$source_dir is too small"; exit 1; }
  half=$((size_mib << 19))
  { head -c "$half" "$a"; head -c 1000 /dev/urandom; tail -c +$((half + 1)) "$a"; } >"$b"
  dd if=/dev/urandom of="$b" bs=1M count=1 seek=$((size_mib / 4)) conv=notrunc status=none
fi
bytes=$(stat -c %s "$a")

now() { bench_now; }
mbps() { awk -v b="$bytes" -v s="$1" -v e="$2" 'BEGIN { printf "%.0f", b / (e - s) / 1e6 }'; }
timed() { # label command... ; prints "label: N MB/s" and remembers the last JSON line
  local t0 t1
  # The file stays in the page cache (it fits in RAM): every step reads it warm, as
  # sha256sum and zstd do.
  t0=$(now)
  "$@" >"$work/last.json"
  t1=$(now)
  printf '| %s | %s |\n' "$label" "$(mbps "$t0" "$t1")"
}

local1=$work/store-local
local2=$work/store-pulled
s3="s3://$KILN_TEST_S3_BUCKET/bench-$$"
rm -rf "$local1" "$local2" "$work/out.img"

echo "# store benchmark: $(date -u +%FT%TZ), $(nproc) cores, artifact $a ($((bytes >> 20)) MiB)"
echo

# kiln store import against the standard tools on the same file, in the same run: the
# file is read once first so that all of them read it from the page cache.
cat "$a" >/dev/null
t0=$(now)
openssl dgst -sha256 "$a" >/dev/null
zstd -q -3 -T0 -c "$a" >/dev/null
t1=$(now)
rm -rf "$work/store-ratio"
"$kiln" --json store import "$a" bench:ratio --store "$work/store-ratio" >/dev/null
t2=$(now)
rm -rf "$work/store-ratio"
awk -v b="$bytes" -v s="$t0" -v m="$t1" -v e="$t2" 'BEGIN {
  printf "| import vs the tools | seconds | MB/s |\n| --- | ---: | ---: |\n"
  printf "| openssl dgst -sha256, then zstd -3 -T0 | %.2f | %.0f |\n", m - s, b / (m - s) / 1e6
  printf "| kiln store import (new local store) | %.2f | %.0f |\n", e - m, b / (e - m) / 1e6
  printf "\nkiln import / the tools (speed): %.2f\n\n", (m - s) / (e - m) }'

echo "| step | MB/s |"
echo "| --- | ---: |"
label="sha256sum (1 core)" timed sha256sum "$a"
label="zstd -3 (1 core)" timed zstd -3 -T1 -q -c "$a" -o /dev/null
label="import to local" timed "$kiln" --json store import "$a" bench:a --store "$local1"
label="import to S3 (moto)" timed "$kiln" --json store import "$a" bench:direct --store "$s3"
label="push local -> S3 (moto)" timed "$kiln" --json store push bench:a --store "$local1" --to "$s3"
t0=$(now)
"$kiln" --json store push bench:a --store "$local1" --to "$s3" >"$work/again.json"
t1=$(now)
label="pull S3 (moto) -> new local" timed "$kiln" --json store pull bench:a --from "$s3" --store "$local2"
label="export (materialize) from local" timed "$kiln" --json store export bench:a "$work/out.img" --store "$local2"
cmp -s "$a" "$work/out.img" || { log "exported artifact differs from the original"; exit 1; }

python3 - "$work/again.json" "$t0" "$t1" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
done = ev[-1]
secs = float(sys.argv[3]) - float(sys.argv[2])
print()
print(f"push again, every object already in S3: {secs:.2f} s; last event: {json.dumps(done)}")
PY

[ -n "$b" ] || exit 0
echo
"$kiln" --json store import "$b" bench:b --store "$local1" >"$work/b.json"
python3 - "$work/b.json" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
done = [e for e in ev if e.get("event") == "imported"][-1]
print(f"second artifact (1000 bytes inserted mid-file, 1 MiB overwritten), imported after the first:")
print(f"  chunks {done['chunks']}, already present {done['chunksPresent']} "
      f"({100 * done['chunksPresent'] / max(done['chunks'], 1):.1f}%), "
      f"raw bytes already present {100 * done['bytesPresent'] / max(done['bytes'], 1):.1f}%, "
      f"uploaded {done['storedUploaded'] / 1e6:.1f} MB stored")
PY
