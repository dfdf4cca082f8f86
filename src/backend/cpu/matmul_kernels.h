#pragma once
// Internal interface between cpu_matmul's dispatcher (matmul.cpp) and its per-ISA kernels
// (matmul_avx512.cpp, matmul_avx2.cpp, scalar code in matmul.cpp). Only raw pointers cross this
// boundary: the ISA files are compiled under `#pragma GCC target`, and instantiating std templates
// there could leak AVX-512 code into inline functions shared with the rest of the program.
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace vireo::kernels {

struct MatmulArgs {
  const float* x;      // [T, in]
  int64_t T;
  int64_t in, out;
  DType dtype;
  const void* w;       // [out, in] in `dtype`
  const float* scale;  // F8_E4M3 only: [ceil(out/128), scale_cols]
  int64_t scale_cols;
  float* y;            // [T, out]
};

// Floats of per-thread scratch each kernel needs (the caller allocates it once per thread).
size_t scratch_floats_scalar(const MatmulArgs& a);
size_t scratch_floats_avx2(const MatmulArgs& a);
size_t scratch_floats_avx512(const MatmulArgs& a);

// Compute y[t, o] for all t < T and o in [r0, r1). Each output element's summation order depends
// only on (dtype, in, T), never on r0/r1, so any partition of rows gives identical bits.
void matmul_rows_scalar(const MatmulArgs& a, int64_t r0, int64_t r1, float* scratch);
void matmul_rows_avx2(const MatmulArgs& a, int64_t r0, int64_t r1, float* scratch);
void matmul_rows_avx512(const MatmulArgs& a, int64_t r0, int64_t r1, float* scratch);

}  // namespace vireo::kernels
