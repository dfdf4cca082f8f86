#pragma once
// Helpers of the op-parity suites (a backend against the CPU reference): random inputs, the
// normalized mean squared error they are judged by, and host vectors moved to and from a
// backend's buffers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/dtype.h"

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

// v [out, in] as a DeepSeek/GLM FP8 checkpoint stores it: one f32 scale per 128 x 128 block,
// scale = amax / 448 (1 for an all-zero block), q = e4m3(v / scale). scales [ceil(out/128),
// ceil(in/128)].
inline void fp8_quantize_blocks(const std::vector<float>& v, int64_t out, int64_t in, uint8_t* q, float* scales) {
  const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
  std::fill(scales, scales + so * si, 0.0f);
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j) {
      float& m = scales[(i / 128) * si + j / 128];
      m = std::max(m, std::fabs(v[size_t(i * in + j)]) / 448.0f);
    }
  for (int64_t b = 0; b < so * si; ++b)
    if (scales[b] == 0.0f) scales[b] = 1.0f;
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j)
      q[i * in + j] = f32_to_fp8_e4m3(v[size_t(i * in + j)] / scales[(i / 128) * si + j / 128]);
}

// A weight in a stored dtype, built from values uniform in [-scale, scale), owning its bytes.
struct HostWeight {
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
  Weight w;
};
// blocky: each 128 x 128 block's values scaled by its own power of two (1/4 .. 4), so that FP8
// block scales differ from block to block and a product that reads the wrong one shows.
inline HostWeight make_weight(DType dt, int64_t out, int64_t in, uint32_t seed, float scale = 0.1f,
                              bool blocky = false) {
  HostWeight h;
  std::vector<float> v = randv(size_t(out * in), seed, scale);
  if (blocky)
    for (int64_t r = 0; r < out; ++r)
      for (int64_t c = 0; c < in; ++c)
        v[size_t(r * in + c)] *= std::ldexp(1.0f, int((r / 128 + 2 * (c / 128)) % 5) - 2);
  h.bytes.resize(size_t(out * in) * dtype_size(dt));
  if (dt == DType::F32) {
    std::memcpy(h.bytes.data(), v.data(), h.bytes.size());
  } else if (dt == DType::BF16 || dt == DType::F16) {
    auto* p = reinterpret_cast<uint16_t*>(h.bytes.data());
    for (size_t i = 0; i < v.size(); ++i) p[i] = dt == DType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
  } else {
    const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
    h.scales.resize(size_t(so * si));
    fp8_quantize_blocks(v, out, in, h.bytes.data(), h.scales.data());
    h.w.scale_inv = Tensor(h.scales.data(), DType::F32, {so, si});
  }
  h.w.w = Tensor(h.bytes.data(), dt, {out, in});
  return h;
}

// The shape part of MLA attention arguments (pointers left for the caller).
inline MlaAttentionArgs mla_shape(int64_t T, int64_t H, int64_t nope, int64_t rope, int64_t vd, int64_t L, int64_t N,
                                  int64_t pos0, float scale, bool absorbed) {
  MlaAttentionArgs a;
  a.T = T;
  a.n_heads = H;
  a.qk_nope = nope;
  a.qk_rope = rope;
  a.v_dim = vd;
  a.kv_lora = L;
  a.n_keys = N;
  a.pos0 = pos0;
  a.scale = scale;
  a.absorbed = absorbed;
  return a;
}

// The CPU reference's attention output for `a` on host inputs (selection: none = every causal key).
inline std::vector<float> cpu_mla_attention(Backend& cpu, MlaAttentionArgs a, const std::vector<float>& q,
                                            const std::vector<float>& kv, const Weight& kv_b,
                                            const KeySelection* selection) {
  std::vector<float> out(static_cast<size_t>(a.T * a.n_heads * a.v_dim));
  a.q = q.data();
  a.kv = kv.data();
  a.kv_b = &kv_b;
  a.out = out.data();
  if (selection) a.selection = *selection;
  cpu.mla_attention(a);
  return out;
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
