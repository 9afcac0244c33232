#!/usr/bin/env bash
# Several `kiln serve` nodes on one queue (issue 19). Not a test: never run by `cargo test`
# or ci/test.sh.
#
# For N = 1, 2 and 3 nodes: a new PostgreSQL database on the test server
# (KILN_TEST_POSTGRES_URL) and a new prefix in the test S3 bucket, N real `kiln serve`
# processes on free 127.0.0.1 ports, each with its own state directory and host cache, one
# API key. KILN_BENCH_BUILDS busybox builds (KILN_TEST_BUSYBOX_REF) are submitted round
# robin across the nodes, half of them uncached (each its own RUN) and half one recipe that
# is a cache hit after its first run; the figure is builds per minute from the first POST
# to the last build's end. The machine's cores are shared by all nodes, so the figures show
# the queue and the store, not CPU scaling.
#
# Then, with 2 nodes: a build held inside its RUN step (it fetches from a local server that
# never answers), kill -9 of the node that claimed it, and the time from the kill until
# another node has claimed it again (attempt 2), with --heartbeat KILN_BENCH_HEARTBEAT and
# --takeover-after KILN_BENCH_TAKEOVER.
#
#   KILN_BENCH_BUILDS     builds per node count; default 12
#   KILN_BENCH_WORKERS    each node's --workers; default 2
#   KILN_BENCH_HEARTBEAT  default 1s
#   KILN_BENCH_TAKEOVER   default 3s
#   PROFILE               cargo profile of the kiln binary; default dev (the CI's build)
#
# Needs root (the namespace executor), the test servers of ci/setup.sh and psql.
set -euo pipefail

ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=ci/bench-common.sh
. "$ci_dir/bench-common.sh"
bench_env
bench_apt postgresql-client
bench_kiln "${PROFILE:-dev}"
work=$(mktemp -d /var/tmp/kiln-bench-nodes.XXXXXX)
trap 'rm -rf "$work"' EXIT
: >"$work/config.toml"
export KILN_CONFIG=$work/config.toml KILN_LOG=warn
unset KILN_STORE KILN_LISTEN KILN_SERVE_DATABASE KILN_SERVE_STATE_DIR KILN_STATE_DIR RUST_LOG

python3 - "$kiln" "$work" <<'PY'
import http.server, json, os, signal, socketserver, subprocess, sys, threading, time
import urllib.request

kiln, work = sys.argv[1:3]
env = os.environ
pg = env["KILN_TEST_POSTGRES_URL"]
bucket = env["KILN_TEST_S3_BUCKET"]
bb = env["KILN_TEST_BUSYBOX_REF"]
builds = int(env.get("KILN_BENCH_BUILDS", "12"))
workers = env.get("KILN_BENCH_WORKERS", "2")
hb = env.get("KILN_BENCH_HEARTBEAT", "1s")
takeover = env.get("KILN_BENCH_TAKEOVER", "3s")


def psql(url, sql):
    return subprocess.run(["psql", url, "-qAtc", sql], check=True, capture_output=True,
                          text=True).stdout.strip()


def call(method, url, key, body=None, ctype=None):
    req = urllib.request.Request(url, data=body, method=method)
    req.add_header("Authorization", f"Bearer {key}")
    if ctype:
        req.add_header("Content-Type", ctype)
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def submit(base, key, recipe, tag):
    b = "kiln-bench-boundary"
    spec = json.dumps({"tags": [tag], "network": "host",
                       "build_args": {"SOURCE_DATE_EPOCH": "1700000000"}})
    body = (f"--{b}\r\nContent-Disposition: form-data; name=\"build\"; filename=\"build\"\r\n"
            f"Content-Type: application/json\r\n\r\n{spec}\r\n"
            f"--{b}\r\nContent-Disposition: form-data; name=\"recipe\"; filename=\"recipe\"\r\n"
            f"Content-Type: text/plain\r\n\r\n{recipe}\r\n--{b}--\r\n").encode()
    return call("POST", f"{base}/v1/builds", key, body, f"multipart/form-data; boundary={b}")["id"]


class Cluster:
    def __init__(self, label, n):
        self.dir = os.path.join(work, label)
        name = f"kiln_bench_nodes_{os.getpid()}_{label}"
        psql(pg, f"CREATE DATABASE {name}")
        self.db = f"{pg.rsplit('/', 1)[0]}/{name}"
        self.store = f"s3://{bucket}/bench-nodes-{os.getpid()}-{int(time.time())}-{label}"
        self.nodes = [self.start(i) for i in range(n)]
        out = subprocess.run([kiln, "serve", "keys", "create", "--workspace", "bench",
                              "--database", self.db, "--state-dir", f"{self.dir}/keys",
                              "--max-concurrent", "100", "--max-queued", "10000"],
                             check=True, capture_output=True, text=True)
        self.key = out.stdout.strip()

    def start(self, i):
        d = f"{self.dir}/node{i}"
        os.makedirs(d, exist_ok=True)
        log = open(f"{d}/serve.log", "w+")
        p = subprocess.Popen(
            [kiln, "serve", "--listen", "127.0.0.1:0", "--trust-tenants", "--state-dir",
             f"{d}/state", "--store", self.store, "--database", self.db, "--workers", workers,
             "--heartbeat", hb, "--takeover-after", takeover,
             # The fixture registry is on 127.0.0.1, which tenants may not reach otherwise.
             "--allow-registry", bb.split("/", 1)[0]],
            stderr=log, stdout=subprocess.DEVNULL, env={**env, "KILN_CACHE": f"{d}/cache"})
        for _ in range(600):
            log.seek(0)
            for l in log:
                if l.startswith("kiln serve: listening on "):
                    return (p, l.split()[4])
            if p.poll() is not None:
                sys.exit(f"kiln serve ended: {open(f'{d}/serve.log').read()}")
            time.sleep(0.1)
        sys.exit("kiln serve did not start")

    def wait(self, ids, limit=900):
        t0, left = time.time(), set(ids)
        while left:
            for i in list(left):
                v = call("GET", f"{self.nodes[0][1]}/v1/builds/{i}", self.key)
                if v["state"] in ("succeeded", "failed", "cancelled"):
                    if v["state"] != "succeeded":
                        sys.exit(f"build {i} {v['state']}: {json.dumps(v.get('failure'))}")
                    left.discard(i)
            if time.time() - t0 > limit:
                sys.exit(f"{len(left)} builds did not end in {limit} s")
            time.sleep(0.2)

    def close(self):
        for p, _ in self.nodes:
            if p.poll() is None:
                p.kill()
            p.wait()


print(f"# kiln serve nodes: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, {os.cpu_count()} cores, "
      f"PostgreSQL and S3 (moto) on 127.0.0.1, {builds} builds, --workers {workers}")
print()
print("| nodes | builds | distinct RUN steps | seconds | builds/min |")
print("| ---: | ---: | ---: | ---: | ---: |")
for n in (1, 2, 3):
    c = Cluster(f"n{n}", n)
    try:
        ids, t0 = [], time.time()
        for i in range(builds):
            recipe = (f"FROM {bb}\nRUN echo {n}-{i} > /built\n" if i % 2 == 0
                      else f"FROM {bb}\nRUN echo same > /built\n")
            ids.append(submit(c.nodes[i % n][1], c.key, recipe, f"b:{i}"))
        c.wait(ids)
        dt = time.time() - t0
        print(f"| {n} | {builds} | {(builds + 1) // 2 + 1} | {dt:.1f} | {builds / dt * 60:.1f} |")
    finally:
        c.close()


class Never(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(3600)


srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Never)
srv.daemon_threads = True
threading.Thread(target=srv.serve_forever, daemon=True).start()
c = Cluster("takeover", 2)
try:
    recipe = f"FROM {bb}\nRUN --network=host wget -q -O /x http://127.0.0.1:{srv.server_address[1]}/\n"
    h = submit(c.nodes[0][1], c.key, recipe, "h:1")
    row = ""
    for _ in range(3000):
        row = psql(c.db, "SELECT n.listen FROM builds b JOIN nodes n ON n.id = b.claimed_by "
                   f"WHERE b.id = '{h}' AND b.state = 'running' AND EXISTS (SELECT 1 FROM "
                   f"build_steps s WHERE s.build_id = b.id)")
        if row:
            break
        time.sleep(0.1)
    victim = next(p for p, base in c.nodes if base == f"http://{row}")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    t_kill = time.time()
    while psql(c.db, f"SELECT attempt FROM builds WHERE id = '{h}' AND state = 'running'") != "2":
        if time.time() - t_kill > 300:
            sys.exit("not taken over within 300 s")
        time.sleep(0.05)
    print()
    print(f"takeover after kill -9 (2 nodes, --heartbeat {hb}, --takeover-after {takeover}): "
          f"{time.time() - t_kill:.2f} s from the kill to attempt 2's claim")
finally:
    c.close()
PY
