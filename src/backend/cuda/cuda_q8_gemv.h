#pragma once
// Decode products of 2 to 8 rows on FP8 weights in --math fast-fp8 (cuda_q8_gemv.cu): x quantized
// to e4m3 per (token, 128 columns) with act_quant's arithmetic (scale amax / 448), then e4m3 x e4m3
// on the tensor cores (mma.sync m16n8k32, one token a column of B), each 128-deep block's sum
// scaled by x's and the weight's block scales and added in f32: the prefill path's products
// (cuda_fp8_gemm.h) for a few rows, as DeepSeek's reference inference runs every FP8 linear layer.
// Why only from 2 rows: one row is faster on the f32-math GEMV (o_proj 32 against 41 us, H200).
// Against the f32-math GEMVs of 2..8 rows (x in shared memory too, cuda_matmul.cu) these are
// 1.3-2.5x faster per product at 4-8 rows (BENCHMARKS.md, session 16); o_proj at 8 rows, once
// slower (200 against 187 us: each of its 384 blocks quantized all of x), takes x quantized once
// ahead since session 36 (67.5 us).
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_kernels.cuh"

namespace vireo::cuda {

// On unless the environment sets VIREO_Q8_DECODE=0 (A/B runs: fast-fp8 decode then uses the
// f32-math GEMVs).
bool q8_decode_switch();

// Whether q8_gemv takes the product: T in 1..8, FP8 weight rows of a multiple of 64 columns,
// x and the weight 16-byte aligned, T x K bytes of quantized x within a block's shared memory.
bool q8_gemv_fits(const float* x, int64_t T, const DevW& w);
// x already quantized by act_quant (cuda_fp8_gemm.h): bytes q [Tp, K] (16-byte aligned), scales s
// [ceil(K / 128), Tp], Tp >= T; q null: none.
struct Q8PreX {
  const uint8_t* q = nullptr;
  const float* s = nullptr;
  int64_t Tp = 0;
};
// Whether a product of T rows on w should take x quantized once (act_quant, then Q8PreX) rather
// than each block quantizing x itself: where the blocks' reads of x (T x K f32 each) outweigh the
// weight's bytes, as o_proj's 384 blocks at 8 rows (201 MB of x against 100 MB of weights; H200:
// 197 -> BENCHMARKS session 36). VIREO_Q8_PREQUANT=0: never (A/B runs).
bool q8_prequantize(int64_t T, const DevW& w);
void set_q8_prequant(bool on);  // process-wide (cuda_set_q8_prequant)
// y[t] = W x[t] (x [T, K], y [T, out]); false (nothing launched) where q8_gemv_fits is false (or
// pre is given with Tp < T or unaligned bytes). pre: x's bytes and scales as act_quant writes
// them (the same bits the blocks' own quantization gives), copied into each block.
bool q8_gemv(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st, const Q8PreX& pre = {});

}  // namespace vireo::cuda
