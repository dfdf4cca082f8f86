// Prefill attention for the fast math mode (CudaGemmMode::Bf16): one bf16 tensor-core pass.
//
// The exact kernel (mla_prefill_tc_kernel, cuda_attention.cu) splits every operand into bf16
// hi + lo and runs 3 mma passes; it also loads K and V as scalar f32 from the [N, H, hw] kvx rows
// with per-element index math, converting in the loop, with no overlap of loads and math. Here
// each operand is rounded to bf16 once (as most engines do; ~2^-9 relative per operand, NMSE
// ~1e-5), products accumulate in f32 and the softmax runs online in f32 (FlashAttention-2).
//
// 1. No conversion pass over K and V: in this mode the backend's kv_b GEMM writes its k_nope | v
//    rows ([N, H, hw]) as bf16 directly (cuBLASLt, f32 accumulation, bf16 output), and k_rope
//    (shared by all heads) is rounded into a small [N, rope] array (prefill_fast_rope_kernel).
//    The main kernel gathers a tile's K row (k_nope | k_rope | 0 up to D) and V row (v | 0) per key
//    with 16-byte cp.async pieces (zero-filled beyond qw / vd and for keys >= n_keys, so padded
//    products add 0 and P V never meets garbage); each key row of a head is 384 + 512 contiguous
//    bytes at GLM-5 shapes, so the gather costs no DRAM efficiency. (A first version converted
//    the f32 expansion into head-major bf16 K / V arrays: 0.2 ms per layer at T = 4096, reading
//    470 MB and writing 268 MB, 7% of the total; writing bf16 from the GEMM also halves its
//    output traffic and the scratch.) D: max(qw, vd) rounded up to 64 / 128 / 256.
// 2. The main kernel (prefill_fast_kernel): a block owns 128 queries of one head (8 warps x 16
//    rows); Q is converted from f32 into shared memory once. It walks 64-key tiles; the next
//    needed tile's K and V are fetched with cp.async into the other half of a double buffer while
//    the current one is used (one __syncthreads per tile). Per warp: S [16, 64] = Q K^T in
//    registers (ldmatrix + mma.sync.m16n8k16 bf16, f32 accumulate), causal / n_keys / DSA masks,
//    online softmax in base 2 (scale * log2 e folded into one FMA), then P is re-packed from the
//    S accumulators straight into A fragments (the accumulator layout of m16n8 equals the A
//    layout of m16k16, no shared-memory round trip) and O [16, D] += P V with V fragments from
//    ldmatrix.trans of the row-major [key][D] tile.
//
// Why 128 x 64 tiles, 8 warps, 1 block per SM (GLM-5: D = 256):
//  - Registers: O is 16 x 256 f32 per warp = 128 per thread, S 32, fragments and indices the rest:
//    ~200-240 per thread, so at most 8 warps fit one SM's 64K registers whatever the grouping.
//    Splitting vd over two blocks would halve O but repeat the whole Q K^T (half the FLOPs), so
//    one block holds all of vd.
//  - Shared memory: Q 128 x 256 + 2 x (K + V) 64 x 256, bf16, rows padded by 16 bytes = 198 KB.
//    Rows of 512 (+16) bytes: the 8 row addresses of an ldmatrix 8x8 land 16 bytes apart mod 128,
//    i.e. on all 32 banks (no swizzle needed). 64-query blocks would not fit 2 per SM with the
//    double buffer, so they would only double the K/V traffic per FLOP.
//  - The bound: every warp reads the whole K and V tile from shared memory (64 ldmatrix.x4 each
//    per tile, 16 rows of A per B fragment): 8 warps x 72 KB per 8.4 MFLOP tile at 128 B/clock
//    is ~4600 clocks vs ~3100 of mma.sync issue: ~1800 FLOP/clock/SM, ~470 TFLOP/s on 132 SMs
//    at 1.98 GHz. Expected ~50-60% of that with the softmax and barriers: ~250 TFLOP/s, i.e. for
//    1.1e12 FLOP (2 layers, T = 4096, causal) ~4.4 ms. Measured on an H200 (H 64, T 4096, pos0 0,
//    CudaFastAttention.TimingGlm5): 2.57 ms per layer, 214 TFLOP/s counting causal keys; with a
//    DSA selection of 2048 keys for rows >= 2048: 2.94 ms (few tiles are empty for a 128-query
//    block, the masking runs on every tile). The exact split kernel: 14.6 ms. Past this design's
//    bound only wgmma (B read from shared memory once per warpgroup of 64 rows, no ldmatrix per
//    warp) cuts the per-FLOP shared-memory traffic.
//  - Grid: (query tiles, heads) with the longest (last) query tiles first and all tiles of a head
//    adjacent, so the blocks on the chip at once share a few heads' K/V in L2.
// Tiles no query of the block selected (DSA) are skipped when choosing the next tile to fetch; a
// warp skips the math of a tile past its rows' causal limit or with none of its rows' keys.
#include <algorithm>
#include <climits>

#include "backend/cuda/cuda_attention.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_wgmma.cuh"

namespace vireo::cuda {

namespace {

constexpr int kFBQ = 128;               // queries per block
constexpr int kFBK = 64;                // keys per tile
constexpr int kFThreads = kFBQ / 16 * 32;  // one warp per 16 query rows

// Head dims the kernels are built for (K and V padded with zeros to D); 0 when none fits.
int fast_dim(const PrefillAttnArgs& a) {
  const int64_t m = std::max(a.qw, a.vd);
  return m <= 64 ? 64 : m <= 128 ? 128 : m <= 256 ? 256 : 0;
}
template <int D> constexpr size_t fast_smem_bytes() { return size_t(kFBQ + 4 * kFBK) * (D + 8) * 2; }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// k_rope (kv[u, L : L + rope], shared by all heads) as bf16 [n_keys][rope].
__global__ void prefill_fast_rope_kernel(const float* __restrict__ kv, int64_t kvw, int64_t L, int64_t rope,
                                         int64_t n, __nv_bfloat16* __restrict__ out) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * rope; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(kv[(i / rope) * kvw + L + i % rope]);
}

// --- Pieces shared by the two fast kernels (mma.sync and wgmma) ---------------------------------

// One thread's share of fetching a 64-key tile: 16-byte pieces of K rows (k_nope | k_rope | 0 up
// to D) and V rows (v | 0), all in one column xc of rows rf, rf + kRStep, ..: the source addresses
// are a fixed base plus a fixed stride per key, set up once (with 64-bit index math per piece the
// mma.sync kernel took 2.88 ms instead of 2.57 at GLM-5 shapes, T = 4096: the loads' instructions
// compete with the math for issue slots). Keys >= n_keys are zero-filled (their scores are
// masked, but P V must not meet garbage: 0 * NaN). The kernel gives the shared-memory offsets.
template <int D, int THREADS>
struct TileFetch {
  static constexpr int CH = D / 8;              // 16-byte chunks per K / V row
  static constexpr int kRStep = THREADS / CH;   // rows one pass of the block covers
  static_assert(THREADS % CH == 0 && kFBK % kRStep == 0, "tile fetch shape");
  int xc, rf;
  bool kcol, vcol;
  int64_t kstride, vstride;
  const __nv_bfloat16 *kbase, *vbase, *any;
  __device__ TileFetch(int tid, int h, int H, int qw, int nope, int vd, int hw, const __nv_bfloat16* kvxb,
                       const __nv_bfloat16* ropeb) {
    xc = (tid % CH) * 8;
    rf = tid / CH;
    kcol = xc < qw;
    vcol = xc < vd;
    vstride = int64_t(H) * hw;
    kstride = xc < nope ? vstride : int64_t(qw - nope);
    kbase = xc < nope ? kvxb + int64_t(h) * hw + xc : ropeb + (xc - nope);
    vbase = kvxb + int64_t(h) * hw + nope + xc;
    any = kvxb;
  }
  // Tile kt's pieces of this thread: row rf + i kRStep goes to kdst / vdst + i * dstep (bytes).
  __device__ void issue(int kt, int n_keys, uint32_t kdst, uint32_t vdst, uint32_t dstep) const {
    const int u0 = kt * kFBK + rf;
    const __nv_bfloat16* kp = kbase + int64_t(u0) * kstride;
    const __nv_bfloat16* vp = vbase + int64_t(u0) * vstride;
#pragma unroll
    for (int i = 0; i < kFBK / kRStep; ++i) {
      const bool in = u0 + i * kRStep < n_keys, kok = in && kcol, vok = in && vcol;
      cp_async16_zfill(kdst + uint32_t(i) * dstep, kok ? kp + i * kRStep * kstride : any, kok);
      cp_async16_zfill(vdst + uint32_t(i) * dstep, vok ? vp + i * kRStep * vstride : any, vok);
    }
    cp_async_commit();
  }
};

// This thread's share of "does any query of the block (q0 .. q0 + 127) select a key of tile
// kt": one mask word (query q0 + tid / 2, word 2 kt + tid % 2); nonzero = yes. The block ORs
// the shares with __syncthreads_or (every thread of the 256-thread block). The kernels load the
// share of the tile after next one tile ahead: loaded right before the reduction, its L2
// latency stalled the whole block once per tile (ncu: long-scoreboard the top stall reason).
__device__ __forceinline__ uint32_t need_word(const uint32_t* __restrict__ mask, int64_t mwords, int T, int q0,
                                              int tid, int kt) {
  const int t = q0 + (tid >> 1);
  const int64_t w = int64_t(kt) * 2 + (tid & 1);
  return t < T && w < mwords ? mask[int64_t(t) * mwords + w] : 0u;
}
// The first tile >= kt some query of the block selected (kt_end: none); a barrier per tile tried.
__device__ __forceinline__ int next_needed_tile(const uint32_t* __restrict__ mask, int64_t mwords, int T, int q0,
                                                int tid, int kt, int kt_end) {
  if (!mask) return kt;
  while (kt < kt_end && !__syncthreads_or(need_word(mask, mwords, T, q0, tid, kt) != 0u)) ++kt;
  return kt;
}
// The block's Q rows q0 .. q0 + 127 of head h as bf16 into shared memory (zero beyond T and qw):
// elements d .. d + 3 of row r at base + dst(r, d) (8 bytes). 16-byte loads, eight in flight per
// thread (two scalar loads at a time made this prologue a long-scoreboard stall per block).
template <int D, int THREADS, class Dst>
__device__ __forceinline__ void load_q(const float* __restrict__ q, int T, int H, int h, int qw, int q0, int tid,
                                       unsigned char* base, Dst dst) {
  constexpr int Q4 = D / 4, N = kFBQ * Q4;
#pragma unroll 1
  for (int i0 = tid; i0 < N; i0 += 8 * THREADS) {
    float4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = i0 + j * THREADS, r = i / Q4, d = 4 * (i % Q4), t = q0 + r;
      v[j] = i < N && t < T && d < qw ? *reinterpret_cast<const float4*>(q + (int64_t(t) * H + h) * qw + d)
                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = i0 + j * THREADS, r = i / Q4, d = 4 * (i % Q4);
      if (i < N) *reinterpret_cast<uint2*>(base + dst(r, d)) = make_uint2(pack_bf16x2(v[j].x, v[j].y), pack_bf16x2(v[j].z, v[j].w));
    }
  }
}
// This thread's rows' mask words of tile kt (row a: w[0], w[1]; row b: w[2], w[3]).
__device__ __forceinline__ void load_words(const uint32_t* __restrict__ mask, int64_t mwords, int T, int ta, int tb,
                                           int kt, uint32_t (&w)[4]) {
  if (!mask) return;
  const int64_t w0 = int64_t(kt) * 2;
  const bool w1ok = w0 + 1 < mwords;
  w[0] = ta < T ? mask[int64_t(ta) * mwords + w0] : 0u;
  w[1] = ta < T && w1ok ? mask[int64_t(ta) * mwords + w0 + 1] : 0u;
  w[2] = tb < T ? mask[int64_t(tb) * mwords + w0] : 0u;
  w[3] = tb < T && w1ok ? mask[int64_t(tb) * mwords + w0 + 1] : 0u;
}

// The rows' running softmax state (raw-score maxima, partial row sums of this thread's columns).
struct RowState {
  float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f;
};
// One tile's scores s [16 x 64 per warp, m16n8 accumulator layout: element e of tile nt is row ta
// (e < 2) or tb, key k0 + nt * 8 + 2 tq + (e & 1)]: causal / n_keys / DSA masks (`check`: some
// key of the tile may be past a row's limit), then the online softmax step in base 2 (scale *
// log2 e folded into one FMA): s becomes p, the state moves, and alpha (the factors the rows'
// earlier sums and O are rescaled by; exactly 1 where the maximum did not move) comes back.
__device__ __forceinline__ void softmax_tile(float (&s)[8][4], int k0, int lim_a, int lim_b, bool check,
                                             const uint32_t* mask, const uint32_t (&cw)[4], int tq, float sl2,
                                             RowState& st, float& alpha_a, float& alpha_b) {
  if (mask || check) {
    // Relative to this thread's first column (k0 + 2 tq), so every per-element shift and compare
    // is by a constant: key k0 + 2 tq + c is bit c % 32 of the pre-shifted word of its half.
    // The causal limit becomes a bit mask too (bits 0 .. limit), ANDed with the DSA words: one
    // bit test per element.
    auto upto = [](int l) -> uint32_t { return l >= 31 ? ~0u : l < 0 ? 0u : (2u << l) - 1u; };
    const int ra = lim_a - k0 - 2 * tq, rb = lim_b - k0 - 2 * tq;
    uint32_t ka0 = upto(ra), ka1 = upto(ra - 32), kb0 = upto(rb), kb1 = upto(rb - 32);
    if (mask) {
      ka0 &= cw[0] >> (2 * tq);
      ka1 &= cw[1] >> (2 * tq);
      kb0 &= cw[2] >> (2 * tq);
      kb1 &= cw[3] >> (2 * tq);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t keep = e < 2 ? (nt < 4 ? ka0 : ka1) : (nt < 4 ? kb0 : kb1);
        if (!((keep >> ((nt & 3) * 8 + (e & 1))) & 1u)) s[nt][e] = -INFINITY;
      }
  }
  float mxa = st.ma, mxb = st.mb;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    mxa = fmaxf(mxa, fmaxf(s[nt][0], s[nt][1]));
    mxb = fmaxf(mxb, fmaxf(s[nt][2], s[nt][3]));
  }
  mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
  mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
  mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
  mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
  // Reference points in the scaled log2 domain; 0 while a row has seen no key (then every p is
  // exp2(-inf) = 0 and alpha too, so nothing changes).
  const float ra = mxa == -INFINITY ? 0.0f : mxa * sl2, rb = mxb == -INFINITY ? 0.0f : mxb * sl2;
  alpha_a = mxa == st.ma ? 1.0f : exp2f(fmaf(st.ma, sl2, -ra));
  alpha_b = mxb == st.mb ? 1.0f : exp2f(fmaf(st.mb, sl2, -rb));
  st.ma = mxa;
  st.mb = mxb;
  float sa = 0.0f, sb = 0.0f;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    s[nt][0] = exp2f(fmaf(s[nt][0], sl2, -ra));
    s[nt][1] = exp2f(fmaf(s[nt][1], sl2, -ra));
    s[nt][2] = exp2f(fmaf(s[nt][2], sl2, -rb));
    s[nt][3] = exp2f(fmaf(s[nt][3], sl2, -rb));
    sa += s[nt][0] + s[nt][1];
    sb += s[nt][2] + s[nt][3];
  }
  st.la = st.la * alpha_a + sa;
  st.lb = st.lb * alpha_b + sb;
}
// O's rows scaled by alpha; skipped when no row of the warp moved its maximum (most tiles once
// the maxima settle: 128 multiplies per thread saved).
template <int NT>
__device__ __forceinline__ void rescale_rows(float (&o)[NT][4], float alpha_a, float alpha_b) {
  if (__any_sync(0xffffffffu, alpha_a != 1.0f || alpha_b != 1.0f)) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      o[i][0] *= alpha_a;
      o[i][1] *= alpha_a;
      o[i][2] *= alpha_b;
      o[i][3] *= alpha_b;
    }
  }
}
// P's 16 keys kk * 16 .. + 15 as an m16k16 A fragment: the m16n8 accumulator layout of two
// 8-key tiles equals the A layout, so no shared-memory round trip.
__device__ __forceinline__ void p_fragment(const float (&s)[8][4], int kk, uint32_t (&a)[4]) {
  a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}
// out[ta | tb, h, :] = O / l (the row sums reduced over the 4 threads of a row first).
template <int NT>
__device__ __forceinline__ void write_rows(const float (&o)[NT][4], RowState st, int T, int H, int h, int vd, int ta,
                                           int tb, int tq, float* __restrict__ out) {
  st.la += __shfl_xor_sync(0xffffffffu, st.la, 1);
  st.la += __shfl_xor_sync(0xffffffffu, st.la, 2);
  st.lb += __shfl_xor_sync(0xffffffffu, st.lb, 1);
  st.lb += __shfl_xor_sync(0xffffffffu, st.lb, 2);
  const float ia = st.la > 0.0f ? 1.0f / st.la : 0.0f, ib = st.lb > 0.0f ? 1.0f / st.lb : 0.0f;
  float* oa = ta < T ? out + (int64_t(ta) * H + h) * vd : nullptr;
  float* ob = tb < T ? out + (int64_t(tb) * H + h) * vd : nullptr;
  const bool pairs = (vd & 1) == 0 && (reinterpret_cast<uintptr_t>(out) & 7u) == 0;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int c = i * 8 + 2 * tq;
    if (c >= vd) continue;
    if (pairs) {
      if (oa) *reinterpret_cast<float2*>(oa + c) = make_float2(o[i][0] * ia, o[i][1] * ia);
      if (ob) *reinterpret_cast<float2*>(ob + c) = make_float2(o[i][2] * ib, o[i][3] * ib);
    } else {
      if (oa) oa[c] = o[i][0] * ia;
      if (ob) ob[c] = o[i][2] * ib;
      if (c + 1 < vd) {
        if (oa) oa[c + 1] = o[i][1] * ia;
        if (ob) ob[c + 1] = o[i][3] * ib;
      }
    }
  }
}

// This thread's place in a 128-query block: its warp's 16 rows from r0, its rows ta and tb (g
// and g + 8 of the warp), the last key each of them sees (-1: no such row; the warp's first row
// sees the fewest), and the block's end in key tiles (the longest rows' blocks run first).
struct BlockRows {
  int tid, warp, g, tq, h, q0, r0, ta, tb, kt_end, lim_a, lim_b, warp_lo;
  __device__ BlockRows(int T, int n_keys, int pos0) {
    tid = int(threadIdx.x);
    warp = tid >> 5;
    g = (tid & 31) >> 2;
    tq = tid & 3;
    h = int(blockIdx.x);
    q0 = int(gridDim.y - 1 - blockIdx.y) * kFBQ;
    r0 = q0 + warp * 16;
    ta = r0 + g;
    tb = ta + 8;
    kt_end = (min(n_keys, pos0 + min(T, q0 + kFBQ)) + kFBK - 1) / kFBK;
    lim_a = ta < T ? min(n_keys - 1, pos0 + ta) : -1;
    lim_b = tb < T ? min(n_keys - 1, pos0 + tb) : -1;
    warp_lo = r0 < T ? min(n_keys - 1, pos0 + r0) : -1;
  }
};
// The walk over the key tiles some query of the block selected (every tile without DSA): the
// thread's rows' mask words of the next tile and its share of the vote on the tile after it are
// loaded a tile ahead, so neither load's latency stalls the block.
struct TileWalk {
  const uint32_t* mask;
  int64_t mwords;
  int T;
  const BlockRows& b;
  uint32_t nw[4] = {~0u, ~0u, ~0u, ~0u}, cand = 1u;
  // The first tile (b.kt_end: none); `fetch(kt)` issues its loads.
  template <class Fetch>
  __device__ int first(Fetch fetch) {
    const int kt = next_needed_tile(mask, mwords, T, b.q0, b.tid, 0, b.kt_end);
    if (kt < b.kt_end) prefetch(kt, fetch);
    return kt;
  }
  // The tile after kt (a block-wide vote when DSA may skip it).
  __device__ int next(int kt) {
    int nxt = kt + 1;
    if (mask && nxt < b.kt_end && !__syncthreads_or(cand != 0u))
      nxt = next_needed_tile(mask, mwords, T, b.q0, b.tid, nxt + 1, b.kt_end);
    return nxt;
  }
  template <class Fetch>
  __device__ void prefetch(int kt, Fetch fetch) {
    fetch(kt);
    load_words(mask, mwords, T, b.ta, b.tb, kt, nw);
    if (mask && kt + 1 < b.kt_end) cand = need_word(mask, mwords, T, b.q0, b.tid, kt + 1);
  }
};

template <int D>
__global__ void __launch_bounds__(kFThreads, 1) prefill_fast_kernel(
    const float* __restrict__ q, int T, int H, int qw, int nope, int vd, const __nv_bfloat16* __restrict__ kvxb,
    int hw, const __nv_bfloat16* __restrict__ ropeb, int n_keys, int pos0, const uint32_t* __restrict__ mask,
    int64_t mwords, float sl2, float* __restrict__ out) {
  pdl_begin();
  constexpr int RS = D + 8;      // shared row stride in bf16 (16-byte pad: conflict-free ldmatrix)
  constexpr int NT = D / 8;      // 8-column tiles of O
  extern __shared__ __align__(16) unsigned char fast_smem[];
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(fast_smem);  // [kFBQ][RS]
  __nv_bfloat16* Ks = Qs + kFBQ * RS;                                 // [2][kFBK][RS]
  __nv_bfloat16* Vs = Ks + 2 * kFBK * RS;                             // [2][kFBK][RS]
  const BlockRows b(T, n_keys, pos0);
  const int tid = b.tid, warp = b.warp, lane = tid & 31, tq = b.tq, h = b.h, q0 = b.q0;
  const int warp_hi = b.r0 < T ? min(n_keys - 1, pos0 + min(T - 1, b.r0 + 15)) : -1;
  const TileFetch<D, kFThreads> fetch(tid, h, H, qw, nope, vd, hw, kvxb, ropeb);
  const uint32_t soff = uint32_t(fetch.rf * RS + fetch.xc) * 2, dstep = uint32_t(fetch.kRStep * RS * 2);
  auto load_tile = [&](int kt, int buf) {
    fetch.issue(kt, n_keys, smem_u32(Ks + buf * kFBK * RS) + soff, smem_u32(Vs + buf * kFBK * RS) + soff, dstep);
  };
  TileWalk walk{mask, mwords, T, b};
  int kt = walk.first([&](int k) { load_tile(k, 0); });  // in flight while Q is converted
  load_q<D, kFThreads>(q, T, H, h, qw, q0, tid, fast_smem, [](int r, int d) { return (r * RS + d) * 2; });

  float o[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  RowState st;
  // ldmatrix row addresses (see the fragment layouts of m16n8k16): A = Q rows lane % 16, columns
  // +8 for lanes >= 16; B of S = K rows (keys) lane % 8 (+8 for lanes >= 16), columns +8 for
  // lanes 8-15 and 24-31; B of O = V rows (keys) lane % 16, columns +8 for lanes >= 16 (.trans).
  const uint32_t qaddr = smem_u32(Qs + (warp * 16 + (lane & 15)) * RS + (lane >> 4) * 8);
  const int koff = ((lane & 7) + ((lane >> 4) << 3)) * RS + ((lane >> 3) & 1) * 8;
  const int voff = (lane & 15) * RS + (lane >> 4) * 8;

  int buf = 0;
  while (kt < b.kt_end) {
    const int nxt = walk.next(kt);
    const uint32_t cw[4] = {walk.nw[0], walk.nw[1], walk.nw[2], walk.nw[3]};
    cp_async_wait_all();
    __syncthreads();  // tile kt (and Q) visible to all; every warp is done with buffer buf ^ 1
    if (nxt < b.kt_end) walk.prefetch(nxt, [&](int k) { load_tile(k, buf ^ 1); });
    const int k0 = kt * kFBK;
    bool work = k0 <= warp_hi;
    if (mask) work = __any_sync(0xffffffffu, (cw[0] | cw[1] | cw[2] | cw[3]) != 0u) && work;
    if (work) {
      const uint32_t kaddr = smem_u32(Ks + buf * kFBK * RS + koff);
      const uint32_t vaddr = smem_u32(Vs + buf * kFBK * RS + voff);
      float s[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {  // S = Q K^T, 16 dims per step
        uint32_t a0, a1, a2, a3;
        ldsm_x4(qaddr + kd * 32, a0, a1, a2, a3);
#pragma unroll
        for (int np = 0; np < 4; ++np) {  // two 8-key tiles per ldmatrix
          uint32_t b0, b1, b2, b3;
          ldsm_x4(kaddr + uint32_t(np * 16 * RS + kd * 16) * 2, b0, b1, b2, b3);
          mma_bf16_16816(s[2 * np], a0, a1, a2, a3, b0, b1);
          mma_bf16_16816(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
        }
      }
      float alpha_a, alpha_b;
      softmax_tile(s, k0, b.lim_a, b.lim_b, k0 + kFBK - 1 > b.warp_lo, mask, cw, tq, sl2, st, alpha_a, alpha_b);
      rescale_rows(o, alpha_a, alpha_b);
#pragma unroll
      for (int kk = 0; kk < kFBK / 16; ++kk) {  // O += P V, 16 keys per step
        uint32_t a[4];
        p_fragment(s, kk, a);
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {  // two 8-column tiles of O per ldmatrix
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(vaddr + uint32_t(kk * 16 * RS + j * 16) * 2, b0, b1, b2, b3);
          mma_bf16_16816(o[2 * j], a[0], a[1], a[2], a[3], b0, b1);
          mma_bf16_16816(o[2 * j + 1], a[0], a[1], a[2], a[3], b2, b3);
        }
      }
    }
    kt = nxt;
    buf ^= 1;
  }
  write_rows(o, st, T, H, h, vd, b.ta, b.tb, tq, out);
}

// --- The wgmma kernel (sm_90a) --------------------------------------------------------------------
//
// Same math, tiles and masks as prefill_fast_kernel, on Hopper's warpgroup MMA: a block's 128
// queries are 2 warpgroups of 64 rows; S [64 x 64] = Q K^T reads both operands from shared memory
// (wgmma m64n64k16, 16 steps over D = 256) and O [64 x D] += P V takes P from registers (the
// accumulator layout again) and V from shared memory. Why: in the mma.sync kernel every warp
// (16 rows) reads the whole K and V tile through ldmatrix, 72 KB per warp per 1 MFLOP tile, which
// bounds it near ~470 TFLOP/s before any other cost (it measured 185-214); a warpgroup reads them
// once per 64 rows: 96 KB per 4.2 MFLOP (Q 32 + K 32 from shared memory for S, V 32 for O), about
// 0.75 of the shared-memory bandwidth at the tensor cores' rate. Registers are the same as the
// mma.sync kernel's per thread: O 64 x 256 f32 over 128 threads = 128, S 32.
//
// Shared memory: every [rows][D] bf16 tile is stored as D / 64 "atoms" of [rows][64] (128-byte
// lines), the 16-byte chunk c of line r at chunk c ^ (r % 8): the 128-byte swizzle the wgmma
// descriptors name (mode 1), with each atom 1024-byte aligned. Q and K are K-major operands
// (their 16 dims of a k-step are 32 contiguous bytes of a line: start + 32 kd within the atom,
// 8-row groups 1024 bytes apart = SBO). V is the B operand of P V read N-major (transpose flag):
// N = the 64 dims of one atom (wgmma n64, one per atom), K = 16 keys = 2 groups of 8 lines,
// SBO 1024 bytes, LBO the next atom (8 KB; unused at n64).
// The cp.async pieces land in that layout: a thread's column chunk xc and rows rf + i kRStep
// (kRStep a multiple of 8) keep r % 8 fixed, so its swizzled offsets are a base + i kRStep 128.
// Writes by cp.async and st.shared are made visible to wgmma (the async proxy) by
// fence.proxy.async before the barrier that publishes them.

constexpr int kWThreads = 256;  // 2 warpgroups x 64 query rows = kFBQ

template <int D> constexpr size_t wgmma_smem_bytes() { return size_t(kFBQ + 4 * kFBK) * D * 2 + 1024; }

// Byte offset of 16-byte chunk c (0 .. D/8 - 1) of row r in a [ROWS][D] swizzled tile.
template <int ROWS>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return uint32_t((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
// Named barriers 1 and 2 between the block's two warpgroups (256 threads: one arrives, the other
// waits); barrier 0 is __syncthreads.
template <int ID>
__device__ __forceinline__ void wg_bar_sync() { asm volatile("bar.sync %0, 256;\n" ::"n"(ID) : "memory"); }
template <int ID>
__device__ __forceinline__ void wg_bar_arrive() {
  asm volatile("bar.arrive %0, 256;\n" ::"n"(ID) : "memory");
}
// d [64 x 64] += A B: A [64 x 16] bf16 in registers (a[0..3] per thread, the m16k16 A fragment
// layout per warp), B [16 x 64] N-major in shared memory (transpose flag). d = o[A0 .. A0 + 7].
template <int A0, int NT>
__device__ __forceinline__ void wgmma_rs_m64n64(float (&o)[NT][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n}\n"
      : "+f"(o[A0 + 0][0]), "+f"(o[A0 + 0][1]), "+f"(o[A0 + 0][2]), "+f"(o[A0 + 0][3]),
          "+f"(o[A0 + 1][0]), "+f"(o[A0 + 1][1]), "+f"(o[A0 + 1][2]), "+f"(o[A0 + 1][3]),
          "+f"(o[A0 + 2][0]), "+f"(o[A0 + 2][1]), "+f"(o[A0 + 2][2]), "+f"(o[A0 + 2][3]),
          "+f"(o[A0 + 3][0]), "+f"(o[A0 + 3][1]), "+f"(o[A0 + 3][2]), "+f"(o[A0 + 3][3]),
          "+f"(o[A0 + 4][0]), "+f"(o[A0 + 4][1]), "+f"(o[A0 + 4][2]), "+f"(o[A0 + 4][3]),
          "+f"(o[A0 + 5][0]), "+f"(o[A0 + 5][1]), "+f"(o[A0 + 5][2]), "+f"(o[A0 + 5][3]),
          "+f"(o[A0 + 6][0]), "+f"(o[A0 + 6][1]), "+f"(o[A0 + 6][2]), "+f"(o[A0 + 6][3]),
          "+f"(o[A0 + 7][0]), "+f"(o[A0 + 7][1]), "+f"(o[A0 + 7][2]), "+f"(o[A0 + 7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// O += P V over the D / 64 atoms of V; vdesc: the descriptor of atom 0 at this k-step.
template <int NT, int A>
__device__ __forceinline__ void pv_atoms(float (&o)[NT][4], const uint32_t (&a)[4], uint64_t vdesc) {
  if constexpr (A < NT / 8) {
    wgmma_rs_m64n64<A * 8>(o, a, vdesc + desc_off(uint32_t(A) * (kFBK * 128)));
    pv_atoms<NT, A + 1>(o, a, vdesc);
  }
}

template <int D>
__global__ void __launch_bounds__(kWThreads, 1) prefill_wgmma_kernel(
    const float* __restrict__ q, int T, int H, int qw, int nope, int vd, const __nv_bfloat16* __restrict__ kvxb,
    int hw, const __nv_bfloat16* __restrict__ ropeb, int n_keys, int pos0, const uint32_t* __restrict__ mask,
    int64_t mwords, float sl2, float* __restrict__ out) {
  pdl_begin();
  constexpr int NT = D / 8;                       // 8-column tiles of O
  constexpr uint32_t kQBytes = kFBQ * D * 2, kTileBytes = kFBK * D * 2;
  extern __shared__ unsigned char wg_smem[];
  const uint32_t raw = smem_u32(wg_smem), sbase = (raw + 1023u) & ~1023u;  // the swizzle repeats per 1 KB
  unsigned char* base = wg_smem + (sbase - raw);
  const uint32_t sQ = sbase, sK = sbase + kQBytes, sV = sK + 2 * kTileBytes;  // Q; K[2]; V[2]
  const BlockRows b(T, n_keys, pos0);
  const int tid = b.tid, tq = b.tq, h = b.h, q0 = b.q0;
  const int wgi = b.warp >> 2;  // warpgroup: rows 64 wgi .. + 63 of the block
  // The warpgroup's last row's limit: tiles past it hold no key of any of its rows (uniform over
  // the warpgroup, as wgmma needs).
  const int g0 = q0 + wgi * 64;
  const int wg_hi = g0 < T ? min(n_keys - 1, pos0 + min(T - 1, g0 + 63)) : -1;
  const TileFetch<D, kWThreads> fetch(tid, h, H, qw, nope, vd, hw, kvxb, ropeb);
  const uint32_t soff = swz<kFBK>(fetch.rf, fetch.xc / 8), dstep = uint32_t(fetch.kRStep * 128);
  auto load_tile = [&](int kt, int buf) {
    fetch.issue(kt, n_keys, sK + uint32_t(buf) * kTileBytes + soff, sV + uint32_t(buf) * kTileBytes + soff, dstep);
  };
  TileWalk walk{mask, mwords, T, b};
  int kt = walk.first([&](int k) { load_tile(k, 0); });  // in flight while Q is converted
  load_q<D, kWThreads>(q, T, H, h, qw, q0, tid, base, [](int r, int d) { return swz<kFBQ>(r, d >> 3) + (d & 7) * 2; });

  float o[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  RowState st;
  const uint64_t qdesc = gmma_desc(sQ + uint32_t(wgi * 64 * 128), 16, 1024);  // this warpgroup's rows of atom 0

  int buf = 0;
  while (kt < b.kt_end) {
    const int nxt = walk.next(kt);
    const uint32_t cw[4] = {walk.nw[0], walk.nw[1], walk.nw[2], walk.nw[3]};
    wgmma_wait_all();  // this warpgroup's P V of the last tile: its V buffer is refilled next
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();  // tile kt (and Q) visible to all; both warpgroups are done with buffer buf ^ 1
    if (nxt < b.kt_end) walk.prefetch(nxt, [&](int k) { load_tile(k, buf ^ 1); });
    const int k0 = kt * kFBK;
    const bool mine = k0 <= wg_hi;
    const uint64_t kdesc = gmma_desc(sK + uint32_t(buf) * kTileBytes, 16, 1024);
    const uint64_t vdesc = gmma_desc(sV + uint32_t(buf) * kTileBytes, kFBK * 128, 1024);
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    // Ping-pong: warpgroup 1 issues its S only once warpgroup 0's is done, and warpgroup 0 its
    // P V only once warpgroup 1's S is done, so one's softmax runs while the other's products
    // keep the tensor cores busy (both at once, the softmax would leave them idle).
    if (wgi == 1) wg_bar_sync<1>();
    if (mine) {
      wgmma_fence();
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {  // S = Q K^T, 16 dims per step
        const uint32_t in_atom = uint32_t((kd & 3) * 32);  // 16 dims = 32 bytes of a 128-byte line
        wgmma_ss_m64n64(s, qdesc + desc_off(uint32_t(kd >> 2) * (kFBQ * 128) + in_atom),
                        kdesc + desc_off(uint32_t(kd >> 2) * (kFBK * 128) + in_atom), kd > 0);
      }
      wgmma_commit();
    }
    wgmma_wait_all();  // this tile's S
    pin(s);
    pin(o);
    if (wgi == 0) wg_bar_arrive<1>();
    else wg_bar_arrive<2>();
    if (mine) {
      float alpha_a, alpha_b;
      softmax_tile(s, k0, b.lim_a, b.lim_b, k0 + kFBK - 1 > b.warp_lo, mask, cw, tq, sl2, st, alpha_a, alpha_b);
      rescale_rows(o, alpha_a, alpha_b);
    }
    uint32_t p[kFBK / 16][4];
#pragma unroll
    for (int kk = 0; kk < kFBK / 16; ++kk) p_fragment(s, kk, p[kk]);
    if (wgi == 0) wg_bar_sync<2>();
    if (mine) {
      pin(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kFBK / 16; ++kk)  // O += P V, 16 keys (2 groups of 8 lines) per step
        pv_atoms<NT, 0>(o, p[kk], vdesc + desc_off(uint32_t(kk * 16 * 128)));
      wgmma_commit();  // waited for before the next tile's barrier (the other warpgroup's S can go first)
    }
    kt = nxt;
    buf ^= 1;
  }
  wgmma_wait_all();
  pin(o);
  write_rows(o, st, T, H, h, vd, b.ta, b.tb, tq, out);
}

template <int D>
void launch_attend(const PrefillAttnArgs& a, const void* kvx_bf16, const void* rope_bf16, cudaStream_t st,
                   bool wgmma) {
  auto kernel = wgmma ? prefill_wgmma_kernel<D> : prefill_fast_kernel<D>;
  const size_t smem = wgmma ? wgmma_smem_bytes<D>() : fast_smem_bytes<D>();
  static bool configured[2] = {false, false};
  if (!configured[wgmma]) {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    configured[wgmma] = true;
  }
  // Blocks are dispatched x first: every head's last (most keys, causal) query block, then every
  // head's one before it, ..., so the short blocks fill the last wave (longest first). With the
  // heads' blocks in order, 512 queries of 64 heads (256 blocks of 1-4 tile pairs) left SMs idle
  // behind a few long blocks.
  const dim3 grid(unsigned(a.H), unsigned((a.T + kFBQ - 1) / kFBQ));
  launch(kernel, grid, wgmma ? kWThreads : kFThreads, smem, st, a.q, int(a.T), int(a.H), int(a.qw), int(a.nope),
         int(a.vd), static_cast<const __nv_bfloat16*>(kvx_bf16), int(a.hw),
         static_cast<const __nv_bfloat16*>(rope_bf16), int(a.n_keys), int(a.pos0), a.mask, a.mwords,
         a.scale * 1.4426950408889634f, a.out);
  VIREO_CUDA_LAUNCHED();
}

}  // namespace

bool mla_prefill_fast_supported(const PrefillAttnArgs& a) {
  // Indices inside the kernel are 32-bit (row and key numbers; offsets are 64-bit). K / V rows
  // are fetched in 16-byte pieces: nope, rope and vd multiples of 8 bf16. The grid's y counts
  // query blocks (at most 65535).
  const int64_t lim = INT_MAX / 2;
  return fast_dim(a) != 0 && a.scale > 0.0f && a.T > 0 && a.n_keys > 0 && a.T < lim && a.n_keys < lim && a.pos0 >= 0 &&
         a.pos0 < lim && a.H < 65536 && (a.T + kFBQ - 1) / kFBQ <= 65535 && a.nope % 8 == 0 && a.qw % 8 == 0 &&
         a.vd % 8 == 0 && a.hw == a.nope + a.vd && a.hw < lim;
}

void mla_prefill_fast_rope(const PrefillAttnArgs& a, void* rope_bf16, cudaStream_t st) {
  const int64_t rope = a.qw - a.nope, n = a.n_keys * rope;
  if (n <= 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 4096));
  launch(prefill_fast_rope_kernel, blocks, 256, 0, st, a.kv, a.kvw, a.L, rope, a.n_keys,
         static_cast<__nv_bfloat16*>(rope_bf16));
  VIREO_CUDA_LAUNCHED();
}

void mla_prefill_fast(const PrefillAttnArgs& a, const void* kvx_bf16, const void* rope_bf16, cudaStream_t st,
                      bool wgmma) {
  switch (fast_dim(a)) {
    case 64: launch_attend<64>(a, kvx_bf16, rope_bf16, st, wgmma); break;
    case 128: launch_attend<128>(a, kvx_bf16, rope_bf16, st, wgmma); break;
    default: launch_attend<256>(a, kvx_bf16, rope_bf16, st, wgmma); break;
  }
}

}  // namespace vireo::cuda
