#!/usr/bin/env bash
# How much of a night's ext4 image is new (issue "kiln exec and kiln nightly", the figure):
# three `kiln nightly` runs of base-images/debian.yaml into one fresh store, with
# SOURCE_DATE_EPOCH fixed:
#   night 1  the first night (everything is new);
#   night 2  nothing changed upstream;
#   night 3  one package changed: a local apt repository's package `kiln-probe` goes from
#            1.0 to 1.1 (a .deb made with dpkg-deb, served by python's http.server).
# Prints, per night, the ext4 image's new and reused chunk bytes (raw) and the share new,
# from each night's `--json` report (pipeline::nightly::NightlyReport.disk).
#
# The build's network (slirp4netns with --disable-host-loopback) cannot reach the host's
# 127.0.0.1 by design, so the repository listens on the host's own address (the source
# address of its default route).
#
# Needs: a kiln binary (KILN_BIN, default target/release/kiln), KILN_KERNEL and
# KILN_INITRAMFS (as `kiln nightly` does; `kiln-test-guest-assets` prints them), dpkg-deb,
# dpkg-scanpackages (dpkg-dev) and python3. Runs as root (the builder's namespaces, QEMU).
#
#   ci/measure-nightly-dedup.sh [WORKDIR]      # WORKDIR default: a new mktemp -d
#
# Behind a TLS-inspecting proxy, set EXTRA_CA_CERTS to its CA certificates (PEM), e.g.
# EXTRA_CA_CERTS="$(cat /usr/local/share/ca-certificates/*.crt)": it is passed on as the
# recipe's build argument of that name (see base-images/debian.yaml's header).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. ci/measure-lib.sh
measure_init "${1:-}"
store=$work/store
repo=$work/apt
mkdir -p "$repo"

addr=$(ip -4 route get 1.1.1.1 | sed -n 's/.* src \([0-9.]*\).*/\1/p')
[ -n "$addr" ] || { echo "measure: no host address to serve the apt repository on" >&2; exit 1; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
python3 -m http.server --bind "$addr" --directory "$repo" "$port" >"$work/http.log" 2>&1 &
http_pid=$!
trap 'kill $http_pid 2>/dev/null || true' EXIT

# The package at version $1: one file naming its version.
publish() {
  local v=$1 root=$work/pkg-$1
  rm -rf "$root" "$repo"/*.deb
  mkdir -p "$root/DEBIAN" "$root/usr/share/kiln-probe"
  printf 'Package: kiln-probe\nVersion: %s\nArchitecture: all\nMaintainer: kiln <kiln@localhost>\nDescription: one file whose content is its version\n' "$v" >"$root/DEBIAN/control"
  printf '%s\n' "$v" >"$root/usr/share/kiln-probe/version"
  SOURCE_DATE_EPOCH=1700000000 dpkg-deb --root-owner-group --build "$root" "$repo/kiln-probe_${v}_all.deb" >/dev/null
  (cd "$repo" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null >Packages)
}

# debian.yaml with one more step, first: the local repository's package.
recipe=$work/debian-probe.yaml
python3 - base-images/debian.yaml "$recipe" <<'PY'
import sys
text = open(sys.argv[1]).read()
text = text.replace("args:\n", "args:\n  LOCAL_APT: \"\"\n", 1)
step = """commands:
  # The measurement's local apt repository (ci/measure-nightly-dedup.sh).
  - |
    set -eu
    export DEBIAN_FRONTEND=noninteractive
    echo "deb [trusted=yes] $LOCAL_APT ./" >/etc/apt/sources.list.d/kiln-probe.list
    apt-get update -o Dir::Etc::sourcelist=/etc/apt/sources.list.d/kiln-probe.list \\
      -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0
    apt-get install -y --no-install-recommends kiln-probe
    rm -f /etc/apt/sources.list.d/kiln-probe.list
    rm -rf /var/lib/apt/lists/*
"""
assert "commands:\n" in text
text = text.replace("commands:\n", step, 1)
open(sys.argv[2], "w").write(text)
PY

night() {
  local day=$1
  measure_run "night-$day" env KILN_STORE="$store" KILN_STATE_DIR="$work/state" \
    KILN_SNAPSHOT_CACHE="$work/snapshots" \
    "$kiln" nightly "$recipe" --tag debian-probe:latest --day "$day" --json \
    --build-arg SOURCE_DATE_EPOCH=1700000000 --build-arg "LOCAL_APT=http://$addr:$port" \
    --build-arg "EXTRA_CA_CERTS=${EXTRA_CA_CERTS:-}" \
    --report-file "$work/night-$day.json"
}

publish 1.0
t=$(date +%s); night 20261201; echo "night 1 (first) took $(( $(date +%s) - t )) s"
t=$(date +%s); night 20261202; echo "night 2 (no change) took $(( $(date +%s) - t )) s"
publish 1.1
t=$(date +%s); night 20261203; echo "night 3 (kiln-probe 1.0 -> 1.1) took $(( $(date +%s) - t )) s"

python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
print(f"{'night':<28} {'new chunks':>10} {'new MB':>9} {'reused MB':>10} {'holes MB':>9} {'new %':>7}")
for day, what in [("20261201", "1 first"), ("20261202", "2 no change"), ("20261203", "3 one package changed")]:
    r = json.load(open(f"{work}/night-{day}.json"))
    d = r["disk"]
    raw = d["new_bytes"] + d["reused_bytes"]
    share = 100.0 * d["new_bytes"] / raw if raw else 0.0
    print(f"{what:<28} {d['new_chunks']:>10} {d['new_bytes']/1e6:>9.2f} {d['reused_bytes']/1e6:>10.2f} "
          f"{d['hole_bytes']/1e6:>9.2f} {share:>6.2f}%")
    if r.get("packages"):
        print(f"{'':<28} packages: {json.dumps(r['packages'])[:300]}")
PY
echo "reports and logs: $work"
