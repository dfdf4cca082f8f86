// Decode products of 2 to 8 rows on FP8 weights in --math fast-fp8: e4m3 weights x e4m3
// activations on the tensor cores (cuda_q8_gemv.h).
//
// Why: in fast-fp8 the activations are e4m3 anyway (DeepSeek's act_quant, as the prefill products
// take them), and one mma.sync m16n8k32 multiplies 16 rows x 32 columns of weights by up to 8
// tokens, one a column of B, where f32 math does 8x the FMAs of one row. At GLM-5 shapes on the
// H200, per product at 4-8 rows: q_b 16-22 us against 28-55 for the f32-math GEMV with x in shared
// memory, down 9-13 against 12-22; o_proj at 8 rows 204 against 185 (session 36: 67.5 with x
// quantized once ahead, q8_prequantize). For one row these kernels lost (o_proj 41 against 32 us),
// and the f32-math GEMV keeps it (BENCHMARKS.md, session 16).
//
// Layout. A warp owns 16-row tiles and a set of 128-column k-blocks. Lane (g = lane / 4,
// q = lane % 4) loads 16 bytes of rows g and g + 8 at columns 64 h + 16 q of a k-block (h = 0, 1):
// the mma's logical k of A and B is a permutation of the physical columns (the same for both
// operands, so the dot product is unchanged), which lets every lane read whole 16-byte pieces of
// its rows. B's column g is token g's quantized x, read from shared memory at the same columns;
// D's columns 2q, 2q + 1 are tokens, rows g, g + 8. Each k-block's four mmas start from zero and
// are scaled and added in f32 (x's block scale, then the weight's), the 128-deep promotion of
// DeepSeek's FP8 recipe (measured: 1e-15 NMSE against the quantized operands' exact product).
//
// Each block quantizes x (all T tokens) into shared memory with act_quant's arithmetic, the same
// e4m3 bytes and scales as the prefill path, while its warps' first weight loads are in flight;
// or, where the blocks' reads of f32 x would outweigh the weight (o_proj at 5-8 rows: 384 blocks
// x 512 KB of x against 100 MB of weights), copies act_quant's output, made once ahead.
// (Quantizing each k-block as it is consumed instead, ~70 instructions between loads, measured
// slower still: 45 us for o_proj at one row.)
#include "backend/cuda/cuda_q8_gemv.h"

#include "backend/cuda/cuda_internal.h"

namespace vireo::cuda {

namespace {

constexpr int kQ8Warps = 8;      // warps a block
constexpr int kQ8MaxTokens = 8;  // B's columns

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

// Quantizes k-blocks of x into shared memory as act_quant_kernel does (act_quant_lane: per token
// and 128 columns s = amax / 448, q = e4m3(x / s)); columns >= K are 0. The calling warp takes items first, first + step, ... of
// T x KB (item = t KB + kb), into xq [T][K] bytes and sx [T][KB]; x rows are x_stride apart and
// 16-byte aligned. Loads are issued 4 items at a time: one dependent L2 round trip per k-block
// made o_proj's quantization ~5 us of a 40 us kernel (H200, ncu).
__device__ __forceinline__ void q8_quantize(const float* __restrict__ x, int64_t x_stride, int64_t K, int T,
                                            uint8_t* xq, float* sx, int first, int step) {
  const int lane = threadIdx.x & 31, KB = int((K + 127) / 128), items = T * KB;
  constexpr int kBatch = 4;
  for (int i0 = first; i0 < items; i0 += kBatch * step) {
    float4 f[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int it = i0 + u * step, t = it / KB;
      const int64_t c = int64_t(it % KB) * 128 + 4 * lane;
      f[u] = it < items && c < K ? __ldg(reinterpret_cast<const float4*>(x + t * x_stride + c))
                                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int it = i0 + u * step, t = it / KB;
      if (it >= items) break;
      const int64_t c = int64_t(it % KB) * 128 + 4 * lane;
      const float v[4] = {f[u].x, f[u].y, f[u].z, f[u].w};
      float sc;
      const uint32_t packed = act_quant_lane(v, sc);
      if (c < K) *reinterpret_cast<uint32_t*>(xq + t * K + c) = packed;
      if (lane == 0) sx[it] = sc;
    }
  }
}

// acc[i] += this lane's D fragment of tile i (rows g, g + 8 x columns 2q, 2q + 1; column c is
// token c) over the warp's k-blocks kb0, kb0 + kb_step, ... of K columns (K % 64 == 0), x already
// quantized in xq [T][K] and sx [T][KB] by `prologue`, which runs after the first DEPTH k-blocks'
// weight loads are issued (so x's quantization overlaps their latency) and must end with the
// barrier that makes xq visible to this warp. DEPTH k-blocks of loads in a ring: a slot is
// refilled as soon as it is consumed, so the warp always has the next ones in flight.
template <int NT, int DEPTH, class Prologue>
__device__ __forceinline__ void q8_warp_tiles(const Q8Tile (&tile)[NT], int64_t K, int T, const uint8_t* xq,
                                              const float* sx, int kb0, int kb_step, float (&acc)[NT][4],
                                              Prologue&& prologue) {
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
  Q8Chunk<NT> c[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
    if (kb0 + d * kb_step < KB) load(c[d], kb0 + d * kb_step);
  prologue();
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

// Dynamic shared memory for quantized x: xq [T][K] bytes and sx [T][KB] floats, each rounded up
// to 16 bytes.
__host__ __device__ constexpr size_t q8_xq_bytes(int64_t T, int64_t K) { return size_t(T * K + 15) / 16 * 16; }
__host__ __device__ constexpr size_t q8_x_smem(int64_t T, int64_t K) {
  return q8_xq_bytes(T, K) + size_t(T * ((K + 127) / 128) * 4 + 15) / 16 * 16;
}
constexpr size_t kQ8MaxSmem = 200 << 10;

// y[t] = W x[t] for T <= 8 tokens: the weight's 16-row tiles in order; a block's kQ8Warps warps
// are kQ8Warps / WK groups of NT tiles each, the WK warps of a group splitting its k-blocks (warp
// kp of a group: kp, kp + WK, ...); their sums are added in order of kp. The block quantizes x (all
// T rows, every k-block) into shared memory first, its warps a share each.
template <int NT, int MIN_BLOCKS = NT == 1 ? 3 : 2>
__global__ void __launch_bounds__(32 * kQ8Warps, MIN_BLOCKS)
    q8_gemv_kernel(const float* __restrict__ x, int T, DevW w, float* __restrict__ y, int WK, Q8PreX pre) {
  pdl_begin();
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float red[kQ8Warps * NT * 128];
  const int warp = threadIdx.x >> 5, group = warp / WK, groups = kQ8Warps / WK;
  const int64_t K = w.in, ntiles = (w.out + 15) / 16;
  uint8_t* xq = smem;
  float* sx = reinterpret_cast<float*>(smem + q8_xq_bytes(T, K));
  const int64_t first = (int64_t(blockIdx.x) * groups + group) * NT;  // this warp's first tile
  Q8Tile tile[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int64_t r0 = (first + i < ntiles ? first + i : 0) * 16;  // past the end: tile 0, dropped below
    tile[i] = {static_cast<const uint8_t*>(w.w) + r0 * K, w.s + (r0 >> 7) * w.s_cols, int(w.out - r0 < 16 ? w.out - r0 : 16)};
  }
  float acc[NT][4] = {};
  q8_warp_tiles<NT, 2>(tile, K, T, xq, sx, warp % WK, WK, acc, [&] {
    if (pre.q) {  // act_quant's bytes [Tp][K] and scales [KB][Tp]: copied, the scales transposed
      const int KB = int((K + 127) / 128);
      const int64_t n16 = int64_t(T) * K / 16;  // K % 64 == 0
      for (int64_t i = threadIdx.x; i < n16; i += blockDim.x)
        reinterpret_cast<uint4*>(xq)[i] = __ldg(reinterpret_cast<const uint4*>(pre.q) + i);
      for (int i = int(threadIdx.x); i < T * KB; i += int(blockDim.x))
        sx[i] = __ldg(pre.s + int64_t(i % KB) * pre.Tp + i / KB);
    } else {
      q8_quantize(x, K, K, T, xq, sx, warp, kQ8Warps);
    }
    __syncthreads();
  });
  q8_stash<NT>(acc, red);
  __syncthreads();
  for (int e = int(threadIdx.x); e < groups * NT * 16 * T; e += int(blockDim.x)) {
    const int gi = e / (16 * T), r = (e / T) % 16, t = e % T;  // gi: tile gi % NT of group gi / NT
    const int64_t row = (int64_t(blockIdx.x) * groups * NT + gi) * 16 + r;
    if (row >= w.out) continue;
    float v = 0.0f;
    for (int kp = 0; kp < WK; ++kp) v += red[(((gi / NT) * WK + kp) * NT + gi % NT) * 128 + r * 8 + t];
    y[t * w.out + row] = v;
  }
}

// 0: one-tile warps always at 3 blocks an SM (VIREO_Q8_SPILL_FREE=0, A/B runs).
bool q8_spill_free() {
  static const bool on = env_switch("VIREO_Q8_SPILL_FREE");
  return on;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int NT, int MIN_BLOCKS = NT == 1 ? 3 : 2>
void launch_gemv(const float* x, int64_t T, const DevW& w, float* y, int wk, const Q8PreX& pre, cudaStream_t st) {
  const int64_t per_block = int64_t(kQ8Warps / wk) * NT;
  allow_dynamic_smem<q8_gemv_kernel<NT, MIN_BLOCKS>, kQ8MaxSmem>();
  launch(q8_gemv_kernel<NT, MIN_BLOCKS>, unsigned(((w.out + 15) / 16 + per_block - 1) / per_block), 32 * kQ8Warps,
         q8_x_smem(T, w.in), st, x, int(T), w, y, wk, pre);
}

}  // namespace

bool q8_decode_switch() {
  static const bool on = env_switch("VIREO_Q8_DECODE");
  return on;
}

bool q8_gemv_fits(const float* x, int64_t T, const DevW& w) {
  return T >= 1 && T <= kQ8MaxTokens && aligned16(x) && w.dt == W_FP8 && w.in > 0 && w.in % 64 == 0 && w.out > 0 &&
         aligned16(w.w) && w.s != nullptr && q8_x_smem(T, w.in) <= kQ8MaxSmem;
}

namespace {
bool g_q8_prequant = env_switch("VIREO_Q8_PREQUANT");

// Blocks of the one-tile form on w: the weight's 16-row tiles over the block's groups of warps.
int64_t one_tile_blocks(const DevW& w) {
  const int64_t groups = kQ8Warps / q8_ksplit(w.in, kQ8Warps);
  return ((w.out + 15) / 16 + groups - 1) / groups;
}
}  // namespace
void set_q8_prequant(bool on) { g_q8_prequant = on; }

bool q8_prequantize(int64_t T, const DevW& w) {
  // The blocks' reads of f32 x (T x K x 4 bytes each) exceed the weight's (out x K).
  return g_q8_prequant && T >= 2 && one_tile_blocks(w) * T * 4 > w.out;
}

bool q8_gemv(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st, const Q8PreX& pre) {
  if (!q8_gemv_fits(x, T, w)) return false;
  if (pre.q && (pre.Tp < T || reinterpret_cast<uintptr_t>(pre.q) % 16 != 0)) return false;
  const int wk = q8_ksplit(w.in, kQ8Warps);
  // Two tiles a warp (x quantized once for twice the rows) where that still leaves two blocks an
  // SM, else one (o_proj's 384 tiles: 384 blocks of one tile, every SM busy).
  const bool two = (w.out + 15) / 16 / (2 * (kQ8Warps / wk)) >= 2 * int64_t(multiprocessors());
  // One tile a warp: bounded at 3 blocks an SM (80 registers; its k-block ring reloads spilled
  // values every trip, `tools/sass_loops.py --loads`) where the grid needs the third block to be
  // one wave (o_proj's 384 blocks), else at 2 (100 registers, no spills). H200, e4m3 products at
  // 2-8 rows (BENCHMARKS, session 36): at 2 an SM q_b 14.2 -> 11.1 us (T 2), 21.9 -> 16.8 (T 8),
  // down and gate | up 2-5% faster; o_proj at 2 an SM (two waves) 48.7 -> 64.4 us (T 2).
  // VIREO_Q8_SPILL_FREE=0: always 3 (A/B runs).
  const int64_t blocks = one_tile_blocks(w);
  if (two) launch_gemv<2>(x, T, w, y, wk, pre, st);
  else if (blocks <= 2 * int64_t(multiprocessors()) && q8_spill_free()) launch_gemv<1, 2>(x, T, w, y, wk, pre, st);
  else launch_gemv<1>(x, T, w, y, wk, pre, st);
  VIREO_CUDA_LAUNCHED();
  return true;
}

}  // namespace vireo::cuda
