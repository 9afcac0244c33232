#!/usr/bin/env bash
# Test environment setup: everything the test suite needs, on a bare Debian 12 machine of
# this kind (root, a Rust toolchain, Python 3). Idempotent: a second run installs nothing and
# restarts only the servers that are not answering.
#
# Source it (`. ci/setup.sh`) to get the environment the tests read, or run it to just set up.
#   KILN_CI_CACHE   where caches live (target dir, venv, fixtures); default /var/cache/kiln-ci
#   KILN_SETUP_PACKAGES_ONLY=1  stop after the packages (what `ci/main-job.sh` needs)
# Exports: CARGO_TARGET_DIR, KILN_TEST_CACHE, KILN_TEST_REGISTRY, KILN_TEST_REGISTRY_AUTH, KILN_TEST_REGISTRY_TOKEN,
#   KILN_TEST_REGISTRY_USER, KILN_TEST_REGISTRY_PASSWORD, KILN_TEST_S3_ENDPOINT, KILN_TEST_S3_BUCKET
#   and the AWS_* variables object_store reads for the test S3 server.
set -euo pipefail

KILN_CI_CACHE=${KILN_CI_CACHE:-/var/cache/kiln-ci}
export KILN_CI_CACHE
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$KILN_CI_CACHE/target}
export KILN_TEST_CACHE=${KILN_TEST_CACHE:-$KILN_CI_CACHE/fixtures}
mkdir -p "$KILN_CI_CACHE" "$KILN_TEST_CACHE" "$KILN_CI_CACHE/run"
ci_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Each line says how long the run has taken so far ($SECONDS: seconds since this shell began).
log() { printf 'setup: [%ss] %s\n' "$SECONDS" "$*" >&2; }

# --- Debian packages ---------------------------------------------------------------------
# Packages from bookworm itself.
apt_main=(docker-registry slirp4netns skopeo umoci busybox-static debootstrap zstd
  python3-venv apache2-utils curl ca-certificates openssl pkg-config
  uidmap iproute2 netcat-openbsd xz-utils postgresql
  git # git: ADD <git url> (run on the host), and the tests of it and of git through the egress proxy
  openssh-client # ssh-agent, ssh-add, ssh-keygen: builder's exec test of RUN --mount=type=ssh
  openssh-server # sshd, started by the test itself on 127.0.0.1 (never the system service): ADD git over ssh
  g++) # g++: libfuzzer-sys builds libFuzzer's C++ sources (ci/fuzz.sh)
# Packages that must come from bookworm-backports: e2fsprogs >= 1.47.1 reads a tarball with
# `mke2fs -d`, and only when libarchive13 is installed. QEMU too: this kind of machine ships
# qemu-utils from backports, which breaks bookworm's qemu-system-common.
apt_bpo=(e2fsprogs libarchive13 qemu-system-x86 qemu-utils)

# The backports suite, on the same mirror apt already uses for bookworm.
add_backports() {
  if grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    return
  fi
  local mirror
  bookworm_mirror() {
    apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null |
      awk '$2 == "bookworm" { print $1; exit }'
  }
  mirror=$(bookworm_mirror)
  if [ -z "$mirror" ]; then
    # indextargets lists only what has been downloaded: a new machine may have no lists yet.
    apt-get update -qq || true
    mirror=$(bookworm_mirror)
  fi
  if [ -z "$mirror" ]; then
    log "cannot find the mirror apt uses for bookworm; add a bookworm-backports line by hand"
    exit 1
  fi
  log "adding bookworm-backports from $mirror"
  echo "deb $mirror bookworm-backports main" >/etc/apt/sources.list.d/kiln-bookworm-backports.list
  apt_updated=
}

need_install() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || return 0
  done
  return 1
}

apt_updated=no
apt_update() {
  if [ "$apt_updated" != yes ]; then
    apt-get update -qq || apt-get update -qq -o APT::Update::Error-Mode=any || true
    apt_updated=yes
  fi
}

e2fs_ok() {
  # 1.47.1 is the first release whose mke2fs -d reads a tarball.
  local v
  v=$(dpkg-query -W -f='${Version}' e2fsprogs 2>/dev/null || echo 0)
  dpkg --compare-versions "$v" ge 1.47.1 && ! need_install libarchive13
}

export DEBIAN_FRONTEND=noninteractive
add_backports
if need_install "${apt_main[@]}"; then
  apt_update
  log "installing ${apt_main[*]}"
  apt-get install -y -qq --no-install-recommends "${apt_main[@]}" >/dev/null
fi
if ! e2fs_ok || need_install "${apt_bpo[@]}"; then
  apt_update
  log "installing ${apt_bpo[*]} from bookworm-backports"
  apt-get install -y -qq --no-install-recommends -t bookworm-backports "${apt_bpo[@]}" >/dev/null
fi
e2fs_ok || { log "e2fsprogs >= 1.47.1 with libarchive13 is required"; exit 1; }

# --- subordinate ids for build steps (issue 36) ---------------------------------------------
# Namespace-executor steps run in a user namespace mapped to the subordinate ids of `kiln`
# (builder/src/exec/userns.rs; README "Build steps run in a user namespace"), as Docker's
# userns-remap uses dockremap's. 65,536 ids from 100000, where useradd(8) starts
# (SUB_UID_MIN in /etc/login.defs), unless the machine already has a range for kiln.
for f in /etc/subuid /etc/subgid; do
  if ! grep -qs '^kiln:' "$f"; then
    log "adding kiln:100000:65536 to $f"
    echo 'kiln:100000:65536' >>"$f"
  fi
done

# --- an unprivileged user for the builds without root (issue 36 §2) -------------------------
# kiln/tests/build_rootless.rs runs `kiln build` as this user, which needs subordinate ids of
# its own (apart from kiln's above) and, for a step's default network (slirp4netns), a
# /dev/net/tun that every user may open: crw-rw-rw-, as Debian's udev rules make it
# (50-udev-default.rules); a machine without udev may have it 0600.
if ! id kiln-rootless >/dev/null 2>&1; then
  log "adding the user kiln-rootless"
  useradd --create-home --shell /usr/sbin/nologin kiln-rootless
fi
for f in /etc/subuid /etc/subgid; do
  if ! grep -qs '^kiln-rootless:' "$f"; then
    log "adding kiln-rootless:300000:65536 to $f"
    echo 'kiln-rootless:300000:65536' >>"$f"
  fi
done
if [ -c /dev/net/tun ] && [ "$(stat -c %a /dev/net/tun)" != 666 ]; then
  log "making /dev/net/tun usable by every user (mode 0666, as udev does)"
  chmod 0666 /dev/net/tun
fi

# --- Rust components -------------------------------------------------------------------------
if command -v rustup >/dev/null; then
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
fi

# `ci/main-job.sh` (the README's main job) needs the packages above, not the test servers.
if [ "${KILN_SETUP_PACKAGES_ONLY:-}" = 1 ]; then
  log "packages installed (KILN_SETUP_PACKAGES_ONLY=1: no servers, no fixtures)"
  return 0 2>/dev/null || exit 0
fi

# --- Python tools (moto's S3 server) in a venv -----------------------------------------------
venv=$KILN_CI_CACHE/venv
# 5.1.4 ignores If-Match on PutObject (a stale compare-and-swap succeeds); 5.1.22 checks it.
moto_version=5.1.22
moto_reinstalled=
if ! "$venv/bin/python" -c "import moto, sys; sys.exit(moto.__version__ != '$moto_version')" 2>/dev/null; then
  moto_reinstalled=1
  log "installing moto[server]==$moto_version into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "moto[server]==$moto_version"
fi

# schemathesis, run by the kiln serve tests against its /openapi.json, in a venv of its own.
st_venv=$KILN_CI_CACHE/venv-schemathesis
schemathesis_version=4.32.5
if ! "$st_venv/bin/schemathesis" --version 2>/dev/null |
  grep -qx "schemathesis, version $schemathesis_version"; then
  log "installing schemathesis==$schemathesis_version into $st_venv"
  rm -rf "$st_venv"
  python3 -m venv "$st_venv"
  "$st_venv/bin/pip" install -q "schemathesis==$schemathesis_version"
fi
export KILN_TEST_SCHEMATHESIS=$st_venv/bin/schemathesis

# --- servers on 127.0.0.1 ------------------------------------------------------------------
run=$KILN_CI_CACHE/run

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
  local port=$1 name=$2 i
  for i in $(seq 1 100); do
    port_open "$port" && return 0
    sleep 0.1
  done
  log "$name did not start on 127.0.0.1:$port; its log:"
  cat "$run/$name.log" >&2 || true
  exit 1
}

start_bg() { # name port command...
  local name=$1 port=$2
  shift 2
  if port_open "$port"; then return; fi
  log "starting $name on 127.0.0.1:$port"
  nohup setsid "$@" >"$run/$name.log" 2>&1 </dev/null &
  echo $! >"$run/$name.pid"
  wait_port "$port" "$name"
}

# Three registries (distribution 2.8): one anonymous, one with basic auth, one with token auth
# (bearer tokens from ci/token-server.py on :5003: anonymous pull, push for the test user).
# Debian's packaged config turns on htpasswd, so each gets a config of our own.
registry_conf() { # name port [auth]
  local name=$1 port=$2 auth=${3:-}
  mkdir -p "$run/$name-data"
  {
    echo "version: 0.1"
    echo "log: {level: warn}"
    echo "storage:"
    echo "  filesystem: {rootdirectory: $run/$name-data}"
    echo "  delete: {enabled: true}"
    echo "http: {addr: 127.0.0.1:$port}"
    if [ "$auth" = token ]; then
      echo "auth:"
      echo "  token: {realm: 'http://127.0.0.1:5003/token', service: kiln-test-registry,"
      echo "    issuer: kiln-test-token-issuer, rootcertbundle: $run/token.crt}"
    elif [ -n "$auth" ]; then
      echo "auth:"
      echo "  htpasswd: {realm: kiln-test, path: $run/$name.htpasswd}"
    fi
  } >"$run/$name.yml"
}
export KILN_TEST_REGISTRY_USER=kiln
export KILN_TEST_REGISTRY_PASSWORD=kiln-test-password
[ -f "$run/registry-auth.htpasswd" ] ||
  htpasswd -Bbn "$KILN_TEST_REGISTRY_USER" "$KILN_TEST_REGISTRY_PASSWORD" >"$run/registry-auth.htpasswd"
registry_conf registry 5000
registry_conf registry-auth 5001 auth
start_bg registry 5000 docker-registry serve "$run/registry.yml"
start_bg registry-auth 5001 docker-registry serve "$run/registry-auth.yml"
export KILN_TEST_REGISTRY=127.0.0.1:5000
export KILN_TEST_REGISTRY_AUTH=127.0.0.1:5001
"$venv/bin/python" "$ci_dir/token-server.py" init "$run"
start_bg token-server 5003 env KILN_TEST_REGISTRY_USER="$KILN_TEST_REGISTRY_USER" \
  KILN_TEST_REGISTRY_PASSWORD="$KILN_TEST_REGISTRY_PASSWORD" \
  "$venv/bin/python" "$ci_dir/token-server.py" serve "$run" 5003
registry_conf registry-token 5002 token
start_bg registry-token 5002 docker-registry serve "$run/registry-token.yml"
export KILN_TEST_REGISTRY_TOKEN=127.0.0.1:5002

# moto's S3 server, in memory. A server started from an older install is restarted.
if [ -n "$moto_reinstalled" ] && [ -f "$run/moto.pid" ] && port_open 9000; then
  log "restarting moto (version changed)"
  kill "$(cat "$run/moto.pid")" 2>/dev/null || true
  for _ in $(seq 1 50); do port_open 9000 || break; sleep 0.1; done
fi
start_bg moto 9000 "$venv/bin/moto_server" -H 127.0.0.1 -p 9000
export KILN_TEST_S3_ENDPOINT=http://127.0.0.1:9000
export KILN_TEST_S3_BUCKET=kiln-test
export AWS_ACCESS_KEY_ID=kiln-test AWS_SECRET_ACCESS_KEY=kiln-test AWS_REGION=us-east-1
export AWS_ENDPOINT_URL=$KILN_TEST_S3_ENDPOINT AWS_ALLOW_HTTP=true
"$venv/bin/python" - <<PY
import boto3, botocore
s3 = boto3.client("s3", endpoint_url="$KILN_TEST_S3_ENDPOINT")
try:
    s3.create_bucket(Bucket="$KILN_TEST_S3_BUCKET")
except botocore.exceptions.ClientError as e:
    if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
        raise
PY

# PostgreSQL (Debian's), the second queue backend of `kiln serve`: a cluster of our own on
# 127.0.0.1:5433 (trust auth, user kiln), beside whatever cluster the package started.
pg_bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
pgdata=$KILN_CI_CACHE/postgres
if [ ! -f "$pgdata/PG_VERSION" ]; then
  install -d -o postgres -m 700 "$pgdata"
  su postgres -s /bin/sh -c "$pg_bin/initdb -D '$pgdata' -A trust -U kiln" >/dev/null
fi
if ! port_open 5433; then
  log "starting postgres on 127.0.0.1:5433"
  su postgres -s /bin/sh -c "$pg_bin/pg_ctl -D '$pgdata' -l '$pgdata/server.log' -w \
    -o '-c listen_addresses=127.0.0.1 -p 5433 -k /tmp' start" >/dev/null
fi
export KILN_TEST_POSTGRES_URL=postgres://kiln@127.0.0.1:5433/postgres

# What the tests read, for a shell that did not source this script.
{
  for v in CARGO_TARGET_DIR KILN_TEST_CACHE KILN_TEST_REGISTRY KILN_TEST_REGISTRY_AUTH \
    KILN_TEST_REGISTRY_TOKEN KILN_TEST_REGISTRY_USER KILN_TEST_REGISTRY_PASSWORD KILN_TEST_S3_ENDPOINT KILN_TEST_S3_BUCKET \
    AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_REGION AWS_ENDPOINT_URL AWS_ALLOW_HTTP \
    KILN_TEST_POSTGRES_URL KILN_TEST_SCHEMATHESIS; do
    printf 'export %s=%q\n' "$v" "${!v}"
  done
} >"$KILN_CI_CACHE/env"
. "$ci_dir/fixtures.sh"

# The busybox fixture on the token-auth registry too, pushed with the test user's token unless
# the registry already has that manifest (looked up with an anonymous pull token).
token_have=$(curl -fsS "http://127.0.0.1:5003/token?service=kiln-test-registry&scope=repository:busybox:pull" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])' |
  xargs -I{} curl -fsS -o /dev/null -D - -H 'Authorization: Bearer {}' \
    -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    "http://$KILN_TEST_REGISTRY_TOKEN/v2/busybox/manifests/latest" 2>/dev/null |
  awk -F': ' 'tolower($1) == "docker-content-digest" { gsub("\r", "", $2); print $2 }') || true
if [ "$token_have" != "$(fixture_layout_digest "$KILN_TEST_BUSYBOX_OCI" latest)" ]; then
  log "pushing the busybox fixture to $KILN_TEST_REGISTRY_TOKEN"
  skopeo copy -q --preserve-digests --dest-tls-verify=false \
    --dest-creds "$KILN_TEST_REGISTRY_USER:$KILN_TEST_REGISTRY_PASSWORD" \
    "oci:$KILN_TEST_BUSYBOX_OCI:latest" "docker://$KILN_TEST_REGISTRY_TOKEN/busybox:latest"
fi

# --- guest kernel and initramfs (issue 8) -------------------------------------------------
# Debian's cloud kernel, fetched by name (apt's lists must know the package), and an
# initramfs with kiln-guest-init built static from this checkout. Appends KILN_TEST_KERNEL and
# KILN_TEST_INITRAMFS to the env file.
apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1 || apt_update
log "guest kernel and initramfs (cargo builds the workspace's tests, kiln-test-guest-assets among them, and the static init)"
# kiln-test-guest-assets is built the way `cargo test --workspace` and `cargo nextest run
# --workspace` build it, so that the test phases find the workspace built: `cargo run -p
# kiln-tests` resolves the features of that one package, which differ from the workspace's,
# and a cold run then compiled tokio, serde, ring... once here and again for the tests.
(cd "$ci_dir/.." && cargo test -q --locked --workspace --no-run >&2)
guest_assets=$(cd "$ci_dir/.." && "$CARGO_TARGET_DIR/debug/kiln-test-guest-assets")
eval "$(printf '%s\n' "$guest_assets" | grep '^export ')"
printf '%s\n' "$guest_assets" >>"$KILN_CI_CACHE/env"
log "ready; environment in $KILN_CI_CACHE/env"
