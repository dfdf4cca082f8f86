#!/usr/bin/env bash
# One device call: get CUDA binaries (carried prebuilt ones if they run here, else build), run the
# CUDA tests (op parity + fixtures), the read probe (vireo_read_probe, where the binaries have it)
# and `vireo bench --device cuda`, write logs under $OUT and print a summary table last.
#
#   OUT=/tmp/out tools/gpu-check.sh [bench args...]     (default: --layers 2 --experts 16)
#
# Carried files (.devcarry, git-ignored): bin/{vireo,vireo_tests[,vireo_read_probe]} built elsewhere with the same
# nvcc, lib/ their shared libraries, prefix/ the Debian -dev packages (headers, cmake configs,
# pkg-config) for building here when the carried binaries do not run.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
CARRY=$ROOT/.devcarry
BENCH_ARGS=("$@")
[ ${#BENCH_ARGS[@]} -eq 0 ] && BENCH_ARGS=(--layers 2 --experts 16)
export LD_LIBRARY_PATH=$CARRY/lib:$CARRY/prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
log() { echo "[gpu-check] $*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
log "gpu: $(tail -n +2 "$OUT/gpu.txt" | head -1)"

# Binaries compiled elsewhere look for fixtures under the path they were built in.
# (GPU_CHECK_NO_LINK: leave /work alone, as the script's own test does.)
if [ -z "${GPU_CHECK_NO_LINK:-}" ] && [ ! -e /work/main ] && [ "$ROOT" != /work/main ]; then
  mkdir -p /work && ln -s "$ROOT" /work/main
fi

BIN=""
if [ -x "$CARRY/bin/vireo_tests" ] && "$CARRY/bin/vireo_tests" --gtest_filter='CudaOps.NormsRopeElementwise' \
     >"$OUT/probe.log" 2>&1 && grep -q "PASSED" "$OUT/probe.log"; then
  BIN=$CARRY/bin
  log "binaries: carried prebuilt ($BIN)"
else
  log "binaries: carried ones do not run here ($(tail -2 "$OUT/probe.log" | tr '\n' ' ')); building"
  P=$CARRY/prefix/usr
  for pc in "$P"/lib/x86_64-linux-gnu/pkgconfig/*.pc "$P"/share/pkgconfig/*.pc; do
    [ -f "$pc" ] && sed -i "s|^prefix=.*|prefix=$P|" "$pc"
  done
  PKGCONF=$(command -v pkg-config || echo "$P/bin/pkgconf")
  export PKG_CONFIG_PATH=$P/lib/x86_64-linux-gnu/pkgconfig:$P/share/pkgconfig
  B=$ROOT/build-dev
  if cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DVIREO_CUDA=ON \
       -DCMAKE_PREFIX_PATH="$P" -DPKG_CONFIG_EXECUTABLE="$PKGCONF" -DCMAKE_INCLUDE_PATH="$P/include" \
       >"$OUT/build.log" 2>&1 && cmake --build "$B" -j "$(nproc)" >>"$OUT/build.log" 2>&1; then
    BIN=$B
    log "binaries: built here ($B)"
  else
    log "BUILD FAILED: see build.log"; tail -30 "$OUT/build.log"; exit 1
  fi
fi

# Tests that exec the CLI look for it where it was built (VIREO_BIN, compiled in).
want=$(strings "$BIN/vireo_tests" | grep -m1 -E '^/.*/vireo$' || true)
if [ -n "$want" ] && [ ! -x "$want" ]; then mkdir -p "$(dirname "$want")" && cp "$BIN/vireo" "$want"; fi

set -o pipefail
timeout 300 "$BIN/vireo_tests" --gtest_filter='*Cuda*:*DeviceStore*:MemoryPlan.Gpu*:DemoModel.*:Branches.*:Mtp.*:ModelFixtures.*:Generate*:Scheduler.*' \
  >"$OUT/tests.log" 2>&1
log "tests: exit $?"
grep -E "^\[  FAILED|Failure|Expected|actual|^(F32|BF16|F16|F8_E4M3) " "$OUT/tests.log" | cut -c1-200 | head -60
# Each test's own result line ends in its time; gtest's closing list repeats the failed ones
# without it. (The count took only tests with Cuda in their name before: a failing DemoModel or
# DeviceStore test read as 0 failed.)
log "tests: $(grep -c '^\[       OK' "$OUT/tests.log") passed, $(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$OUT/tests.log") failed, $(grep -cE '^\[  SKIPPED \] .* \([0-9]+ ms\)$' "$OUT/tests.log") skipped"

# What a weight-shaped read reaches on this GPU (BENCHMARKS "Session 21"), beside the bench's
# copy line: the ceiling of the decode GEMVs' access shape.
if [ -x "$BIN/vireo_read_probe" ]; then
  timeout 60 "$BIN/vireo_read_probe" >"$OUT/read_probe.log" 2>&1
  log "read probe: rc $?"
else
  log "read probe: no vireo_read_probe in $BIN"
fi

for dt in bf16 fp8; do
  timeout 110 "$BIN/vireo" bench --device cuda --synthetic glm5 --dtype $dt --decode 128 "${BENCH_ARGS[@]}" \
    >"$OUT/bench_$dt.log" 2>&1
  log "bench $dt: rc $?"
done

echo
echo "================ summary ================"
cat "$OUT/summary.txt"
grep -h "^  " "$OUT/tests.log" | head -20
[ -f "$OUT/read_probe.log" ] && { echo "--- read probe"; cat "$OUT/read_probe.log"; }
for dt in bf16 fp8; do echo "--- bench $dt"; grep -vE "^(building|loaded)" "$OUT/bench_$dt.log" | tail -12; done
