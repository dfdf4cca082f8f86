// Decode products of FP8 weights in --math fast-fp8: e4m3 weights x e4m3 activations on the
// tensor cores (cuda_q8_gemv.h).
//
// Why: the f32-math FP8 GEMVs (cuda_decode.cu) spend ~40 instructions per 16-byte weight load
// (8 e4m3x2 conversions, 8 f16x2 -> f32 widenings, 16 FMAs, 4 shared-memory reads of f32 x), twice
// the BF16 kernels' ~18, and measured at 3.0-3.4 TB/s where the BF16 ones reach 3.9-4.0 (H200,
// ncu, sessions 3-15: a warp issues its next loads only after it has consumed the last ones, so
// the longer consume leaves fewer bytes in flight). In fast-fp8 the activations are e4m3 anyway
// (DeepSeek's act_quant, as the prefill products take them): one mma.sync m16n8k32 consumes 512
// weight bytes, so a warp spends ~6 instructions per two 16-byte loads and keeps the next chunk in
// flight while it consumes the current one.
//
// Layout. A warp owns 16-row tiles and a set of 128-column k-blocks. Lane (g = lane / 4,
// q = lane % 4) loads 16 bytes of rows g and g + 8 at columns 64 h + 16 q of a k-block (h = 0, 1):
// the mma's logical k of A and B is a permutation of the physical columns (the same for both
// operands, so the dot product is unchanged), which lets every lane read whole 16-byte pieces of
// its rows. B's column g is token g's quantized x (from the warp's staging area in shared memory);
// D's columns 2q, 2q + 1
// are tokens, rows g, g + 8. Each k-block's four mmas start from zero and are scaled and added in
// f32 (x's block scale, then the weight's), the 128-deep promotion DeepSeek's FP8 recipe uses
// against the tensor cores' ~14-bit FP8 accumulation.
//
// x is quantized by each warp that consumes it, a k-block at a time (loaded with the weights, a
// few k-blocks ahead), with act_quant's arithmetic: the same e4m3 bytes and scales as the prefill
// path. Every block redoes it for its rows: ~70 instructions a k-block and warp, issued while the
// next k-blocks' weights are in flight, against one more launch (~2 us) per product input.
#include "backend/cuda/cuda_q8_gemv.h"

#include <cuda_fp8.h>

#include <algorithm>

#include "backend/cuda/cuda_internal.h"

namespace vireo::cuda {

namespace {

constexpr int kQ8Warps = 8;                     // warps a block (dense products and gate | up)
constexpr int kQ8MaxTokens = 8;                 // B's columns

__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 16-row tile of a weight: row r0's bytes, the valid rows (1..16; lanes past them read the
// last valid row and their sums are dropped) and the scales of the tile's 128-row block.
struct Q8Tile {
  const uint8_t* w = nullptr;
  const float* s = nullptr;
  int rows = 0;
};

// A k-block in this lane's registers: NT tiles' weights ([tile][row g half 0, row g + 8 half 0,
// row g half 1, row g + 8 half 1]) and TT tokens' x at columns 4 lane .. 4 lane + 3.
template <int NT, int TT>
struct Q8Chunk {
  uint4 w[NT][4];
  float4 x[TT];
};

// A warp's staging area in shared memory, two k-blocks deep: e4m3 x [2][TT][128], scales [2][TT].
template <int TT>
struct alignas(16) Q8Stage {
  uint8_t q[2][TT][128];
  float s[2][TT];
};

// acc[i] += this lane's D fragment of tile i (rows g, g + 8 x columns 2q, 2q + 1; column c is
// token c) over the warp's k-blocks kb0, kb0 + kb_step, ... of K columns (K % 64 == 0). The T
// tokens of x (row stride x_stride, 16-byte aligned) are read with the weights, DEPTH k-blocks
// ahead, and quantized as each k-block is consumed, with act_quant_kernel's arithmetic (its VEC
// path): s = amax / 448 (1 for a zero block), q = e4m3(x / s) rounded to nearest even, saturating.
// Why there and not once before the loop: a warp's k-blocks quantized up front were that many
// dependent L2 round trips before its first product (o_proj: 16, ~5 us of a 30 us kernel, H200).
template <int NT, int TT, int DEPTH>
__device__ __forceinline__ void q8_warp_tiles(const Q8Tile (&tile)[NT], int64_t K, const float* __restrict__ x,
                                              int64_t x_stride, int T, Q8Stage<TT>& st, int kb0, int kb_step,
                                              float (&acc)[NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int KB = int((K + 127) / 128);
  const uint8_t* rg[NT];
  const uint8_t* rg8[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    rg[i] = tile[i].w + int64_t(min(g, tile[i].rows - 1)) * K + 16 * q;
    rg8[i] = tile[i].w + int64_t(min(g + 8, tile[i].rows - 1)) * K + 16 * q;
  }
  auto load = [&](Q8Chunk<NT, TT>& c, int kb) {
    const int64_t o = int64_t(kb) * 128;
    const bool full = o + 128 <= K;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      c.w[i][0] = ldg_stream(reinterpret_cast<const uint4*>(rg[i] + o));
      c.w[i][1] = ldg_stream(reinterpret_cast<const uint4*>(rg8[i] + o));
      if (full) {
        c.w[i][2] = ldg_stream(reinterpret_cast<const uint4*>(rg[i] + o + 64));
        c.w[i][3] = ldg_stream(reinterpret_cast<const uint4*>(rg8[i] + o + 64));
      }
    }
    const int64_t col = o + 4 * lane;
#pragma unroll
    for (int t = 0; t < TT; ++t)
      c.x[t] = t < T && col < K ? __ldg(reinterpret_cast<const float4*>(x + t * x_stride + col))
                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  };
  const int tg = g < T ? g : 0, t0 = 2 * q < T ? 2 * q : 0, t1 = 2 * q + 1 < T ? 2 * q + 1 : 0;
  int buf = 0;
  auto consume = [&](const Q8Chunk<NT, TT>& c, int kb) {
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t >= T) break;
      const float4 f = c.x[t];
      const float a = warp_max(fmaxf(fmaxf(fabsf(f.x), fabsf(f.y)), fmaxf(fabsf(f.z), fabsf(f.w))));
      const float sc = a > 0.0f ? a / 448.0f : 1.0f;
      const uint32_t b0 = __nv_cvt_float_to_fp8(f.x / sc, __NV_SATFINITE, __NV_E4M3);
      const uint32_t b1 = __nv_cvt_float_to_fp8(f.y / sc, __NV_SATFINITE, __NV_E4M3);
      const uint32_t b2 = __nv_cvt_float_to_fp8(f.z / sc, __NV_SATFINITE, __NV_E4M3);
      const uint32_t b3 = __nv_cvt_float_to_fp8(f.w / sc, __NV_SATFINITE, __NV_E4M3);
      *reinterpret_cast<uint32_t*>(&st.q[buf][t][4 * lane]) = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
      if (lane == 0) st.s[buf][t] = sc;
    }
    __syncwarp();
    const bool full = int64_t(kb) * 128 + 128 <= K;
    const uint4 xa = *reinterpret_cast<const uint4*>(&st.q[buf][tg][16 * q]);
    const uint4 xb = *reinterpret_cast<const uint4*>(&st.q[buf][tg][64 + 16 * q]);
    const float s0 = st.s[buf][t0], s1 = st.s[buf][t1];
    buf ^= 1;  // the next k-block writes the other half while lanes may still read this one
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const uint4* w = c.w[i];
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_e4m3_16832(d, w[0].x, w[1].x, w[0].y, w[1].y, xa.x, xa.y);
      mma_e4m3_16832(d, w[0].z, w[1].z, w[0].w, w[1].w, xa.z, xa.w);
      if (full) {
        mma_e4m3_16832(d, w[2].x, w[3].x, w[2].y, w[3].y, xb.x, xb.y);
        mma_e4m3_16832(d, w[2].z, w[3].z, w[2].w, w[3].w, xb.z, xb.w);
      }
      const float ws = tile[i].s[kb];
      acc[i][0] += d[0] * s0 * ws;
      acc[i][1] += d[1] * s1 * ws;
      acc[i][2] += d[2] * s0 * ws;
      acc[i][3] += d[3] * s1 * ws;
    }
  };
  // DEPTH chunks in a ring: a slot is refilled (DEPTH k-blocks on) as soon as it is consumed.
  Q8Chunk<NT, TT> c[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
    if (kb0 + d * kb_step < KB) load(c[d], kb0 + d * kb_step);
  for (int kb = kb0; kb < KB; kb += DEPTH * kb_step) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int k = kb + d * kb_step;
      if (k >= KB) break;
      consume(c[d], k);
      if (k + DEPTH * kb_step < KB) load(c[d], k + DEPTH * kb_step);
    }
  }
}

// The warps' fragments into red[warp][tile][row][column] (16 x 8 a tile), for a block-wide sum.
template <int NT>
__device__ __forceinline__ void q8_stash(const float (&acc)[NT][4], float* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    float* r = red + (warp * NT + i) * 128;
    r[g * 8 + 2 * q] = acc[i][0];
    r[g * 8 + 2 * q + 1] = acc[i][1];
    r[(g + 8) * 8 + 2 * q] = acc[i][2];
    r[(g + 8) * 8 + 2 * q + 1] = acc[i][3];
  }
}

// How many warps of a block split one tile's k-blocks: the largest power of two up to the block's
// warps that leaves each warp at least 8 k-blocks (so its ring of loads has work to run ahead of).
__host__ __device__ constexpr int q8_ksplit(int64_t K, int warps) {
  const int64_t KB = (K + 127) / 128;
  int wk = 1;
  while (wk < warps && KB / (2 * wk) >= 8) wk *= 2;
  return wk;
}

// Products of several weights sharing x (T tokens): the weights' 16-row tiles in order (tile0[i]:
// weight i's first). A block's kQ8Warps warps are kQ8Warps / WK groups of NT tiles each, WK warps a
// group splitting its k-blocks (warp kp of a group: kp, kp + WK, ...); the groups' sums are added
// in order of kp.
struct Q8Many {
  DevW w[kMaxMany];
  float* y[kMaxMany];
  int64_t tile0[kMaxMany + 1];
  int n = 0;
};

// Weight j and first row r0 of global tile t (t < tile0[n]).
__device__ __forceinline__ int q8_tile_weight(const Q8Many& m, int64_t t, int64_t& r0) {
  int j = 0;
  while (j + 1 < m.n && t >= m.tile0[j + 1]) ++j;
  r0 = (t - m.tile0[j]) * 16;
  return j;
}

template <int NT, int TT>
__global__ void __launch_bounds__(32 * kQ8Warps) q8_gemv_kernel(const float* __restrict__ x, int T, Q8Many m, int WK) {
  pdl_begin();
  __shared__ Q8Stage<TT> stage[kQ8Warps];
  __shared__ float red[kQ8Warps * NT * 128];
  const int warp = threadIdx.x >> 5, group = warp / WK, groups = kQ8Warps / WK;
  const int64_t K = m.w[0].in, ntiles = m.tile0[m.n];
  const int64_t first = (int64_t(blockIdx.x) * groups + group) * NT;  // this warp's first tile
  Q8Tile tile[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int64_t t = first + i < ntiles ? first + i : 0;  // past the end: tile 0, dropped below
    int64_t r0;
    const DevW& w = m.w[q8_tile_weight(m, t, r0)];
    tile[i].w = static_cast<const uint8_t*>(w.w) + r0 * K;
    tile[i].s = w.s + (r0 >> 7) * w.s_cols;
    tile[i].rows = int(w.out - r0 < 16 ? w.out - r0 : 16);
  }
  float acc[NT][4] = {};
  q8_warp_tiles<NT, TT, 2>(tile, K, x, K, T, stage[warp], warp % WK, WK, acc);
  q8_stash<NT>(acc, red);
  __syncthreads();
  for (int e = int(threadIdx.x); e < groups * NT * 16 * T; e += int(blockDim.x)) {
    const int gi = e / (16 * T), r = (e / T) % 16, t = e % T;  // gi: tile gi % NT of group gi / NT
    const int64_t tt = int64_t(blockIdx.x) * groups * NT + gi;
    if (tt >= ntiles) continue;
    int64_t r0;
    const int j = q8_tile_weight(m, tt, r0);
    if (r0 + r >= m.w[j].out) continue;
    float v = 0.0f;
    for (int kp = 0; kp < WK; ++kp) v += red[(((gi / NT) * WK + kp) * NT + gi % NT) * 128 + r * 8 + t];
    m.y[j][t * m.w[j].out + r0 + r] = v;
  }
}

// h[s, row] = silu(gate_e[row] . x[t]) * (up_e[row] . x[t]) as moe_gate_up_kernel, for slots
// k0 .. k0 + nk - 1 of each token: a block per (kQ8Warps / WK 16-row tiles, slot), each group of
// WK warps with a tile of gate and the same of up, splitting the k-blocks.
__global__ void __launch_bounds__(32 * kQ8Warps)
    q8_moe_gate_up_kernel(const float* __restrict__ x, int64_t D, int64_t I, int K, int S, int n_routed, int k0,
                          int nk, const int32_t* __restrict__ ids, const DevExpert* __restrict__ bank,
                          float* __restrict__ h, int WK) {
  pdl_begin();
  __shared__ Q8Stage<1> stage[kQ8Warps];
  __shared__ float red[kQ8Warps * 2 * 128];
  const int warp = threadIdx.x >> 5, group = warp / WK, groups = kQ8Warps / WK;
  const int64_t t = blockIdx.y / nk, s = t * (K + S) + k0 + blockIdx.y % nk;
  const DevExpert& e = bank[slot_expert(ids, t, int(s % (K + S)), K, n_routed)];
  const int64_t mine = (int64_t(blockIdx.x) * groups + group) * 16, r0 = mine < I ? mine : 0;
  const int rows = int(I - r0 < 16 ? I - r0 : 16);
  const Q8Tile tile[2] = {
      {static_cast<const uint8_t*>(e.gate.w) + r0 * D, e.gate.s + (r0 >> 7) * e.gate.s_cols, rows},
      {static_cast<const uint8_t*>(e.up.w) + r0 * D, e.up.s + (r0 >> 7) * e.up.s_cols, rows}};
  float acc[2][4] = {};
  q8_warp_tiles<2, 1, 2>(tile, D, x + t * D, D, 1, stage[warp], warp % WK, WK, acc);
  q8_stash<2>(acc, red);
  __syncthreads();
  if (int(threadIdx.x) < groups * 16) {
    const int gi = int(threadIdx.x) / 16, r = int(threadIdx.x) % 16;
    const int64_t row = (int64_t(blockIdx.x) * groups + gi) * 16 + r;
    if (row < I) {
      float gs = 0.0f, us = 0.0f;
      for (int kp = 0; kp < WK; ++kp) {
        gs += red[((gi * WK + kp) * 2) * 128 + r * 8];
        us += red[((gi * WK + kp) * 2 + 1) * 128 + r * 8];
      }
      h[s * I + row] = gs / (1.0f + expf(-gs)) * us;
    }
  }
}

// out[t, row] as moe_down_kernel: block (16-row tile of D, token), warp k streams slot k's down
// rows over all of I (quantizing h[s] as it goes), then the slots are summed in order of k.
__global__ void __launch_bounds__(512) q8_moe_down_kernel(const float* __restrict__ h, int64_t D, int64_t I, int K,
                                                          int S, int n_routed, const int32_t* __restrict__ ids,
                                                          const float* __restrict__ wts,
                                                          const DevExpert* __restrict__ bank, float* __restrict__ out) {
  pdl_begin();
  __shared__ Q8Stage<1> stage[16];
  __shared__ float red[16 * 128];
  const int k = threadIdx.x >> 5, KS = K + S;
  const int64_t r0 = int64_t(blockIdx.x) * 16, t = blockIdx.y, s = t * KS + k;
  const DevW& w = bank[slot_expert(ids, t, k, K, n_routed)].down;
  const int rows = int(D - r0 < 16 ? D - r0 : 16);
  const Q8Tile tile[1] = {{static_cast<const uint8_t*>(w.w) + r0 * I, w.s + (r0 >> 7) * w.s_cols, rows}};
  float acc[1][4] = {};
  q8_warp_tiles<1, 1, 2>(tile, I, h + s * I, I, 1, stage[k], 0, 1, acc);
  q8_stash<1>(acc, red);  // red[k][0][row][0]
  __syncthreads();
  if (int(threadIdx.x) < rows) {
    const int r = int(threadIdx.x);
    float a = 0.0f;
    for (int j = 0; j < KS; ++j) {
      const float y = red[j * 128 + r * 8];
      a = j < K ? __fadd_rn(a, __fmul_rn(wts[t * K + j], y)) : __fadd_rn(a, y);
    }
    out[t * D + r0 + r] = a;
  }
}

int multiprocessors() {
  static const int n = [] {
    int dev = 0, v = 0;
    VIREO_CUDA_CHECK(cudaGetDevice(&dev));
    VIREO_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A weight the kernels take: FP8, 16-byte aligned rows of a multiple of 64 columns.
bool q8_weight_fits(const DevW& w, int64_t K) {
  return w.dt == W_FP8 && w.in == K && K % 64 == 0 && K > 0 && w.out > 0 && aligned16(w.w) && w.s != nullptr;
}

ManyW one_weight(const DevW& w, float* y) {
  ManyW m;
  m.n = 1;
  m.w[0] = w;
  m.y[0] = y;
  m.row0[0] = 0;
  m.row0[1] = w.out;
  return m;
}

template <int NT, int TT>
void launch_gemv(const float* x, int64_t T, const Q8Many& m, int wk, cudaStream_t st) {
  const int64_t per_block = int64_t(kQ8Warps / wk) * NT;
  launch(q8_gemv_kernel<NT, TT>, unsigned((m.tile0[m.n] + per_block - 1) / per_block), 32 * kQ8Warps, 0, st, x,
         int(T), m, wk);
}

}  // namespace

bool q8_decode_switch() {
  static const bool on = env_switch("VIREO_Q8_DECODE");
  return on;
}

bool q8_gemv_many_fits(const float* x, int64_t T, const ManyW& m) {
  if (T < 1 || T > kQ8MaxTokens || m.n < 1 || m.n > kMaxMany || !aligned16(x)) return false;
  for (int i = 0; i < m.n; ++i)
    if (!q8_weight_fits(m.w[i], m.w[0].in)) return false;
  return true;
}

bool q8_gemv_many(const float* x, int64_t T, const ManyW& mw, cudaStream_t st) {
  if (!q8_gemv_many_fits(x, T, mw)) return false;
  Q8Many m;
  m.n = mw.n;
  m.tile0[0] = 0;
  for (int i = 0; i < mw.n; ++i) {
    m.w[i] = mw.w[i];
    m.y[i] = mw.y[i];
    m.tile0[i + 1] = m.tile0[i] + (mw.w[i].out + 15) / 16;
  }
  const int wk = q8_ksplit(m.w[0].in, kQ8Warps);
  // Two tiles a warp (x quantized once for 32 rows) where that still leaves two blocks an SM,
  // else one (o_proj's 384 tiles: 384 blocks of one tile, every SM busy).
  const bool two = m.tile0[m.n] / (2 * (kQ8Warps / wk)) >= 2 * int64_t(multiprocessors());
  if (T == 1) {
    if (two) launch_gemv<2, 1>(x, T, m, wk, st);
    else launch_gemv<1, 1>(x, T, m, wk, st);
  } else {
    if (two) launch_gemv<2, kQ8MaxTokens>(x, T, m, wk, st);
    else launch_gemv<1, kQ8MaxTokens>(x, T, m, wk, st);
  }
  VIREO_CUDA_LAUNCHED();
  return true;
}

bool q8_gemv_fits(const float* x, int64_t T, const DevW& w) { return q8_gemv_many_fits(x, T, one_weight(w, nullptr)); }
bool q8_gemv(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st) {
  return q8_gemv_many(x, T, one_weight(w, y), st);
}

bool q8_moe_experts(const float* x, int64_t N, int64_t D, int64_t I, int K, int S, int n_routed, const int32_t* ids,
                    const float* weights, const DevExpert* bank, MoePart part, float* h, float* out, cudaStream_t st) {
  if (N <= 0 || D % 64 != 0 || I % 64 != 0 || K + S > 16 || !aligned16(x) || !aligned16(h)) return false;
  const int k0 = part == MoePart::SharedGateUp ? K : 0;
  const int nk = part == MoePart::All ? K + S : part == MoePart::SharedGateUp ? S : K;
  if (nk > 0) {
    const int wk = q8_ksplit(D, kQ8Warps), rows_per_block = 16 * (kQ8Warps / wk);
    launch(q8_moe_gate_up_kernel, dim3(unsigned((I + rows_per_block - 1) / rows_per_block), unsigned(N * nk)),
           32 * kQ8Warps, 0, st, x, D, I, K, S, n_routed, k0, nk, ids, bank, h, wk);
    VIREO_CUDA_LAUNCHED();
  }
  if (part != MoePart::SharedGateUp) {
    launch(q8_moe_down_kernel, dim3(unsigned((D + 15) / 16), unsigned(N)), unsigned(32 * (K + S)), 0, st, h, D, I, K,
           S, n_routed, ids, weights, bank, out);
    VIREO_CUDA_LAUNCHED();
  }
  return true;
}

}  // namespace vireo::cuda
