#!/usr/bin/env bash
# Installs dependencies, builds, and runs every test suite under CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
cd build && ctest --output-on-failure -j"$(nproc)" "$@"
