#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs the Python readers the
# tests check tables with, then builds and runs every Rust test and example.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/py/requirements.txt
export LAKESTREAM_PYTHON="$PWD/.venv/bin/python"

# Examples must not rot: run the library example on its bundled data.
cargo run --quiet -p lakestream --example embed
cargo test --workspace --no-fail-fast
