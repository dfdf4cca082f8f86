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

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// src_bytes 0: 16 zero bytes (nothing is read; src must still be a valid address).
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool copy) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(copy ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
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
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * rope; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(kv[(i / rope) * kvw + L + i % rope]);
}

template <int D>
__global__ void __launch_bounds__(kFThreads, 1) prefill_fast_kernel(
    const float* __restrict__ q, int T, int H, int qw, int nope, int vd, const __nv_bfloat16* __restrict__ kvxb,
    int hw, const __nv_bfloat16* __restrict__ ropeb, int n_keys, int pos0, const uint32_t* __restrict__ mask,
    int64_t mwords, float sl2, float* __restrict__ out) {
  constexpr int RS = D + 8;      // shared row stride in bf16 (16-byte pad: conflict-free ldmatrix)
  constexpr int NT = D / 8;      // 8-column tiles of O
  constexpr int CH = D / 8;      // 16-byte chunks per K / V row
  constexpr int P = D / 2;
  extern __shared__ __align__(16) unsigned char fast_smem[];
  __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(fast_smem);  // [kFBQ][RS]
  __nv_bfloat16* Ks = Qs + kFBQ * RS;                                 // [2][kFBK][RS]
  __nv_bfloat16* Vs = Ks + 2 * kFBK * RS;                             // [2][kFBK][RS]
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int h = int(blockIdx.y);
  const int q0 = int(gridDim.x - 1 - blockIdx.x) * kFBQ;  // the longest rows first
  const int r0 = q0 + warp * 16, ta = r0 + g, tb = ta + 8;
  const int kmax = min(n_keys, pos0 + min(T, q0 + kFBQ));
  const int kt_end = (kmax + kFBK - 1) / kFBK;
  // Last key each of this thread's rows sees (-1: no such row); the warp's first row sees the
  // fewest, its last the most.
  const int lim_a = ta < T ? min(n_keys - 1, pos0 + ta) : -1;
  const int lim_b = tb < T ? min(n_keys - 1, pos0 + tb) : -1;
  const int warp_lo = r0 < T ? min(n_keys - 1, pos0 + r0) : -1;
  const int warp_hi = r0 < T ? min(n_keys - 1, pos0 + min(T - 1, r0 + 15)) : -1;
  // K row of key u: kvx[u, h, 0 : nope] | rope[u, :] | 0; V row: kvx[u, h, nope : nope + vd] | 0;
  // keys >= n_keys all 0 (their scores are masked, but P V must not meet garbage: 0 * NaN).
  // A thread's 16-byte pieces all sit in one column xc (kFThreads is a multiple of CH) of rows
  // rf, rf + kRStep, ..: its source addresses are a fixed base plus a fixed stride per key, set up
  // once here (with 64-bit index math per piece the kernel took 2.88 ms instead of 2.57 at GLM-5
  // shapes, T = 4096: the loads' instructions compete with the math for issue slots).
  constexpr int kRStep = kFThreads / CH;
  const int xc = (tid % CH) * 8, rf = tid / CH;
  const bool kcol = xc < qw, vcol = xc < vd;
  const int64_t vstride = int64_t(H) * hw, kstride = xc < nope ? vstride : int64_t(qw - nope);
  const __nv_bfloat16* kbase = xc < nope ? kvxb + int64_t(h) * hw + xc : ropeb + (xc - nope);
  const __nv_bfloat16* vbase = kvxb + int64_t(h) * hw + nope + xc;
  const uint32_t soff = uint32_t(rf * RS + xc) * 2;
  auto load_tile = [&](int kt, int buf) {
    const uint32_t kdst = smem_u32(Ks + buf * kFBK * RS) + soff, vdst = smem_u32(Vs + buf * kFBK * RS) + soff;
    const int u0 = kt * kFBK + rf;
    const __nv_bfloat16* kp = kbase + int64_t(u0) * kstride;
    const __nv_bfloat16* vp = vbase + int64_t(u0) * vstride;
#pragma unroll
    for (int i = 0; i < kFBK / kRStep; ++i) {
      const bool in = u0 + i * kRStep < n_keys, kok = in && kcol, vok = in && vcol;
      cp_async16_zfill(kdst + uint32_t(i * kRStep * RS * 2), kok ? kp + i * kRStep * kstride : kvxb, kok);
      cp_async16_zfill(vdst + uint32_t(i * kRStep * RS * 2), vok ? vp + i * kRStep * vstride : kvxb, vok);
    }
    cp_async_commit();
  };
  // Whether any query of the block selected a key of tile kt (block-uniform; a barrier).
  auto tile_needed = [&](int kt) -> bool {
    if (!mask) return true;
    const int t = q0 + (tid >> 1);
    const int64_t w = int64_t(kt) * 2 + (tid & 1);
    const bool any = t < T && w < mwords && mask[int64_t(t) * mwords + w] != 0u;
    return __syncthreads_or(int(any)) != 0;
  };
  auto next_tile = [&](int kt) {
    while (kt < kt_end && !tile_needed(kt)) ++kt;
    return kt;
  };
  // This thread's rows' mask words of tile kt (row a: w[0], w[1]; row b: w[2], w[3]).
  auto load_words = [&](int kt, uint32_t (&w)[4]) {
    if (!mask) return;
    const int64_t w0 = int64_t(kt) * 2;
    const bool w1ok = w0 + 1 < mwords;
    w[0] = ta < T ? mask[int64_t(ta) * mwords + w0] : 0u;
    w[1] = ta < T && w1ok ? mask[int64_t(ta) * mwords + w0 + 1] : 0u;
    w[2] = tb < T ? mask[int64_t(tb) * mwords + w0] : 0u;
    w[3] = tb < T && w1ok ? mask[int64_t(tb) * mwords + w0 + 1] : 0u;
  };

  int kt = next_tile(0);
  uint32_t nw[4] = {~0u, ~0u, ~0u, ~0u};
  if (kt < kt_end) {
    load_tile(kt, 0);  // in flight while Q is converted
    load_words(kt, nw);
  }
  for (int i = tid; i < kFBQ * P; i += kFThreads) {
    const int r = i / P, d = 2 * (i % P), t = q0 + r;
    float x = 0.0f, y = 0.0f;
    if (t < T) {
      const float* qr = q + (int64_t(t) * H + h) * qw;
      if (d < qw) x = qr[d];
      if (d + 1 < qw) y = qr[d + 1];
    }
    *reinterpret_cast<__nv_bfloat162*>(Qs + r * RS + d) = __floats2bfloat162_rn(x, y);
  }

  float o[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f;  // raw-score maxima; partial row sums
  // ldmatrix row addresses (see the fragment layouts of m16n8k16): A = Q rows lane % 16, columns
  // +8 for lanes >= 16; B of S = K rows (keys) lane % 8 (+8 for lanes >= 16), columns +8 for
  // lanes 8-15 and 24-31; B of O = V rows (keys) lane % 16, columns +8 for lanes >= 16 (.trans).
  const uint32_t qaddr = smem_u32(Qs + (warp * 16 + (lane & 15)) * RS + (lane >> 4) * 8);
  const int koff = ((lane & 7) + ((lane >> 4) << 3)) * RS + ((lane >> 3) & 1) * 8;
  const int voff = (lane & 15) * RS + (lane >> 4) * 8;

  int buf = 0;
  while (kt < kt_end) {
    const int nxt = next_tile(kt + 1);
    uint32_t cw[4] = {nw[0], nw[1], nw[2], nw[3]};
    cp_async_wait_all();
    __syncthreads();  // tile kt (and Q) visible to all; every warp is done with buffer buf ^ 1
    if (nxt < kt_end) {
      load_tile(nxt, buf ^ 1);
      load_words(nxt, nw);
    }
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
      // Element e of tile nt: row ta (e < 2) or tb, key k0 + nt * 8 + 2 tq + (e & 1).
      if (mask || k0 + kFBK - 1 > warp_lo) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = nt * 8 + 2 * tq + (e & 1);
            bool ok = k0 + col <= (e < 2 ? lim_a : lim_b);
            if (mask) ok = ok && ((cw[(e < 2 ? 0 : 2) + (nt >= 4)] >> (col & 31)) & 1u);
            if (!ok) s[nt][e] = -INFINITY;
          }
      }
      float mxa = ma, mxb = mb;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        mxa = fmaxf(mxa, fmaxf(s[nt][0], s[nt][1]));
        mxb = fmaxf(mxb, fmaxf(s[nt][2], s[nt][3]));
      }
      mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
      mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
      mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
      mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
      // Reference points in the scaled log2 domain; 0 while a row has seen no key (then every
      // p is exp2(-inf) = 0 and alpha too, so nothing changes).
      const float ra = mxa == -INFINITY ? 0.0f : mxa * sl2, rb = mxb == -INFINITY ? 0.0f : mxb * sl2;
      const float alpha_a = mxa == ma ? 1.0f : exp2f(fmaf(ma, sl2, -ra));
      const float alpha_b = mxb == mb ? 1.0f : exp2f(fmaf(mb, sl2, -rb));
      ma = mxa;
      mb = mxb;
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
      la = la * alpha_a + sa;
      lb = lb * alpha_b + sb;
      // Once the running maxima settle most tiles change none of the warp's rows: skip the
      // 128 multiplies per thread then (alpha is exactly 1 when the maximum did not move).
      if (__any_sync(0xffffffffu, alpha_a != 1.0f || alpha_b != 1.0f)) {
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          o[i][0] *= alpha_a;
          o[i][1] *= alpha_a;
          o[i][2] *= alpha_b;
          o[i][3] *= alpha_b;
        }
      }
#pragma unroll
      for (int kk = 0; kk < kFBK / 16; ++kk) {  // O += P V, 16 keys per step
        const uint32_t a0 = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), a1 = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
        const uint32_t a2 = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        const uint32_t a3 = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {  // two 8-column tiles of O per ldmatrix
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(vaddr + uint32_t(kk * 16 * RS + j * 16) * 2, b0, b1, b2, b3);
          mma_bf16_16816(o[2 * j], a0, a1, a2, a3, b0, b1);
          mma_bf16_16816(o[2 * j + 1], a0, a1, a2, a3, b2, b3);
        }
      }
    }
    kt = nxt;
    buf ^= 1;
  }
  la += __shfl_xor_sync(0xffffffffu, la, 1);
  la += __shfl_xor_sync(0xffffffffu, la, 2);
  lb += __shfl_xor_sync(0xffffffffu, lb, 1);
  lb += __shfl_xor_sync(0xffffffffu, lb, 2);
  const float ia = la > 0.0f ? 1.0f / la : 0.0f, ib = lb > 0.0f ? 1.0f / lb : 0.0f;
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

template <int D>
void launch_attend(const PrefillAttnArgs& a, const void* kvx_bf16, const void* rope_bf16, cudaStream_t st) {
  constexpr size_t smem = fast_smem_bytes<D>();
  static bool configured = false;
  if (!configured) {
    VIREO_CUDA_CHECK(
        cudaFuncSetAttribute(prefill_fast_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    configured = true;
  }
  const dim3 grid(unsigned((a.T + kFBQ - 1) / kFBQ), unsigned(a.H));
  prefill_fast_kernel<D><<<grid, kFThreads, smem, st>>>(
      a.q, int(a.T), int(a.H), int(a.qw), int(a.nope), int(a.vd), static_cast<const __nv_bfloat16*>(kvx_bf16),
      int(a.hw), static_cast<const __nv_bfloat16*>(rope_bf16), int(a.n_keys), int(a.pos0), a.mask, a.mwords,
      a.scale * 1.4426950408889634f, a.out);
  VIREO_CUDA_LAUNCHED();
}

}  // namespace

bool mla_prefill_fast_supported(const PrefillAttnArgs& a) {
  // Indices inside the kernel are 32-bit (row and key numbers; offsets are 64-bit). K / V rows
  // are fetched in 16-byte pieces: nope, rope and vd multiples of 8 bf16.
  const int64_t lim = INT_MAX / 2;
  return fast_dim(a) != 0 && a.scale > 0.0f && a.T > 0 && a.n_keys > 0 && a.T < lim && a.n_keys < lim &&
         a.pos0 >= 0 && a.pos0 < lim && a.H < 65536 && a.nope % 8 == 0 && a.qw % 8 == 0 && a.vd % 8 == 0 &&
         a.hw == a.nope + a.vd && a.hw < lim;
}

void mla_prefill_fast_rope(const PrefillAttnArgs& a, void* rope_bf16, cudaStream_t st) {
  const int64_t rope = a.qw - a.nope, n = a.n_keys * rope;
  if (n <= 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 4096));
  prefill_fast_rope_kernel<<<blocks, 256, 0, st>>>(a.kv, a.kvw, a.L, rope, a.n_keys,
                                                  static_cast<__nv_bfloat16*>(rope_bf16));
  VIREO_CUDA_LAUNCHED();
}

void mla_prefill_fast(const PrefillAttnArgs& a, const void* kvx_bf16, const void* rope_bf16, cudaStream_t st) {
  switch (fast_dim(a)) {
    case 64: launch_attend<64>(a, kvx_bf16, rope_bf16, st); break;
    case 128: launch_attend<128>(a, kvx_bf16, rope_bf16, st); break;
    default: launch_attend<256>(a, kvx_bf16, rope_bf16, st); break;
  }
}

}  // namespace vireo::cuda
