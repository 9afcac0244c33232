#!/usr/bin/env bash
# Time and peak memory of `kiln plan` on the Dockerfile of issue 44 §3: `FROM busybox AS
# s0`, then `FROM s{i-1} AS s{i}` and `ENV X{i}={i}` for each next stage, (1) with 5,000
# stages (about 170 KB, the reported case) and (2) up to 1 MiB, the size limit of a recipe
# sent to `kiln serve` (MAX_RECIPE_BYTES, about 28,000 stages), and (3) that chain with a
# `RUN true` in each stage, up to 1 MiB: each step carries its whole env (its cache key),
# so that plan is quadratic and is refused at MAX_PLAN_BYTES (64 MiB), exit status 1.
#
#   ci/bench-plan.sh [WORKDIR]
#   PROFILE=dev ci/bench-plan.sh          (default: release, as bench_kiln builds it)
#   KILN_BENCH_KILN=/path/to/kiln ci/bench-plan.sh   (another build, for before/after)
#
# Prints one line per case: stages, bytes, exit status, wall seconds, user+system CPU
# seconds and peak RSS in MiB (getrusage RUSAGE_CHILDREN of the one `kiln plan` run; Linux
# gives ru_maxrss in KiB). The machine's other load is not controlled: compare within a run.
set -euo pipefail
# shellcheck source=ci/bench-common.sh
. "$(dirname "$0")/bench-common.sh"
bench_env
bench_kiln "${PROFILE:-release}"
WORK=${1:-$(mktemp -d /var/tmp/kiln-bench-plan.XXXXXX)}
mkdir -p "$WORK"

# chain FILE MAX_STAGES MAX_BYTES [STEP]: writes the chain (with the instruction STEP in
# each stage after the first), stopping at whichever bound comes first.
chain() {
    python3 - "$@" <<'PY'
import sys
path, stages, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
step = sys.argv[4] + "\n" if len(sys.argv) > 4 else ""
text = "FROM busybox AS s0\n"
i = 1
while i < stages:
    nxt = f"FROM s{i-1} AS s{i}\nENV X{i}={i}\n{step}"
    if len(text) + len(nxt) > limit:
        break
    text += nxt
    i += 1
open(path, "w").write(text)
print(i)
PY
}

# measure NAME FILE: one `kiln plan` run.
measure() {
    python3 - "$kiln" "$2" "$1" <<'PY'
import os, resource, subprocess, sys, time
kiln, path, name = sys.argv[1:4]
t = time.time()
r = subprocess.run([kiln, "plan", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
wall = time.time() - t
u = resource.getrusage(resource.RUSAGE_CHILDREN)
err = [l for l in r.stderr.decode(errors="replace").splitlines() if l.startswith("error")]
tail = f" ({err[0][:100]})" if r.returncode != 0 and err else ""
print(f"{name}: bytes={os.path.getsize(path)} exit={r.returncode} wall={wall:.2f}s "
      f"cpu={u.ru_utime + u.ru_stime:.2f}s maxrss={u.ru_maxrss / 1024:.1f}MiB{tail}")
PY
}

n=$(chain "$WORK/chain-5000.Dockerfile" 5000 $((1 << 30)))
measure "chain stages=$n" "$WORK/chain-5000.Dockerfile"
n=$(chain "$WORK/chain-1mib.Dockerfile" 1000000000 $((1 << 20)))
measure "chain stages=$n" "$WORK/chain-1mib.Dockerfile"
n=$(chain "$WORK/chain-run-1mib.Dockerfile" 1000000000 $((1 << 20)) "RUN true")
measure "chain with RUN stages=$n" "$WORK/chain-run-1mib.Dockerfile"
