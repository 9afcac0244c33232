#!/usr/bin/env bash
# The main job (README.md): on a Debian 12 machine with a Rust toolchain, as root, install
# what kiln needs, build kiln, then build base-images/debian.yaml into the local store
# ($KILN_STORE, else the config file's `store`, else ~/.local/share/kiln/store) and print the
# image manifest digest as the last line on stdout. Arguments are passed on to `kiln build`
# (e.g. `--no-cache`, `--progress plain`).
#
#   KILN_MAIN_RECIPE  the recipe to build (default base-images/debian.yaml)
#   KILN_MAIN_TAG     the tag to set (default debian-sandbox:bookworm)
#   KILN_BIN          use this kiln binary instead of building one
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Debian packages only (debootstrap, e2fsprogs and libarchive13 from bookworm-backports,
# slirp4netns...): no test servers. Sets CARGO_TARGET_DIR (default under /var/cache/kiln-ci).
KILN_SETUP_PACKAGES_ONLY=1 . ci/setup.sh
set -euo pipefail
recipe=${KILN_MAIN_RECIPE:-base-images/debian.yaml}
tag=${KILN_MAIN_TAG:-debian-sandbox:bookworm}

if [ -n "${KILN_BIN:-}" ]; then
  kiln=$KILN_BIN # an already built kiln (the end-to-end test passes its own)
else
  echo "main-job: building kiln" >&2
  cargo build --locked -p kiln >&2
  kiln=$CARGO_TARGET_DIR/debug/kiln
  # The guest init, static, beside kiln: where `kiln build --snapshot` and `kiln kernel` look.
  echo "main-job: building kiln-guest-init (static)" >&2
  RUSTFLAGS='-C target-feature=+crt-static -C strip=symbols' cargo build --locked --release -p kiln-guest \
    --bin kiln-guest-init --target x86_64-unknown-linux-gnu >&2
  cp "$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/kiln-guest-init" "$(dirname "$kiln")/"
fi

# A machine that reaches the package registries through a TLS-inspecting proxy trusts the
# proxy's CA through /usr/local/share/ca-certificates; the build's pip and npm need it too
# (the recipe trusts it during the build only and removes it in its last step).
args=()
shopt -s nullglob
extra=(/usr/local/share/ca-certificates/*.crt)
shopt -u nullglob
if [ ${#extra[@]} -gt 0 ]; then
  args+=(--build-arg "EXTRA_CA_CERTS=$(cat "${extra[@]}")")
fi

echo "main-job: kiln build -f $recipe -t $tag" >&2
start=$(date +%s)
# kiln build prints the image manifest digest as its last line on stdout.
"$kiln" build -f "$recipe" -t "$tag" "${args[@]}" "$@" "$(dirname "$recipe")"
echo "main-job: built $tag in $(($(date +%s) - start)) s (kiln inspect $tag)" >&2
