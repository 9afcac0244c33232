#!/usr/bin/env bash
# Store benchmark (issue 3). Not a test: never run by `cargo test` or ci/test.sh.
#
# Measures, on one >= 1 GiB artifact and in the same run:
#   - the single-core limits on that file: `sha256sum` and `zstd -3` MB/s;
#   - the standard tools one after the other on it, `openssl dgst -sha256 FILE` then
#     `zstd -3 -T0 FILE` (all cores), against `kiln store import` of it into a new local
#     store: both times and kiln's speed as a ratio to the tools' (issues 16 and 33: >= 1.0;
#     kiln finds the FastCDC cuts of a file on up to 4 cores, 8 MiB per core at a time, and
#     hashes and compresses chunks on all of them);
#   - import (cut, hash, compress, write) into a local store and into S3 (moto), MB/s;
#   - `kiln store push` local -> S3 and `kiln store pull` S3 -> a fresh local store, MB/s;
#   - a second `kiln store push` of the same tag, every object already there: its time and
#     the objects it checked;
#   - export (materialize: read, verify, decompress, write a sparse file) MB/s;
#   - the dedup ratio of a second, near-identical artifact (the first with 1000 bytes inserted
#     in the middle and 1 MiB overwritten) imported after the first;
#   - issue 33's S3 baseline: `kiln store push` (local -> S3, a new prefix) and `kiln store
#     pull` (S3 -> a new local store) of the artifact against a plain boto3 `upload_file` and
#     `download_file` of the same file as one multipart object (boto3's TransferConfig
#     defaults: 8 MiB parts, 10 threads) to the same server, KILN_BENCH_RUNS times,
#     alternating which goes first; per step the median MB/s with its spread, and kiln's
#     speed as a ratio to boto3's (median and spread of the per-run ratios). Goal (issue
#     33): push and pull >= 0.8x boto3. boto3's times are taken inside Python around the
#     transfer call alone (no interpreter start or import), kiln's around the whole process.
#     Caveat, moto 5.1: every GET, ranged or not, copies the whole object out of its buffer
#     under the object's lock before slicing it (moto/s3/models.py FakeKey.value), so boto3's
#     download of one large object is bounded by moto, not by the transfer: measured here,
#     ranged 122 MB/s and one GET 181 MB/s at 32 MiB, but about 20 MB/s for both at 512 MiB
#     (load 8 on 2 cores). A one-GET download (no ranges) is printed beside the ranged one;
#     the pull baseline says more about moto than about kiln until a real S3 is used.
# MB = 10^6 bytes, always of the raw artifact (kiln moves zstd chunks, boto3 the raw file).
# Needs the servers of ci/setup.sh (sources $KILN_CI_CACHE/env). S3 work goes to a bucket of
# its own on that server (kiln-bench-PID), emptied and removed at exit, as are the local
# stores; the artifacts stay in KILN_BENCH_DIR for the next run. boto3 comes from ci/setup.sh's
# venv ($KILN_CI_CACHE/venv, moto's) when it has it, else from a venv of the bench's own
# ($KILN_BENCH_DIR/venv-boto3, made with pip on first use).
#
#   KILN_BENCH_DIR    work directory; default $KILN_CI_CACHE/bench-store
#   KILN_BENCH_SIZE   artifact size in MiB; default 1024
#   KILN_BENCH_RUNS   runs of the push/pull baseline; default 3
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
runs=${KILN_BENCH_RUNS:-3}

# boto3: ci/setup.sh's venv has it (moto depends on it); on a bare machine, a venv of our own.
boto3_version=1.44.18
py=
for cand in "$KILN_CI_CACHE/venv/bin/python" "$work/venv-boto3/bin/python"; do
  if [ -x "$cand" ] && "$cand" -c 'import boto3' 2>/dev/null; then py=$cand; break; fi
done
if [ -z "$py" ]; then
  log "installing boto3==$boto3_version into $work/venv-boto3"
  bench_apt python3-venv
  rm -rf "$work/venv-boto3"
  python3 -m venv "$work/venv-boto3"
  "$work/venv-boto3/bin/pip" install -q "boto3==$boto3_version"
  py=$work/venv-boto3/bin/python
fi

# s3py OP ARGS...: one boto3 operation against the test server; prints what it measured.
#   mb BUCKET | rb BUCKET (every object, then the bucket) | rm BUCKET PREFIX (its objects)
#   put FILE BUCKET KEY | get BUCKET KEY FILE (ranged, 8 MiB parts) | get1 BUCKET KEY FILE
#   (one GET): prints the seconds of the transfer call alone
#   version
s3py() {
  "$py" - "$@" <<'PY'
import os, sys, time
import boto3
from boto3.s3.transfer import TransferConfig
op, args = sys.argv[1], sys.argv[2:]
if op == "version":
    print(boto3.__version__)
    sys.exit()
s3 = boto3.client("s3", endpoint_url=os.environ["KILN_TEST_S3_ENDPOINT"])
cfg = TransferConfig()  # boto3's defaults: multipart above 8 MiB, 8 MiB parts, 10 threads
def empty(bucket, prefix=""):
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys[i:i + 1000], "Quiet": True})
if op == "mb":
    s3.create_bucket(Bucket=args[0])
elif op == "rb":
    try:
        empty(args[0])
        s3.delete_bucket(Bucket=args[0])
    except s3.exceptions.NoSuchBucket:
        pass
elif op == "rm":
    empty(args[0], args[1])
elif op == "put":
    t0 = time.monotonic()
    s3.upload_file(args[0], args[1], args[2], Config=cfg)
    print(f"{time.monotonic() - t0:.6f}")
elif op in ("get", "get1"):
    # get1: one GET, no ranges (TransferConfig's threshold above the object's size)
    c, cl = cfg, s3
    if op == "get1":
        # moto answers a whole GET of a multipart object with a checksum that is not the
        # object's (botocore: FlexibleChecksumError), so this one does not validate it.
        from botocore.config import Config
        c = TransferConfig(multipart_threshold=1 << 62)
        cl = boto3.client("s3", endpoint_url=os.environ["KILN_TEST_S3_ENDPOINT"],
                          config=Config(response_checksum_validation="when_required"))
    t0 = time.monotonic()
    cl.download_file(args[0], args[1], args[2], Config=c)
    print(f"{time.monotonic() - t0:.6f}")
else:
    sys.exit(f"s3py: unknown op {op}")
PY
}

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
bucket=kiln-bench-$$
s3="s3://$bucket/bench"
cleanup() {
  rm -rf "$local1" "$local2" "$work/out.img" "$work/store-ratio" "$work"/store-run-* \
    "$work/boto3.out"
  s3py rb "$bucket" || log "could not remove the bucket $bucket"
}
trap cleanup EXIT
rm -rf "$local1" "$local2" "$work/out.img"
s3py mb "$bucket"

echo "# store benchmark: $(date -u +%FT%TZ), $(nproc) cores, artifact $a ($((bytes >> 20)) MiB)"
echo "load average $(cut -d' ' -f1-3 /proc/loadavg); $kiln ($("$kiln" --version), tree $(git -C "$bench_repo" rev-parse --short HEAD)); boto3 $(s3py version)"
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
# A prefix of its own: the push below must find nothing there (it used to follow this import
# into the same prefix, every chunk already present).
label="import to S3 (moto)" timed "$kiln" --json store import "$a" bench:direct --store "s3://$bucket/direct"
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

# Issue 33's S3 baseline: kiln push/pull against boto3 moving the same bytes as one
# multipart object, KILN_BENCH_RUNS times. Each run pushes to a new prefix (nothing there
# yet) and pulls into a new local store; its objects are removed before the next run.
echo
kp=() bp=() kl=() bl=() b1=()
secs() { awk -v s="$1" -v e="$2" 'BEGIN { printf "%.6f", e - s }'; }
kiln_push() {
  local t0 t1
  t0=$(now)
  "$kiln" --json store push bench:a --store "$local1" --to "s3://$bucket/run-$1" >/dev/null
  t1=$(now)
  kp+=("$(secs "$t0" "$t1")")
}
kiln_pull() {
  local t0 t1
  rm -rf "$work/store-run-$1"
  t0=$(now)
  "$kiln" --json store pull bench:a --from "s3://$bucket/run-$1" --store "$work/store-run-$1" >/dev/null
  t1=$(now)
  kl+=("$(secs "$t0" "$t1")")
  rm -rf "$work/store-run-$1"
}
boto3_put() { bp+=("$(s3py put "$a" "$bucket" "boto3-$1/artifact")"); }
boto3_get() {
  bl+=("$(s3py get "$bucket" "boto3-$1/artifact" "$work/boto3.out")")
  cmp -s "$a" "$work/boto3.out" || { log "boto3's download differs from the artifact"; exit 1; }
  rm -f "$work/boto3.out"
  b1+=("$(s3py get1 "$bucket" "boto3-$1/artifact" "$work/boto3.out")")
  cmp -s "$a" "$work/boto3.out" || { log "boto3's one-GET download differs from the artifact"; exit 1; }
  rm -f "$work/boto3.out"
}
for i in $(seq 1 "$runs"); do
  if [ $((i % 2)) -eq 1 ]; then
    kiln_push "$i"; boto3_put "$i"; kiln_pull "$i"; boto3_get "$i"
  else
    boto3_put "$i"; kiln_push "$i"; boto3_get "$i"; kiln_pull "$i"
  fi
  s3py rm "$bucket" "run-$i/"
  s3py rm "$bucket" "boto3-$i/"
done
echo "| S3 (moto), $runs runs, alternating | median MB/s | spread MB/s |"
echo "| --- | ---: | ---: |"
row() { # label seconds...
  local label=$1 t v
  shift
  v=$(for t in "$@"; do awk -v b="$bytes" -v t="$t" 'BEGIN { printf "%.0f\n", b / t / 1e6 }'; done)
  printf '| %s | %s | %s |\n' "$label" "$(echo "$v" | bench_median)" "$(echo "$v" | bench_spread)"
}
row "kiln store push local -> S3 (new prefix)" "${kp[@]}"
row "boto3 upload_file (one multipart object)" "${bp[@]}"
row "kiln store pull S3 -> new local store" "${kl[@]}"
row "boto3 download_file (one multipart object)" "${bl[@]}"
row "boto3 download_file, one GET (no ranges; see the header)" "${b1[@]}"
ratio() { # NAME-OF-KILN-SECONDS NAME-OF-BOTO3-SECONDS: per run, boto3's time / kiln's
  local -n k=$1 o=$2
  local i
  for i in "${!k[@]}"; do awk -v k="${k[$i]}" -v o="${o[$i]}" 'BEGIN { printf "%.2f\n", o / k }'; done
}
r=$(ratio kp bp)
echo
echo "kiln push / boto3 upload (speed): median $(echo "$r" | bench_median) ($(echo "$r" | bench_spread)); goal >= 0.8"
r=$(ratio kl bl)
echo "kiln pull / boto3 download (speed): median $(echo "$r" | bench_median) ($(echo "$r" | bench_spread)); goal >= 0.8"
r=$(ratio kl b1)
echo "kiln pull / boto3 one-GET download (speed): median $(echo "$r" | bench_median) ($(echo "$r" | bench_spread))"

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
