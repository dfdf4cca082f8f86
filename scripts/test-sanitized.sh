#!/usr/bin/env bash
# Builds the CPU code with AddressSanitizer, UndefinedBehaviorSanitizer and LeakSanitizer into
# build-asan/ (no CUDA: the sanitizers do not see into GPU kernels) and runs every test suite under
# CTest there. Slower than scripts/test.sh (~25 min from scratch on 2 cores, the tests ~5 of it), so not part
# of CI; run it after changes to parsers, the template engine, the server or memory handling.
# Any sanitizer report fails its test (undefined behaviour aborts; a leak fails the process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
# A fuzz campaign (VIREO_FUZZ_SCALE=N, tests/test_helpers.h) runs N times the iterations: the slowest
# fuzz test (TokenizerFile.FuzzMutationsLoadOrFailCleanly) takes ~18 s a unit of N here, so each
# test's limit grows with N (at N = 60 the default 600 s stopped it mid-run).
scale=${VIREO_FUZZ_SCALE:-1}
[[ $scale =~ ^[0-9]+$ ]] && [ "$scale" -ge 1 ] || scale=1
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVIREO_CUDA=OFF \
  -DVIREO_TEST_TIMEOUT=$((600 + 40 * scale)) \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build build-asan -j"$(nproc)"
# The server test checks the process's RSS after a round of streams: ASan's quarantine of freed
# memory (256 MB by default) would read as growth, and its shadow memory and allocator caches
# still add a little (16.2-17.6 MB against the test's 16 MB; LeakSanitizer checks leaks instead).
export ASAN_OPTIONS="detect_leaks=1:quarantine_size_mb=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export VIREO_TEST_RSS_SLACK_MB=32
export UBSAN_OPTIONS="print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
cd build-asan && ctest --output-on-failure -j"$(nproc)" "$@"
