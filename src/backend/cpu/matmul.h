#pragma once
// CPU matrix products against stored-dtype weights. Weights stay in their checkpoint dtype
// (F32, BF16, F16, F8_E4M3 with 128x128 block scales) and are converted to f32 in registers as
// they stream through; products accumulate in f32. Both the decode case (T = 1, a GEMV bound by
// memory bandwidth) and the prefill case (T > 1, weights reused across rows) go through here.
#include <cstdint>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace vireo {

// A linear layer's weight as stored: w [out, in]; for F8_E4M3, scale_inv [ceil(out/128),
// ceil(in/128)] F32 with value(i, j) = w[i, j] * scale_inv[i / 128, j / 128]. Other dtypes leave
// scale_inv empty.
struct Weight {
  Tensor w;
  Tensor scale_inv;
  int64_t out() const { return w.dim(0); }
  int64_t in() const { return w.dim(1); }
  size_t nbytes() const { return w.nbytes() + (scale_inv.empty() ? 0 : scale_inv.nbytes()); }
};

// y[t, o] = sum_i x[t, i] * value(o, i) for t < T. x is [T, in] f32 with row stride in, y is
// [T, out] f32 with row stride out. Parallel over output rows on `pool`; the result does not
// depend on the number of threads, nor on T: each row of y is bit-identical to a T = 1 call on
// that row of x (a speculative verification step's rows are decode steps'; a batch of sequences
// gets each sequence's rows as it would alone).
void cpu_matmul(const float* x, int64_t T, const Weight& w, float* y, ThreadPool& pool);

// Kernel families. Auto (the default) picks the widest the CPU supports at run time; tests force
// each one to check it against the reference. Results differ between families only by f32
// rounding; within one family they never depend on the thread count.
enum class MatmulIsa { Auto, Scalar, Avx2, Avx512 };
bool cpu_matmul_isa_supported(MatmulIsa isa);
// Throws vireo::Error if the CPU lacks `isa`. Not thread-safe against concurrent cpu_matmul.
void cpu_matmul_set_isa(MatmulIsa isa);
// The family cpu_matmul uses now (never Auto).
MatmulIsa cpu_matmul_isa();
const char* matmul_isa_name(MatmulIsa isa);

// Reference implementation: one element at a time, scalar conversion, f64 accumulation. Used by
// tests as the oracle for cpu_matmul.
void cpu_matmul_reference(const float* x, int64_t T, const Weight& w, float* y);

// Converts row `row` of a stored weight to f32 (applying block scales). out has w.in() floats.
void cpu_dequantize_row(const Weight& w, int64_t row, float* out);

}  // namespace vireo
