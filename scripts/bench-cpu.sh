#!/usr/bin/env bash
# CPU decode/prefill on the synthetic GLM-5-shaped model (real layer shapes, random weights),
# BF16 and FP8, 1 and 2 threads. Each run measures the machine's read bandwidth itself, so the
# achieved weight GB/s is stated against the bound of that same run. Needs ~8 GB of RAM.
set -euo pipefail
cd "$(dirname "$0")/.."
layers=${LAYERS:-2} experts=${EXPERTS:-16}
for dtype in bf16 fp8; do
  for threads in 1 2; do
    echo "== --dtype $dtype --threads $threads"
    ./build/vireo --threads "$threads" bench --synthetic glm5 --layers "$layers" --experts "$experts" \
      --dtype "$dtype" --prompt 64 --decode 16 2>/dev/null | grep -E "bandwidth|active|prefill|decode"
  done
done
