#include "backend/cpu/matmul.h"

#include <vector>

namespace vireo {

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
      const uint8_t* p = w.w.ptr<uint8_t>() + row * in;
      const float* s = w.scale_inv.f32() + (row / 128) * w.scale_inv.dim(1);
      for (int64_t j = 0; j < in; ++j) out[j] = fp8_e4m3_to_f32(p[j]) * s[j / 128];
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
  const int64_t in = w.in(), out = w.out();
  pool.parallel_for(out, [&](int64_t b, int64_t e, int) {
    std::vector<float> row(in);
    for (int64_t o = b; o < e; ++o) {
      cpu_dequantize_row(w, o, row.data());
      for (int64_t t = 0; t < T; ++t) {
        const float* xr = x + t * in;
        float acc = 0;
        for (int64_t j = 0; j < in; ++j) acc += xr[j] * row[j];
        y[t * out + o] = acc;
      }
    }
  });
}

}  // namespace vireo
