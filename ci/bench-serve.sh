#!/usr/bin/env bash
# `kiln serve` benchmark (issue 13, "Benchmark, not a test"). Not a test: never run by
# `cargo test` or ci/test.sh.
#
# One real `kiln serve` (release build) on a free 127.0.0.1 port, its state directory and
# store in a temporary directory, one API key. A small recipe with no network (FROM scratch,
# COPY of Debian's static busybox, RUN with it, COPY), its context uploaded once with PUT
# /v1/blobs, is built twice: the first build runs its steps, the second must find every
# step in the build cache. Then, with wrk (closed loop, fixed connections and duration):
#   - GET /healthz: axum's floor, the peer the other figures are ratios to;
#   - GET /v1/builds/{id} of the second build;
#   - POST /v1/builds of the same build (a JSON body naming the uploaded context) into a
#     workspace whose queue is full (quota max-queued 0): every answer is a 429, after the
#     same parsing and recipe check as an accepted one;
#   - POST /v1/builds of the same build into the benchmark's workspace (queue cap
#     KILN_BENCH_MAX_QUEUED): each accepted build is all cache hits, and the workers run
#     them while the load goes on.
# Then it waits until every accepted build has ended, and says how long that took after the
# last POST was answered, and how many POSTs got 429.
# Exits non-zero when a response was a 5xx, a request got no answer, or an accepted build
# did not end (or did not succeed) within KILN_BENCH_DRAIN_TIMEOUT.
#
# SQLite by default; PostgreSQL when KILN_TEST_POSTGRES_URL is set (`. ci/setup.sh` starts
# one on 127.0.0.1:5433 and exports it): a new database there, dropped at the end.
#
#   KILN_BENCH_DURATION       seconds of load per endpoint; default 10
#   KILN_BENCH_CONNECTIONS    concurrent connections; default 16
#   KILN_BENCH_THREADS        wrk threads; default 1 (2 cores: one for the server)
#   KILN_BENCH_WORKERS        the server's --workers; default 2
#   KILN_BENCH_MAX_QUEUED     the workspace's queue cap (past it: 429); default 100000, so
#                             that every POST is accepted. Draining them takes a while: 2
#                             workers end 3 to 5 cache-hit builds a second on 2 cores, so
#                             10 s of POSTs (about 1800 builds) take 6 to 10 minutes
#   KILN_BENCH_MAX_CONCURRENT the workspace's builds at once; default 2
#   KILN_BENCH_DRAIN_TIMEOUT  seconds to wait for the accepted builds; default 1800
#   KILN_BENCH_DIR            work directory; default a new /var/tmp/kiln-bench-serve.*,
#                             removed at the end unless KILN_BENCH_KEEP=1
#   PROFILE                   cargo profile of the kiln binary; default release
set -euo pipefail

ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
duration=${KILN_BENCH_DURATION:-10}
conns=${KILN_BENCH_CONNECTIONS:-16}
threads=${KILN_BENCH_THREADS:-1}
workers=${KILN_BENCH_WORKERS:-2}
max_queued=${KILN_BENCH_MAX_QUEUED:-100000}
max_concurrent=${KILN_BENCH_MAX_CONCURRENT:-2}
drain_timeout=${KILN_BENCH_DRAIN_TIMEOUT:-1800}
pg_url=${KILN_TEST_POSTGRES_URL:-}
PROFILE=${PROFILE:-release}

log() { printf 'bench-serve: %s\n' "$*" >&2; }

# shellcheck source=ci/bench-common.sh
. "$ci_dir/bench-common.sh"
# What this script needs from Debian: wrk, busybox-static (the recipe's one binary), curl,
# and psql for the PostgreSQL run.
pkgs=(wrk busybox-static curl)
[ -z "$pg_url" ] || pkgs+=(postgresql-client)
bench_apt "${pkgs[@]}"

bench_kiln "$PROFILE"

if [ -n "${KILN_BENCH_DIR:-}" ]; then
  work=$KILN_BENCH_DIR
  rm -rf "$work/state" "$work/store" "$work/out"
  mkdir -p "$work"
else
  work=$(mktemp -d /var/tmp/kiln-bench-serve.XXXXXX)
fi
mkdir -p "$work/out"
server_pid=
pg_db=
cleanup() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  if [ -n "$pg_db" ]; then
    psql "$pg_url" -qAtc "DROP DATABASE IF EXISTS $pg_db" >/dev/null 2>&1 || true
  fi
  if [ -z "${KILN_BENCH_DIR:-}" ] && [ "${KILN_BENCH_KEEP:-}" != 1 ]; then
    rm -rf "$work"
  fi
}
trap cleanup EXIT

# The server reads only its flags: no config file or KILN_* setting of the caller's.
: >"$work/config.toml"
export KILN_CONFIG=$work/config.toml KILN_CACHE=$work/cache KILN_LOG=warn
unset KILN_STORE KILN_LISTEN KILN_SERVE_DATABASE KILN_SERVE_STATE_DIR KILN_STATE_DIR RUST_LOG

db_args=()
backend=sqlite
if [ -n "$pg_url" ]; then
  backend=postgresql
  pg_db=kiln_bench_$$_$(date +%s)
  psql "$pg_url" -qAtc "CREATE DATABASE $pg_db" >/dev/null
  db_args=(--database "${pg_url%/*}/$pg_db")
fi

# The server, on a free port, and its operator listener (/metrics) on another (it prints
# the addresses it got).
"$kiln" serve --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --trust-tenants \
  --state-dir "$work/state" --store "$work/store" --workers "$workers" "${db_args[@]}" \
  2>"$work/serve.log" &
server_pid=$!
base=
for _ in $(seq 1 300); do
  base=$(sed -n 's/^kiln serve: listening on \(http[^ ]*\).*/\1/p' "$work/serve.log")
  metrics_url=$(sed -n 's/^kiln serve: metrics on \(http[^ ]*\).*/\1/p' "$work/serve.log")
  [ -n "$base" ] && break
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$base" ]; then
  log "kiln serve did not start; its log:"
  cat "$work/serve.log" >&2
  exit 1
fi
new_key() { # WORKSPACE quota flags...
  local ws=$1
  shift
  "$kiln" serve keys create --workspace "$ws" --state-dir "$work/state" "${db_args[@]}" "$@" \
    2>/dev/null
}
key=$(new_key bench --max-queued "$max_queued" --max-concurrent "$max_concurrent")
full_key=$(new_key full --max-queued 0)

# The recipe and its context, uploaded once.
ctx=$work/ctx
rm -rf "$ctx" && mkdir -p "$ctx"
cp /bin/busybox "$ctx/busybox"
echo "hello from the bench context" >"$ctx/hello.txt"
cat >"$ctx/Dockerfile" <<'EOF'
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "sh", "-c", "/bin/busybox mkdir -p /etc && echo built > /etc/built"]
COPY hello.txt /etc/hello.txt
EOF
tar -C "$ctx" --sort=name --owner=0 --group=0 --mtime=@1700000000 -cf "$work/ctx.tar" .
digest=sha256:$(sha256sum "$work/ctx.tar" | cut -d' ' -f1)
auth=(-H "Authorization: Bearer $key")
for k in "$key" "$full_key"; do
  curl -fsS -o /dev/null -H "Authorization: Bearer $k" -X PUT \
    -H 'Content-Type: application/octet-stream' --data-binary @"$work/ctx.tar" \
    "$base/v1/blobs/$digest"
done
printf '{"context":"%s","tags":["bench:1"],"build_args":{"SOURCE_DATE_EPOCH":"1700000000"}}' \
  "$digest" >"$work/build.json"

# build_once: submits the build, waits for its end, prints its JSON view.
build_once() {
  local id i v
  id=$(curl -fsS "${auth[@]}" -H 'Content-Type: application/json' \
    --data-binary @"$work/build.json" "$base/v1/builds" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])')
  for i in $(seq 1 3000); do
    v=$(curl -fsS "${auth[@]}" "$base/v1/builds/$id")
    case $(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["state"])' "$v") in
    succeeded | failed | cancelled) printf '%s\n' "$v"; return ;;
    esac
    sleep 0.1
  done
  log "build $id did not end in 300 s"
  return 1
}
log "warm-up build (runs its steps)"
build_once >"$work/out/cold.json"
log "second build (every step a cache hit)"
build_once >"$work/out/warm.json"
warm_id=$(python3 - "$work/out/cold.json" "$work/out/warm.json" <<'PY'
import json, sys
cold, warm = (json.load(open(p)) for p in sys.argv[1:3])
for name, v in (("warm-up", cold), ("second", warm)):
    if v["state"] != "succeeded":
        sys.exit(f"bench-serve: the {name} build did not succeed: {json.dumps(v, indent=1)}")
missed = [s["location"] for s in warm["steps"] if not s["cached"]]
if missed or not warm["steps"]:
    sys.exit(f"bench-serve: the second build missed the cache at {missed}")
print(warm["id"])
PY
)

# The load generator: wrk with a script that counts answers by status, keeps the ids of the
# accepted builds (one file per thread) and writes the figures as JSON.
cat >"$work/bench.lua" <<'LUA'
local threads, n = {}, 0
function setup(thread)
  n = n + 1
  thread:set("tid", n)
  table.insert(threads, thread)
end
function init(args)
  statuses = {}
  local headers = {}
  local key = os.getenv("BENCH_KEY")
  if key and key ~= "" then headers["Authorization"] = "Bearer " .. key end
  local body
  local bf = os.getenv("BENCH_BODY")
  if bf and bf ~= "" then
    local f = assert(io.open(bf, "rb"))
    body = f:read("*a")
    f:close()
    headers["Content-Type"] = "application/json"
  end
  req = wrk.format(os.getenv("BENCH_METHOD") or "GET", nil, headers, body)
  local idf = os.getenv("BENCH_IDS")
  if idf and idf ~= "" then
    ids = assert(io.open(idf .. "." .. tid, "w"))
    ids:setvbuf("line")
  end
end
function request() return req end
function response(status, headers, body)
  local k = tostring(status)
  statuses[k] = (statuses[k] or 0) + 1
  if ids and status == 202 then
    local id = body:match('"id"%s*:%s*"([^"]+)"')
    if id then ids:write(id, "\n") end
  end
end
function done(summary, latency, requests)
  local st = {}
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("statuses")) do st[k] = (st[k] or 0) + v end
  end
  local parts = {}
  for k, v in pairs(st) do table.insert(parts, string.format('"%s":%d', k, v)) end
  local e = summary.errors
  local f = assert(io.open(os.getenv("BENCH_OUT"), "w"))
  f:write(string.format(
    '{"requests":%d,"duration_us":%d,"errors":{"connect":%d,"read":%d,"write":%d,"timeout":%d},' ..
    '"latency_us":{"mean":%.1f,"p50":%d,"p90":%d,"p99":%d,"max":%d},"statuses":{%s}}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, table.concat(parts, ",")))
  f:close()
end
LUA

# load NAME KEY METHOD PATH [BODY]: wrk against PATH; figures in out/NAME.json.
load() {
  local name=$1 k=$2 method=$3 path=$4 body=${5:-}
  log "$name: $method $path: $conns connections, $threads thread(s), ${duration}s"
  BENCH_KEY=$k BENCH_METHOD=$method BENCH_BODY=$body BENCH_OUT=$work/out/$name.json \
    BENCH_IDS=$([ "$method" = POST ] && echo "$work/out/$name.ids") \
    wrk -t "$threads" -c "$conns" -d "${duration}s" --timeout 60s -s "$work/bench.lua" \
    "$base$path" >"$work/out/$name.wrk"
}
metric() { # metric NAME: its value on /metrics
  curl -fsS "$metrics_url" | awk -v m="$1" '$1 == m { print $2 }'
}

load healthz "" GET /healthz
load get "$key" GET "/v1/builds/$warm_id"
load post429 "$full_key" POST /v1/builds "$work/build.json"
t_first=$(date +%s.%N)
load post "$key" POST /v1/builds "$work/build.json"
t_last=$(date +%s.%N)

# Every accepted build ends: wait until none is queued or running.
log "waiting for the accepted builds to end"
drained=
while :; do
  q=$(metric 'kiln_builds{state="queued"}')
  r=$(metric 'kiln_builds{state="running"}')
  if [ "$q" = 0 ] && [ "$r" = 0 ]; then
    drained=$(date +%s.%N)
    break
  fi
  if awk -v a="$t_last" -v b="$(date +%s.%N)" -v t="$drain_timeout" 'BEGIN { exit !(b - a > t) }'; then
    log "builds still queued ($q) or running ($r) ${drain_timeout}s after the last POST"
    break
  fi
  sleep 0.2
done
curl -fsS "$metrics_url" >"$work/out/metrics.txt"
cat "$work/out"/post.ids.* 2>/dev/null | sort -u >"$work/out/accepted.ids"

BENCH_THREADS=$threads BENCH_CONNS=$conns BENCH_DURATION=$duration BENCH_WORKERS=$workers \
  BENCH_MAX_CONCURRENT=$max_concurrent BENCH_MAX_QUEUED=$max_queued \
  python3 - "$work/out" "$base" "$key" "$t_first" "$t_last" "${drained:-}" "$backend" <<'PY'
import http.client, json, os, statistics, sys, urllib.parse
from datetime import datetime

out, base, key, t_first, t_last, drained, backend = sys.argv[1:8]
t_first, t_last = float(t_first), float(t_last)
rows = (("healthz", "GET /healthz"), ("get", "GET /v1/builds/{id}"),
        ("post429", "POST /v1/builds, queue full"), ("post", "POST /v1/builds, all cache hits"))
fig = {n: json.load(open(f"{out}/{n}.json")) for n, _ in rows}
env = os.environ


def rate(f):
    return f["requests"] / (f["duration_us"] / 1e6)


def ts(s):
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


# Each accepted id that wrk saw, one GET each: its state, times and cache hits.
u = urllib.parse.urlsplit(base)
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
ids = [l.strip() for l in open(f"{out}/accepted.ids") if l.strip()]
states, spans, ends, missed = {}, [], [], 0
for i in ids:
    conn.request("GET", f"/v1/builds/{i}", headers={"Authorization": f"Bearer {key}"})
    r = conn.getresponse()
    v = json.loads(r.read())
    st = v.get("state", f"HTTP {r.status}")
    states[st] = states.get(st, 0) + 1
    if v.get("started_at") and v.get("finished_at"):
        spans.append(ts(v["finished_at"]) - ts(v["started_at"]))
        ends.append(ts(v["finished_at"]))
    missed += any(not s["cached"] for s in v.get("steps", []))

metrics = {}
for l in open(f"{out}/metrics.txt"):
    if l.strip() and not l.startswith("#"):
        k, _, val = l.rpartition(" ")
        metrics[k] = float(val)
by_state = {s: int(metrics.get(f'kiln_builds{{state="{s}"}}', 0))
            for s in ("queued", "running", "succeeded", "failed", "cancelled")}
in_db = sum(by_state.values())

hz = fig["healthz"]
print(f"# kiln serve benchmark: {datetime.now().astimezone().isoformat(timespec='seconds')}, "
      f"{os.cpu_count()} cores, {backend}")
print(f"wrk: {env['BENCH_THREADS']} thread(s), {env['BENCH_CONNS']} connections, "
      f"{env['BENCH_DURATION']} s per row; kiln serve --workers {env['BENCH_WORKERS']}, "
      f"workspace quota max-concurrent {env['BENCH_MAX_CONCURRENT']}, "
      f"max-queued {env['BENCH_MAX_QUEUED']}")
print()
print("| endpoint | requests | req/s | p50 ms | p99 ms | req/s / healthz | p99 / healthz | answers |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
bad = []
for name, label in rows:
    f = fig[name]
    lat = f["latency_us"]
    answers = " ".join(f"{k}:{v}" for k, v in sorted(f["statuses"].items()))
    errs = {k: v for k, v in f["errors"].items() if v}
    if not f["requests"]:
        bad.append(f"{label}: no request answered in {env['BENCH_DURATION']} s")
    if errs:
        answers += " no answer: " + " ".join(f"{k}:{v}" for k, v in errs.items())
        bad.append(f"{label}: requests without an answer: {errs}")
    five = sum(v for k, v in f["statuses"].items() if k.startswith("5"))
    if five:
        bad.append(f"{label}: {five} answers 5xx")
    print(f"| {label} | {f['requests']} | {rate(f):.0f} | {lat['p50'] / 1e3:.2f} | "
          f"{lat['p99'] / 1e3:.2f} | {rate(f) / rate(hz):.4f} | "
          f"{lat['p99'] / max(hz['latency_us']['p99'], 1):.1f} | {answers} |")

p = fig["post"]["statuses"]
accepted, throttled = p.get("202", 0), p.get("429", 0)
unseen = in_db - 2 - accepted
print()
print(f"POST, all cache hits: {accepted} accepted (202), {throttled} refused with 429 "
      f"(the full workspace: {fig['post429']['statuses'].get('429', 0)}; /metrics counts "
      f"{metrics.get('kiln_submissions_throttled_total', 0):.0f} in all)")
if unseen < 0:
    bad.append(f"{accepted} builds accepted but only {in_db - 2} in the database (lost)")
elif unseen:
    print(f"  plus {unseen} accepted while wrk was stopping (answers it did not read)")
if len(ids) != accepted:
    bad.append(f"{accepted} answers 202 but {len(ids)} distinct build ids")
print("builds by state (/metrics, the 2 warm-up builds included): "
      + ", ".join(f"{k} {v}" for k, v in by_state.items()))
print("the accepted ids, each read back: " + ", ".join(f"{k} {v}" for k, v in sorted(states.items()))
      + f"; {missed} with a step not found in the cache")
if drained:
    d = float(drained) - t_last
    print(f"every build ended {d:.1f} s after the last POST was answered; "
          f"{in_db - 2} builds in {float(drained) - t_first:.1f} s from the first POST: "
          f"{(in_db - 2) / (float(drained) - t_first):.1f} builds/s")
else:
    bad.append("builds still queued or running at the drain timeout")
if spans:
    print(f"one build, claim to end: median {statistics.median(spans) * 1e3:.0f} ms, "
          f"p99 {sorted(spans)[int(len(spans) * 0.99)] * 1e3:.0f} ms, max {max(spans) * 1e3:.0f} ms")
if by_state["failed"] or by_state["cancelled"] or any(k != "succeeded" for k in states):
    bad.append(f"builds that did not succeed: {by_state}, {states}")
if missed:
    bad.append(f"{missed} accepted builds ran a step (a cache miss)")
for b in bad:
    print(f"FAIL: {b}")
sys.exit(1 if bad else 0)
PY
