#!/usr/bin/env bash
# Set up from a clean clone (scripts/setup.sh) and run the demo: a Shaw relative-attention layer
# built from the relpos ops, checked against the eager reference, with a small timing table.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${RELPOS_VENV:-$root/.venv}/bin/activate"
cd /tmp && python -m relpos_ext.demo "$@"
