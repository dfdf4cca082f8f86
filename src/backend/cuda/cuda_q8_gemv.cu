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
// its rows. B's column g is token g's quantized x (from shared memory); D's columns 2q, 2q + 1
// are tokens, rows g, g + 8. Each k-block's four mmas start from zero and are scaled and added in
// f32 (x's block scale, then the weight's), the 128-deep promotion DeepSeek's FP8 recipe uses
// against the tensor cores' ~14-bit FP8 accumulation.
//
// x is quantized by the block that consumes it, each warp the k-blocks it owns (no block-wide
// barrier), with act_quant's arithmetic: the same e4m3 bytes and scales as the prefill path.
#include "backend/cuda/cuda_q8_gemv.h"

#include <cuda_fp8.h>

#include <algorithm>

#include "backend/cuda/cuda_internal.h"

namespace vireo::cuda {

namespace {

constexpr int kQ8Warps = 8;                     // warps a block (dense products and gate | up)
constexpr size_t kQ8MaxSmem = 200 << 10;        // dynamic shared memory a block may take
constexpr int kQ8MaxTokens = 8;                 // B's columns

__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A warp quantizes x[c0, c0 + 128) (columns >= K are 0) into q[c0 ..] (shared memory) and returns
// the block's scale, with act_quant_kernel's arithmetic (its VEC path): s = amax / 448 (1 for a
// zero block), q = e4m3(x / s) rounded to nearest even, saturating. x 16-byte aligned, K % 4 == 0.
__device__ __forceinline__ float q8_quant_block(const float* __restrict__ x, int64_t K, int64_t c0, uint8_t* q,
                                                int lane) {
  const int64_t c = c0 + 4 * lane;
  const float4 f = c < K ? __ldg(reinterpret_cast<const float4*>(x + c)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float a = warp_max(fmaxf(fmaxf(fabsf(f.x), fabsf(f.y)), fmaxf(fabsf(f.z), fabsf(f.w))));
  const float sc = a > 0.0f ? a / 448.0f : 1.0f;
  const uint32_t b0 = __nv_cvt_float_to_fp8(f.x / sc, __NV_SATFINITE, __NV_E4M3);
  const uint32_t b1 = __nv_cvt_float_to_fp8(f.y / sc, __NV_SATFINITE, __NV_E4M3);
  const uint32_t b2 = __nv_cvt_float_to_fp8(f.z / sc, __NV_SATFINITE, __NV_E4M3);
  const uint32_t b3 = __nv_cvt_float_to_fp8(f.w / sc, __NV_SATFINITE, __NV_E4M3);
  if (c < K) *reinterpret_cast<uint32_t*>(q + c) = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
  return sc;
}

// One 16-row tile of a weight: row r0's bytes, the valid rows (1..16; lanes past them read the
// last valid row and their sums are dropped) and the scales of the tile's 128-row block.
struct Q8Tile {
  const uint8_t* w = nullptr;
  const float* s = nullptr;
  int rows = 0;
};

// A k-block of NT tiles in this lane's registers: [tile][row g half 0, row g + 8 half 0, row g
// half 1, row g + 8 half 1].
template <int NT>
struct Q8Chunk {
  uint4 w[NT][4];
};

// acc[i] += this lane's D fragment of tile i (rows g, g + 8 x columns 2q, 2q + 1) over the warp's
// k-blocks kb0, kb0 + kb_step, ... of K columns. T tokens of x (row stride x_stride) are quantized
// into xq ([T][K] bytes) and sx ([T][ceil(K / 128)]) here, for those k-blocks only. K % 64 == 0.
template <int NT>
__device__ __forceinline__ void q8_warp_tiles(const Q8Tile (&tile)[NT], int64_t K, const float* __restrict__ x,
                                              int64_t x_stride, int T, uint8_t* xq, float* sx, int kb0, int kb_step,
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
  auto load = [&](Q8Chunk<NT>& c, int kb) {
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
  };
  const uint8_t* xr = xq + int64_t(g < T ? g : 0) * K + 16 * q;
  const float* sa = sx + (2 * q < T ? 2 * q : 0) * KB;
  const float* sb = sx + (2 * q + 1 < T ? 2 * q + 1 : 0) * KB;
  auto consume = [&](const Q8Chunk<NT>& c, int kb) {
    const int64_t o = int64_t(kb) * 128;
    const bool full = o + 128 <= K;
    const uint4 xa = *reinterpret_cast<const uint4*>(xr + o);
    const uint4 xb = full ? *reinterpret_cast<const uint4*>(xr + o + 64) : make_uint4(0, 0, 0, 0);
    const float s0 = sa[kb], s1 = sb[kb];
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
  // Two chunks: the next k-block's loads are issued before the current one is consumed.
  Q8Chunk<NT> a, b;
  if (kb0 < KB) load(a, kb0);  // in flight while x is quantized
  for (int kb = kb0; kb < KB; kb += kb_step)
    for (int t = 0; t < T; ++t) {
      const float s = q8_quant_block(x + t * x_stride, K, int64_t(kb) * 128, xq + t * K, lane);
      if (lane == 0) sx[t * KB + kb] = s;
    }
  __syncwarp();
  for (int kb = kb0; kb < KB; kb += 2 * kb_step) {
    const int kb1 = kb + kb_step;
    if (kb1 < KB) load(b, kb1);
    consume(a, kb);
    if (kb1 >= KB) break;
    if (kb1 + kb_step < KB) load(a, kb1 + kb_step);
    consume(b, kb1);
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

// Dynamic shared memory of a block: xq [T][K] bytes (16-byte multiple), sx [T][KB], red.
__host__ __device__ constexpr size_t q8_xq_bytes(int64_t T, int64_t K) { return size_t(T * K + 15) / 16 * 16; }
__host__ __device__ constexpr size_t q8_sx_bytes(int64_t T, int64_t K) {
  return size_t(T * ((K + 127) / 128) * 4 + 15) / 16 * 16;
}
__host__ __device__ constexpr size_t q8_smem(int64_t T, int64_t K, int warps, int nt) {
  return q8_xq_bytes(T, K) + q8_sx_bytes(T, K) + size_t(warps) * nt * 128 * 4;
}

// Products of several weights sharing x (T tokens): block b owns global 16-row tiles
// [b NT, b NT + NT) of the weights in order (tile0[i]: weight i's first), its warps split the
// k-blocks (warp w: w, w + 8, ...), then sum their fragments in order of warp.
struct Q8Many {
  DevW w[kMaxMany];
  float* y[kMaxMany];
  int64_t tile0[kMaxMany + 1];
  int n = 0;
};

template <int NT>
__global__ void __launch_bounds__(32 * kQ8Warps) q8_gemv_kernel(const float* __restrict__ x, int T, Q8Many m) {
  pdl_begin();
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t K = m.w[0].in;
  uint8_t* xq = smem;
  float* sx = reinterpret_cast<float*>(smem + q8_xq_bytes(T, K));
  float* red = reinterpret_cast<float*>(smem + q8_xq_bytes(T, K) + q8_sx_bytes(T, K));
  Q8Tile tile[NT];
  int wi[NT];
  int64_t r0[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int64_t t = int64_t(blockIdx.x) * NT + i;
    int j = 0;
    while (j + 1 < m.n && t >= m.tile0[j + 1]) ++j;
    const bool valid = t < m.tile0[m.n];
    wi[i] = valid ? j : -1;
    r0[i] = valid ? (t - m.tile0[j]) * 16 : 0;
    const DevW& w = m.w[valid ? j : 0];
    tile[i].w = static_cast<const uint8_t*>(w.w) + r0[i] * K;
    tile[i].s = w.s + (r0[i] >> 7) * w.s_cols;
    tile[i].rows = int(w.out - r0[i] < 16 ? w.out - r0[i] : 16);
  }
  float acc[NT][4] = {};
  q8_warp_tiles<NT>(tile, K, x, K, T, xq, sx, threadIdx.x >> 5, kQ8Warps, acc);
  q8_stash<NT>(acc, red);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int e = int(threadIdx.x), r = e / T, t = e % T;  // 16 T <= 128 <= blockDim.x
    if (wi[i] < 0 || r >= tile[i].rows) continue;
    float v = 0.0f;
    for (int w = 0; w < kQ8Warps; ++w) v += red[(w * NT + i) * 128 + r * 8 + t];
    m.y[wi[i]][t * m.w[wi[i]].out + r0[i] + r] = v;
  }
}

// h[s, row] = silu(gate_e[row] . x[t]) * (up_e[row] . x[t]) as moe_gate_up_kernel, for slots
// k0 .. k0 + nk - 1 of each token: block (16-row tile, slot) with the gate and up tiles, its warps
// splitting the k-blocks.
__global__ void __launch_bounds__(32 * kQ8Warps)
    q8_moe_gate_up_kernel(const float* __restrict__ x, int64_t D, int64_t I, int K, int S, int n_routed, int k0,
                          int nk, const int32_t* __restrict__ ids, const DevExpert* __restrict__ bank,
                          float* __restrict__ h) {
  pdl_begin();
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* xq = smem;
  float* sx = reinterpret_cast<float*>(smem + q8_xq_bytes(1, D));
  float* red = reinterpret_cast<float*>(smem + q8_xq_bytes(1, D) + q8_sx_bytes(1, D));
  const int64_t r0 = int64_t(blockIdx.x) * 16, t = blockIdx.y / nk, s = t * (K + S) + k0 + blockIdx.y % nk;
  const DevExpert& e = bank[slot_expert(ids, t, int(s % (K + S)), K, n_routed)];
  const int rows = int(I - r0 < 16 ? I - r0 : 16);
  const Q8Tile tile[2] = {
      {static_cast<const uint8_t*>(e.gate.w) + r0 * D, e.gate.s + (r0 >> 7) * e.gate.s_cols, rows},
      {static_cast<const uint8_t*>(e.up.w) + r0 * D, e.up.s + (r0 >> 7) * e.up.s_cols, rows}};
  float acc[2][4] = {};
  q8_warp_tiles<2>(tile, D, x + t * D, D, 1, xq, sx, threadIdx.x >> 5, kQ8Warps, acc);
  q8_stash<2>(acc, red);
  __syncthreads();
  if (int(threadIdx.x) < rows) {
    const int r = int(threadIdx.x);
    float g = 0.0f, u = 0.0f;
    for (int w = 0; w < kQ8Warps; ++w) {
      g += red[(w * 2) * 128 + r * 8];
      u += red[(w * 2 + 1) * 128 + r * 8];
    }
    h[s * I + r0 + r] = g / (1.0f + expf(-g)) * u;
  }
}

// out[t, row] as moe_down_kernel: block (16-row tile of D, token), warp k streams slot k's down
// rows over all of I (h[s] quantized by that warp), then the slots are summed in order of k.
__global__ void __launch_bounds__(512, 2) q8_moe_down_kernel(const float* __restrict__ h, int64_t D, int64_t I, int K, int S, int n_routed,
                                   const int32_t* __restrict__ ids, const float* __restrict__ wts,
                                   const DevExpert* __restrict__ bank, float* __restrict__ out) {
  pdl_begin();
  extern __shared__ __align__(16) uint8_t smem[];
  const int k = threadIdx.x >> 5, KS = K + S;
  uint8_t* xq = smem + size_t(k) * q8_xq_bytes(1, I);
  float* sx = reinterpret_cast<float*>(smem + size_t(KS) * q8_xq_bytes(1, I) + size_t(k) * q8_sx_bytes(1, I));
  float* red = reinterpret_cast<float*>(smem + size_t(KS) * (q8_xq_bytes(1, I) + q8_sx_bytes(1, I)));
  const int64_t r0 = int64_t(blockIdx.x) * 16, t = blockIdx.y, s = t * KS + k;
  const DevW& w = bank[slot_expert(ids, t, k, K, n_routed)].down;
  const int rows = int(D - r0 < 16 ? D - r0 : 16);
  const Q8Tile tile[1] = {{static_cast<const uint8_t*>(w.w) + r0 * I, w.s + (r0 >> 7) * w.s_cols, rows}};
  float acc[1][4] = {};
  q8_warp_tiles<1>(tile, I, h + s * I, I, 1, xq, sx, 0, 1, acc);
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

template <auto Kernel>
void allow_q8_smem() {
  static const bool done = [] {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kQ8MaxSmem)));
    return true;
  }();
  (void)done;
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
  return w.dt == W_FP8 && w.in == K && K % 64 == 0 && K > 0 && w.out > 0 && aligned16(w.w);
}

}  // namespace

bool q8_decode_switch() {
  static const bool on = env_switch("VIREO_Q8_DECODE");
  return on;
}

namespace {
// The shared memory q8_gemv_many's launch takes, and whether two tiles a block: x quantized once
// for 32 rows where that still leaves two blocks an SM, else one tile (o_proj's 384 tiles in 192
// blocks would leave a third of the SMs with one block, the rest with two).
bool q8_two_tiles(int64_t tiles) { return tiles >= 4 * int64_t(multiprocessors()); }
int64_t q8_tiles(const ManyW& m) {
  int64_t tiles = 0;
  for (int i = 0; i < m.n; ++i) tiles += (m.w[i].out + 15) / 16;
  return tiles;
}
}  // namespace

bool q8_gemv_many_fits(const float* x, int64_t T, const ManyW& m) {
  if (T < 1 || T > kQ8MaxTokens || m.n < 1 || m.n > kMaxMany || !aligned16(x)) return false;
  const int64_t K = m.w[0].in;
  for (int i = 0; i < m.n; ++i)
    if (!q8_weight_fits(m.w[i], K)) return false;
  return q8_smem(T, K, kQ8Warps, q8_two_tiles(q8_tiles(m)) ? 2 : 1) <= kQ8MaxSmem;
}

bool q8_gemv_many(const float* x, int64_t T, const ManyW& mw, cudaStream_t st) {
  if (!q8_gemv_many_fits(x, T, mw)) return false;
  const int64_t K = mw.w[0].in;
  Q8Many m;
  m.n = mw.n;
  m.tile0[0] = 0;
  for (int i = 0; i < mw.n; ++i) {
    m.w[i] = mw.w[i];
    m.y[i] = mw.y[i];
    m.tile0[i + 1] = m.tile0[i] + (mw.w[i].out + 15) / 16;
  }
  const int64_t tiles = m.tile0[m.n];
  const bool two = q8_two_tiles(tiles);
  const size_t smem = q8_smem(T, K, kQ8Warps, two ? 2 : 1);
  if (two) {
    allow_q8_smem<q8_gemv_kernel<2>>();
    launch(q8_gemv_kernel<2>, unsigned((tiles + 1) / 2), 32 * kQ8Warps, smem, st, x, int(T), m);
  } else {
    allow_q8_smem<q8_gemv_kernel<1>>();
    launch(q8_gemv_kernel<1>, unsigned(tiles), 32 * kQ8Warps, smem, st, x, int(T), m);
  }
  VIREO_CUDA_LAUNCHED();
  return true;
}

namespace {
ManyW one_weight(const DevW& w, float* y) {
  ManyW m;
  m.n = 1;
  m.w[0] = w;
  m.y[0] = y;
  m.row0[0] = 0;
  m.row0[1] = w.out;
  return m;
}
}  // namespace

bool q8_gemv_fits(const float* x, int64_t T, const DevW& w) { return q8_gemv_many_fits(x, T, one_weight(w, nullptr)); }
bool q8_gemv(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st) {
  return q8_gemv_many(x, T, one_weight(w, y), st);
}

bool q8_moe_experts(const float* x, int64_t N, int64_t D, int64_t I, int K, int S, int n_routed, const int32_t* ids,
                    const float* weights, const DevExpert* bank, MoePart part, float* h, float* out, cudaStream_t st) {
  if (N <= 0 || D % 64 != 0 || I % 64 != 0 || K + S > 16 || !aligned16(x) || !aligned16(h)) return false;
  const size_t gu_smem = q8_smem(1, D, kQ8Warps, 2);
  const size_t down_smem = size_t(K + S) * (q8_xq_bytes(1, I) + q8_sx_bytes(1, I)) + size_t(K + S) * 128 * 4;
  if (gu_smem > kQ8MaxSmem || down_smem > kQ8MaxSmem) return false;
  const int k0 = part == MoePart::SharedGateUp ? K : 0;
  const int nk = part == MoePart::All ? K + S : part == MoePart::SharedGateUp ? S : K;
  if (nk > 0) {
    allow_q8_smem<q8_moe_gate_up_kernel>();
    launch(q8_moe_gate_up_kernel, dim3(unsigned((I + 15) / 16), unsigned(N * nk)), 32 * kQ8Warps, gu_smem, st, x, D, I,
           K, S, n_routed, k0, nk, ids, bank, h);
    VIREO_CUDA_LAUNCHED();
  }
  if (part != MoePart::SharedGateUp) {
    allow_q8_smem<q8_moe_down_kernel>();
    launch(q8_moe_down_kernel, dim3(unsigned((D + 15) / 16), unsigned(N)), unsigned(32 * (K + S)), down_smem, st, h,
           D, I, K, S, n_routed, ids, weights, bank, out);
    VIREO_CUDA_LAUNCHED();
  }
  return true;
}

}  // namespace vireo::cuda
