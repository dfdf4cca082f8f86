#pragma once
// Helpers of the op-parity suites (a backend against the CPU reference): random inputs, the
// normalized mean squared error they are judged by, and host vectors moved to and from a
// backend's buffers.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "backend/backend.h"

namespace vireo::test {

// n values uniform in [-scale, scale), from `seed`.
inline std::vector<float> randv(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(g) * scale;
  return v;
}

// NMSE = sum (got - want)^2 / sum want^2; infinite if anything got is not finite.
template <typename Want>
double nmse(const std::vector<float>& got, const std::vector<Want>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    const double d = double(got[i]) - double(want[i]);
    num += d * d;
    den += double(want[i]) * double(want[i]);
  }
  return num / std::max(den, 1e-30);
}

// Host vectors <-> a backend's buffers (kept alive as long as this is).
struct Dev {
  explicit Dev(Backend& b) : be(b) {}
  Backend& be;
  std::vector<std::shared_ptr<float>> keep;
  std::vector<std::shared_ptr<int32_t>> keep_i;
  float* up(const std::vector<float>& h) {
    auto b = be.alloc_f32(h.size());
    be.copy_from_host(b.get(), h.data(), h.size());
    keep.push_back(b);
    return b.get();
  }
  int32_t* up_i(const std::vector<int32_t>& h) {
    auto b = be.alloc_i32(h.size());
    be.copy_from_host_i32(b.get(), h.data(), h.size());
    keep_i.push_back(b);
    return b.get();
  }
  float* zeros(size_t n) { return up(std::vector<float>(n, 0.0f)); }
  int32_t* zeros_i(size_t n) { return up_i(std::vector<int32_t>(n, 0)); }
  std::vector<float> down(const float* d, size_t n) {
    std::vector<float> h(n);
    be.copy_to_host(h.data(), d, n);
    return h;
  }
  std::vector<int32_t> down_i(const int32_t* d, size_t n) {
    std::vector<int32_t> h(n);
    be.copy_to_host_i32(h.data(), d, n);
    return h;
  }
};

}  // namespace vireo::test
