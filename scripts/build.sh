#!/usr/bin/env bash
# Configures and builds vireo (Release) into build/. CUDA is detected by CMake; set
# VIREO_CUDA=OFF to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DVIREO_CUDA="${VIREO_CUDA:-AUTO}" >/dev/null
cmake --build build -j"$(nproc)"
