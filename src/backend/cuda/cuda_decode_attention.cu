// Absorbed (decode) MLA attention with every head of a query in one block, and the indexer's top-k
// on one 1024-thread block with the keys in registers. See docs/notes/cuda-decode-attention.md for
// the bounds these were designed against.
//
// Attention, three kernels (f32 FMA throughout: the op-parity tolerance is f32-level; the fast
// modes' scores on bf16 tensor cores, mla_decode_scores_tc_kernel):
//  1. scores S[h, i] = scale log2(e) (q_lat_h . latent(u_i) + q_rope_h . k_rope(u_i)) for the selected keys
//     u_i: blocks of 32 heads x 32 keys, both tiles in shared memory, each thread 4 heads x 4 keys
//     over a quarter of the row. A cache row is read once per 32 heads (not once per 8 as in
//     mla_decode_partial_kernel), the scores go to a small [T, H, keys] buffer.
//  2. o_lat partials: blocks of 64 heads x 32 latent columns x 256 keys exponentiate their scores
//     against a local max and multiply them into their 256 x 32 slice of the rows (every latent
//     byte is read by exactly one block), writing (max, sum, o) per 256-key split.
//  3. merge + W_UV: a block per (head, 128 output rows) merges its head's splits into shared memory
//     and runs the W_UV rows against it (the merge no longer has its own launch).
// Scores are kept in base 2 (the softmax's e^(s - m) = 2^(s log2 e - m log2 e)): kernels 2 and 3 then
// exponentiate with exp2f (the MUFU.EX2 instruction, 2 ulp) instead of the libm-accurate expf's
// ~20 instructions; kernel 2 exponentiates each score once per 32-column slice (16 times at L =
// 512), and the accurate expf made up a third of its instructions.
// Splitting scores from the weighted sum keeps both GEMM-shaped with all heads sharing each loaded
// row, and fills the chip (128 blocks each at 2048 keys) where one fused kernel on f32 CUDA cores
// would need either 16-key splits (16 MB of partials) or a quarter of the SMs. The fast modes'
// long key lists (tensor cores, where the products take ~70 mma a warp) run 1 and 2 as one kernel,
// mla_decode_fused_tc_kernel: 64-key splits of 16 heads (128 blocks at 2048 keys), split pairs
// reduced in clusters, so 3 merges 128-key splits.
#include <algorithm>
#include <type_traits>

#include <cooperative_groups.h>

#include "backend/cuda/cuda_attention.h"
#include "backend/cuda/cuda_internal.h"

namespace vireo::cuda {

namespace {

constexpr int kSH = 32, kSK = 32;               // scores block: heads x keys
constexpr int kPH = 64, kPC = 32, kPK = 256;    // o_lat block: heads x latent columns x keys
constexpr int kPS = kPK + 4;                    // probability row stride (words): 4 mod 32
// W_UV rows a merge block takes (kWuvWarps warps of kWuvRowsPerWarp rows): 128, so that GLM-5's
// 64 heads x 256 rows are one wave of 128 blocks (one an SM at ~116 registers a thread). Blocks of
// 32 rows (8 warps of 4) made 512 blocks over ~1.3 waves and merged each head's splits 8 times over:
// H200, fp8 decode +0.5 to +1.0 points at 8 layers, +0.6 to +1.2 at 2 layers, context 0 and 4096
// (BENCHMARKS, session 32). VIREO_WUV_ROWS=32: the old blocks (A/B runs).
constexpr int kWuvWarps = 16, kWuvRowsPerWarp = 8;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A scores block's tiles (both scores kernels): its kSH heads' query rows (q_lat | q_rope; zeros
// past H) and its cnt keys' cache rows, row stride P words.
struct ScoreTiles {
  float* qs;
  float* ks;
  int P;
  const float* qlat;
  const float* q;
  int H, hg0, qw, nope, L;
  const float* kv;
  int kvw;
  const int* us;
  int cnt;
  int64_t t;
};
// Columns [c4a, c4b) (16-byte units) of both tiles by cp.async, as one group; warp of nw warps.
// Key rows past cnt stay stale: their scores are never written.
__device__ __forceinline__ void load_score_tiles(const ScoreTiles& a, int c4a, int c4b, int warp, int nw, int lane) {
  const int L4 = a.L / 4;
  for (int r = warp; r < kSH; r += nw) {
    const int h = a.hg0 + r;
    for (int c4 = c4a + lane; c4 < c4b; c4 += 32) {
      float* d = a.qs + r * a.P + 4 * c4;
      if (h >= a.H) *reinterpret_cast<float4*>(d) = make_float4(0.f, 0.f, 0.f, 0.f);
      else if (c4 < L4) cp_async16(d, a.qlat + ((a.t * a.H + h) * a.L + 4 * c4));
      else cp_async16(d, a.q + ((a.t * a.H + h) * a.qw + a.nope + 4 * (c4 - L4)));
    }
  }
  for (int r = warp; r < a.cnt; r += nw) {
    const float* src = a.kv + int64_t(a.us[r]) * a.kvw;
    for (int c4 = c4a + lane; c4 < c4b; c4 += 32) cp_async16(a.ks + r * a.P + 4 * c4, src + 4 * c4);
  }
  cp_async_commit();
}

// Row stride of the scores kernel's tiles in words: >= kvw, 16-byte aligned and 4 mod 32, so the
// 4 (heads) or 8 (keys) distinct rows one warp reads with a 16-byte load sit in distinct banks.
__host__ __device__ inline int score_tile_stride(int kvw) { return (kvw + 31) / 32 * 32 + 4; }

// Grid (key tiles, at most 64, a block taking every gridDim.x-th tile; head groups of 32; T); 64 KQ
// threads: kq = tid / 64 takes every KQ-th 16-byte column of the row, ht = (tid / 8) % 8 the heads
// ht + 8i, kt = tid % 8 the keys kt + 8j (i, j < 4): the strided sets put a warp's distinct rows on
// distinct banks. The tiles arrive by cp.async in
// two column halves, the first half's products overlapping the second half's loads; the KQ column
// groups' sums meet in shared memory at the end.
template <int KQ>
__global__ void __launch_bounds__(64 * KQ) mla_decode_scores_kernel(
    const float* __restrict__ qlat, const float* __restrict__ q, int H, int qw, int nope, int L,
    const float* __restrict__ kv, int kvw, int64_t pos0, const int32_t* __restrict__ pos0_dev,
    const int32_t* __restrict__ sel, const int32_t* __restrict__ counts, int64_t sel_stride, float scale,
    int64_t sstride, float* __restrict__ scores) {
  pdl_begin();
  extern __shared__ __align__(16) float sm[];
  const int P = score_tile_stride(kvw);
  float* qs = sm;                                        // [kSH][P]: q_lat | q_rope
  float* ks = qs + kSH * P;                              // [kSK][P]: the keys' cache rows
  int* us = reinterpret_cast<int*>(ks + kSK * P);        // [kSK]
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int64_t t = blockIdx.z;
  const int hg0 = int(blockIdx.y) * kSH;
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t n = sel ? int64_t(counts[t]) : pos0 + t + 1;
  for (int64_t k0 = int64_t(blockIdx.x) * kSK; k0 < n; k0 += int64_t(gridDim.x) * kSK) {  // uniform over the block
    const int cnt = int(n - k0 > kSK ? kSK : n - k0);
    __syncthreads();  // the previous tile's reads of shared memory are done
    if (tid < cnt) us[tid] = sel ? sel[t * sel_stride + k0 + tid] : int(k0 + tid);
    __syncthreads();
    const int C4 = kvw / 4, CA = (C4 / 2) / 4 * 4;  // 16-byte columns; first half
    constexpr int NT = 64 * KQ, NW = NT / 32;
    const ScoreTiles tiles{qs, ks, P, qlat, q, H, hg0, qw, nope, L, kv, kvw, us, cnt, t};
    auto load = [&](int c4a, int c4b) { load_score_tiles(tiles, c4a, c4b, warp, NW, lane); };
    load(0, CA);
    load(CA, C4);
    const int kq = tid >> 6, ht = (tid >> 3) & 7, kt = tid & 7;
    float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  auto run = [&](int c4a, int c4b) {
    for (int c4 = c4a + kq; c4 < c4b; c4 += KQ) {
      float4 a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const float4*>(qs + (ht + 8 * i) * P + 4 * c4);
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = *reinterpret_cast<const float4*>(ks + (kt + 8 * j) * P + 4 * c4);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float s = acc[i][j];
          s = fmaf(a[i].x, b[j].x, s);
          s = fmaf(a[i].y, b[j].y, s);
          s = fmaf(a[i].z, b[j].z, s);
          s = fmaf(a[i].w, b[j].w, s);
          acc[i][j] = s;
        }
    }
  };
  cp_async_wait<1>();
  __syncthreads();
  run(0, CA);
  cp_async_wait<0>();
  __syncthreads();
  run(CA, C4);
  __syncthreads();  // the tiles are dead: the 4 column quarters' sums meet in qs
  float* red = qs;  // [KQ][kSH][kSK + 1]
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) red[(kq * kSH + ht + 8 * i) * (kSK + 1) + kt + 8 * j] = acc[i][j];
  __syncthreads();
  for (int o = tid; o < kSH * kSK; o += NT) {
    const int h = o / kSK, j = o % kSK;
    if (hg0 + h >= H || j >= cnt) continue;
    float s = 0.0f;
#pragma unroll
    for (int x = 0; x < KQ; ++x) s += red[(x * kSH + h) * (kSK + 1) + j];
    scores[(t * H + hg0 + h) * sstride + k0 + j] = s * scale;
  }
  }
}

// The fast modes' scores kernel: the same grid, tiles and loads as mla_decode_scores_kernel, the
// products on the tensor cores (q and the cache rows rounded to bf16 at the fragment loads,
// mma.sync m16n8k16, f32 sums). 16 warps: warp w takes heads 16 (w & 1).., keys 8 ((w >> 1) & 3)..
// over half the row's 16-wide k-steps (w >> 3): the first half as soon as the first column half
// of the tiles lands, the second after; the halves' sums meet in shared memory in that order.
// Tile rows are padded to 8 mod 32 words, so the fragments' 8-byte loads hit distinct banks.
__host__ __device__ inline int tc_tile_stride(int kvw) { return (kvw + 31) / 32 * 32 + 8; }
constexpr int kTcWarps = 16;                   // 2 head tiles x 4 key tiles x 2 k-halves
constexpr int kTcRed = kTcWarps / 2 * 32 * 4;  // the second k-half's warps' tiles, 4 floats a lane

// d += p[16 heads][k0, k0 + 16) x latent[k0, k0 + 16)[8 columns] on the tensor cores (mma.sync
// m16n8k16): this lane's A words from pa (rows g and g + 8, ps floats apart), B words from vb (key
// rows vs floats apart), both rounded to bf16 here.
__device__ __forceinline__ void mma_p_latent(float (&d)[4], const float* pa, int ps, const float* vb, int vs, int k0) {
  const float2 x0 = *reinterpret_cast<const float2*>(pa + k0);
  const float2 x1 = *reinterpret_cast<const float2*>(pa + 8 * ps + k0);
  const float2 x2 = *reinterpret_cast<const float2*>(pa + k0 + 8);
  const float2 x3 = *reinterpret_cast<const float2*>(pa + 8 * ps + k0 + 8);
  const float* v = vb + k0 * vs;
  mma_bf16_16816(d, pack_bf16x2(x0.x, x0.y), pack_bf16x2(x1.x, x1.y), pack_bf16x2(x2.x, x2.y), pack_bf16x2(x3.x, x3.y),
                 pack_bf16x2(v[0], v[vs]), pack_bf16x2(v[8 * vs], v[9 * vs]));
}

// The tc scores' two k-halves of a block's tiles, whose columns land as two cp.async groups (the
// first k-half's first): warps of half kh = 0 run the first half's 16-wide k-steps [0, KA) as soon
// as its group lands, warps of half 1 the steps [KA, KS) after the last; the second half's sums
// meet the first's in `red` ([warps / 2][32][4]), in that order. Returns true in the first half's
// warps, with this lane's 4 sums of the 16 x 8 tile in sc. pa, pb: this lane's first A (query)
// and B (cache row) fragment words, rows P floats apart; q and the rows rounded to bf16 here.
__device__ __forceinline__ bool tc_score_halves(const float* pa, const float* pb, int P, int KA, int KS, int kh,
                                                int warp, int lane, int warps, float* red, float (&sc)[4]) {
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  auto run = [&](int ka, int kb) {
    for (int k = ka; k < kb; ++k) {
      const int c = 16 * k;
      const float2 a0 = *reinterpret_cast<const float2*>(pa + c);
      const float2 a1 = *reinterpret_cast<const float2*>(pa + 8 * P + c);
      const float2 a2 = *reinterpret_cast<const float2*>(pa + c + 8);
      const float2 a3 = *reinterpret_cast<const float2*>(pa + 8 * P + c + 8);
      const float2 b0 = *reinterpret_cast<const float2*>(pb + c), b1 = *reinterpret_cast<const float2*>(pb + c + 8);
      mma_bf16_16816(d, pack_bf16x2(a0.x, a0.y), pack_bf16x2(a1.x, a1.y), pack_bf16x2(a2.x, a2.y),
                     pack_bf16x2(a3.x, a3.y), pack_bf16x2(b0.x, b0.y), pack_bf16x2(b1.x, b1.y));
    }
  };
  cp_async_wait<1>();
  __syncthreads();
  if (kh == 0) run(0, KA);
  cp_async_wait<0>();
  __syncthreads();
  if (kh == 1) {
    run(KA, KS);
    *reinterpret_cast<float4*>(red + ((warp - warps / 2) * 32 + lane) * 4) = make_float4(d[0], d[1], d[2], d[3]);
  }
  __syncthreads();
  if (kh != 0) return false;
  const float4 o = *reinterpret_cast<const float4*>(red + (warp * 32 + lane) * 4);
  sc[0] = d[0] + o.x;
  sc[1] = d[1] + o.y;
  sc[2] = d[2] + o.z;
  sc[3] = d[3] + o.w;
  return true;
}

__global__ void __launch_bounds__(kTcWarps * 32)
    mla_decode_scores_tc_kernel(const float* __restrict__ qlat, const float* __restrict__ q, int H, int qw, int nope,
                                int L, const float* __restrict__ kv, int kvw, int64_t pos0,
                                const int32_t* __restrict__ pos0_dev, const int32_t* __restrict__ sel,
                                const int32_t* __restrict__ counts, int64_t sel_stride, float scale, int64_t sstride,
                                float* __restrict__ scores) {
  pdl_begin();
  extern __shared__ __align__(16) float sm[];
  const int P = tc_tile_stride(kvw);
  float* qs = sm;                                  // [kSH][P]: q_lat | q_rope
  float* ks = qs + kSH * P;                        // [kSK][P]: the keys' cache rows
  float* red = ks + kSK * P;                       // [8][32][4]
  int* us = reinterpret_cast<int*>(red + kTcRed);  // [kSK]
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int mt = warp & 1, nt = (warp >> 1) & 3, kh = warp >> 3, g = lane >> 2, qq = lane & 3;
  const int64_t t = blockIdx.z;
  const int hg0 = int(blockIdx.y) * kSH;
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t n = sel ? int64_t(counts[t]) : pos0 + t + 1;
  const int KS = kvw / 16, KA = KS / 2;  // 16-wide k-steps; the first half's
  for (int64_t k0 = int64_t(blockIdx.x) * kSK; k0 < n; k0 += int64_t(gridDim.x) * kSK) {  // uniform
    const int cnt = int(n - k0 > kSK ? kSK : n - k0);
    __syncthreads();  // the previous tile's reads of shared memory are done
    if (tid < cnt) us[tid] = sel ? sel[t * sel_stride + k0 + tid] : int(k0 + tid);
    __syncthreads();
    const ScoreTiles tiles{qs, ks, P, qlat, q, H, hg0, qw, nope, L, kv, kvw, us, cnt, t};
    load_score_tiles(tiles, 0, 4 * KA, warp, kTcWarps, lane);  // 16-byte columns of the first k-half
    load_score_tiles(tiles, 4 * KA, kvw / 4, warp, kTcWarps, lane);
    const float* pa = qs + (16 * mt + g) * P + 2 * qq;  // A: q[head][dim], rows g and g + 8
    const float* pb = ks + (8 * nt + g) * P + 2 * qq;   // B: row[key][dim], column (key) g
    float sc[4];
    if (tc_score_halves(pa, pb, P, KA, KS, kh, warp, lane, kTcWarps, red, sc)) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int h = hg0 + 16 * mt + g + 8 * r, j = 8 * nt + 2 * qq + e;
          if (h < H && j < cnt) scores[(t * H + h) * sstride + k0 + j] = sc[2 * r + e] * scale;
        }
    }
  }
}

// The fast modes' long key lists (tensor cores): scores, softmax and p x latent of one (split of kFK
// keys, group of kFH heads) in one block, both products on bf16 tensor cores as
// mla_decode_scores_tc_kernel and mla_decode_pv_kernel<8, true> round them (q, the cache rows and
// p rounded to bf16 at the fragment loads, f32 sums): it loads its 16 queries and 64 cache rows
// once (~190 KB) and needs no [H, keys] round trip of scores. 16 warps: scores as the tc scores
// kernel (warp: key tile 8 (w & 7).., k-half w >> 3); a warp a head for the softmax; p x latent a
// warp per 8-column tiles w, w + 16, ... The blocks of two consecutive splits are a cluster: each
// keeps its (max, sum, o) in shared memory, and rank r merges heads [8 r, 8 r + 8) of the pair
// through distributed shared memory into one partial, so mla_decode_merge_wuv_kernel reads
// 128-key splits (16 at 2048 keys). Grid (splits rounded up to even, head groups, T).
// H200, GLM-5 shapes, 2048 of 4096 keys (BENCHMARKS "Session 45"): the two kernels took 6.8 + 7.8
// us of advance a layer. Unpaired (32 64-key splits to merge) the fused kernel ran 9.3 and the
// merge 11.1 (7.0 over 8 splits): even. Clusters of 4 and 8 fit 30 and 15 at once (120 of 128
// blocks: two waves), 23 us, -3 points. Pairs fit 66 at once: 11.5 us, the merge 8.4 (19.9 against
// 21.6 a layer), +0.6 and +0.1 points at 4096 cached in two A/Bs.
constexpr int kFH = 16, kFK = 64, kFWarps = 16, kFCL = 2;
constexpr int kFPS = kFK + 8;  // p row stride (words): 8 mod 32, as the tc tiles
__host__ __device__ inline size_t fused_attn_smem(int kvw) {
  return size_t((kFH + kFK) * tc_tile_stride(kvw) + kTcRed + kFH * kFPS + 2 * kFH) * 4 + kFK * 4;
}
__global__ void __cluster_dims__(kFCL, 1, 1) __launch_bounds__(kFWarps * 32, 1)
    mla_decode_fused_tc_kernel(const float* __restrict__ qlat, const float* __restrict__ q, int H, int qw, int nope,
                               int L, const float* __restrict__ kv, int kvw, int64_t pos0,
                               const int32_t* __restrict__ pos0_dev, const int32_t* __restrict__ sel,
                               const int32_t* __restrict__ counts, int64_t sel_stride, float scale2, int nks,
                               float* __restrict__ opart, float* __restrict__ mpart, float* __restrict__ lpart) {
  pdl_begin();
  extern __shared__ __align__(16) float sm[];
  const int P = tc_tile_stride(kvw);
  float* qs = sm;                               // [kFH][P]: q_lat | q_rope
  float* ks = qs + kFH * P;                     // [kFK][P]: the split's cache rows
  float* red = ks + kFK * P;                    // [8][32][4]: the second k-half's sums
  float* ps = red + kTcRed;                     // [kFH][kFPS]: scores, then p (bf16 values)
  float* msm = ps + kFH * kFPS;                 // [kFH]: each head's max
  float* lsm = msm + kFH;                       // [kFH]: and sum
  int* us = reinterpret_cast<int*>(lsm + kFH);  // [kFK]
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, qq = lane & 3;
  const int64_t t = blockIdx.z;
  const int s = int(blockIdx.x), hg0 = int(blockIdx.y) * kFH;
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t n = sel ? int64_t(counts[t]) : pos0 + t + 1;
  const int64_t i0 = int64_t(s) * kFK;
  const int cnt = int(n - i0 < 0 ? 0 : n - i0 > kFK ? kFK : n - i0);
  if (cnt == 0 && tid < kFH) {  // an empty split: its pair's reduction skips it by its max
    msm[tid] = -INFINITY;
    lsm[tid] = 0.0f;
  }
  if (cnt > 0) {  // (uniform; an empty split still meets the cluster's barriers below)
    if (tid < cnt) us[tid] = sel ? sel[t * sel_stride + i0 + tid] : int(i0 + tid);
    // Rows past cnt: zero latent (p x latent sums over all kFK keys with p = 0 there; stale shared
    // memory could hold NaN bits). Their scores are never used.
    for (int x = tid; x < (kFK - cnt) * (L / 4); x += kFWarps * 32)
      *reinterpret_cast<float4*>(ks + (cnt + x / (L / 4)) * P + 4 * (x % (L / 4))) = make_float4(0.f, 0.f, 0.f, 0.f);
    __syncthreads();  // us
    const int L4 = L / 4, KS = kvw / 16, KA = KS / 2;
    auto load = [&](int c4a, int c4b) {  // columns [c4a, c4b) of both tiles, one cp.async group
      for (int r = warp; r < kFH; r += kFWarps) {
        const int h = hg0 + r;
        for (int c4 = c4a + lane; c4 < c4b; c4 += 32) {
          float* d = qs + r * P + 4 * c4;
          if (h >= H) *reinterpret_cast<float4*>(d) = make_float4(0.f, 0.f, 0.f, 0.f);
          else if (c4 < L4) cp_async16(d, qlat + ((t * H + h) * L + 4 * c4));
          else cp_async16(d, q + ((t * H + h) * qw + nope + 4 * (c4 - L4)));
        }
      }
      for (int r = warp; r < cnt; r += kFWarps) {
        const float* src = kv + int64_t(us[r]) * kvw;
        for (int c4 = c4a + lane; c4 < c4b; c4 += 32) cp_async16(ks + r * P + 4 * c4, src + 4 * c4);
      }
      cp_async_commit();
    };
    load(0, 4 * KA);
    load(4 * KA, kvw / 4);
    // Scores: warp (nt, kh) takes keys 8 nt.. over k-half kh; rows g, g + 8 of the 16 heads.
    const int nt = warp & 7, kh = warp >> 3;
    const float* pa = qs + g * P + 2 * qq;
    const float* pb = ks + (8 * nt + g) * P + 2 * qq;
    float sc[4];
    if (tc_score_halves(pa, pb, P, KA, KS, kh, warp, lane, kFWarps, red, sc)) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 8 * nt + 2 * qq + e;
          ps[(g + 8 * r) * kFPS + j] = j < cnt ? sc[2 * r + e] * scale2 : -INFINITY;
        }
    }
    __syncthreads();
    {  // softmax of head `warp` over the split's keys: 2 a lane; p rounded to bf16 as stored
      static_assert(kFH == kFWarps && kFK == 64, "a warp a head, two keys a lane");
      float* prow = ps + warp * kFPS;
      const float s0 = prow[lane], s1 = prow[lane + 32];
      const float m = warp_max(fmaxf(s0, s1));
      float p0 = lane < cnt ? exp2f(s0 - m) : 0.0f, p1 = lane + 32 < cnt ? exp2f(s1 - m) : 0.0f;
      p0 = __bfloat162float(__float2bfloat16_rn(p0));
      p1 = __bfloat162float(__float2bfloat16_rn(p1));
      prow[lane] = p0;
      prow[lane + 32] = p1;
      const float l = warp_sum(p0 + p1);
      if (lane == 0) {
        msm[warp] = m;
        lsm[warp] = l;
      }
    }
    __syncthreads();
    // p x latent: 8-column tiles cn = 8 w, 8 (w + 16), ..; A p[head][key], B latent[key][column].
    const float* pp = ps + g * kFPS + 2 * qq;
    for (int cn = 8 * warp; cn < L; cn += 8 * kFWarps) {
      float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const float* vb = ks + 2 * qq * P + cn + g;
#pragma unroll
      for (int k0 = 0; k0 < kFK; k0 += 16) mma_p_latent(o, pp, kFPS, vb, P, k0);
#pragma unroll
      for (int r = 0; r < 2; ++r)  // o[2r], o[2r + 1]: head g + 8r, columns cn + 2qq, + 1, into the
        // query tile's space (the scores read it last)
        *reinterpret_cast<float2*>(qs + (g + 8 * r) * P + cn + 2 * qq) = make_float2(o[2 * r], o[2 * r + 1]);
    }
  }  // cnt > 0
  {
    namespace cg = cooperative_groups;
    constexpr int CL = kFCL, HPR = kFH / CL;
    const cg::cluster_group cl = cg::this_cluster();
    cl.sync();  // every block's (max, sum, o) written
    const int rank = int(cl.block_rank()), nko = nks / CL, so = s / CL;
    const float* rm[CL];
    const float* rl[CL];
    const float* ro[CL];
#pragma unroll
    for (int i = 0; i < CL; ++i) {
      rm[i] = cl.map_shared_rank(msm, i);
      rl[i] = cl.map_shared_rank(lsm, i);
      ro[i] = cl.map_shared_rank(qs, i);
    }
    for (int e = 4 * tid; e < HPR * L; e += 4 * kFWarps * 32) {
      const int hh = rank * HPR + e / L, c = e % L, h = hg0 + hh;
      float mi[CL], M = -INFINITY;
#pragma unroll
      for (int i = 0; i < CL; ++i) {
        mi[i] = rm[i][hh];
        M = fmaxf(M, mi[i]);
      }
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      float lsum = 0.0f;
#pragma unroll
      for (int i = 0; i < CL; ++i) {
        if (mi[i] == -INFINITY) continue;
        const float w = exp2f(mi[i] - M);
        const float4 v = *reinterpret_cast<const float4*>(ro[i] + hh * P + c);
        acc.x += w * v.x;
        acc.y += w * v.y;
        acc.z += w * v.z;
        acc.w += w * v.w;
        if (c == 0) lsum += w * rl[i][hh];
      }
      if (h < H) {
        *reinterpret_cast<float4*>(opart + ((t * H + h) * nko + so) * L + c) = acc;
        if (c == 0) {
          mpart[(t * H + h) * nko + so] = M;
          lpart[(t * H + h) * nko + so] = lsum;
        }
      }
    }
    cl.sync();  // no block leaves while another reads its shared memory
  }
}

// Grid (L / 32 column slices, key splits of 256, T x head groups of 64); 64 KG threads. Each block:
// its heads' scores for the split (cp.async) -> p = 2^(s - m_local) in shared memory ([head][key]),
// the split's 256 x 32 slice of the latent rows (cp.async, landing while the scores are
// exponentiated), then o[h, c] = sum_j p[h, j] v[j, c] with thread tile 8 heads (ht + 8i) x 4
// columns over every KG-th 4-key step (kg = tid / 64), the KG key groups summed through shared
// memory. Column slice 0 also writes each head's (m, l) for the merge. TC (the fast modes): p
// rounded to bf16 as it is stored, the product on mma.sync m16n8k16 (16 warps, a 16 heads x 8
// columns tile each, the latent rounded at the fragment loads), rows padded to 8 and 4 mod 32 words.
template <int KG, bool TC>
__global__ void __launch_bounds__(64 * KG)
    mla_decode_pv_kernel(const float* __restrict__ scores, int64_t sstride, int H, int nhg, int L,
                         const float* __restrict__ kv, int kvw, int64_t pos0, const int32_t* __restrict__ pos0_dev,
                         const int32_t* __restrict__ sel, const int32_t* __restrict__ counts, int64_t sel_stride,
                         int nks, float* __restrict__ opart, float* __restrict__ mpart, float* __restrict__ lpart) {
  pdl_begin();
  constexpr int PS = TC ? kPK + 8 : kPS, VS = TC ? kPC + 4 : kPC;  // row strides (words)
  static_assert(!TC || (KG == 8 && kPH == 64 && kPC == 32), "16 warps of 16 x 8 tiles");
  extern __shared__ __align__(16) float sm[];
  float* ps = sm;                                   // [kPH][PS]
  float* vs = ps + kPH * PS;                        // [kPK][VS]
  int* us = reinterpret_cast<int*>(vs + kPK * VS);  // [kPK]
  constexpr int NT = 64 * KG, NW = NT / 32;
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int64_t t = blockIdx.z / nhg;
  const int hg0 = int(blockIdx.z % nhg) * kPH, c0 = int(blockIdx.x) * kPC, s = int(blockIdx.y);
  const int64_t i0 = int64_t(s) * kPK;
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t n = sel ? int64_t(counts[t]) : pos0 + t + 1;
  const int cnt = int(n - i0 < 0 ? 0 : n - i0 > kPK ? kPK : n - i0);
  if (cnt == 0) {  // an empty split: the merge skips it by its max
    if (blockIdx.x == 0)
      for (int h = tid; h < kPH && hg0 + h < H; h += NT) {
        mpart[(t * H + hg0 + h) * nks + s] = -INFINITY;
        lpart[(t * H + hg0 + h) * nks + s] = 0.0f;
      }
    return;
  }
  const int cntr = (cnt + 4 * KG - 1) / (4 * KG) * (4 * KG);  // the product loop's step: KG groups x 4 keys
  for (int j = tid; j < cnt; j += NT) us[j] = sel ? sel[t * sel_stride + i0 + j] : int(i0 + j);
  // The scores first (they are needed first), 16 bytes at a time: every load of the block in flight
  // at once (a warp walking its heads' rows in global memory waited on one round trip per head).
  // Chunks past cnt read stale scores inside the row (sstride covers them); they are zeroed below.
  const int c4n = (cnt + 3) / 4;
  for (int x = tid; x < kPH * c4n; x += NT) {
    const int hh = x / c4n, c4 = x % c4n;
    if (hg0 + hh < H) cp_async16(ps + hh * PS + 4 * c4, scores + (t * H + hg0 + hh) * sstride + i0 + 4 * c4);
  }
  cp_async_commit();
  __syncthreads();  // us
  for (int x = tid; x < cnt * (kPC / 4); x += NT) {
    const int j = x / (kPC / 4), c4 = x % (kPC / 4);
    cp_async16(vs + j * VS + 4 * c4, kv + int64_t(us[j]) * kvw + c0 + 4 * c4);
  }
  cp_async_commit();
  for (int x = tid; x < (cntr - cnt) * kPC; x += NT)  // padding keys: p = 0, v = 0
    vs[(cnt + x / kPC) * VS + x % kPC] = 0.0f;
  cp_async_wait<1>();
  __syncthreads();
  for (int hh = warp; hh < kPH; hh += NW) {  // warp hh: one head's scores at a time, 8 per lane
    const int h = hg0 + hh;
    float* prow = ps + hh * PS;
    if (h >= H) {
      for (int j = lane; j < cntr; j += 32) prow[j] = 0.0f;
      continue;
    }
    float sv[kPK / 32];
    float m = -INFINITY;
#pragma unroll
    for (int r = 0; r < kPK / 32; ++r) {
      const int j = lane + 32 * r;
      sv[r] = j < cnt ? prow[j] : -INFINITY;
      m = fmaxf(m, sv[r]);
    }
    m = warp_max(m);
    float l = 0.0f;
#pragma unroll
    for (int r = 0; r < kPK / 32; ++r) {
      const int j = lane + 32 * r;
      float p = j < cnt ? exp2f(sv[r] - m) : 0.0f;
      if constexpr (TC) p = __bfloat162float(__float2bfloat16_rn(p));
      if (j < cntr) prow[j] = p;
      l += p;
    }
    l = warp_sum(l);
    if (blockIdx.x == 0 && lane == 0) {
      mpart[(t * H + h) * nks + s] = m;
      lpart[(t * H + h) * nks + s] = l;
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if constexpr (TC) {
    const int g = lane >> 2, q = lane & 3, hm = 16 * (warp >> 2), cn = 8 * (warp & 3);
    const float* pa = ps + (hm + g) * PS + 2 * q;  // A: p[head][key], rows g and g + 8
    const float* vb = vs + 2 * q * VS + cn + g;    // B: latent[key][column], column g
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < cntr; k0 += 16) mma_p_latent(d, pa, PS, vb, VS, k0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // d[2r], d[2r + 1]: head hm + g + 8r, columns cn + 2q, + 1
      const int h = hg0 + hm + g + 8 * r;
      if (h < H)
        *reinterpret_cast<float2*>(opart + ((t * H + h) * nks + s) * L + c0 + cn + 2 * q) =
            make_float2(d[2 * r], d[2 * r + 1]);
    }
    return;
  }
  const int kg = tid >> 6, ht = (tid >> 3) & 7, ct = tid & 7;  // kg < KG
  float acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][c] = 0.0f;
  for (int j = 4 * kg; j < cntr; j += 4 * KG) {
    float4 v[4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) v[jj] = *reinterpret_cast<const float4*>(vs + (j + jj) * VS + 4 * ct);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 p = *reinterpret_cast<const float4*>(ps + (ht + 8 * i) * PS + j);
      const float pj[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        acc[i][0] = fmaf(pj[jj], v[jj].x, acc[i][0]);
        acc[i][1] = fmaf(pj[jj], v[jj].y, acc[i][1]);
        acc[i][2] = fmaf(pj[jj], v[jj].z, acc[i][2]);
        acc[i][3] = fmaf(pj[jj], v[jj].w, acc[i][3]);
      }
    }
  }
  __syncthreads();  // ps is dead: the 4 key quarters' sums meet there
  float* red = ps;  // [KG][kPH][kPC + 1] (past ps into vs for KG = 8: both are dead)
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) red[(kg * kPH + ht + 8 * i) * (kPC + 1) + 4 * ct + c] = acc[i][c];
  __syncthreads();
  for (int o = tid; o < kPH * kPC; o += NT) {
    const int h = o / kPC, c = o % kPC;
    if (hg0 + h >= H) continue;
    float sum = 0.0f;
#pragma unroll
    for (int x = 0; x < KG; ++x) sum += red[(x * kPH + h) * (kPC + 1) + c];
    opart[((t * H + hg0 + h) * nks + s) * L + c0 + c] = sum;
  }
}

// Grid (H, ceil(vd / (NW RPW)), T); NW warps. o_lat[h] = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s
// into shared memory, then out[t, h, j] = W_UV(h)[j, :] . o_lat[h] for this block's NW x RPW rows: a
// warp per RPW rows, 16-byte weight loads (the RPW rows' loads issued together).
template <int DT, int RPW, int NW>
__global__ void __launch_bounds__(32 * NW)
    mla_decode_merge_wuv_kernel(const float* __restrict__ opart, const float* __restrict__ mpart,
                                const float* __restrict__ lpart, int nks, int H, int L, DevW kvb, int hw, int nope,
                                int vd, float* __restrict__ out) {
  pdl_begin();
  extern __shared__ __align__(16) float olat[];  // [L], then [3][nks]: split weights, maxima, sums
  constexpr int N = GemvVec<DT>::n;
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int h = int(blockIdx.x);
  const int64_t t = blockIdx.z;
  const int64_t base = (t * H + h) * nks;
  // This warp's rows, and their first PF 16-byte chunks per lane loaded before the merge (at
  // L = 512 the whole rows of FP8 and BF16), so the weight stream overlaps the merge's dependent
  // loads. (PF 2 at FP8 loads nothing more at L = 512, where a row is 32 chunks.)
  constexpr int PF = DT == W_FP8 && RPW > 4 ? 1 : 2;
  const int j0 = (int(blockIdx.y) * NW + warp) * RPW;
  const uint4* wr[RPW];
  const float* srow[RPW];
  uint4 wpre[PF][RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int64_t row = int64_t(h) * hw + nope + (j0 + r < vd ? j0 + r : vd - 1);
    wr[r] = reinterpret_cast<const uint4*>(static_cast<const char*>(kvb.w) + row * L * elem_bytes<DT>());
    srow[r] = DT == W_FP8 ? kvb.s + (row >> 7) * kvb.s_cols : nullptr;
  }
#pragma unroll
  for (int pf = 0; pf < PF; ++pf)
#pragma unroll
    for (int r = 0; r < RPW; ++r)
      if (lane + 32 * pf < L / N) wpre[pf][r] = ldg_stream(wr[r] + lane + 32 * pf);
  // The splits' (max, sum) read once into shared memory, then every thread's loops run there: a
  // thread walking them in global memory waited on a round trip per split (and the weighted sum
  // below on one per split and column): merge + W_UV 15 us at 8 splits, H200, ncu, session 18.
  float* wsplit = olat + L;      // [nks]: each split's weight (maxima in base 2), one exp2f per split
  float* msplit = wsplit + nks;  // [nks]
  float* lsplit = msplit + nks;  // [nks]
  for (int s = tid; s < nks; s += 32 * NW) {
    msplit[s] = mpart[base + s];
    lsplit[s] = lpart[base + s];
  }
  __syncthreads();
  float M = -INFINITY;
  for (int s = 0; s < nks; ++s) M = fmaxf(M, msplit[s]);
  float denom = 0.0f;
  for (int s = 0; s < nks; ++s)
    if (msplit[s] > -INFINITY) denom += exp2f(msplit[s] - M) * lsplit[s];
  const float inv = 1.0f / denom;
  for (int s = tid; s < nks; s += 32 * NW) wsplit[s] = msplit[s] > -INFINITY ? exp2f(msplit[s] - M) : 0.0f;
  __syncthreads();
  constexpr int SB = 8;  // splits whose partial loads are in flight together
  for (int c = tid; c < L; c += 32 * NW) {
    float acc = 0.0f;
    for (int s0 = 0; s0 < nks; s0 += SB) {
      float o[SB];
#pragma unroll
      for (int i = 0; i < SB; ++i)
        o[i] = s0 + i < nks && wsplit[s0 + i] != 0.0f ? opart[(base + s0 + i) * L + c] : 0.0f;
#pragma unroll
      for (int i = 0; i < SB; ++i)
        if (s0 + i < nks && wsplit[s0 + i] != 0.0f) acc += wsplit[s0 + i] * o[i];
    }
    olat[c] = acc * inv;
  }
  __syncthreads();
  float acc[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) acc[r] = 0.0f;
  auto consume = [&](int v, const uint4 (&w)[RPW]) {
    float x[N];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 xv = *reinterpret_cast<const float4*>(olat + v * N + 4 * i);
      x[4 * i] = xv.x;
      x[4 * i + 1] = xv.y;
      x[4 * i + 2] = xv.z;
      x[4 * i + 3] = xv.w;
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      float wf[N];
      unpack16<DT>(w[r], wf);
      float p = 0.0f;
#pragma unroll
      for (int i = 0; i < N; ++i) p = fmaf(wf[i], x[i], p);
      if constexpr (DT == W_FP8) acc[r] = fmaf(srow[r][(v * N) >> 7], p, acc[r]);
      else acc[r] += p;
    }
  };
#pragma unroll
  for (int pf = 0; pf < PF; ++pf)
    if (lane + 32 * pf < L / N) consume(lane + 32 * pf, wpre[pf]);
  for (int v = lane + 32 * PF; v < L / N; v += 32) {
    uint4 w[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) w[r] = ldg_stream(wr[r] + v);
    consume(v, w);
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float sum = warp_sum(acc[r]);
    if (lane == 0 && j0 + r < vd) out[(t * H + h) * vd + j0 + r] = sum;
  }
}

// Short contexts (every query's key count <= kDecodeShortMaxKeys): scores, softmax and p x latent in one
// kernel. Grid (key splits of kQK, head groups of kQH, T); 256 threads. A block stages its <= 32
// cache rows and its 4 heads' queries once (cp.async, ~77 KB), then: each warp scores keys
// warp, warp + 8, ... for the 4 heads (a row's 16-byte column chunks over the lanes, one shuffle
// tree per head); a warp per head exponentiates its 32 scores against their max; each thread sums
// p x latent for one 16-byte column chunk of 2 heads over the split's keys. Writes the same
// (max, sum, o) split partials as mla_decode_pv_kernel, for mla_decode_merge_wuv_kernel. At a few
// dozen keys the two long-context kernels were latency-bound on a few SMs (9.7 + 6.8 us a GLM-5
// layer under ncu with 2 cached keys, H200; docs/notes/cuda-decode-attention.md).
constexpr int kQH = 4, kQK = 32;  // short kernel block: heads x keys

__global__ void __launch_bounds__(256)
    mla_decode_short_kernel(const float* __restrict__ qlat, const float* __restrict__ q, int H, int qw, int nope, int L,
                            const float* __restrict__ kv, int kvw, int64_t pos0, const int32_t* __restrict__ pos0_dev,
                            const int32_t* __restrict__ sel, const int32_t* __restrict__ counts, int64_t sel_stride,
                            float scale2, int nks, float* __restrict__ opart, float* __restrict__ mpart,
                            float* __restrict__ lpart) {
  pdl_begin();
  extern __shared__ __align__(16) float sm[];
  const int P = score_tile_stride(kvw);
  float* qs = sm;                                    // [kQH][P]: q_lat | q_rope
  float* ks = qs + kQH * P;                          // [kQK][P]: the split's cache rows
  float* ps = ks + kQK * P;                          // [kQH][kQK]: scores, then probabilities
  int* us = reinterpret_cast<int*>(ps + kQH * kQK);  // [kQK]
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int64_t t = blockIdx.z;
  const int s = int(blockIdx.x), h0 = int(blockIdx.y) * kQH;
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t n = sel ? int64_t(counts[t]) : pos0 + t + 1;
  const int64_t i0 = int64_t(s) * kQK;
  const int cnt = int(n - i0 < 0 ? 0 : n - i0 > kQK ? kQK : n - i0);
  if (cnt == 0) {  // an empty split: the merge skips it by its max
    if (tid < kQH && h0 + tid < H) {
      mpart[(t * H + h0 + tid) * nks + s] = -INFINITY;
      lpart[(t * H + h0 + tid) * nks + s] = 0.0f;
    }
    return;
  }
  if (tid < cnt) us[tid] = sel ? sel[t * sel_stride + i0 + tid] : int(i0 + tid);
  const int C4 = kvw / 4, L4 = L / 4;
  for (int x = tid; x < kQH * C4; x += 256) {
    const int r = x / C4, c4 = x % C4, h = h0 + r;
    float* d = qs + r * P + 4 * c4;
    if (h >= H) *reinterpret_cast<float4*>(d) = make_float4(0.f, 0.f, 0.f, 0.f);
    else if (c4 < L4) cp_async16(d, qlat + ((t * H + h) * L + 4 * c4));
    else cp_async16(d, q + ((t * H + h) * qw + nope + 4 * (c4 - L4)));
  }
  __syncthreads();  // us
  for (int x = tid; x < cnt * C4; x += 256) {
    const int r = x / C4, c4 = x % C4;
    cp_async16(ks + r * P + 4 * c4, kv + int64_t(us[r]) * kvw + 4 * c4);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  for (int j = warp; j < cnt; j += 8) {
    float acc[kQH];
#pragma unroll
    for (int hh = 0; hh < kQH; ++hh) acc[hh] = 0.0f;
    for (int c4 = lane; c4 < C4; c4 += 32) {
      const float4 k = *reinterpret_cast<const float4*>(ks + j * P + 4 * c4);
#pragma unroll
      for (int hh = 0; hh < kQH; ++hh) {
        const float4 a = *reinterpret_cast<const float4*>(qs + hh * P + 4 * c4);
        float v = acc[hh];
        v = fmaf(a.x, k.x, v);
        v = fmaf(a.y, k.y, v);
        v = fmaf(a.z, k.z, v);
        v = fmaf(a.w, k.w, v);
        acc[hh] = v;
      }
    }
#pragma unroll
    for (int hh = 0; hh < kQH; ++hh) acc[hh] = warp_sum(acc[hh]);
    if (lane == 0)
#pragma unroll
      for (int hh = 0; hh < kQH; ++hh) ps[hh * kQK + j] = acc[hh] * scale2;
  }
  __syncthreads();
  if (warp < kQH) {  // kQK == 32: a lane per key
    const float sv = lane < cnt ? ps[warp * kQK + lane] : -INFINITY;
    const float m = warp_max(sv);
    const float p = lane < cnt ? exp2f(sv - m) : 0.0f;
    ps[warp * kQK + lane] = p;
    const float l = warp_sum(p);
    if (lane == 0 && h0 + warp < H) {
      mpart[(t * H + h0 + warp) * nks + s] = m;
      lpart[(t * H + h0 + warp) * nks + s] = l;
    }
  }
  __syncthreads();
  for (int x = tid; x < L4 * (kQH / 2); x += 256) {
    const int c4 = x % L4, hp = 2 * (x / L4);
    float4 o0 = make_float4(0.f, 0.f, 0.f, 0.f), o1 = o0;
    for (int j = 0; j < cnt; ++j) {
      const float4 v = *reinterpret_cast<const float4*>(ks + j * P + 4 * c4);
      const float p0 = ps[hp * kQK + j], p1 = ps[(hp + 1) * kQK + j];
      o0.x = fmaf(p0, v.x, o0.x), o0.y = fmaf(p0, v.y, o0.y), o0.z = fmaf(p0, v.z, o0.z), o0.w = fmaf(p0, v.w, o0.w);
      o1.x = fmaf(p1, v.x, o1.x), o1.y = fmaf(p1, v.y, o1.y), o1.z = fmaf(p1, v.z, o1.z), o1.w = fmaf(p1, v.w, o1.w);
    }
    if (h0 + hp < H) *reinterpret_cast<float4*>(opart + ((t * H + h0 + hp) * nks + s) * L + 4 * c4) = o0;
    if (h0 + hp + 1 < H) *reinterpret_cast<float4*>(opart + ((t * H + h0 + hp + 1) * nks + s) * L + 4 * c4) = o1;
  }
}

// --- Indexer top-k ---------------------------------------------------------------------------

// Scores as unsigned keys in the order of the floats (-0 and +0 equal, as floats compare).
__device__ __forceinline__ uint32_t score_key(float s) {
  const uint32_t b = __float_as_uint(s + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Warp 0 of a radix-select pass: the bin holding the rem-th largest of the keys counted in hist,
// counting from bin 255 down (lane l owns bins 255 - 8l .. 248 - 8l; a scan over lanes finds the
// lane, the lane walks its 8 bins). It writes the bin, the keys still to take inside it, and
// whether that is every key of the bin.
__device__ __forceinline__ void radix_pick_bin(const unsigned* hist, int rem, int lane, int* s_bin, int* s_rem,
                                               int* s_all) {
  unsigned c[8], tot = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    c[i] = hist[255 - (lane * 8 + i)];
    tot += c[i];
  }
  unsigned inc = tot;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned v = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += v;
  }
  const unsigned reach = __ballot_sync(0xffffffffu, int(inc) >= rem);
  if (lane == __ffs(reach) - 1) {  // the matching keys number >= rem, so some lane reaches it
    int cum = int(inc - tot);
    int b = 255 - lane * 8, cnt = 0;
    for (int i = 0; i < 8; ++i) {
      b = 255 - (lane * 8 + i);
      cnt = int(c[i]);
      if (b == 0 || cum + cnt >= rem) break;
      cum += cnt;
    }
    *s_bin = b;
    *s_rem = rem - cum;
    *s_all = cnt == rem - cum;
  }
}

// The exclusive prefix sum of every thread's `mine`, in thread order, over a block of 1024 threads
// (warp_tot: 32 entries of shared memory). Every thread of the block calls it.
template <typename U>
__device__ __forceinline__ U block_exclusive_sum_1024(U mine, U* warp_tot, int lane, int warp) {
  U inc = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const U v = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += v;
  }
  if (lane == 31) warp_tot[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const U w = warp_tot[lane];
    U wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const U v = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += v;
    }
    warp_tot[lane] = wi - w;  // exclusive
  }
  __syncthreads();
  return warp_tot[warp] + inc - mine;
}

// The placement of one chunk of 32 consecutive positions, lane l holding position u = c0 + l (its
// key k under the passes' mask; `valid` false past the row or the warp's span): every key above K
// and the first `need` keys equal to K in position order. G and E are the keys above / equal to K
// at positions before the chunk (warp-uniform), advanced past it. A lane's rank among the chunk's
// keys comes from two ballots.
__device__ __forceinline__ void topk_place_chunk(uint32_t k, bool valid, int u, uint32_t K, int need, int lane, int& G,
                                                 int& E, int32_t* __restrict__ sel) {
  const bool above = valid && k > K, equal = valid && k == K;
  const unsigned ba = __ballot_sync(0xffffffffu, above), be = __ballot_sync(0xffffffffu, equal);
  const unsigned lower = (1u << lane) - 1u;
  const int g = G + __popc(ba & lower), e = E + __popc(be & lower);
  if (above) sel[g + (e < need ? e : need)] = u;
  else if (equal && e < need) sel[g + e] = u;
  G += __popc(ba);
  E += __popc(be);
}

// The top `topk` of a row's n causal scores, exactly the CPU's choice (higher score first, equal
// scores by lower position), written in ascending position order. C 1024-thread blocks per row (a
// cluster when C > 1), block b of the row taking its b-th slice of positions (a multiple of 32);
// within a slice chunk c = 32 j + w is held by lane l of warp w in key[j] (slice position
// 1024 j + 32 w + l): every load of a warp is one 128-byte line, and every warp holds
// re = ceil(slice / 1024) <= R chunks or one fewer, however short the row is against the bound R
// was sized for. A radix select over the 32 score bits (4 passes of 8 bits) finds the threshold
// key K and how many keys equal to K are taken (`need`); with C > 1 each pass's histograms meet
// through distributed shared memory, summed by every block alike (the same pick everywhere). The
// position tie-break then needs no passes of its own: the selection is every key above K plus the
// first `need` keys equal to K in position order, placed by ballots within a chunk, one block-wide
// scan of the chunks' (above, equal) counts in chunk order, and the counts of the slices before
// (C > 1). The passes stop early when every key left in the threshold bin is taken (then K is the
// bits found so far, compared under their mask): +0.3 points of decode at 4096 cached (H200, 8
// layers; session 14).
// Before session 58 thread i held positions i re .. i re + re - 1, so a warp's load touched up to
// 32 lines (lanes re keys apart; ~17 at 16384 cached): H100, fp8 8 layers, 16384 cached 2617.4 ->
// 2583.7 us a step, 4096 even (BENCHMARKS "Session 58"). Rows past 32768 keys took one block
// streaming the row from L2 each pass (indexer_topk_stream_kernel: ~88 us a layer at 65536 cached,
// H100), now a cluster of 8 (~15 us a layer there: 3266.2 -> 2665.8 us a step, fp8 8 layers, H100;
// BENCHMARKS "Session 59"), as are rows past 16384 keys. With C = 1 the kernel is the one-block
// kernel as before (the same PTX).
template <int R, int C>
__global__ void __launch_bounds__(1024, 1)
    indexer_topk_reg_kernel(const float* __restrict__ scores, int64_t n_keys, int64_t pos0,
                            const int32_t* __restrict__ pos0_dev, int topk, int32_t* __restrict__ selected,
                            int32_t* __restrict__ counts, bool early) {
  pdl_begin();
  static_assert(R >= 1 && R <= 32 && 1024 * R < 65536, "a chunk count a thread of the scan; 16-bit packed counts");
  // Three histograms in turn: with C > 1 the other blocks read this pass's while this block may
  // already clear the next one (the one read two passes ago, before the last cluster barrier).
  constexpr int kHists = C > 1 ? 3 : 2;
  __shared__ unsigned hist[kHists][256];
  __shared__ unsigned total[C > 1 ? 256 : 1];
  __shared__ int s_bin, s_rem, s_all;
  __shared__ unsigned warp_tot[32];
  __shared__ unsigned chunk_counts[32 * R];  // (above K) << 16 | (equal to K) a chunk, then their exclusive sums
  __shared__ int s_above, s_equal;           // this slice's (C > 1)
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t t = C > 1 ? blockIdx.y : blockIdx.x;  // the grid: C x T, or T
  const int n = int(pos0 + t + 1);
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int rank = C > 1 ? int(blockIdx.x) : 0;  // the block's rank in its cluster
  int32_t* sel = selected + t * topk;
  if (n <= topk) {  // every causal key: sparse equals dense (every block of the row returns here)
    if (rank == 0) {
      for (int u = tid; u < n; u += 1024) sel[u] = u;
      if (tid == 0) counts[t] = n;
    }
    return;
  }
  const int per = ((n + 31) / 32 + C - 1) / C * 32;  // a slice: whole chunks
  const int s0 = C > 1 ? min(rank * per, n) : 0, len = C > 1 ? min(per, n - s0) : n;
  const float* sr = scores + t * n_keys + s0;
  const int re = min(R, (len + 1023) / 1024);
  uint32_t key[R];
#pragma unroll
  for (int j = 0; j < R; ++j) key[j] = j < re ? score_key(sr[min(1024 * j + tid, len - 1)]) : 0u;
  if (tid < 256) hist[0][tid] = 0;
  __syncthreads();
  uint32_t prefix = 0, pmask = 0;
  int rem = topk;
#pragma unroll 1
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    unsigned* cur = hist[pass % kHists];
    // One shared-memory atomic per candidate key. Lanes of a warp combining their counts first
    // (__match_any_sync, one atomic per distinct bin) measured slower: 9.0 us for the kernel at
    // 4096 keys (ncu), and -0.9 points of fp8 decode at 4096 cached against this (H200, session 39).
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (j >= re || 1024 * j + 32 * warp >= len) break;  // this warp's chunk j: past the slice
      const bool in = 1024 * j + tid < len && (key[j] & pmask) == prefix;
      if (in) atomicAdd(&cur[(key[j] >> shift) & 255u], 1u);
    }
    if (tid < 256) hist[(pass + 1) % kHists][tid] = 0;  // with C = 1 last read by the previous pass's scan
    const unsigned* counted = cur;
    if constexpr (C > 1) {
      namespace cg = cooperative_groups;
      const cg::cluster_group cl = cg::this_cluster();
      cl.sync();  // every slice's counts of this pass are in
      if (tid < 256) {
        unsigned sum = 0;
        for (int r = 0; r < C; ++r) sum += cl.map_shared_rank(cur, r)[tid];  // rank order: the same sum everywhere
        total[tid] = sum;
      }
      counted = total;
    }
    __syncthreads();
    if (warp == 0) radix_pick_bin(counted, rem, lane, &s_bin, &s_rem, &s_all);
    __syncthreads();
    prefix |= uint32_t(s_bin) << shift;
    pmask |= 255u << shift;
    rem = s_rem;
    if (early && s_all) break;  // the bin's keys are all taken: no lower bits need deciding
  }
  // Under pmask, prefix is the topk-th largest key K; rem keys equal to K are taken, the lowest
  // positions first (all of them when the passes stopped early).
  const uint32_t K = prefix;
  const int need = rem;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    if (j >= re) break;
    const int u = 1024 * j + tid;
    const uint32_t k = key[j] & pmask;
    const unsigned a = __popc(__ballot_sync(0xffffffffu, u < len && k > K));
    const unsigned e = __popc(__ballot_sync(0xffffffffu, u < len && k == K));
    if (lane == 0) chunk_counts[32 * j + warp] = a << 16 | e;
  }
  __syncthreads();
  // Chunk c = tid's count, summed over the chunks before it (thread order is chunk order).
  const unsigned mine = tid < 32 * re ? chunk_counts[tid] : 0u;
  const unsigned before = block_exclusive_sum_1024(mine, warp_tot, lane, warp);
  if (tid < 32 * re) chunk_counts[tid] = before;
  int G0 = 0, E0 = 0;  // the keys above / equal to K in the slices before this one
  if constexpr (C > 1) {
    if (tid == 1023) s_above = int((before + mine) >> 16), s_equal = int((before + mine) & 0xffffu);
    namespace cg = cooperative_groups;
    const cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    for (int r = 0; r < rank; ++r) G0 += *cl.map_shared_rank(&s_above, r), E0 += *cl.map_shared_rank(&s_equal, r);
  } else {
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < R; ++j) {
    if (j >= re) break;
    const unsigned b = chunk_counts[32 * j + warp];
    int G = G0 + int(b >> 16), E = E0 + int(b & 0xffffu);
    const int u = 1024 * j + tid;
    topk_place_chunk(key[j] & pmask, u < len, s0 + u, K, need, lane, G, E, sel);
  }
  if (rank == 0 && tid == 0) counts[t] = topk;
  if constexpr (C > 1) cooperative_groups::this_cluster().sync();  // no block leaves while another reads its counts
}

// The same selection for rows of any length, past what the register kernels hold (262144 keys on a
// cluster, 32768 on one block):
// every pass reads the row's scores again from L2 (the scores kernel has just written them), and
// lanes of a warp with one bin combine their counts first (most keys of a long row share a few bins
// of the first passes). Warp w walks its own span of the row, a 32nd rounded up to chunks of 32
// positions, kTopkStreamBatch chunks at a time: each lane issues that many loads (one 128-byte line
// a warp each) before using any, so a pass waits on ~n / (1024 kTopkStreamBatch) round trips to L2
// rather than one a chunk; the placement walks the span twice in the same batches (the warp's
// counts, one block-wide scan over the warps, then the chunks placed by ballots), with 32-bit
// counts. Before session 58 a pass loaded one score a lane at a time and the placement walked each
// thread's contiguous run of positions (a warp's load touching 32 lines): H100, 65536 cached,
// 3380.0 -> 3264.9 us a step; the kernel still takes ~80-95 us a layer there, most of it not the
// loads (the trace: BENCHMARKS "Session 58"). Before session 55 such rows took the shared-memory
// kernel (8 passes of 64-bit keys): H200, fp8 8 layers, 32768 cached, 3509 us a step against 1987
// at 16384 (BENCHMARKS "Session 55").
constexpr int kTopkStreamBatch = 16;

__global__ void __launch_bounds__(1024)
    indexer_topk_stream_kernel(const float* __restrict__ scores, int64_t n_keys, int64_t pos0,
                               const int32_t* __restrict__ pos0_dev, int topk, int32_t* __restrict__ selected,
                               int32_t* __restrict__ counts, bool early) {
  pdl_begin();
  constexpr int B = kTopkStreamBatch;
  __shared__ unsigned hist[2][256];
  __shared__ int s_bin, s_rem, s_all;
  __shared__ unsigned long long warp_tot[32];
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t t = blockIdx.x;
  const int n = int(pos0 + t + 1);
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  int32_t* sel = selected + t * topk;
  if (n <= topk) {  // every causal key: sparse equals dense
    for (int u = tid; u < n; u += 1024) sel[u] = u;
    if (tid == 0) counts[t] = n;
    return;
  }
  const float* sr = scores + t * n_keys;
  const int span = ((n + 31) / 32 + 31) / 32 * 32;  // positions a warp walks: a multiple of 32
  const int w0 = min(warp * span, n), w1 = min(w0 + span, n);
  // Loads a batch: lane l's scores at c0 + 32 b + l (clamped into the row; what lies past the span
  // is loaded and not used).
  float v[B];
  auto load_batch = [&](int c0) {
#pragma unroll
    for (int b = 0; b < B; ++b) v[b] = sr[min(c0 + 32 * b + lane, n - 1)];
  };
  if (tid < 256) hist[0][tid] = 0;
  __syncthreads();
  uint32_t prefix = 0, pmask = 0;
  int rem = topk;
#pragma unroll 1
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    unsigned* cur = hist[pass & 1];
    for (int c0 = w0; c0 < w1; c0 += 32 * B) {  // warp-uniform: __match_any_sync sees every lane
      load_batch(c0);
#pragma unroll
      for (int b = 0; b < B; ++b) {
        if (c0 + 32 * b >= w1) break;
        int bin = -1;
        if (c0 + 32 * b + lane < w1) {
          const uint32_t k = score_key(v[b]);
          if ((k & pmask) == prefix) bin = int((k >> shift) & 255u);
        }
        const unsigned same = __match_any_sync(0xffffffffu, bin);
        if (bin >= 0 && lane == __ffs(same) - 1) atomicAdd(&cur[bin], unsigned(__popc(same)));
      }
    }
    if (tid < 256) hist[(pass + 1) & 1][tid] = 0;  // last read by the previous pass's pick
    __syncthreads();
    if (warp == 0) radix_pick_bin(cur, rem, lane, &s_bin, &s_rem, &s_all);
    __syncthreads();
    prefix |= uint32_t(s_bin) << shift;
    pmask |= 255u << shift;
    rem = s_rem;
    if (early && s_all) break;
  }
  const uint32_t K = prefix;
  const int need = rem;
  unsigned above = 0, equal = 0;  // the warp's, in every lane
  for (int c0 = w0; c0 < w1; c0 += 32 * B) {
    load_batch(c0);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (c0 + 32 * b >= w1) break;
      const bool valid = c0 + 32 * b + lane < w1;
      const uint32_t k = score_key(v[b]) & pmask;
      above += __popc(__ballot_sync(0xffffffffu, valid && k > K));
      equal += __popc(__ballot_sync(0xffffffffu, valid && k == K));
    }
  }
  // The warps before this one, in position order: lane 0 carries the warp's (above, equal).
  const unsigned long long mine = lane == 0 ? (static_cast<unsigned long long>(above) << 32) | equal : 0ull;
  const unsigned long long before = __shfl_sync(0xffffffffu, block_exclusive_sum_1024(mine, warp_tot, lane, warp), 0);
  int G = int(before >> 32), E = int(before & 0xffffffffu);
  for (int c0 = w0; c0 < w1; c0 += 32 * B) {
    load_batch(c0);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (c0 + 32 * b >= w1) break;
      const int u = c0 + 32 * b + lane;
      topk_place_chunk(score_key(v[b]) & pmask, u < w1, u, K, need, lane, G, E, sel);
    }
  }
  if (tid == 0) counts[t] = topk;
}

// 16-byte loads along kv_b rows of length L need L a multiple of the vector and an aligned base.
bool rows_vectorizable(const DevW& w, int64_t L) {
  const int n = 16 / (w.dt == W_F32 ? 4 : w.dt == W_FP8 ? 1 : 2);
  return L % n == 0 && reinterpret_cast<uintptr_t>(w.w) % 16 == 0;
}

}  // namespace

static_assert(kQK == CudaBufferSizes::kDecodeShortSplitKeys, "the decode splits' rule (cuda_backend.h) counts these");

// mla_decode_fused_tc_kernel for the fast modes' long key lists (on; VIREO_FUSED_ATTENTION=0 or
// set_fused_decode_attention(false): the scores and p x latent kernels, for A/B runs and tests).
static bool g_fused_attention = env_switch("VIREO_FUSED_ATTENTION");
void set_fused_decode_attention(bool on) { g_fused_attention = on; }

bool mla_decode_fast(const DecodeAttnArgs& a, cudaStream_t st) {
  const int64_t kvw = a.kvw, L = a.L;
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  const int P = score_tile_stride(int(kvw));
  // The tiles' space also holds the 4 column quarters' sums at the end.
  const size_t smem_s = size_t(std::max((kSH + kSK) * P, 8 * kSH * (kSK + 1))) * 4 + kSK * 4;
  const size_t smem_p = size_t(kPH * kPS + kPK * kPC) * 4 + kPK * 4;
  // The tensor-core form's padded rows, and at least 120 KB: one block an SM (see its launch).
  const size_t smem_ptc = std::max<size_t>(size_t(kPH * (kPK + 8) + kPK * (kPC + 4)) * 4 + kPK * 4, 120 * 1024);
  if (!a.scores || a.max_keys <= 0 || L % kPC != 0 || kvw % 4 != 0 || a.qw % 4 != 0 || a.nope % 4 != 0 ||
      !aligned(a.qlat) || !aligned(a.q) || !aligned(a.kv) || !rows_vectorizable(a.kvb, L) ||
      smem_s > size_t(227) * 1024)
    return false;
  // 512 threads (KQ = KG = 8) for both: measured against 256 (KQ = KG = 4) at GLM-5 shapes, 2048
  // keys, -3.3 us per layer (docs/notes/cuda-decode-attention.md); one block per SM either way.
  constexpr int KQ = 8, KG = 8;
  static bool configured = false;
  if (!configured) {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(mla_decode_scores_kernel<KQ>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          227 * 1024));
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(mla_decode_pv_kernel<KG, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(smem_p)));
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(mla_decode_pv_kernel<KG, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(smem_ptc)));
    configured = true;
  }
  const int H = int(a.H), nhg = int((a.H + kPH - 1) / kPH);
  const float scale2 = float(double(a.scale) * 1.4426950408889634);  // base-2 scores: see the top
  const int64_t short_splits = decode_short_splits(a.max_keys);
  const size_t smem_q = size_t((kQH + kQK) * P + kQH * kQK + kQK) * 4;
  static const bool short_on = env_switch("VIREO_SHORT_ATTENTION");  // 0: the long kernels always (A/B runs)
  int nks = 0;
  // The fused kernel's splits, rounded up to whole pairs; the partials it writes: half as many.
  const int64_t fused_splits = ((a.max_keys + kFK - 1) / kFK + kFCL - 1) / kFCL * kFCL;
  if (short_on && short_splits > 0 && short_splits <= a.nsplit && smem_q <= size_t(227) * 1024) {
    nks = int(short_splits);
    allow_dynamic_smem<mla_decode_short_kernel, 227 * 1024>();
    launch(mla_decode_short_kernel, dim3(unsigned(nks), unsigned((a.H + kQH - 1) / kQH), unsigned(a.T)), 256, smem_q,
           st, a.qlat, a.q, H, int(a.qw), int(a.nope), int(L), a.kv, int(kvw), a.pos0, a.pos0_dev, a.sel, a.counts,
           a.sel_stride, scale2, nks, a.opart, a.mpart, a.lpart);
    VIREO_CUDA_LAUNCHED();
  } else if (g_fused_attention && a.tc && kvw % 16 == 0 && L % 8 == 0 && L <= kvw && fused_splits / kFCL <= a.nsplit &&
             fused_attn_smem(int(kvw)) <= size_t(227) * 1024) {
    allow_dynamic_smem<mla_decode_fused_tc_kernel, 227 * 1024>();
    launch(mla_decode_fused_tc_kernel, dim3(unsigned(fused_splits), unsigned((a.H + kFH - 1) / kFH), unsigned(a.T)),
           kFWarps * 32, fused_attn_smem(int(kvw)), st, a.qlat, a.q, H, int(a.qw), int(a.nope), int(L), a.kv, int(kvw),
           a.pos0, a.pos0_dev, a.sel, a.counts, a.sel_stride, scale2, int(fused_splits), a.opart, a.mpart, a.lpart);
    VIREO_CUDA_LAUNCHED();
    nks = int(fused_splits / kFCL);
  } else {
    const int64_t sstride = (a.max_keys + kSK - 1) / kSK * kSK;
    nks = int((a.max_keys + kPK - 1) / kPK);
    // At most kScoreTiles blocks per (head group, query), each looping over every kScoreTiles-th
    // key tile: a recorded step sizes the launch for the cache capacity (the length comes at run
    // time), and one block per tile put a short context's few live tiles among two waves of empty
    // blocks of ~150 KB shared memory each (1 per SM).
    constexpr int64_t kScoreTiles = 64;
    const dim3 sgrid(unsigned(std::min(sstride / kSK, kScoreTiles)), unsigned((a.H + kSH - 1) / kSH), unsigned(a.T));
    // The fast modes' scores on the tensor cores (mla_decode_scores_tc_kernel).
    const size_t smem_stc = size_t((kSH + kSK) * tc_tile_stride(int(kvw)) + kTcRed) * 4 + kSK * 4;
    if (a.tc && kvw % 16 == 0 && smem_stc <= size_t(227) * 1024) {
      allow_dynamic_smem<mla_decode_scores_tc_kernel, 227 * 1024>();
      launch(mla_decode_scores_tc_kernel, sgrid, kTcWarps * 32, smem_stc, st, a.qlat, a.q, H, int(a.qw), int(a.nope),
             int(L), a.kv, int(kvw), a.pos0, a.pos0_dev, a.sel, a.counts, a.sel_stride, scale2, sstride, a.scores);
    } else {
      launch(mla_decode_scores_kernel<KQ>, sgrid, 64 * KQ, smem_s, st, a.qlat, a.q, H, int(a.qw), int(a.nope), int(L),
             a.kv, int(kvw), a.pos0, a.pos0_dev, a.sel, a.counts, a.sel_stride, scale2, sstride, a.scores);
    }
    VIREO_CUDA_LAUNCHED();
    const dim3 pgrid(unsigned(L / kPC), unsigned(nks), unsigned(a.T * nhg));
    // The fast modes' p x latent on the tensor cores too. Its form takes 54 registers a thread
    // (the f32 form 70), so two of its blocks would fit an SM and the scheduler packed them: 10.8 ->
    // 12.9 us a layer (session 38). Asking for more than half the SM's shared memory holds it to one
    // block an SM: +0.9 points of fp8 decode at 4096 cached over the f32 form (session 39).
    if (a.tc)
      launch(mla_decode_pv_kernel<KG, true>, pgrid, 64 * KG, smem_ptc, st, a.scores, sstride, H, nhg, int(L), a.kv,
             int(kvw), a.pos0, a.pos0_dev, a.sel, a.counts, a.sel_stride, nks, a.opart, a.mpart, a.lpart);
    else
      launch(mla_decode_pv_kernel<KG, false>, pgrid, 64 * KG, smem_p, st, a.scores, sstride, H, nhg, int(L), a.kv,
             int(kvw), a.pos0, a.pos0_dev, a.sel, a.counts, a.sel_stride, nks, a.opart, a.mpart, a.lpart);
    VIREO_CUDA_LAUNCHED();
  }
  static const bool wide_merge = [] {
    const char* e = std::getenv("VIREO_WUV_ROWS");
    return !(e && std::atoi(e) == 32);
  }();
  const size_t smem_m = size_t(L + 3 * nks) * 4;
  const int hw = int(a.hw), nope = int(a.nope), vd = int(a.vd);
  auto launch_merge = [&](auto kernel, int warps, int rows) {
    const dim3 grid(unsigned(a.H), unsigned((a.vd + rows - 1) / rows), unsigned(a.T));
    launch(kernel, grid, 32 * warps, smem_m, st, a.opart, a.mpart, a.lpart, nks, H, int(L), a.kvb, hw, nope, vd, a.out);
  };
  auto merge = [&](auto dt) {
    constexpr int DT = decltype(dt)::value;
    if constexpr (DT != W_F32) {  // (f32 W_UV, the test models': the wide form would spill)
      if (wide_merge)
        return launch_merge(mla_decode_merge_wuv_kernel<DT, kWuvRowsPerWarp, kWuvWarps>, kWuvWarps,
                            kWuvWarps * kWuvRowsPerWarp);
    }
    launch_merge(mla_decode_merge_wuv_kernel<DT, 4, 8>, 8, 32);
  };
  switch (a.kvb.dt) {
    case W_F32: merge(std::integral_constant<int, W_F32>{}); break;
    case W_BF16: merge(std::integral_constant<int, W_BF16>{}); break;
    case W_F16: merge(std::integral_constant<int, W_F16>{}); break;
    default: merge(std::integral_constant<int, W_FP8>{}); break;
  }
  VIREO_CUDA_LAUNCHED();
  return true;
}

// VIREO_TOPK_REG32=0 (with VIREO_TOPK_CLUSTER=0): rows of 16385-32768 keys on the shared-memory
// top-k (indexer_topk_kernel), as before session 55 (A/B runs).
static bool topk_reg32() {
  static const bool on = env_switch("VIREO_TOPK_REG32");
  return on;
}

// VIREO_TOPK_STREAM=0: longer rows on the shared-memory top-k, as before session 55 (A/B runs).
static bool topk_stream() {
  static const bool on = env_switch("VIREO_TOPK_STREAM");
  return on;
}

// VIREO_TOPK_CLUSTER=0: rows of 16385 .. 32768 keys on one block (32 keys a thread), longer ones on
// the one-block streaming kernel, as before session 59 (A/B runs; the same selection).
static bool topk_cluster() {
  static const bool on = env_switch("VIREO_TOPK_CLUSTER");
  return on;
}

// Rows of 16385 .. 262144 keys: each over a cluster of kTopkCluster blocks, a slice each held in
// registers (R keys a thread for the slice's share of the bound). Shorter rows stay on one block:
// at 4096 cached (bounds of 8192 keys) a cluster of 8 holding 2 keys a thread cost 2.5 us a layer
// more than one block holding 8; at 16384 cached (bounds of 32768) it saved 5.8 (H100, fp8 8
// layers, BENCHMARKS "Session 59").
constexpr int kTopkCluster = 8;
template <typename... Args>
void launch_topk_cluster(int64_t bound, int64_t T, cudaStream_t st, Args... args) {
  auto go = [&](auto kernel) {
    launch_clustered(kTopkCluster, kernel, dim3(kTopkCluster, unsigned(T)), 1024, 0, st, args...);
  };
  const int64_t slice = (bound + kTopkCluster - 1) / kTopkCluster;
  if (slice <= 1024 * 4) go(indexer_topk_reg_kernel<4, kTopkCluster>);
  else if (slice <= 1024 * 8) go(indexer_topk_reg_kernel<8, kTopkCluster>);
  else if (slice <= 1024 * 16) go(indexer_topk_reg_kernel<16, kTopkCluster>);
  else go(indexer_topk_reg_kernel<32, kTopkCluster>);
}

bool indexer_topk_fast(const float* scores, int64_t T, int64_t n_keys, int64_t pos0, const int32_t* pos0_dev,
                       int64_t topk, int32_t* selected, int32_t* counts, cudaStream_t st) {
  // n_keys bounds every row's causal count (pos0 + T with host positions, the bound with run-time ones).
  const int64_t bound = std::max(n_keys, pos0 + T);
  if (topk < 1) return false;
  static const bool early = env_switch("VIREO_TOPK_EARLY");  // 0: every pass (A/B runs; the same selection)
  if (bound <= 1024 * 4)
    launch(indexer_topk_reg_kernel<4, 1>, unsigned(T), 1024, 0, st, scores, n_keys, pos0, pos0_dev, int(topk), selected,
           counts, early);
  else if (bound <= 1024 * 8)
    launch(indexer_topk_reg_kernel<8, 1>, unsigned(T), 1024, 0, st, scores, n_keys, pos0, pos0_dev, int(topk), selected,
           counts, early);
  else if (bound <= 1024 * 16)
    launch(indexer_topk_reg_kernel<16, 1>, unsigned(T), 1024, 0, st, scores, n_keys, pos0, pos0_dev, int(topk),
           selected, counts, early);
  else if (bound <= kTopkCluster * 1024 * 32 && T <= 65535 && topk_cluster())  // T: the grid's y
    launch_topk_cluster(bound, T, st, scores, n_keys, pos0, pos0_dev, int(topk), selected, counts, early);
  else if (bound <= 1024 * 32 && topk_reg32())
    launch(indexer_topk_reg_kernel<32, 1>, unsigned(T), 1024, 0, st, scores, n_keys, pos0, pos0_dev, int(topk),
           selected, counts, early);
  else if (topk_stream() && bound < (int64_t(1) << 31))
    launch(indexer_topk_stream_kernel, unsigned(T), 1024, 0, st, scores, n_keys, pos0, pos0_dev, int(topk), selected,
           counts, early);
  else return false;
  VIREO_CUDA_LAUNCHED();
  return true;
}

}  // namespace vireo::cuda
