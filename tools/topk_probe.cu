// vireo_topk_probe: the decode top-k (`cuda::indexer_topk_fast`, the kernel the decode step runs)
// timed alone on score rows of four shapes, and its selection checked against a plain host top-k.
// One row of n keys at a run-time position (the recorded step's form), top 2048:
//   narrow:  scores uniform in [1, 4) (every key's top 8 bits in one or two of 256 bins);
//   normal:  N(0, 1) (both signs, a handful of exponents);
//   indexer: sum over 32 heads of w_h relu(z), w_h and z N(0, 1) (the indexer's own form);
//   spread:  random finite bit patterns (every bin of the first pass about equally full).
// Each: a graph of 200 dependent launches (PDL, as in the step), replayed; us a launch, the median
// of 9 replays. The top-k's own switch (VIREO_TOPK_EARLY=0: every radix pass) is read from the
// environment, so a run per setting. Session 51 ran it against two forms since dropped
// (docs/notes/patches/s51-experiments.patch; BENCHMARKS "Session 51").
//
//   build-cuda/vireo_topk_probe [n_keys (4097)]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cuda/cuda_attention.h"
#include "probe_check.h"

namespace {

constexpr const char* kProbeName = "vireo_topk_probe";

constexpr int kTopk = 2048, kLaunches = 200;

// The host's choice: higher score first, equal scores by lower position; ascending positions.
std::vector<int32_t> host_topk(const std::vector<float>& s, int n, int k) {
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return s[size_t(a)] > s[size_t(b)]; });
  idx.resize(size_t(std::min(n, k)));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 4097;
  if (n <= kTopk || n > 8192) {
    std::fprintf(stderr, "%s: n_keys must be in (%d, 8192], got %d\n", kProbeName, kTopk, n);
    return 1;
  }
  const int64_t bound = (n + 63) / 64 * 64;  // the recorded step's row stride: a bound above n
  std::mt19937_64 rng(51);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(1.0f, 4.0f);
  const char* names[] = {"narrow", "normal", "indexer", "spread"};
  float* scores = nullptr;
  int32_t *sel = nullptr, *counts = nullptr, *pos = nullptr;
  CHECK(cudaMalloc(&scores, size_t(bound) * 4));
  CHECK(cudaMalloc(&sel, size_t(kTopk) * 4));
  CHECK(cudaMalloc(&counts, 4));
  CHECK(cudaMalloc(&pos, 4));
  const int32_t pos0 = n - 1;
  CHECK(cudaMemcpy(pos, &pos0, 4, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf("%-8s %8s  %s\n", "scores", "us", "selection");
  for (int d = 0; d < 4; ++d) {
    std::vector<float> s(size_t(bound), 0.0f);
    std::vector<float> w(32);
    for (float& x : w) x = nd(rng);
    for (int i = 0; i < n; ++i) {
      float v = 0.0f;
      if (d == 0) v = ud(rng);
      else if (d == 1) v = nd(rng);
      else if (d == 2)
        for (int h = 0; h < 32; ++h) v += w[size_t(h)] * std::max(0.0f, nd(rng));
      else {
        uint32_t b;
        do b = uint32_t(rng());
        while (((b >> 23) & 255u) == 255u);  // no inf / NaN
        std::memcpy(&v, &b, 4);
      }
      s[size_t(i)] = v;
    }
    CHECK(cudaMemcpy(scores, s.data(), size_t(bound) * 4, cudaMemcpyHostToDevice));
    // The check: one launch, its selection against the host's.
    if (!vireo::cuda::indexer_topk_fast(scores, 1, bound, 0, pos, kTopk, sel, counts, st)) {
      std::fprintf(stderr, "%s: indexer_topk_fast declined n_keys %lld\n", kProbeName, (long long)bound);
      return 1;
    }
    CHECK(cudaStreamSynchronize(st));
    std::vector<int32_t> got(kTopk);
    int32_t cnt = 0;
    CHECK(cudaMemcpy(got.data(), sel, size_t(kTopk) * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&cnt, counts, 4, cudaMemcpyDeviceToHost));
    const std::vector<int32_t> want = host_topk(s, n, kTopk);
    const bool same = cnt == kTopk && got == want;
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < kLaunches; ++i)
      vireo::cuda::indexer_topk_fast(scores, 1, bound, 0, pos, kTopk, sel, counts, st);
    CHECK(cudaStreamEndCapture(st, &g));
    cudaGraphExec_t ge;
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    float us = 0;
    CHECK(median_replay_us(
        st, e0, e1, 1, [&](int) { CHECK(cudaGraphLaunch(ge, st)); }, &us));
    std::printf("%-8s %8.2f  %s\n", names[d], us / kLaunches, same ? "= host" : "DIFFERS from host");
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
    if (!same) return 1;
  }
  return 0;
}
