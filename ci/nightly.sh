#!/usr/bin/env bash
# The nightly rebuild (README.md, "Nightly rebuild"): `kiln nightly` of the default image's
# recipe, promoting its tag only when the build, the boot and every smoke check passed. Exits
# with kiln's code: 0 promoted, 1 a step or check failed (no tag moved), 4 the tag moved
# during the night (only NAME:nightly-YYYYMMDD was set). Arguments are passed on to
# `kiln nightly` (e.g. `--json`, `--build-arg EXTRA_CA_CERTS=...`).
#
#   KILN_NIGHTLY_RECIPE  the recipe (default base-images/debian.yaml)
#   KILN_NIGHTLY_TAG     the tag promoted (default default:latest)
#   KILN_NIGHTLY_KEEP    nights kept as NAME:nightly-* tags (default 14)
#   KILN_BIN             the kiln binary (default: kiln on PATH)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
kiln=${KILN_BIN:-kiln}
exec "$kiln" nightly "${KILN_NIGHTLY_RECIPE:-base-images/debian.yaml}" \
  --tag "${KILN_NIGHTLY_TAG:-default:latest}" --keep "${KILN_NIGHTLY_KEEP:-14}" "$@"
