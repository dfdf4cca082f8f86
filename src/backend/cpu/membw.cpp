#include "backend/cpu/membw.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "core/error.h"

namespace vireo {

namespace {

// Sums n floats with several independent accumulators so the loop is bound by loads, not by
// the add latency. The result is consumed so the compiler cannot drop the reads.
__attribute__((target("avx2"))) float sum_avx2(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  float s = 0;
  for (float v : lanes) s += v;
  for (; i < n; ++i) s += p[i];
  return s;
}

float sum_scalar(const float* p, size_t n) {
  float a[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) a[k] += p[i + k];
  float s = 0;
  for (float v : a) s += v;
  for (; i < n; ++i) s += p[i];
  return s;
}

}  // namespace

double measure_memory_bandwidth_gbs(ThreadPool& pool, size_t bytes) {
  const size_t n = std::max<size_t>(bytes / sizeof(float), 1024) / 8 * 8;
  struct Free { void operator()(float* p) const { std::free(p); } };
  std::unique_ptr<float, Free> buf(static_cast<float*>(std::aligned_alloc(64, n * sizeof(float))));
  if (!buf) fail("membw: out of memory allocating ", n * sizeof(float), " bytes");
  float* p = buf.get();
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2");
  const int nt = pool.size();
  // Each thread touches the pages it will read (first touch places them near that thread).
  pool.parallel_for(nt, [&](int64_t b, int64_t e, int) {
    for (int64_t t = b; t < e; ++t) {
      size_t lo = n * size_t(t) / nt / 8 * 8, hi = n * size_t(t + 1) / nt / 8 * 8;
      if (t == nt - 1) hi = n;
      for (size_t i = lo; i < hi; ++i) p[i] = float(i & 7);
    }
  });
  std::vector<float> sink(nt, 0.0f);
  double best = 0;
  for (int run = 0; run < 5; ++run) {
    auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(nt, [&](int64_t b, int64_t e, int) {
      for (int64_t t = b; t < e; ++t) {
        size_t lo = n * size_t(t) / nt / 8 * 8, hi = n * size_t(t + 1) / nt / 8 * 8;
        if (t == nt - 1) hi = n;
        sink[t] += avx2 ? sum_avx2(p + lo, hi - lo) : sum_scalar(p + lo, hi - lo);
      }
    });
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(n * sizeof(float)) / s / 1e9);
  }
  volatile float keep = 0;
  for (float v : sink) keep = keep + v;
  (void)keep;
  return best;
}

}  // namespace vireo
