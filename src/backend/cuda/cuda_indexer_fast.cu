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
// The next head's query rows are copied (cp.async, f32) into the other of two buffers while this
// head's products run, and rounded to bf16 at the fragment loads: one barrier per head, and the
// loads' latency hidden (loading after a barrier, then a second barrier before the products,
// left the kernel at ~100 TFLOP/s on the H200, 0.52 ms a GLM-5 layer at 4096 tokens).
#include <cuda_bf16.h>

#include "backend/cuda/cuda_attention.h"
#include "backend/cuda/cuda_internal.h"

namespace vireo::cuda {

namespace {

constexpr int kIxQ = 64, kIxK = 128, kIxThreads = 256;

// Grid (ceil(n_keys / kIxK), ceil(T / kIxQ)). d a multiple of 16, q 16-byte aligned.
__global__ void __launch_bounds__(kIxThreads, 2)
    indexer_scores_bf16_kernel(const float* __restrict__ q, const float* __restrict__ wts,
                               const float* __restrict__ keys, int64_t T, int nI, int d, int64_t n_keys, int64_t pos0,
                               int64_t topk, float scale, float wscale, float* __restrict__ scores) {
  pdl_begin();
  extern __shared__ uint32_t smw[];
  const int dw = d / 2 + 4;  // words per K row
  const int qs = d + 8;      // floats per Q row (float2 fragment loads of a half-warp on distinct banks)
  uint32_t* Ks = smw;                                         // [kIxK][dw] bf16 pairs
  float* Qf = reinterpret_cast<float*>(Ks + kIxK * dw);       // [2][kIxQ][qs] f32
  float* ws = Qf + 2 * kIxQ * qs;                             // [kIxQ][nI]
  const int64_t t0 = int64_t(blockIdx.y) * kIxQ, u0 = int64_t(blockIdx.x) * kIxK;
  const int64_t t_last = (T < t0 + kIxQ ? T : t0 + kIxQ) - 1;
  const int64_t n_last = pos0 + t_last + 1;  // causal keys of the block's last row
  if (n_last <= topk || u0 >= n_last) return;  // no row here needs these scores: uniform exit
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int wq = warp & 3, wk = warp >> 2;  // the warp's 16 queries and 64 keys
  const int half = d / 2, quads = d / 4;

  // Head h's query rows (f32, converted at the fragment loads) into buffer b, 16-byte pieces;
  // rows past T zero-filled.
  auto fetch = [&](int h, int b) {
    float* Qb = Qf + b * kIxQ * qs;
    for (int i = tid; i < kIxQ * quads; i += kIxThreads) {
      const int r = i / quads, c = 4 * (i % quads);
      const int64_t t = t0 + r;
      cp_async16_zfill(smem_u32(Qb + r * qs + c), t < T ? q + (t * nI + h) * d + c : q, t < T);
    }
    cp_async_commit();
  };
  fetch(0, 0);  // in flight while K and w are loaded
  for (int i = tid; i < kIxK * half; i += kIxThreads) {
    const int j = i / half, p = i % half;
    const int64_t u = u0 + j;
    float2 v = make_float2(0.0f, 0.0f);
    if (u < n_last && u < n_keys) v = *reinterpret_cast<const float2*>(keys + u * d + 2 * p);
    Ks[j * dw + p] = pack_bf16x2(v.x, v.y);
  }
  for (int i = tid; i < kIxQ * nI; i += kIxThreads) {
    const int64_t t = t0 + i / nI;
    ws[i] = t < T ? __fmul_rn(wts[t * nI + i % nI], wscale) : 0.0f;
  }
  float acc[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

  for (int h = 0; h < nI; ++h) {
    cp_async_wait_all();
    // Head h's rows (and, the first time, K and w) visible; every warp is done with the other
    // buffer (head h - 1's), which head h + 1's rows go to now, in flight during the products.
    __syncthreads();
    if (h + 1 < nI) fetch(h + 1, (h + 1) & 1);
    const float* Qb = Qf + (h & 1) * kIxQ * qs;
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    for (int kd = 0; kd < d / 16; ++kd) {
      const float* qa = Qb + (wq * 16 + g) * qs + kd * 16 + 2 * tq;
      const float2 q0 = *reinterpret_cast<const float2*>(qa), q1 = *reinterpret_cast<const float2*>(qa + 8 * qs),
                   q2 = *reinterpret_cast<const float2*>(qa + 8), q3 = *reinterpret_cast<const float2*>(qa + 8 * qs + 8);
      const uint32_t a0 = pack_bf16x2(q0.x, q0.y), a1 = pack_bf16x2(q1.x, q1.y), a2 = pack_bf16x2(q2.x, q2.y),
                     a3 = pack_bf16x2(q3.x, q3.y);
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

// --math fast decode (a few rows, run-time positions): the same scores as indexer_scores_bf16_kernel's
// (q and k rounded to bf16 once, products on mma.sync m16n8k16, f32 sums), shaped for latency: a
// block is 4 warps of 8 keys each; a warp's key fragments are loaded straight from global memory
// into registers (16 float2 loads a thread for d = 128, all in flight at once), the row's queries
// once a block into shared memory as bf16 pairs, and the heads' weighted sum is a 3-step shuffle.
// The exact kernel (indexer_score_v4_kernel: sequential unfused sums, ~2 instructions a product)
// took 10.7 us for 4096 keys (ncu, H200, session 39) on the decode step's critical path; this one
// 6.9 us (ncu, in the step; its advance there ~10 -> ~5.8 us a layer, +1.1-1.2 points of fp8
// decode at 4096 cached). Issuing every load before storing any query measured even.
// Grid (ceil(n_keys / 32), T); d a multiple of 16 up to 128, nI up to 64.
constexpr int kIdWarps = 4, kIdMaxKd = 8, kIdMaxMt = 4;
__global__ void __launch_bounds__(kIdWarps * 32)
    indexer_scores_decode_tc_kernel(const float* __restrict__ q, const float* __restrict__ wts,
                                    const float* __restrict__ keys, int nI, int d, int64_t n_keys, int64_t pos0,
                                    const int32_t* __restrict__ pos0_dev, int64_t topk, float scale, float wscale,
                                    float* __restrict__ scores) {
  pdl_begin();
  __shared__ uint32_t qs[kIdMaxMt * 16 * (kIdMaxKd * 8 + 4)];  // [nI rounded up to 16][d / 2 + 4] bf16 pairs
  __shared__ float ws[kIdMaxMt * 16];                          // [nI rounded up to 16] w[t, h] wscale (0 past nI)
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t t = blockIdx.y, n_causal = pos0 + t + 1, u0 = int64_t(blockIdx.x) * (8 * kIdWarps);
  if (n_causal <= topk || u0 >= n_causal) return;  // whole block: uniform
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int kds = d / 16, mts = (nI + 15) / 16, dw = d / 2 + 4;
  // This lane's key fragments first (their loads are the longest wait): key u0 + 8 warp + g,
  // dimensions 16 kd + 2 tq, + 1 and 16 kd + 2 tq + 8, + 9.
  const int64_t u = u0 + 8 * warp + g;
  const bool live = u < n_causal && u < n_keys;
  const float* kr = keys + (live ? u : 0) * d + 2 * tq;
  float2 kf[kIdMaxKd][2];
#pragma unroll
  for (int kd = 0; kd < kIdMaxKd; ++kd)
    if (kd < kds) {
      kf[kd][0] = live ? *reinterpret_cast<const float2*>(kr + 16 * kd) : make_float2(0.0f, 0.0f);
      kf[kd][1] = live ? *reinterpret_cast<const float2*>(kr + 16 * kd + 8) : make_float2(0.0f, 0.0f);
    }
  const float* qt = q + t * nI * d;
  for (int i = tid; i < mts * 16 * (d / 2); i += kIdWarps * 32) {
    const int h = i / (d / 2), c = i % (d / 2);
    const float2 v = h < nI ? *reinterpret_cast<const float2*>(qt + h * d + 2 * c) : make_float2(0.0f, 0.0f);
    qs[h * dw + c] = pack_bf16x2(v.x, v.y);
  }
  for (int h = tid; h < mts * 16; h += kIdWarps * 32) ws[h] = h < nI ? __fmul_rn(wts[t * nI + h], wscale) : 0.0f;
  __syncthreads();
  uint32_t kb[kIdMaxKd][2];
#pragma unroll
  for (int kd = 0; kd < kIdMaxKd; ++kd)
    if (kd < kds) {
      kb[kd][0] = pack_bf16x2(kf[kd][0].x, kf[kd][0].y);
      kb[kd][1] = pack_bf16x2(kf[kd][1].x, kf[kd][1].y);
    }
  float p0 = 0.0f, p1 = 0.0f;  // this lane's heads' share of keys 2 tq and 2 tq + 1 of the warp's 8
  for (int mt = 0; mt < mts; ++mt) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const uint32_t* qa = qs + (16 * mt + g) * dw + tq;
#pragma unroll
    for (int kd = 0; kd < kIdMaxKd; ++kd)
      if (kd < kds)
        mma_bf16_16816(acc, qa[8 * kd], qa[8 * dw + 8 * kd], qa[8 * kd + 4], qa[8 * dw + 8 * kd + 4], kb[kd][0],
                       kb[kd][1]);
    const float wa = ws[16 * mt + g], wb = ws[16 * mt + g + 8];  // heads 16 mt + g, + 8
    p0 += wa * fmaxf(acc[0] * scale, 0.0f) + wb * fmaxf(acc[2] * scale, 0.0f);
    p1 += wa * fmaxf(acc[1] * scale, 0.0f) + wb * fmaxf(acc[3] * scale, 0.0f);
  }
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {  // over g: the lanes holding the same keys
    p0 += __shfl_xor_sync(0xffffffffu, p0, o);
    p1 += __shfl_xor_sync(0xffffffffu, p1, o);
  }
  if (g == 0) {
    const int64_t uk = u0 + 8 * warp + 2 * tq;
    float* row = scores + t * n_keys;
    if (uk < n_causal) row[uk] = p0;
    if (uk + 1 < n_causal) row[uk + 1] = p1;
  }
}
}  // namespace

bool indexer_scores_bf16(const float* q, const float* wts, const float* keys, int64_t T, int64_t nI, int64_t d,
                         int64_t n_keys, int64_t pos0, int64_t topk, float scale, float wscale, float* scores,
                         cudaStream_t st) {
  if (d % 16 != 0 || d > 512 || nI > 128 || nI <= 0 || T <= 0) return false;
  if (reinterpret_cast<uintptr_t>(q) % 16 != 0 || reinterpret_cast<uintptr_t>(keys) % 8 != 0) return false;
  // GLM-5 (d 128, 32 heads): 112 KB, two blocks per SM.
  const size_t smem = size_t(kIxK * (d / 2 + 4)) * 4 + size_t(2 * kIxQ * (d + 8)) * 4 + size_t(kIxQ * nI) * 4;
  if (smem > 227 * 1024) return false;
  static size_t configured = 0;  // the largest size the attribute allows so far
  if (smem > 48 * 1024 && smem > configured) {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(indexer_scores_bf16_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(smem)));
    configured = smem;
  }
  dim3 grid(unsigned((n_keys + kIxK - 1) / kIxK), unsigned((T + kIxQ - 1) / kIxQ));
  launch(indexer_scores_bf16_kernel, grid, kIxThreads, smem, st, q, wts, keys, T, int(nI), int(d), n_keys, pos0, topk,
         scale, wscale, scores);
  VIREO_CUDA_LAUNCHED();
  return true;
}

bool indexer_scores_decode_tc(const float* q, const float* wts, const float* keys, int64_t T, int64_t nI, int64_t d,
                              int64_t n_keys, int64_t pos0, const int32_t* pos0_dev, int64_t topk, float scale,
                              float wscale, float* scores, cudaStream_t st) {
  if (d % 16 != 0 || d > 16 * kIdMaxKd || nI <= 0 || nI > 16 * kIdMaxMt || T <= 0) return false;
  if (reinterpret_cast<uintptr_t>(q) % 8 != 0 || reinterpret_cast<uintptr_t>(keys) % 8 != 0) return false;
  // Key blocks past a row's causal keys exit at once (n_keys bounds them under run-time positions).
  const dim3 grid(unsigned((n_keys + 8 * kIdWarps - 1) / (8 * kIdWarps)), unsigned(T));
  launch(indexer_scores_decode_tc_kernel, grid, kIdWarps * 32, 0, st, q, wts, keys, int(nI), int(d), n_keys, pos0,
         pos0_dev, topk, scale, wscale, scores);
  VIREO_CUDA_LAUNCHED();
  return true;
}

}  // namespace vireo::cuda
