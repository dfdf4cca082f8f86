#include "backend/cpu/matmul.h"

#include <algorithm>
#include <array>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <vector>

#include "backend/cpu/matmul_kernels.h"

namespace vireo {

namespace kernels {

size_t scratch_floats_scalar(const MatmulArgs& a) { return size_t(a.in); }

// Portable fallback: dequantize one row into scratch, then plain f32 dot products.
void matmul_rows_scalar(const MatmulArgs& a, int64_t r0, int64_t r1, float* row) {
  const int64_t in = a.in;
  for (int64_t o = r0; o < r1; ++o) {
    switch (a.dtype) {
      case DType::F32: {
        const float* p = static_cast<const float*>(a.w) + o * in;
        for (int64_t j = 0; j < in; ++j) row[j] = p[j];
        break;
      }
      case DType::BF16: {
        const uint16_t* p = static_cast<const uint16_t*>(a.w) + o * in;
        for (int64_t j = 0; j < in; ++j) row[j] = bf16_to_f32(p[j]);
        break;
      }
      case DType::F16: {
        const uint16_t* p = static_cast<const uint16_t*>(a.w) + o * in;
        for (int64_t j = 0; j < in; ++j) row[j] = f16_to_f32(p[j]);
        break;
      }
      case DType::F8_E4M3: {
        const uint8_t* p = static_cast<const uint8_t*>(a.w) + o * in;
        const float* s = a.scale + (o / 128) * a.scale_cols;
        for (int64_t j = 0; j < in; ++j) row[j] = fp8_e4m3_to_f32(p[j]) * s[j / 128];
        break;
      }
      default: return;  // rejected by the dispatcher
    }
    for (int64_t t = 0; t < a.T; ++t) {
      const float* xr = a.x + t * in;
      float acc = 0;
      for (int64_t j = 0; j < in; ++j) acc += xr[j] * row[j];
      a.y[t * a.out + o] = acc;
    }
  }
}

}  // namespace kernels

namespace {

MatmulIsa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return MatmulIsa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return MatmulIsa::Avx2;
  return MatmulIsa::Scalar;
}

MatmulIsa detected_isa() {
  static const MatmulIsa best = best_isa();
  return best;
}

std::atomic<MatmulIsa> g_isa{MatmulIsa::Auto};

// Per-thread scratch (pool workers live as long as the pool), grown on first use only, so the
// hot path does not allocate.
struct Scratch {
  struct Free { void operator()(float* p) const { std::free(p); } };
  std::unique_ptr<float, Free> data;
  size_t floats = 0;
  float* get(size_t n) {
    if (n > floats) {
      size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
      data.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      if (!data) fail("out of memory allocating matmul scratch of ", bytes, " bytes");
      floats = n;
    }
    return data.get();
  }
};
thread_local Scratch t_scratch;

}  // namespace

bool cpu_matmul_isa_supported(MatmulIsa isa) {
  const MatmulIsa best = detected_isa();
  switch (isa) {
    case MatmulIsa::Auto:
    case MatmulIsa::Scalar: return true;
    case MatmulIsa::Avx2: return best == MatmulIsa::Avx2 || best == MatmulIsa::Avx512;
    case MatmulIsa::Avx512: return best == MatmulIsa::Avx512;
  }
  return false;
}

void cpu_matmul_set_isa(MatmulIsa isa) {
  if (!cpu_matmul_isa_supported(isa))
    fail("matmul: this CPU does not support the ", matmul_isa_name(isa), " kernels");
  g_isa.store(isa);
}

MatmulIsa cpu_matmul_isa() {
  MatmulIsa isa = g_isa.load();
  return isa == MatmulIsa::Auto ? detected_isa() : isa;
}

const char* matmul_isa_name(MatmulIsa isa) {
  switch (isa) {
    case MatmulIsa::Auto: return "auto";
    case MatmulIsa::Scalar: return "scalar";
    case MatmulIsa::Avx2: return "avx2";
    case MatmulIsa::Avx512: return "avx512";
  }
  return "?";
}

void cpu_dequantize_row(const Weight& w, int64_t row, float* out) {
  const int64_t in = w.in();
  switch (w.w.dtype) {
    case DType::F32: {
      const float* p = w.w.f32() + row * in;
      for (int64_t j = 0; j < in; ++j) out[j] = p[j];
      break;
    }
    case DType::BF16: {
      const uint16_t* p = w.w.ptr<uint16_t>() + row * in;
      for (int64_t j = 0; j < in; ++j) out[j] = bf16_to_f32(p[j]);
      break;
    }
    case DType::F16: {
      const uint16_t* p = w.w.ptr<uint16_t>() + row * in;
      for (int64_t j = 0; j < in; ++j) out[j] = f16_to_f32(p[j]);
      break;
    }
    case DType::F8_E4M3: {
      // A 256-entry table: this runs per head per decoded token in absorbed attention (W_UK,
      // W_UV rows), where a per-element ldexp cost more than the rest of the layer.
      static const std::array<float, 256> lut = [] {
        std::array<float, 256> t{};
        for (int c = 0; c < 256; ++c) t[size_t(c)] = fp8_e4m3_to_f32(uint8_t(c));
        return t;
      }();
      const uint8_t* p = w.w.ptr<uint8_t>() + row * in;
      const float* s = w.scale_inv.f32() + (row / 128) * w.scale_inv.dim(1);
      for (int64_t b0 = 0; b0 < in; b0 += 128) {
        const float sc = s[b0 / 128];
        const int64_t e = std::min(in, b0 + 128);
        for (int64_t j = b0; j < e; ++j) out[j] = lut[p[j]] * sc;
      }
      break;
    }
    default:
      fail("matmul: unsupported weight dtype ", dtype_name(w.w.dtype));
  }
}

void cpu_matmul_reference(const float* x, int64_t T, const Weight& w, float* y) {
  const int64_t in = w.in(), out = w.out();
  std::vector<float> row(in);
  for (int64_t o = 0; o < out; ++o) {
    cpu_dequantize_row(w, o, row.data());
    for (int64_t t = 0; t < T; ++t) {
      double acc = 0;
      for (int64_t j = 0; j < in; ++j) acc += double(x[t * in + j]) * row[j];
      y[t * out + o] = float(acc);
    }
  }
}

void cpu_matmul(const float* x, int64_t T, const Weight& w, float* y, ThreadPool& pool) {
  if (w.w.ndim != 2) fail("matmul: weight must be 2-D, got ", w.w.shape_str());
  const DType dt = w.w.dtype;
  if (dt != DType::F32 && dt != DType::BF16 && dt != DType::F16 && dt != DType::F8_E4M3)
    fail("matmul: unsupported weight dtype ", dtype_name(dt));
  kernels::MatmulArgs a{x, T, w.in(), w.out(), dt, w.w.data, nullptr, 0, y};
  if (dt == DType::F8_E4M3) {
    const Tensor& s = w.scale_inv;
    if (s.empty() || s.dtype != DType::F32 || s.ndim != 2 || s.dim(0) != (a.out + 127) / 128 ||
        s.dim(1) != (a.in + 127) / 128)
      fail("matmul: F8_E4M3 weight ", w.w.shape_str(), " needs F32 scale_inv [",
           (a.out + 127) / 128, ", ", (a.in + 127) / 128, "], got ",
           s.empty() ? std::string("none") : std::string(dtype_name(s.dtype)) + " " + s.shape_str());
    a.scale = s.f32();
    a.scale_cols = s.dim(1);
  }
  if (T <= 0 || a.out <= 0) return;
  if (a.in == 0) {
    for (int64_t i = 0; i < T * a.out; ++i) y[i] = 0;
    return;
  }

  using Fn = void (*)(const kernels::MatmulArgs&, int64_t, int64_t, float*);
  Fn fn = kernels::matmul_rows_scalar;
  size_t scratch = 0;
  switch (cpu_matmul_isa()) {
    case MatmulIsa::Avx512:
      fn = kernels::matmul_rows_avx512;
      scratch = kernels::scratch_floats_avx512(a);
      break;
    case MatmulIsa::Avx2:
      fn = kernels::matmul_rows_avx2;
      scratch = kernels::scratch_floats_avx2(a);
      break;
    default:
      scratch = kernels::scratch_floats_scalar(a);
      break;
  }
  // Chunks of 16 rows keep each thread's rows in whole register blocks; which thread computes a
  // row never changes its bits (see matmul_kernels.h).
  pool.parallel_for(a.out, [&](int64_t b, int64_t e, int) {
    float* s = scratch ? t_scratch.get(scratch) : nullptr;
    fn(a, b, e, s);
  }, 16);
}

}  // namespace vireo
