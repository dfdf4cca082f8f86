#pragma once
// Decode products (at most 8 tokens) of FP8 weights in --math fast-fp8 (cuda_q8_gemv.cu): x
// quantized to e4m3 per (token, 128 columns) with act_quant's arithmetic (scale amax / 448), then
// e4m3 x e4m3 on the tensor cores (mma.sync m16n8k32), each 128-deep block's sum scaled by x's and
// the weight's block scales and added in f32: the prefill path's products (cuda_fp8_gemm.h) for
// one to eight rows, as DeepSeek's reference inference runs every FP8 linear layer.
// Each returns false, launching nothing, for shapes it does not take (then the f32-math GEMVs
// run): weights other than FP8, rows of a length that is no multiple of 64, x or h not 16-byte
// aligned, more than 8 tokens.
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_decode.h"

namespace vireo::cuda {

// On unless the environment sets VIREO_Q8_DECODE=0 (A/B runs: fast-fp8 decode then uses the
// f32-math GEMVs).
bool q8_decode_switch();

// y[t] = W x[t] for T <= 8 tokens (x [T, K], y [T, out]). *_fits: whether the call would launch.
bool q8_gemv_fits(const float* x, int64_t T, const DevW& w);
bool q8_gemv_many_fits(const float* x, int64_t T, const ManyW& m);
bool q8_gemv(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st);
// Up to kMaxMany FP8 weights of the same input length on the same x, one launch (y_i [T, out_i]).
bool q8_gemv_many(const float* x, int64_t T, const ManyW& m, cudaStream_t st);
// moe_experts (cuda_decode.h) with every expert FP8: gate | up products quantize x, the down
// products quantize each slot's h = silu(g) * u (h stays f32 in its buffer), slots summed in order
// of k as the f32 kernels do. Needs K + S <= 16.
bool q8_moe_experts(const float* x, int64_t N, int64_t D, int64_t I, int K, int S, int n_routed, const int32_t* ids,
                    const float* weights, const DevExpert* bank, MoePart part, float* h, float* out, cudaStream_t st);

}  // namespace vireo::cuda
