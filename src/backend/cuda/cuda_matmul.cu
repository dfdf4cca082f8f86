// Matrix products against stored-dtype weights on the GPU.
//  - Decode (T <= 8 rows): our own GEMV. Each weight byte is read once with 16-byte loads and
//    converted in registers; all T rows are accumulated against it (f32). The warps per output
//    row are chosen so the grid covers the chip even for narrow matrices; the partial sums are
//    combined in a fixed order, so results never depend on timing.
//  - Prefill (T > 8): BF16 weights go to cuBLASLt tensor cores (x split into bf16 hi + lo so the
//    product stays within ~2^-16 of f32 math). FP8 weights too: each 128x128 block of w * scale is
//    dequantized to f32 and split into bf16 hi + lo (a scratch copy, in row chunks), and
//    y = W_hi x_hi + W_hi x_lo + W_lo x_hi (three passes, f32 accumulation; the dropped W_lo x_lo
//    and the rounding of the lo parts are ~2^-16 relative). F32/F16 weights (and shapes cuBLASLt
//    refuses) run a tiled f32 CUDA-core kernel. cuBLASLt's own FP8 path needs FP8 activations
//    (measured in shared/notes), which is a different, lossier function: the exact mode does not
//    use it; the fast mode does on FP8 weights, as DeepSeek's inference does (cuda_fp8_gemm.h).
#include <cublasLt.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_kernels.cuh"

namespace vireo::cuda {

namespace {

// y[t, row] for t < TT; WARPS warps per block, `wpr` warps per row. XS: the block first copies x
// (TT rows) into shared memory, swizzled (stage_x), and reads it there: through L1 each 16-byte
// weight load cost TT x 4 float4 reads of x, lanes 64 bytes apart (FP8), and 2..8 rows ran 4-13x
// slower than one (H200: o_proj 124 us at 2 rows, 409 at 8, against 32). Each lane sums the same
// terms in the same order either way (dot_chunk is gemv_consume's expression), so for the same
// wpr the two give the same bits.
template <int DT, int TT, bool XS = false, int WARPS = 8>
__global__ void __launch_bounds__(32 * WARPS) gemv_kernel(const float* __restrict__ x, DevW w,
                                                          float* __restrict__ y, int wpr) {
  pdl_begin();
  extern __shared__ float4 xs[];
  constexpr int N = GemvVec<DT>::n;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpb = WARPS / wpr;
  const int64_t row = int64_t(blockIdx.x) * rpb + warp / wpr;
  const int sub = warp % wpr;
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
  if constexpr (XS) stage_x(x, TT * w.in, xs);
  // Chunk v (16 bytes) of the row into acc: gemv_consume (x through L1) or its sums over the
  // shared copy.
  auto consume = [&](const uint4& a, int64_t v, const float* srow) {
    if constexpr (XS) {
      float scale = 1.0f;
      if constexpr (DT == W_FP8) scale = srow[(v * N) >> 7];
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        const XShared xt{xs, int(t * w.in / 4)};
        float4 xv[N / 4];
#pragma unroll
        for (int j = 0; j < N / 4; ++j) xv[j] = xt(v * (N / 4) + j);
        const float p = dot_chunk<DT>(a, xv);
        if constexpr (DT == W_FP8) acc[t] += scale * p;
        else acc[t] += p;
      }
    } else {
      gemv_consume<DT, TT>(a, x, w.in, v * N, srow, acc);
    }
  };
  if (row < w.out) {
    const uint4* wr = reinterpret_cast<const uint4*>(static_cast<const char*>(w.w) + row * w.in * elem_bytes<DT>());
    const float* srow = DT == W_FP8 ? w.s + (row >> 7) * w.s_cols : nullptr;
    const int64_t nv = w.in / N, step = int64_t(wpr) * 32;
    int64_t v = int64_t(sub) * 32 + lane;
    // Eight (then four) loads in flight before the first use: a warp streams one row, so the
    // bytes in flight per warp are what hides the memory latency.
    for (; v + 7 * step < nv; v += 8 * step) {
      uint4 a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = ldg_stream(wr + v + i * step);
#pragma unroll
      for (int i = 0; i < 8; ++i) consume(a[i], v + i * step, srow);
    }
    for (; v + 3 * step < nv; v += 4 * step) {
      const uint4 a0 = ldg_stream(wr + v), a1 = ldg_stream(wr + v + step), a2 = ldg_stream(wr + v + 2 * step),
                  a3 = ldg_stream(wr + v + 3 * step);
      consume(a0, v, srow);
      consume(a1, v + step, srow);
      consume(a2, v + 2 * step, srow);
      consume(a3, v + 3 * step, srow);
    }
    for (; v < nv; v += step) consume(ldg_stream(wr + v), v, srow);
  }
  __shared__ float red[WARPS][TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    const float s = warp_sum(acc[t]);
    if (lane == 0) red[warp][t] = s;
  }
  __syncthreads();
  if (sub == 0 && lane < TT && row < w.out) {
    float s = 0.0f;
    for (int j = 0; j < wpr; ++j) s += red[warp + j][lane];
    y[int64_t(lane) * w.out + row] = s;
  }
}

// Any shape, any alignment: one warp per output row, scalar loads.
template <int DT>
__global__ void gemv_scalar_kernel(const float* __restrict__ x, int T, DevW w, float* __restrict__ y) {
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * 8 + warp;
  if (row >= w.out) return;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t k = lane; k < w.in; k += 32) {
    const float wv = wget<DT>(w, row, k);
#pragma unroll
    for (int t = 0; t < 8; ++t)
      if (t < T) acc[t] += wv * x[t * w.in + k];
  }
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const float s = warp_sum(acc[t]);
    if (t < T && lane == 0) y[t * w.out + row] = s;
  }
}

// y[T, out] = x[T, in] W^T in f32: 64 x 64 tiles, 16-deep k steps, 4 x 4 outputs per thread.
template <int DT>
__global__ void __launch_bounds__(256) gemm_simt_kernel(const float* __restrict__ x, int64_t T, DevW w,
                                                        float* __restrict__ y) {
  pdl_begin();
  __shared__ float As[16][64 + 4];  // [k][t]
  __shared__ float Bs[16][64 + 4];  // [k][o]
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const int64_t t0 = int64_t(blockIdx.y) * 64, o0 = int64_t(blockIdx.x) * 64;
  const int64_t in = w.in, out = w.out;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < in; k0 += 16) {
    for (int i = threadIdx.x; i < 1024; i += 256) {
      const int r = i >> 4, c = i & 15;
      const int64_t k = k0 + c;
      As[c][r] = (t0 + r < T && k < in) ? x[(t0 + r) * in + k] : 0.0f;
      Bs[c][r] = (o0 + r < out && k < in) ? wget<DT>(w, o0 + r, k) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t t = t0 + ty + 16 * i;
    if (t >= T) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t o = o0 + tx + 16 * j;
      if (o < out) y[t * out + o] = acc[i][j];
    }
  }
}

// x f32 -> hi = bf16(x), lo = bf16(x - hi): x = hi + lo within 2^-16 relative.
__global__ void split_bf16_kernel(const float* __restrict__ x, int64_t n, __nv_bfloat16* __restrict__ hi,
                                  __nv_bfloat16* __restrict__ lo) {
  pdl_begin();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    hi[i] = h;
    if (lo) lo[i] = __float2bfloat16_rn(v - __bfloat162float(h));
  }
}

// rows [row0, row0 + rows) of an FP8 weight -> hi = bf16(w * s), lo = bf16(w * s - hi), [rows, in].
// w * s is the f32 product the CPU reference uses. Four consecutive weights per thread (in % 4 == 0).
__global__ void dequant_split_fp8_kernel(DevW w, int64_t row0, int64_t rows, __nv_bfloat16* __restrict__ hi,
                                         __nv_bfloat16* __restrict__ lo) {
  pdl_begin();
  const int64_t n4 = rows * w.in / 4;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(w.w) + row0 * w.in);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = 4 * i, r = e / w.in, c = e % w.in;
    const float sc = w.s[((row0 + r) >> 7) * w.s_cols + (c >> 7)];
    const uint32_t b = src[i];
    __nv_bfloat16 h[4], l[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float v = fp8_to_f32((b >> (8 * k)) & 0xffu) * sc;
      h[k] = __float2bfloat16_rn(v);
      l[k] = __float2bfloat16_rn(v - __bfloat162float(h[k]));
    }
    uint2 hv, lv;
    hv.x = uint32_t(__bfloat16_as_ushort(h[0])) | (uint32_t(__bfloat16_as_ushort(h[1])) << 16);
    hv.y = uint32_t(__bfloat16_as_ushort(h[2])) | (uint32_t(__bfloat16_as_ushort(h[3])) << 16);
    lv.x = uint32_t(__bfloat16_as_ushort(l[0])) | (uint32_t(__bfloat16_as_ushort(l[1])) << 16);
    lv.y = uint32_t(__bfloat16_as_ushort(l[2])) | (uint32_t(__bfloat16_as_ushort(l[3])) << 16);
    reinterpret_cast<uint2*>(hi)[i] = hv;
    if (lo) reinterpret_cast<uint2*>(lo)[i] = lv;
  }
}

// y [T, E] = x [T, K] w^T for a few weight rows (E <= 32: a MoE router of the 16-expert bench, an
// indexer's head weights) and many tokens. Why: cuBLASLt's tiles for 16 output rows leave most
// SMs idle (H200: 101 us for 4096 x 16 x 6144, 8 TFLOP/s; 30 us at 512 tokens), while the product
// is a single pass over x. A block per TPB tokens, its 256 threads along K (4 columns each, 1024
// a step; a warp per token group measured 289 us at 512 tokens: 16 blocks, each walking all of
// K), f32 products summed per thread in K order, then across each warp's lanes by a fixed xor
// tree and across the warps in warp order: deterministic, f32 throughout (the exact mode's
// accuracy, and better than the fast mode's bf16 inputs).
template <int DT, int EMAX, int TPB>
__global__ void __launch_bounds__(256) skinny_kernel(const float* __restrict__ x, int64_t T, int64_t K, int E,
                                                     const void* __restrict__ w, float* __restrict__ y) {
  pdl_begin();
  __shared__ float part[8][TPB * EMAX];
  static_assert(TPB * EMAX <= 256, "one thread a (token, row) sums the warps' parts");
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const int64_t t0 = int64_t(blockIdx.x) * TPB;
  float acc[TPB][EMAX];
#pragma unroll
  for (int i = 0; i < TPB; ++i)
#pragma unroll
    for (int e = 0; e < EMAX; ++e) acc[i][e] = 0.0f;
  for (int64_t k = int64_t(threadIdx.x) * 4; k < K; k += 1024) {
    float4 xv[TPB];
#pragma unroll
    for (int i = 0; i < TPB; ++i) {
      xv[i] = t0 + i < T ? __ldg(reinterpret_cast<const float4*>(x + (t0 + i) * K + k)) : make_float4(0, 0, 0, 0);
    }
    // Every row's loads unconditional (rows past E repeat the last one, their sums unused), so
    // all of them are issued before the first FMA: with a break at E, each waited for its own
    // load (49 us at 512 tokens, more than cuBLASLt's 30).
#pragma unroll
    for (int e = 0; e < EMAX; ++e) {
      const int64_t row = e < E ? e : E - 1;
      float4 wv;
      if constexpr (DT == W_BF16) {
        const uint2 b = __ldg(reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(w) + row * K + k));
        wv = make_float4(__uint_as_float(b.x << 16), __uint_as_float(b.x & 0xffff0000u), __uint_as_float(b.y << 16),
                         __uint_as_float(b.y & 0xffff0000u));
      } else {
        wv = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(w) + row * K + k));
      }
#pragma unroll
      for (int i = 0; i < TPB; ++i) {
        float a = acc[i][e];
        a = fmaf(xv[i].x, wv.x, a);
        a = fmaf(xv[i].y, wv.y, a);
        a = fmaf(xv[i].z, wv.z, a);
        a = fmaf(xv[i].w, wv.w, a);
        acc[i][e] = a;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < TPB; ++i)
#pragma unroll
    for (int e = 0; e < EMAX; ++e) {
      if (e >= E) break;
      float v = acc[i][e];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) part[warp][i * EMAX + e] = v;
    }
  __syncthreads();
  const int i = int(threadIdx.x) / EMAX, e = int(threadIdx.x) % EMAX;
  if (i < TPB && e < E && t0 + i < T) {
    float v = part[0][threadIdx.x];
#pragma unroll
    for (int wi = 1; wi < 8; ++wi) v += part[wi][threadIdx.x];
    y[(t0 + i) * E + e] = v;
  }
}

template <int DT>
void launch_skinny(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st) {
  if (w.out <= 16) {
    // (8 tokens a block, halving the weight rows' reads from L2, measured slower at 4096 tokens:
    // 98 against 81 us, at 255 registers and one block a multiprocessor; session 12.)
    launch(skinny_kernel<DT, 16, 4>, unsigned((T + 3) / 4), 256, 0, st, x, T, w.in, int(w.out), w.w, y);
  } else {
    launch(skinny_kernel<DT, 32, 2>, unsigned((T + 1) / 2), 256, 0, st, x, T, w.in, int(w.out), w.w, y);
  }
}

// The shared-memory copy of x for several rows: blocks of 16 warps (a copy of up to 200 KB leaves
// one block an SM, so the block carries the SM's loads in flight). Taken by FP8 products of 2..8
// rows and BF16 ones of 4..8 (H200, GLM-5 shapes, against x through L1: FP8 2 rows 1.8-2.8x
// faster, 8 rows 2.4-2.6x; BF16 8 rows 1.3-2x, but 2 rows of o_proj and gate | up slower: 96 and
// 22 us against 80 and 17).
constexpr int kGemvXsWarps = 16;
constexpr size_t kGemvXsMaxBytes = 200 << 10;
template <int DT>
constexpr int kGemvXsMinRows = DT == W_FP8 ? 2 : DT == W_BF16 ? 4 : 9;
// VIREO_GEMV_XS_ROWS=0: several rows read x through L1 again (A/B runs; one-row products keep
// their shared copy, unlike VIREO_GEMV_XS=0).
bool gemv_rows_x_shared() {
  static const bool on = env_switch("VIREO_GEMV_XS_ROWS");
  return on;
}

template <int DT, int TT>
void launch_gemv_t(const float* x, const DevW& w, float* y, cudaStream_t st, int sms, bool x_shared) {
  // Enough warps per row that the grid has ~2 blocks of 8 warps per multiprocessor (the same wpr
  // for the shared-memory kernel, so that both sum alike).
  int wpr = 1;
  while (wpr < 8 && (w.out + (8 / wpr) - 1) / (8 / wpr) < 2 * sms) wpr *= 2;
  if constexpr (TT >= kGemvXsMinRows<DT>) {
    const size_t x_bytes = size_t(TT) * size_t(w.in) * 4;
    if (x_shared && x_bytes <= kGemvXsMaxBytes && gemv_rows_x_shared()) {
      allow_dynamic_smem<gemv_kernel<DT, TT, true, kGemvXsWarps>, kGemvXsMaxBytes>();
      const int rpb = kGemvXsWarps / wpr;
      launch(gemv_kernel<DT, TT, true, kGemvXsWarps>, unsigned((w.out + rpb - 1) / rpb), 32 * kGemvXsWarps, x_bytes,
             st, x, w, y, wpr);
      return;
    }
  }
  const int rpb = 8 / wpr;
  const unsigned blocks = unsigned((w.out + rpb - 1) / rpb);
  launch(gemv_kernel<DT, TT>, blocks, 256, 0, st, x, w, y, wpr);
}

template <int DT>
void launch_gemv(const float* x, int T, const DevW& w, float* y, cudaStream_t st, int sms, bool x_shared) {
  switch (T) {
    case 1: launch_gemv_t<DT, 1>(x, w, y, st, sms, x_shared); break;
    case 2: launch_gemv_t<DT, 2>(x, w, y, st, sms, x_shared); break;
    case 3: launch_gemv_t<DT, 3>(x, w, y, st, sms, x_shared); break;
    case 4: launch_gemv_t<DT, 4>(x, w, y, st, sms, x_shared); break;
    case 5: launch_gemv_t<DT, 5>(x, w, y, st, sms, x_shared); break;
    case 6: launch_gemv_t<DT, 6>(x, w, y, st, sms, x_shared); break;
    case 7: launch_gemv_t<DT, 7>(x, w, y, st, sms, x_shared); break;
    default: launch_gemv_t<DT, 8>(x, w, y, st, sms, x_shared); break;
  }
}

template <int DT>
void launch_small(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st, int sms, bool x_shared) {
  constexpr int N = GemvVec<DT>::n;
  const bool vec = w.in % N == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(w.w) % 16 == 0;
  // FP8 rows whose x is too large for one copy: the rows in groups that fit (each token's sums are
  // the same in any group; o_proj at 4 rows: 2 x 57 us against 208 through L1).
  const int64_t fit = int64_t(kGemvXsMaxBytes / (size_t(w.in) * 4));
  if (vec && DT == W_FP8 && x_shared && gemv_rows_x_shared() && T > fit && fit >= kGemvXsMinRows<DT>) {
    for (int64_t t0 = 0; t0 < T; t0 += fit)
      launch_gemv<DT>(x + t0 * w.in, int(std::min(fit, T - t0)), w, y + t0 * w.out, st, sms, x_shared);
    return;
  }
  if (vec) launch_gemv<DT>(x, int(T), w, y, st, sms, x_shared);
  else launch(gemv_scalar_kernel<DT>, unsigned((w.out + 7) / 8), 256, 0, st, x, int(T), w, y);
}

template <int DT>
void launch_simt(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st) {
  dim3 grid(unsigned((w.out + 63) / 64), unsigned((T + 63) / 64));
  launch(gemm_simt_kernel<DT>, grid, 256, 0, st, x, T, w, y);
}

}  // namespace

void matmul_small(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st, int sms, bool x_shared) {
  switch (w.dt) {
    case W_F32: launch_small<W_F32>(x, T, w, y, st, sms, x_shared); break;
    case W_BF16: launch_small<W_BF16>(x, T, w, y, st, sms, x_shared); break;
    case W_F16: launch_small<W_F16>(x, T, w, y, st, sms, x_shared); break;
    default: launch_small<W_FP8>(x, T, w, y, st, sms, x_shared); break;
  }
}

bool matmul_skinny_fits(const float* x, int64_t T, const DevW& w) {
  return T > 0 && w.out >= 1 && w.out <= 32 && w.in % 4 == 0 && (w.dt == W_BF16 || w.dt == W_F32) &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w.w) % 16 == 0 &&
         T <= (int64_t(1) << 33);
}

bool matmul_skinny(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st) {
  if (!matmul_skinny_fits(x, T, w)) return false;
  if (w.dt == W_BF16) launch_skinny<W_BF16>(x, T, w, y, st);
  else launch_skinny<W_F32>(x, T, w, y, st);
  return true;
}

void matmul_simt(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st) {
  switch (w.dt) {
    case W_F32: launch_simt<W_F32>(x, T, w, y, st); break;
    case W_BF16: launch_simt<W_BF16>(x, T, w, y, st); break;
    case W_F16: launch_simt<W_F16>(x, T, w, y, st); break;
    default: launch_simt<W_FP8>(x, T, w, y, st); break;
  }
}

void dequant_split_fp8(const DevW& w, int64_t row0, int64_t rows, void* hi, void* lo, cudaStream_t st) {
  const int64_t n4 = rows * w.in / 4;
  const unsigned blocks = unsigned(std::clamp<int64_t>((n4 + 255) / 256, 1, 65536));
  launch(dequant_split_fp8_kernel, blocks, 256, 0, st, w, row0, rows, static_cast<__nv_bfloat16*>(hi),
         static_cast<__nv_bfloat16*>(lo));
}

// The same, 4 elements per thread: 16-byte loads, 8-byte stores (the scalar kernel's 4-byte loads
// and 2-byte stores ran at ~2 TB/s; this pass is a prefill product's only extra memory traffic).
__global__ void split_bf16_x4_kernel(const float4* __restrict__ x, int64_t n4, uint2* __restrict__ hi,
                                     uint2* __restrict__ lo) {
  pdl_begin();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = x[i];
    const __nv_bfloat162 h01 = __floats2bfloat162_rn(v.x, v.y), h23 = __floats2bfloat162_rn(v.z, v.w);
    hi[i] = make_uint2(*reinterpret_cast<const uint32_t*>(&h01), *reinterpret_cast<const uint32_t*>(&h23));
    if (lo) {
      const float2 f01 = __bfloat1622float2(h01), f23 = __bfloat1622float2(h23);
      const __nv_bfloat162 l01 = __floats2bfloat162_rn(v.x - f01.x, v.y - f01.y);
      const __nv_bfloat162 l23 = __floats2bfloat162_rn(v.z - f23.x, v.w - f23.y);
      lo[i] = make_uint2(*reinterpret_cast<const uint32_t*>(&l01), *reinterpret_cast<const uint32_t*>(&l23));
    }
  }
}

void split_bf16(const float* x, int64_t n, void* hi, void* lo, cudaStream_t st) {
  const bool vec = n % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(hi) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(lo) % 8 == 0;
  const int64_t items = vec ? n / 4 : n;
  const unsigned blocks = unsigned(std::min<int64_t>((items + 255) / 256, 4 * 132 * 8));
  if (vec)
    launch(split_bf16_x4_kernel, blocks, 256, 0, st, reinterpret_cast<const float4*>(x), n / 4, static_cast<uint2*>(hi),
           static_cast<uint2*>(lo));
  else
    launch(split_bf16_kernel, blocks, 256, 0, st, x, n, static_cast<__nv_bfloat16*>(hi),
           static_cast<__nv_bfloat16*>(lo));
}

namespace {

// A planned cuBLASLt product: descriptors and the heuristic's algorithm for one shape. Planning
// (descriptor creation plus cublasLtMatmulAlgoGetHeuristic) costs the host far more than the
// launch; a 512-token prefill runs ~100 products of a dozen shapes, so each shape is planned
// once per process and reused (pointers, alpha and beta are arguments of each call).
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
};
using LtKey = std::tuple<cublasLtHandle_t, int64_t, int64_t, int64_t, int, int, int, int64_t, size_t, bool, int>;

// batch > 1: a strided batch (A's stride set per call; B's 0, the shared input; D's m x ldd... as
// given per call too).
LtPlan plan_lt(cublasLtHandle_t lt, size_t ws_bytes, int64_t m, int64_t n, int64_t k, cudaDataType_t at,
               cudaDataType_t bt, cudaDataType_t dt, int64_t ldd, int batch, int64_t stride_a, int64_t stride_d) {
  LtPlan p;
  do {
    if (cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) break;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    if (cublasLtMatrixLayoutCreate(&p.la, at, uint64_t(k), uint64_t(m), k) != CUBLAS_STATUS_SUCCESS) break;
    if (cublasLtMatrixLayoutCreate(&p.lb, bt, uint64_t(k), uint64_t(n), k) != CUBLAS_STATUS_SUCCESS) break;
    if (cublasLtMatrixLayoutCreate(&p.ld, dt, uint64_t(m), uint64_t(n), ldd) != CUBLAS_STATUS_SUCCESS) break;
    if (batch > 1) {
      const int64_t zero = 0;
      bool set = true;
      for (cublasLtMatrixLayout_t l : {p.la, p.lb, p.ld})
        set = set && cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch) ==
                         CUBLAS_STATUS_SUCCESS;
      set = set && cublasLtMatrixLayoutSetAttribute(p.la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_a,
                                                    sizeof stride_a) == CUBLAS_STATUS_SUCCESS;
      set = set && cublasLtMatrixLayoutSetAttribute(p.lb, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &zero,
                                                    sizeof zero) == CUBLAS_STATUS_SUCCESS;
      set = set && cublasLtMatrixLayoutSetAttribute(p.ld, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_d,
                                                    sizeof stride_d) == CUBLAS_STATUS_SUCCESS;
      if (!set) break;
    }
    p.ok = lt_heuristic(lt, p.op, p.la, p.lb, p.ld, ws_bytes, 0, p.algo);
  } while (false);
  if (!p.ok) {  // (remembered as a failure: nothing of it is kept)
    if (p.la) cublasLtMatrixLayoutDestroy(p.la);
    if (p.lb) cublasLtMatrixLayoutDestroy(p.lb);
    if (p.ld) cublasLtMatrixLayoutDestroy(p.ld);
    if (p.op) cublasLtMatmulDescDestroy(p.op);
    p = LtPlan{};
  }
  return p;
}

}  // namespace

bool lt_heuristic(cublasLtHandle_t lt, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                  cublasLtMatrixLayout_t ld, size_t ws_bytes, uint32_t min_align, cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return false;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes);
  if (min_align)
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      cublasLtMatmulPreferenceSetAttribute(pref, attr, &min_align, sizeof min_align);
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const bool ok = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &res, &found) == CUBLAS_STATUS_SUCCESS &&
                  found > 0;
  if (ok) algo = res.algo;
  cublasLtMatmulPreferenceDestroy(pref);
  return ok;
}

// D[m = rows of A^T op, n] (column-major, ldd = m unless given) = alpha * op(A) op(B) + beta * D via cuBLASLt.
// A is [k, m] column-major read transposed (a row-major [m, k] matrix), B is [k, n] column-major
// (a row-major [n, k] matrix). Returns false when cuBLASLt has no algorithm for it (remembered:
// that shape returns false from then on without asking again).
bool lt_matmul(cublasLtHandle_t lt, void* workspace, size_t ws_bytes, cudaStream_t st, int64_t m, int64_t n,
               int64_t k, const void* A, cudaDataType_t at, const void* B, cudaDataType_t bt, void* D,
               cudaDataType_t dt, float alpha, float beta, int64_t ldd, int batch, int64_t stride_a,
               int64_t stride_d) {
  if (ldd == 0) ldd = m;
  static std::mutex mu;  // backends on several host threads share the cache
  static std::map<LtKey, LtPlan> plans;  // kept for the process (descriptors are host objects)
  // (beta != 0, which reads D as C, keyed apart: the heuristic was asked without knowing it.)
  const LtKey key{lt, m, n, k, int(at), int(bt), int(dt), ldd, ws_bytes, beta != 0.0f, batch};
  std::lock_guard<std::mutex> g(mu);  // (held through the enqueue: a batch's strides are set per call)
  auto it = plans.find(key);
  if (it == plans.end())
    it = plans.emplace(key, plan_lt(lt, ws_bytes, m, n, k, at, bt, dt, ldd, batch, stride_a, stride_d)).first;
  const LtPlan& p = it->second;
  if (!p.ok) return false;
  if (batch > 1 &&
      (cublasLtMatrixLayoutSetAttribute(p.la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_a, sizeof stride_a) !=
           CUBLAS_STATUS_SUCCESS ||
       cublasLtMatrixLayoutSetAttribute(p.ld, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_d, sizeof stride_d) !=
           CUBLAS_STATUS_SUCCESS))
    return false;
  return cublasLtMatmul(lt, p.op, &alpha, A, p.la, B, p.lb, &beta, D, p.ld, D, p.ld, &p.algo, workspace, ws_bytes,
                        st) == CUBLAS_STATUS_SUCCESS;
}

}  // namespace vireo::cuda
