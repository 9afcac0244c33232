# Test fixtures for the base-image tests (issue 4), sourced by ci/setup.sh after the servers
# are up. Idempotent: each image is built once into $KILN_TEST_CACHE under a key made of its
# inputs (this script, the suite, the package versions used) and rebuilt only when missing;
# pushes happen only when the registry does not already hold the same manifest digest.
#
# Images (OCI image layouts, gzip layers, packed with umoci):
#   busybox  Debian's busybox-static: /bin/busybox, applet symlinks, /etc/passwd, /etc/group
#   debian   a Debian bookworm minbase made with debootstrap from the mirror apt already uses
#   tools    the debian image plus one layer: curl, git, python3-pip and npm (tag `tools`)
#   multi    an OCI image index over busybox for linux/amd64 and a linux/arm64 variant
# Pushed to 127.0.0.1:5000 (busybox:latest, debian:bookworm, debian:tools, multi:latest) and to
# the basic auth registry :5001 (busybox:latest, debian:bookworm).
# Exports (and appends to $KILN_CI_CACHE/env): KILN_TEST_BUSYBOX_OCI, KILN_TEST_DEBIAN_OCI
# (layout dirs; tags `latest` and `bookworm`), KILN_TEST_BUSYBOX_REF, KILN_TEST_DEBIAN_REF,
# KILN_TEST_MULTI_REF, KILN_TEST_MULTI_AMD64_DIGEST, KILN_TEST_MULTI_ARM64_DIGEST,
# KILN_TEST_TOOLS_REF.

fixtures_main() {
  local script_hash fx
  script_hash=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
  fx=$KILN_TEST_CACHE

  # --- busybox ------------------------------------------------------------------------------
  local bb_ver bb_key bb_dir
  bb_ver=$(dpkg-query -W -f='${Version}' busybox-static)
  bb_key=$(printf '%s\n' "$script_hash" "busybox-static=$bb_ver" | sha256sum | cut -c1-16)
  bb_dir=$fx/busybox-$bb_key
  if [ ! -f "$bb_dir/done" ]; then
    log "fixtures: building busybox image ($bb_dir)"
    rm -rf "$bb_dir"
    mkdir -p "$bb_dir"
    umoci init --layout "$bb_dir/oci"
    umoci new --image "$bb_dir/oci:latest"
    umoci unpack --image "$bb_dir/oci:latest" "$bb_dir/bundle" >/dev/null
    local r=$bb_dir/bundle/rootfs applet
    mkdir -p "$r/bin" "$r/sbin" "$r/usr/bin" "$r/usr/sbin" "$r/etc" "$r/tmp" "$r/root" \
      "$r/dev" "$r/proc" "$r/sys"
    chmod 1777 "$r/tmp"
    chmod 700 "$r/root"
    cp /bin/busybox "$r/bin/busybox"
    for applet in $("$r/bin/busybox" --list); do
      [ "$applet" = busybox ] && continue
      [ -e "$r/bin/$applet" ] || ln -s busybox "$r/bin/$applet"
    done
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$r/etc/passwd"
    printf 'root:x:0:\nnogroup:x:65534:\n' >"$r/etc/group"
    printf 'root:*:19000:0:99999:7:::\n' >"$r/etc/shadow"
    chmod 640 "$r/etc/shadow"
    : >"$r/etc/hostname"
    umoci repack --image "$bb_dir/oci:latest" "$bb_dir/bundle" >/dev/null
    umoci config --image "$bb_dir/oci:latest" --config.cmd /bin/sh \
      --os linux --architecture amd64 >/dev/null
    # The arm64 variant (for the platform-selection index): one more layer marking it.
    rm -rf "$bb_dir/bundle"
    umoci unpack --image "$bb_dir/oci:latest" "$bb_dir/bundle" >/dev/null
    echo arm64 >"$bb_dir/bundle/rootfs/etc/kiln-platform"
    umoci repack --image "$bb_dir/oci:arm64" "$bb_dir/bundle" >/dev/null
    umoci config --image "$bb_dir/oci:arm64" --architecture arm64 --os linux >/dev/null
    rm -rf "$bb_dir/bundle"
    umoci gc --layout "$bb_dir/oci"
    touch "$bb_dir/done"
  fi

  # --- debian bookworm minbase ----------------------------------------------------------------
  local db_ver mirror db_key db_dir
  db_ver=$(dpkg-query -W -f='${Version}' debootstrap)
  mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null |
    awk '$2 == "bookworm" { print $1; exit }')
  db_key=$(printf '%s\n' "$script_hash" "debootstrap=$db_ver" bookworm minbase | sha256sum | cut -c1-16)
  db_dir=$fx/debian-$db_key
  if [ ! -f "$db_dir/done" ]; then
    if [ -z "$mirror" ]; then
      log "fixtures: cannot find the mirror apt uses for bookworm"
      return 1
    fi
    log "fixtures: building debian bookworm minbase with debootstrap ($db_dir)"
    rm -rf "$db_dir"
    mkdir -p "$db_dir"
    umoci init --layout "$db_dir/oci"
    umoci new --image "$db_dir/oci:bookworm"
    umoci unpack --image "$db_dir/oci:bookworm" "$db_dir/bundle" >/dev/null
    debootstrap --variant=minbase bookworm "$db_dir/bundle/rootfs" "$mirror" \
      >"$db_dir/debootstrap.log" 2>&1 || {
      log "fixtures: debootstrap failed; its log:"
      tail -30 "$db_dir/debootstrap.log" >&2
      return 1
    }
    rm -rf "$db_dir/bundle/rootfs/var/cache/apt/archives/"*.deb
    umoci repack --image "$db_dir/oci:bookworm" "$db_dir/bundle" >/dev/null
    umoci config --image "$db_dir/oci:bookworm" --config.cmd /bin/bash \
      --os linux --architecture amd64 >/dev/null
    rm -rf "$db_dir/bundle"
    umoci gc --layout "$db_dir/oci"
    touch "$db_dir/done"
  fi

  # --- debian tools: the Debian fixture plus curl, git, python3-pip and npm ---------------------
  # One layer over the Debian fixture's (shared in the registry), for the egress tests that
  # install from local apt, PyPI and npm servers and clone over HTTP in microVM steps.
  local tl_pkgs="curl git python3-pip npm" tl_key tl_dir
  tl_key=$(printf '%s\n' "$db_key" "$tl_pkgs" | sha256sum | cut -c1-16)
  tl_dir=$fx/debian-tools-$tl_key
  if [ ! -f "$tl_dir/done" ]; then
    log "fixtures: building debian tools ($tl_pkgs) over the Debian fixture ($tl_dir)"
    rm -rf "$tl_dir"
    mkdir -p "$tl_dir"
    cp -a "$db_dir/oci" "$tl_dir/oci"
    umoci unpack --image "$tl_dir/oci:bookworm" "$tl_dir/bundle" >/dev/null
    local r=$tl_dir/bundle/rootfs
    if ! (
      mount --bind /dev "$r/dev" && trap 'umount "$r/dev"' EXIT &&
        mount -t proc proc "$r/proc" && trap 'umount "$r/proc"; umount "$r/dev"' EXIT &&
        chroot "$r" /bin/sh -c "apt-get -qq update && DEBIAN_FRONTEND=noninteractive \
          apt-get -qq install -y --no-install-recommends $tl_pkgs && apt-get clean"
    ) >"$tl_dir/apt.log" 2>&1; then
      log "fixtures: installing $tl_pkgs failed; its log:"
      tail -30 "$tl_dir/apt.log" >&2
      return 1
    fi
    rm -rf "$r/var/lib/apt/lists/"* "$r/usr/share/doc" "$r/usr/share/man"
    umoci repack --image "$tl_dir/oci:tools" "$tl_dir/bundle" >/dev/null
    umoci config --image "$tl_dir/oci:tools" --config.cmd /bin/bash >/dev/null
    rm -rf "$tl_dir/bundle"
    umoci gc --layout "$tl_dir/oci"
    touch "$tl_dir/done"
  fi

  # --- pushes -----------------------------------------------------------------------------------
  fixture_push "$bb_dir/oci:latest" "$KILN_TEST_REGISTRY/busybox:latest"
  fixture_push "$db_dir/oci:bookworm" "$KILN_TEST_REGISTRY/debian:bookworm"
  fixture_push "$tl_dir/oci:tools" "$KILN_TEST_REGISTRY/debian:tools"
  fixture_push "$bb_dir/oci:latest" "$KILN_TEST_REGISTRY_AUTH/busybox:latest" auth
  fixture_push "$db_dir/oci:bookworm" "$KILN_TEST_REGISTRY_AUTH/debian:bookworm" auth
  fixture_push "$bb_dir/oci:latest" "$KILN_TEST_REGISTRY/multi:amd64"
  fixture_push "$bb_dir/oci:arm64" "$KILN_TEST_REGISTRY/multi:arm64"
  local amd arm
  amd=$(fixture_layout_digest "$bb_dir/oci" latest)
  arm=$(fixture_layout_digest "$bb_dir/oci" arm64)
  fixture_push_index "$KILN_TEST_REGISTRY" multi latest "$amd" "$arm"

  export KILN_TEST_BUSYBOX_OCI=$bb_dir/oci KILN_TEST_DEBIAN_OCI=$db_dir/oci
  export KILN_TEST_BUSYBOX_REF=$KILN_TEST_REGISTRY/busybox:latest
  export KILN_TEST_DEBIAN_REF=$KILN_TEST_REGISTRY/debian:bookworm
  export KILN_TEST_TOOLS_REF=$KILN_TEST_REGISTRY/debian:tools
  export KILN_TEST_MULTI_REF=$KILN_TEST_REGISTRY/multi:latest
  export KILN_TEST_MULTI_AMD64_DIGEST=$amd KILN_TEST_MULTI_ARM64_DIGEST=$arm
  local v
  for v in KILN_TEST_BUSYBOX_OCI KILN_TEST_DEBIAN_OCI KILN_TEST_BUSYBOX_REF KILN_TEST_DEBIAN_REF \
    KILN_TEST_TOOLS_REF \
    KILN_TEST_MULTI_REF KILN_TEST_MULTI_AMD64_DIGEST KILN_TEST_MULTI_ARM64_DIGEST; do
    printf 'export %s=%q\n' "$v" "${!v}"
  done >>"$KILN_CI_CACHE/env"
}

# The manifest digest a layout's index.json gives for a tag.
fixture_layout_digest() { # layout tag
  python3 - "$1" "$2" <<'PY'
import json, sys
idx = json.load(open(sys.argv[1] + "/index.json"))
for m in idx["manifests"]:
    if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == sys.argv[2]:
        print(m["digest"])
        break
else:
    sys.exit("no tag " + sys.argv[2])
PY
}

# Push a layout tag unless the registry already has that exact manifest under the tag.
fixture_push() { # oci:DIR:TAG HOST/REPO:TAG [auth]
  local src=$1 dst=$2 auth=${3:-} dir tag want have creds=()
  dir=${src%:*}
  tag=${src##*:}
  want=$(fixture_layout_digest "$dir" "$tag")
  if [ -n "$auth" ]; then
    creds=(--dest-creds "$KILN_TEST_REGISTRY_USER:$KILN_TEST_REGISTRY_PASSWORD")
  fi
  local host=${dst%%/*} rest=${dst#*/}
  local curl_auth=()
  [ -n "$auth" ] && curl_auth=(-u "$KILN_TEST_REGISTRY_USER:$KILN_TEST_REGISTRY_PASSWORD")
  have=$(curl -fsS -o /dev/null -D - "${curl_auth[@]}" \
    -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    "http://$host/v2/${rest%:*}/manifests/${rest##*:}" 2>/dev/null |
    awk -F': ' 'tolower($1) == "docker-content-digest" { gsub("\r", "", $2); print $2 }') || true
  if [ "$have" = "$want" ]; then return; fi
  log "fixtures: pushing $dst"
  skopeo copy -q --preserve-digests --dest-tls-verify=false "${creds[@]}" \
    "oci:$src" "docker://$dst"
}

# Put an OCI image index naming the two platform manifests (already pushed to the repo).
fixture_push_index() { # host repo tag amd64-digest arm64-digest
  local host=$1 repo=$2 tag=$3 amd=$4 arm=$5 body
  body=$(python3 - "$host" "$repo" "$amd" "$arm" <<'PY'
import json, sys, urllib.request
host, repo, amd, arm = sys.argv[1:5]
def size(d):
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{d}", method="HEAD",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    return int(urllib.request.urlopen(req).headers["Content-Length"])
mt = "application/vnd.oci.image.manifest.v1+json"
print(json.dumps({
    "schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.index.v1+json",
    "manifests": [
        {"mediaType": mt, "digest": arm, "size": size(arm),
         "platform": {"architecture": "arm64", "os": "linux", "variant": "v8"}},
        {"mediaType": mt, "digest": amd, "size": size(amd),
         "platform": {"architecture": "amd64", "os": "linux"}},
    ],
}, separators=(",", ":")))
PY
  )
  local want have
  want=sha256:$(printf '%s' "$body" | sha256sum | cut -d' ' -f1)
  have=$(curl -fsS -o /dev/null -D - -H 'Accept: application/vnd.oci.image.index.v1+json' \
    "http://$host/v2/$repo/manifests/$tag" 2>/dev/null |
    awk -F': ' 'tolower($1) == "docker-content-digest" { gsub("\r", "", $2); print $2 }') || true
  [ "$have" = "$want" ] && return
  log "fixtures: pushing index $host/$repo:$tag"
  printf '%s' "$body" | curl -fsS -X PUT -H 'Content-Type: application/vnd.oci.image.index.v1+json' \
    --data-binary @- "http://$host/v2/$repo/manifests/$tag" >/dev/null
}

fixtures_main
