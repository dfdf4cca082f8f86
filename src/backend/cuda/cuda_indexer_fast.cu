// DSA indexer scores on tensor cores, for --math fast prefill (CudaGemmMode::Bf16).
//
// I[t, u] = sum_h w[t, h] relu(scale q[t, h, :] . k[u, :]) over the rows with more causal keys
// than top-k (the others select every causal key and need no scores). The exact kernels of
// cuda_attention.cu reproduce the CPU's f32 sums bit for bit at ~2 instructions per product
// (8.2 ms for 2 GLM-5 layers at 4096 tokens); here q and k are rounded to bf16 once (as the
// fast GEMMs round activations; DeepSeek's reference rounds them further, to e4m3) and the dot
// products run on mma.sync m16n8k16 with f32 accumulation: 68 GFLOP a layer at 4096 tokens is
// ~0.1 ms of tensor-core work, so the kernel is bound by its loads.
//
// A block owns 64 queries x 128 keys; its 8 warps each hold a 16 x 64 tile of I in registers.
// The key tile (128 x d, bf16) is loaded once; per head the block loads that head's 64 query
// rows, every warp computes its 16 x 64 dot products, and adds w[t, h] relu(scale s) into I.
// Shared-memory rows are padded to d/2 + 4 words, so fragment loads hit distinct banks.
#include <cuda_bf16.h>

#include "backend/cuda/cuda_attention.h"
#include "backend/cuda/cuda_internal.h"

namespace vireo::cuda {

namespace {

constexpr int kIxQ = 64, kIxK = 128, kIxThreads = 256;

// Grid (ceil(n_keys / kIxK), ceil(T / kIxQ)). d a multiple of 16.
__global__ void __launch_bounds__(kIxThreads) indexer_scores_bf16_kernel(
    const float* __restrict__ q, const float* __restrict__ wts, const float* __restrict__ keys, int64_t T, int nI,
    int d, int64_t n_keys, int64_t pos0, int64_t topk, float scale, float* __restrict__ scores) {
  extern __shared__ uint32_t smw[];
  const int dw = d / 2 + 4;  // words per row
  uint32_t* Ks = smw;                                    // [kIxK][dw]
  uint32_t* Qs = Ks + kIxK * dw;                         // [kIxQ][dw]
  float* ws = reinterpret_cast<float*>(Qs + kIxQ * dw);  // [kIxQ][nI]
  const int64_t t0 = int64_t(blockIdx.y) * kIxQ, u0 = int64_t(blockIdx.x) * kIxK;
  const int64_t t_last = (T < t0 + kIxQ ? T : t0 + kIxQ) - 1;
  const int64_t n_last = pos0 + t_last + 1;  // causal keys of the block's last row
  if (n_last <= topk || u0 >= n_last) return;  // no row here needs these scores: uniform exit
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int wq = warp & 3, wk = warp >> 2;  // the warp's 16 queries and 64 keys
  const int half = d / 2;

  for (int i = tid; i < kIxK * half; i += kIxThreads) {
    const int j = i / half, p = i % half;
    const int64_t u = u0 + j;
    float2 v = make_float2(0.0f, 0.0f);
    if (u < n_last && u < n_keys) v = *reinterpret_cast<const float2*>(keys + u * d + 2 * p);
    Ks[j * dw + p] = pack_bf16x2(v.x, v.y);
  }
  for (int i = tid; i < kIxQ * nI; i += kIxThreads) {
    const int64_t t = t0 + i / nI;
    ws[i] = t < T ? wts[t * nI + i % nI] : 0.0f;
  }
  float acc[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

  for (int h = 0; h < nI; ++h) {
    __syncthreads();  // the previous head's query rows are no longer read (and the first: K, w loaded)
    for (int i = tid; i < kIxQ * half; i += kIxThreads) {
      const int r = i / half, p = i % half;
      const int64_t t = t0 + r;
      float2 v = make_float2(0.0f, 0.0f);
      if (t < T) v = *reinterpret_cast<const float2*>(q + (t * nI + h) * d + 2 * p);
      Qs[r * dw + p] = pack_bf16x2(v.x, v.y);
    }
    __syncthreads();
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    for (int kd = 0; kd < d / 16; ++kd) {
      const uint32_t* qa = Qs + (wq * 16 + g) * dw + kd * 8 + tq;
      const uint32_t a0 = qa[0], a1 = qa[8 * dw], a2 = qa[4], a3 = qa[8 * dw + 4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const uint32_t* kb = Ks + (wk * 64 + nt * 8 + g) * dw + kd * 8 + tq;
        mma_bf16_16816(s[nt], a0, a1, a2, a3, kb[0], kb[4]);
      }
    }
    const float wa = ws[(wq * 16 + g) * nI + h], wb = ws[(wq * 16 + g + 8) * nI + h];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      acc[nt][0] += wa * fmaxf(s[nt][0] * scale, 0.0f);
      acc[nt][1] += wa * fmaxf(s[nt][1] * scale, 0.0f);
      acc[nt][2] += wb * fmaxf(s[nt][2] * scale, 0.0f);
      acc[nt][3] += wb * fmaxf(s[nt][3] * scale, 0.0f);
    }
  }
  // Rows with <= topk causal keys are never read (they select every key); keys beyond a row's
  // causal limit are not written (the top-k reads only the causal ones).
#pragma unroll
  for (int e2 = 0; e2 < 2; ++e2) {
    const int64_t t = t0 + wq * 16 + g + 8 * e2;
    const int64_t n_causal = pos0 + t + 1;
    if (t >= T || n_causal <= topk) continue;
    float* row = scores + t * n_keys;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int64_t u = u0 + wk * 64 + nt * 8 + 2 * tq;
      if (u < n_causal) row[u] = acc[nt][2 * e2];
      if (u + 1 < n_causal) row[u + 1] = acc[nt][2 * e2 + 1];
    }
  }
}

}  // namespace

bool indexer_scores_bf16(const float* q, const float* wts, const float* keys, int64_t T, int64_t nI, int64_t d,
                         int64_t n_keys, int64_t pos0, int64_t topk, float scale, float* scores, cudaStream_t st) {
  if (d % 16 != 0 || d > 512 || nI > 128 || nI <= 0 || T <= 0) return false;
  if (reinterpret_cast<uintptr_t>(q) % 8 != 0 || reinterpret_cast<uintptr_t>(keys) % 8 != 0) return false;
  const size_t smem = size_t((kIxK + kIxQ) * (d / 2 + 4)) * 4 + size_t(kIxQ * nI) * 4;
  static size_t configured = 0;  // the largest size the attribute allows so far
  if (smem > 48 * 1024 && smem > configured) {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(indexer_scores_bf16_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(smem)));
    configured = smem;
  }
  dim3 grid(unsigned((n_keys + kIxK - 1) / kIxK), unsigned((T + kIxQ - 1) / kIxQ));
  indexer_scores_bf16_kernel<<<grid, kIxThreads, smem, st>>>(q, wts, keys, T, int(nI), int(d), n_keys, pos0, topk,
                                                             scale, scores);
  VIREO_CUDA_LAUNCHED();
  return true;
}

}  // namespace vireo::cuda
