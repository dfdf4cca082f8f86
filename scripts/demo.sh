#!/usr/bin/env bash
# Installs dependencies, builds, and generates text from the embedded demo model
# (models/vireo-demo, a small GLM-5-architecture model trained for vireo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
prompt="${1:-The Python interpreter}"
printf '\n%s' "$prompt"
./build/vireo run --model models/vireo-demo --prompt "$prompt" -n 64
