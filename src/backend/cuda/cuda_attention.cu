// MLA attention, the DSA indexer and MoE routing on the GPU.
//
// Absorbed (decode) path: W_UK is folded into the query (q_lat = W_UK^T q_nope), attention runs
// over the cached [latent | k_rope] rows as MQA. By default with every head of a query per block
// (cuda_decode_attention.cu); the kernels here are the reference and the fallback for shapes those
// do not take: split over the key list (flash-decoding: each block does 8 heads x 64 keys and keeps
// (max, sum, o_lat) partials, so one cache row is read once per 8 heads and long contexts still
// fill the chip), then a combine kernel merges the splits and a third applies W_UV.
// Reconstructed (prefill) path: kv_b expands the latents into per-head k_nope | v once (a GEMM),
// then a tiled kernel computes attention under the causal mask and the DSA selection (a bitmask
// [T, ceil(N/32)]); no T x T matrix is ever stored. Default: tensor cores (mma.sync with bf16
// hi/lo operands, 128 queries x 32 keys, see mla_prefill_tc_kernel); CudaGemmMode::Simt: f32
// CUDA cores (32 x 32 tiles, online softmax, exact f32 math, ~10x slower).
// Indexer: scores [T, N] (bit-for-bit the CPU reference's sums, given equal inputs: explicit
// round-to-nearest multiply and add in its order), then an exact top-k per row by radix select
// on (score, -position) keys, so ties go to the lower position, written in ascending order (rows
// of up to 16384 keys take the register-resident top-k of cuda_decode_attention.cu instead).
#include "backend/cuda/cuda_attention.h"
#include "backend/cuda/cuda_internal.h"

namespace vireo::cuda {

namespace {

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// The fused RoPE of absorb_q (AbsorbRope): warp 0 of one block a (token, head) rotates the head's
// rope part q[t, h, nope : qw] in place, as rope_kernel would. The absorption reads only [0, nope).
__device__ __forceinline__ void absorb_rotate(const AbsorbRope& r, int64_t t, int64_t h, int64_t H, int64_t qw,
                                              int64_t nope) {
  if (!r.q || threadIdx.x >= 32) return;
  const int half = int(qw - nope) / 2, i = int(threadIdx.x);
  float* v = r.q + (t * H + h) * qw + nope;
  float2 ab = {};
  if (i < half) ab = rope_pair_read(v, i, half, r.interleaved);
  __syncwarp();
  if (i < half) rope_pair_write(v, i, half, ab, r.cs + t * (qw - nope));
}

constexpr int kHG = 8;       // heads per block in the decode partial kernel (= warps)
constexpr int kSplit = 64;   // keys per split in the decode partial kernel (2 blocks per SM at 2048 keys)
constexpr int kChunk = 32;   // cache rows staged in shared memory at a time (8 warps x 4 keys)
constexpr int kQT = 32, kKT = 32;  // prefill attention tile: queries x keys

__global__ void absorb_q_kernel(const float* __restrict__ q, int64_t H, int64_t qw, int64_t nope, DevW kvb, int64_t hw,
                                int64_t L, float* __restrict__ qlat, AbsorbRope rope) {
  pdl_begin();
  extern __shared__ float qs[];  // [nope]
  const int64_t h = blockIdx.x, t = blockIdx.y;
  absorb_rotate(rope, t, h, H, qw, nope);
  const float* qp = q + (t * H + h) * qw;
  for (int64_t i = threadIdx.x; i < nope; i += blockDim.x) qs[i] = qp[i];
  __syncthreads();
  for (int64_t c = threadIdx.x; c < L; c += blockDim.x) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nope; ++i) acc += qs[i] * wget_rt(kvb, h * hw + i, c);
    qlat[(t * H + h) * L + c] = acc;
  }
}

// q_lat[t, h, c] = sum_i q[t, h, i] W_UK(h)[i, c] with 16-byte weight loads: lane l of warp w owns
// the N columns c0 + l N .. of this block and rows i = w, w + kAqW, ..; the kAqW warps' partial
// sums are added in a fixed order. Grid (H, ceil(L / (32 N)), T): ~one block per SM for GLM-5
// shapes, so the loads in flight per SM are those of one block: 16 warps, each with several rows'
// loads issued ahead (8 warps, one row at a time: 12.6 MB of W_UK in 8.8 us, ~1.4 TB/s). 8 rows
// ahead instead of 4 measured slower (FP8, 6.3 MB: 6.6 -> 8.0 us; H200, ncu, session 9).
constexpr int kAqW = 16;
// AHEAD: the block's W_UK chunks (each thread's own: rows warp, warp + kAqW, .. at its columns)
// staged in shared memory by cp.async before the wait. W_UK does not depend on the queries, and
// the launch starts early (PDL) while q_b streams: its 6.3 MB (FP8, GLM-5) are read beside q_b
// instead of after it, on the queries' chain (which is the step's critical path at context 0).
// Shared memory rather than registers: 48 more registers a thread would keep the block off the
// SMs that q_b's half-SM blocks hold. The same sums in the same order. H200, 8 layers fp8: +0.2 to
// +0.5 points at context 0 in five A/B pairs (session 44; session 42's form +0.6 and +0.2 in two);
// at 4096 cached, where the indexer's branch beside the queries ends last and shares the SMs with
// these blocks, -0.6 to 0.0 (session 42: -0.2, -0.5): so only where the attention reads no
// selection (absorb_q's stage_ahead).
template <int DT, bool AHEAD>
__device__ __forceinline__ int absorb_stage(const DevW& kvb, int64_t hw, int64_t nope, int64_t L) {
  if constexpr (AHEAD) {
    extern __shared__ __align__(16) uint4 stage[];
    constexpr int N = GemvVec<DT>::n;
    const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
    const int64_t h = blockIdx.x, c0 = int64_t(blockIdx.y) * 32 * N + lane * N;
    if (c0 < L)
      for (int64_t i = warp, j = 0; i < nope; i += kAqW, ++j)
        cp_async16_zfill(smem_u32(stage + (j * kAqW + warp) * 32 + lane),
                         static_cast<const char*>(kvb.w) + ((h * hw + i) * L + c0) * elem_bytes<DT>(), true);
    cp_async_commit();
  }
  return 0;
}
template <int DT, bool AHEAD = false>
__global__ void __launch_bounds__(kAqW * 32)
    absorb_q_vec_kernel(const float* __restrict__ q, int64_t H, int64_t qw, int64_t nope, DevW kvb, int64_t hw,
                        int64_t L, float* __restrict__ qlat, AbsorbRope rope) {
  pdl_begin_after(absorb_stage<DT, AHEAD>(kvb, hw, nope, L));
  constexpr int N = GemvVec<DT>::n;
  extern __shared__ __align__(16) uint4 stage[];                      // AHEAD: [rows][32 lanes], then red
  __shared__ float red_static[AHEAD ? 1 : kAqW][AHEAD ? 1 : 32 * N];  // [kAqW][32 N]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t h = blockIdx.x, t = blockIdx.z, c0 = int64_t(blockIdx.y) * 32 * N + lane * N;
  if (blockIdx.y == 0) absorb_rotate(rope, t, h, H, qw, nope);
  const float* qp = q + (t * H + h) * qw;
  float acc[N];
#pragma unroll
  for (int j = 0; j < N; ++j) acc[j] = 0.0f;
  auto row_in = [&](int64_t i, const uint4& v) {
    const int64_t row = h * hw + i;
    float wf[N];
    unpack16<DT>(v, wf);
    float qi = qp[i];
    if constexpr (DT == W_FP8) qi *= kvb.s[(row >> 7) * kvb.s_cols + (c0 >> 7)];
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j] += qi * wf[j];
  };
  if (c0 < L) {
    if constexpr (AHEAD) {
      cp_async_wait_all();  // (this thread's own chunks: no barrier)
#pragma unroll 4
      for (int64_t i = warp, j = 0; i < nope; i += kAqW, ++j) row_in(i, stage[(j * kAqW + warp) * 32 + lane]);
    } else {
      // Unrolled so that several rows' 16-byte loads are in flight per thread.
#pragma unroll 4
      for (int64_t i = warp; i < nope; i += kAqW)
        row_in(i, ldg_stream(reinterpret_cast<const uint4*>(static_cast<const char*>(kvb.w) +
                                                            ((h * hw + i) * L + c0) * elem_bytes<DT>())));
    }
  }
  float* red = &red_static[0][0];
  if constexpr (AHEAD) {
    red = reinterpret_cast<float*>(stage);
    __syncthreads();  // every thread's staged rows read
  }
#pragma unroll
  for (int j = 0; j < N; ++j) red[warp * 32 * N + lane * N + j] = acc[j];
  __syncthreads();
  for (int x = threadIdx.x; x < 32 * N; x += blockDim.x) {
    const int64_t c = int64_t(blockIdx.y) * 32 * N + x;
    if (c >= L) continue;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kAqW; ++w) sum += red[w * 32 * N + x];
    qlat[(t * H + h) * L + c] = sum;
  }
}

// One block: a split of up to kSplit keys x kHG heads x one query. The split's cache rows are
// staged through shared memory kChunk at a time with coalesced 16-byte loads (so no thread waits
// on a chain of dependent global loads), scored by warps that each take 4 keys against all kHG
// heads (a query value read from shared memory serves 4 keys), softmax per head, then o_lat
// accumulated from the same staged rows. Partials (max, sum, o_lat) per split go to the combine.
__global__ void __launch_bounds__(256) mla_decode_partial_kernel(
    const float* __restrict__ qlat, const float* __restrict__ q, int64_t H, int64_t qw, int64_t nope, int64_t L,
    const float* __restrict__ kv, int64_t kvw, int64_t pos0, const int32_t* __restrict__ pos0_dev,
    const int32_t* __restrict__ sel, const int32_t* __restrict__ counts, int64_t sel_stride, float scale, int nsplit,
    float* __restrict__ opart, float* __restrict__ mpart, float* __restrict__ lpart) {
  pdl_begin();
  extern __shared__ float sm[];
  const int kp = int(kvw) + 1;                       // padded row: lanes reading one row hit distinct banks
  float* qs = sm;                                    // [kHG][kvw]: q_lat | q_rope
  float* ks = qs + kHG * kvw;                        // [kChunk][kp] staged cache rows
  float* ps = ks + kChunk * kp;                      // [kSplit][kHG] scores, then probabilities
  int* us = reinterpret_cast<int*>(ps + kSplit * kHG);  // [kSplit] key positions
  const int s = blockIdx.x, t = blockIdx.z;
  const int64_t hg0 = int64_t(blockIdx.y) * kHG;
  const int nh = int(imin(kHG, H - hg0));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t n = sel ? int64_t(counts[t]) : pos0 + t + 1;
  const int64_t i0 = int64_t(s) * kSplit;
  const int cnt = int(imax(0, imin(kSplit, n - i0)));
  // Row by row (a warp per row, lanes along it): no 64-bit divisions in the index math.
  const int kw = int(kvw), Li = int(L);
  for (int g = warp; g < kHG; g += 8) {
    const int64_t h = hg0 + g;
    for (int c = lane; c < kw; c += 32)
      qs[g * kw + c] = g >= nh ? 0.0f : c < Li ? qlat[(t * H + h) * L + c] : q[(t * H + h) * qw + nope + (c - Li)];
  }
  for (int j = threadIdx.x; j < cnt; j += blockDim.x) us[j] = sel ? sel[t * sel_stride + i0 + j] : int(i0 + j);
  __syncthreads();
  const bool vec = (kw & 3) == 0 && (reinterpret_cast<uintptr_t>(kv) & 15) == 0;
  auto stage = [&](int j0, int nk) {  // rows us[j0 .. j0 + nk) -> ks
    for (int j = warp; j < nk; j += 8) {
      const float* src = kv + int64_t(us[j0 + j]) * kvw;
      float* d = ks + j * kp;
      if (vec) {
        for (int c = lane * 4; c < kw; c += 128) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(src + c));
          d[c] = v.x;
          d[c + 1] = v.y;
          d[c + 2] = v.z;
          d[c + 3] = v.w;
        }
      } else {
        for (int c = lane; c < kw; c += 32) d[c] = src[c];
      }
    }
  };
  for (int j0 = 0; j0 < cnt; j0 += kChunk) {  // scores
    const int nk = min(kChunk, cnt - j0);
    stage(j0, nk);
    __syncthreads();
    const int jw = warp * 4;  // this warp's 4 keys of the chunk
    if (jw < nk) {
      float acc[4][kHG];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int g = 0; g < kHG; ++g) acc[r][g] = 0.0f;
      for (int c = lane; c < kw; c += 32) {
        float kr[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) kr[r] = ks[(jw + r) * kp + c];  // rows past nk: stale, never written out
#pragma unroll
        for (int g = 0; g < kHG; ++g) {
          const float qv = qs[g * kvw + c];
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[r][g] += qv * kr[r];
        }
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int g = 0; g < kHG; ++g) {
          const float v = warp_sum(acc[r][g]);
          if (lane == 0 && jw + r < nk) ps[(j0 + jw + r) * kHG + g] = v * scale;
        }
    }
    __syncthreads();
  }
  {  // softmax pieces: warp g owns head g
    const int g = warp;
    float m = -INFINITY;
    for (int j = lane; j < cnt; j += 32) m = fmaxf(m, ps[j * kHG + g]);
    m = warp_max(m);
    float l = 0.0f;
    for (int j = lane; j < cnt; j += 32) {
      const float p = expf(ps[j * kHG + g] - m);
      ps[j * kHG + g] = p;
      l += p;
    }
    l = warp_sum(l);
    if (lane == 0 && g < nh) {
      const int64_t idx = (t * H + hg0 + g) * nsplit + s;
      mpart[idx] = cnt ? m : -INFINITY;
      lpart[idx] = l;
    }
  }
  __syncthreads();
  constexpr int kMaxCols = 4;  // latent columns per thread: L <= 1024
  float o[kMaxCols][kHG];
#pragma unroll
  for (int ci = 0; ci < kMaxCols; ++ci)
#pragma unroll
    for (int g = 0; g < kHG; ++g) o[ci][g] = 0.0f;
  for (int j0 = 0; j0 < cnt; j0 += kChunk) {  // o_lat = sum_j p_j latent_j
    const int nk = min(kChunk, cnt - j0);
    stage(j0, nk);
    __syncthreads();
    for (int j = 0; j < nk; ++j) {
      const float4 p0 = *reinterpret_cast<const float4*>(ps + (j0 + j) * kHG);
      const float4 p1 = *reinterpret_cast<const float4*>(ps + (j0 + j) * kHG + 4);
      const float p[kHG] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
      for (int ci = 0; ci < kMaxCols; ++ci) {
        const int c = int(threadIdx.x) + ci * 256;
        if (c < Li) {
          const float v = ks[j * kp + c];
#pragma unroll
          for (int g = 0; g < kHG; ++g) o[ci][g] += p[g] * v;
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int ci = 0; ci < kMaxCols; ++ci) {
    const int64_t c = threadIdx.x + int64_t(ci) * 256;
    if (c >= L) continue;
    for (int g = 0; g < nh; ++g) opart[((t * H + hg0 + g) * nsplit + s) * L + c] = o[ci][g];
  }
}

// Merges the splits of (t, h): o_lat = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
__global__ void __launch_bounds__(256) mla_decode_combine_kernel(
    const float* __restrict__ opart, const float* __restrict__ mpart, const float* __restrict__ lpart, int nsplit,
    int64_t H, int64_t L, float* __restrict__ olat) {
  pdl_begin();
  const int64_t h = blockIdx.x, t = blockIdx.y;
  const int64_t base = (t * H + h) * nsplit;
  float M = -INFINITY;
  for (int s = 0; s < nsplit; ++s) M = fmaxf(M, mpart[base + s]);
  float denom = 0.0f;
  for (int s = 0; s < nsplit; ++s)
    if (mpart[base + s] > -INFINITY) denom += expf(mpart[base + s] - M) * lpart[base + s];
  for (int64_t c = threadIdx.x; c < L; c += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < nsplit; ++s)
      if (mpart[base + s] > -INFINITY) acc += expf(mpart[base + s] - M) * opart[(base + s) * L + c];
    olat[(t * H + h) * L + c] = acc / denom;
  }
}

// out[t, h, j] = W_UV(h)[j, :] . o_lat[t, h, :]: a warp per (h, j) row, 16-byte loads when the
// rows allow (VEC), 8 rows per block, grid (ceil(H vd / 8), T).
template <int DT, bool VEC>
__global__ void __launch_bounds__(256) apply_wuv_kernel(const float* __restrict__ olat, int64_t H, int64_t L,
                                                        DevW kvb, int64_t hw, int64_t nope, int64_t vd,
                                                        float* __restrict__ out) {
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * 8 + warp, t = blockIdx.y;
  if (r >= H * vd) return;
  const int64_t h = r / vd, j = r % vd, row = h * hw + nope + j;
  const float* x = olat + (t * H + h) * L;
  float acc[1] = {0.0f};
  if constexpr (VEC) {
    constexpr int N = GemvVec<DT>::n;
    const uint4* wr = reinterpret_cast<const uint4*>(static_cast<const char*>(kvb.w) + row * L * elem_bytes<DT>());
    const float* srow = DT == W_FP8 ? kvb.s + (row >> 7) * kvb.s_cols : nullptr;
    for (int64_t v = lane; v < L / N; v += 32) gemv_consume<DT, 1>(ldg_stream(wr + v), x, L, v * N, srow, acc);
  } else {
    for (int64_t c = lane; c < L; c += 32) acc[0] += wget<DT>(kvb, row, c) * x[c];
  }
  const float sum = warp_sum(acc[0]);
  if (lane == 0) out[(t * H + h) * vd + j] = sum;
}

template <int DT>
void launch_wuv(bool vec, const float* olat, int64_t T, int64_t H, int64_t L, const DevW& kvb, int64_t hw,
                int64_t nope, int64_t vd, float* out, cudaStream_t st) {
  const dim3 grid(unsigned((H * vd + 7) / 8), unsigned(T));
  if (vec) launch(apply_wuv_kernel<DT, true>, grid, 256, 0, st, olat, H, L, kvb, hw, nope, vd, out);
  else launch(apply_wuv_kernel<DT, false>, grid, 256, 0, st, olat, H, L, kvb, hw, nope, vd, out);
}

// 16-byte loads along kv_b rows of length L need L a multiple of the vector and an aligned base.
bool kvb_rows_vectorizable(const DevW& w, int64_t L) {
  const int n = 16 / (w.dt == W_F32 ? 4 : w.dt == W_FP8 ? 1 : 2);
  return L % n == 0 && reinterpret_cast<uintptr_t>(w.w) % 16 == 0;
}

__global__ void build_mask_kernel(const int32_t* __restrict__ sel, const int32_t* __restrict__ counts,
                                  int64_t stride, int64_t mwords, uint32_t* __restrict__ mask) {
  pdl_begin();
  const int64_t t = blockIdx.x;
  const int n = counts[t];
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int u = sel[t * stride + i];
    atomicOr(&mask[t * mwords + (u >> 5)], 1u << (u & 31));
  }
}

__global__ void __launch_bounds__(256) mla_prefill_kernel(
    const float* __restrict__ q, int64_t T, int64_t H, int64_t qw, int64_t nope, int64_t vd, int64_t L,
    const float* __restrict__ kv, int64_t kvw, const float* __restrict__ kvx, int64_t hw, int64_t n_keys,
    int64_t pos0, const uint32_t* __restrict__ mask, int64_t mwords, float scale, float* __restrict__ out) {
  pdl_begin();
  extern __shared__ float sm[];
  const int64_t qp = qw + 1;  // padded rows: lane j reading row j hits bank (j + d) % 32
  float* Qs = sm;              // [kQT][qp]
  float* Ks = Qs + kQT * qp;   // [kKT][qp]
  float* Vs = Ks + kKT * qp;   // [kKT][vd]
  float* Os = Vs + kKT * vd;   // [kQT][vd]
  __shared__ float Ps[8][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t h = blockIdx.y, q0 = int64_t(blockIdx.x) * kQT;
  for (int64_t idx = threadIdx.x; idx < kQT * qw; idx += blockDim.x) {
    const int64_t r = idx / qw, d = idx % qw, t = q0 + r;
    Qs[r * qp + d] = t < T ? q[(t * H + h) * qw + d] : 0.0f;
  }
  for (int64_t idx = threadIdx.x; idx < kQT * vd; idx += blockDim.x) Os[idx] = 0.0f;
  float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, l[4] = {0, 0, 0, 0};
  const int64_t kmax = imin(n_keys, pos0 + imin(T, q0 + kQT));
  for (int64_t k0 = 0; k0 < kmax; k0 += kKT) {
    if (mask) {  // skip key tiles no query of this block selected
      int any = 0;
      if (threadIdx.x < kQT && q0 + threadIdx.x < T) any = mask[(q0 + threadIdx.x) * mwords + (k0 >> 5)] != 0;
      if (!__syncthreads_or(any)) continue;
    }
    __syncthreads();
    for (int64_t idx = threadIdx.x; idx < kKT * qw; idx += blockDim.x) {
      const int64_t j = idx / qw, d = idx % qw, u = k0 + j;
      float v = 0.0f;
      if (u < n_keys) v = d < nope ? kvx[(u * H + h) * hw + d] : kv[u * kvw + L + (d - nope)];
      Ks[j * qp + d] = v;
    }
    for (int64_t idx = threadIdx.x; idx < kKT * vd; idx += blockDim.x) {
      const int64_t j = idx / vd, c = idx % vd, u = k0 + j;
      Vs[idx] = u < n_keys ? kvx[(u * H + h) * hw + nope + c] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
      const int r = warp * 4 + rr;
      const int64_t t = q0 + r, u = k0 + lane;
      bool valid = t < T && u < n_keys && u <= pos0 + t;
      if (valid && mask) valid = (mask[t * mwords + (k0 >> 5)] >> lane) & 1u;
      float s = -INFINITY;
      if (valid) {
        float acc = 0.0f;
        for (int64_t d = 0; d < qw; ++d) acc += Qs[r * qp + d] * Ks[lane * qp + d];
        s = acc * scale;
      }
      const float mn = fmaxf(m[rr], warp_max(s));
      if (mn == -INFINITY) continue;  // nothing valid yet for this row (uniform over the warp)
      const float alpha = expf(m[rr] - mn);
      const float p = valid ? expf(s - mn) : 0.0f;
      l[rr] = l[rr] * alpha + warp_sum(p);
      m[rr] = mn;
      Ps[warp][lane] = p;
      __syncwarp();
      for (int64_t c = lane; c < vd; c += 32) {
        float o = Os[r * vd + c] * alpha;
#pragma unroll 8
        for (int j = 0; j < kKT; ++j) o += Ps[warp][j] * Vs[j * vd + c];
        Os[r * vd + c] = o;
      }
      __syncwarp();
    }
  }
  __syncthreads();
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int r = warp * 4 + rr;
    const int64_t t = q0 + r;
    if (t >= T) continue;
    const float inv = 1.0f / l[rr];
    for (int64_t c = lane; c < vd; c += 32) out[(t * H + h) * vd + c] = Os[r * vd + c] * inv;
  }
}

// --- Tensor-core prefill attention -------------------------------------------------------------
// Flash-attention on mma.sync (m16n8k16, bf16 in, f32 accumulate) with every operand split into
// bf16 hi + lo and each product taken as hi*hi + lo*hi + hi*lo: what is dropped (lo*lo, and the
// rounding of lo) is ~2^-16 relative per product, the same f32-level accuracy as the split GEMMs.
// A block owns 128 queries of one head (8 warps x 16 rows) and walks 32-key tiles: the tile's K
// [32, qw] and V^T [vd, 32] are converted to hi/lo in shared memory; each warp computes its S
// [16, 32] in registers, applies the causal and DSA masks, updates its online softmax, and adds
// P V into O [16, vd] held in registers. No T x T matrix exists anywhere.
// Shared-memory rows are padded so every fragment load hits 32 distinct banks (row stride in
// words = 4 mod 8 with an odd quotient).
constexpr int kTcBQ = 128, kTcBK = 32, kTcWarps = kTcBQ / 16;
constexpr int kTcVSW = kTcBK / 2 + 4;  // V^T row stride in words (pairs of keys)

__device__ __forceinline__ uint32_t bf16_bits(__nv_bfloat16 h) { return uint32_t(__bfloat16_as_ushort(h)); }
// (x, y) -> hi = (bf16(x), bf16(y)), lo = (bf16(x - hi.x), bf16(y - hi.y)), low half = x.
__device__ __forceinline__ void split2(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat16 hx = __float2bfloat16_rn(x), hy = __float2bfloat16_rn(y);
  const __nv_bfloat16 lx = __float2bfloat16_rn(x - __bfloat162float(hx));
  const __nv_bfloat16 ly = __float2bfloat16_rn(y - __bfloat162float(hy));
  hi = bf16_bits(hx) | (bf16_bits(hy) << 16);
  lo = bf16_bits(lx) | (bf16_bits(ly) << 16);
}

// NV: 8-wide tiles of v (vd <= 8 NV). qw is padded with zeros to qp (a multiple of 16).
template <int NV>
__global__ void __launch_bounds__(256, 1) mla_prefill_tc_kernel(
    const float* __restrict__ q, int64_t T, int64_t H, int64_t qw, int64_t qp, int64_t nope, int64_t vd, int64_t L,
    const float* __restrict__ kv, int64_t kvw, const float* __restrict__ kvx, int64_t hw, int64_t n_keys,
    int64_t pos0, const uint32_t* __restrict__ mask, int64_t mwords, float scale, float* __restrict__ out) {
  pdl_begin();
  extern __shared__ uint32_t smw[];
  const int qp2 = int(qp / 2), qsw = qp2 + 4;  // words per Q/K row
  uint32_t* Qh = smw;                          // [kTcBQ][qsw]
  uint32_t* Ql = Qh + kTcBQ * qsw;
  uint32_t* Kh = Ql + kTcBQ * qsw;             // [kTcBK][qsw]
  uint32_t* Kl = Kh + kTcBK * qsw;
  uint32_t* Vh = Kl + kTcBK * qsw;             // [8 NV][kTcVSW]: V^T, pairs of keys
  uint32_t* Vl = Vh + 8 * NV * kTcVSW;
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31), g = lane >> 2, tq = lane & 3;
  const int64_t h = blockIdx.y;
  const int64_t q0 = int64_t(gridDim.x - 1 - blockIdx.x) * kTcBQ;  // the longest rows first
  const int64_t r0 = q0 + warp * 16, ta = r0 + g, tb = ta + 8;     // this thread's two query rows

  for (int r = warp; r < kTcBQ; r += kTcWarps) {
    const int64_t t = q0 + r;
    const float* qr = q + (t * H + h) * qw;
    for (int p = lane; p < qp2; p += 32) {
      const int64_t d = 2 * int64_t(p);
      const float x = t < T && d < qw ? qr[d] : 0.0f, y = t < T && d + 1 < qw ? qr[d + 1] : 0.0f;
      split2(x, y, Qh[r * qsw + p], Ql[r * qsw + p]);
    }
  }
  float o[NV][4];
#pragma unroll
  for (int i = 0; i < NV; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f;  // l: this thread's partial row sums

  const int64_t kmax = imin(n_keys, pos0 + imin(T, q0 + kTcBQ));
  const int64_t warp_kmax = imin(n_keys, pos0 + imin(T, r0 + 16));
  for (int64_t k0 = 0; k0 < kmax; k0 += kTcBK) {
    uint32_t wa = ~0u, wb = ~0u;
    if (mask) {
      wa = ta < T ? mask[ta * mwords + (k0 >> 5)] : 0u;
      wb = tb < T ? mask[tb * mwords + (k0 >> 5)] : 0u;
      if (!__syncthreads_or(int((wa | wb) != 0u))) continue;  // no query of the block selected a key here
    }
    __syncthreads();  // the previous tile's K and V are no longer read
    for (int j = warp; j < kTcBK; j += kTcWarps) {
      const int64_t u = k0 + j;
      for (int p = lane; p < qp2; p += 32) {
        float x = 0.0f, y = 0.0f;
        if (u < n_keys) {
          const int64_t d = 2 * int64_t(p);
          x = d < nope ? kvx[(u * H + h) * hw + d] : d < qw ? kv[u * kvw + L + (d - nope)] : 0.0f;
          y = d + 1 < nope ? kvx[(u * H + h) * hw + d + 1] : d + 1 < qw ? kv[u * kvw + L + (d + 1 - nope)] : 0.0f;
        }
        split2(x, y, Kh[j * qsw + p], Kl[j * qsw + p]);
      }
    }
    for (int jp = warp; jp < kTcBK / 2; jp += kTcWarps) {
      const int64_t u = k0 + 2 * jp;
      for (int c = lane; c < 8 * NV; c += 32) {
        const float x = u < n_keys && c < vd ? kvx[(u * H + h) * hw + nope + c] : 0.0f;
        const float y = u + 1 < n_keys && c < vd ? kvx[((u + 1) * H + h) * hw + nope + c] : 0.0f;
        split2(x, y, Vh[c * kTcVSW + jp], Vl[c * kTcVSW + jp]);
      }
    }
    __syncthreads();
    if (k0 >= warp_kmax || !__any_sync(0xffffffffu, (wa | wb) != 0u)) continue;  // nothing for this warp

    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    for (int kd = 0; kd < qp2 / 8; ++kd) {  // S = Q K^T, 16 dims per step
      const uint32_t* qa = Qh + (warp * 16 + g) * qsw + kd * 8 + tq;
      const uint32_t* ql = Ql + (warp * 16 + g) * qsw + kd * 8 + tq;
      const uint32_t ah0 = qa[0], ah1 = qa[8 * qsw], ah2 = qa[4], ah3 = qa[8 * qsw + 4];
      const uint32_t al0 = ql[0], al1 = ql[8 * qsw], al2 = ql[4], al3 = ql[8 * qsw + 4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const uint32_t* kh = Kh + (nt * 8 + g) * qsw + kd * 8 + tq;
        const uint32_t* kl = Kl + (nt * 8 + g) * qsw + kd * 8 + tq;
        const uint32_t bh0 = kh[0], bh1 = kh[4], bl0 = kl[0], bl1 = kl[4];
        mma_bf16_16816(s[nt], ah0, ah1, ah2, ah3, bh0, bh1);
        mma_bf16_16816(s[nt], al0, al1, al2, al3, bh0, bh1);
        mma_bf16_16816(s[nt], ah0, ah1, ah2, ah3, bl0, bl1);
      }
    }
    // Masks, then the online softmax: rows ta (elements 0, 1) and tb (2, 3); a row's 32 keys are
    // spread over the 4 lanes of a quad.
    float mxa = -INFINITY, mxb = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kk = nt * 8 + 2 * tq + (e & 1);
        const int64_t key = k0 + kk, row = e < 2 ? ta : tb;
        const uint32_t w = e < 2 ? wa : wb;
        const bool valid = row < T && key < n_keys && key <= pos0 + row && ((w >> kk) & 1u);
        s[nt][e] = valid ? s[nt][e] * scale : -INFINITY;
        if (e < 2) mxa = fmaxf(mxa, s[nt][e]);
        else mxb = fmaxf(mxb, s[nt][e]);
      }
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
    const float na = fmaxf(ma, mxa), nb = fmaxf(mb, mxb);
    const float alpha_a = na == -INFINITY ? 1.0f : expf(ma - na);
    const float alpha_b = nb == -INFINITY ? 1.0f : expf(mb - nb);
    ma = na;
    mb = nb;
    float sa = 0.0f, sb = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float v = s[nt][e];
        const float pv = v == -INFINITY ? 0.0f : expf(v - (e < 2 ? na : nb));
        s[nt][e] = pv;
        if (e < 2) sa += pv;
        else sb += pv;
      }
    la = la * alpha_a + sa;
    lb = lb * alpha_b + sb;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      o[i][0] *= alpha_a;
      o[i][1] *= alpha_a;
      o[i][2] *= alpha_b;
      o[i][3] *= alpha_b;
    }
#pragma unroll
    for (int kk = 0; kk < kTcBK / 16; ++kk) {  // O += P V, 16 keys per step
      uint32_t ph0, pl0, ph1, pl1, ph2, pl2, ph3, pl3;
      split2(s[2 * kk][0], s[2 * kk][1], ph0, pl0);
      split2(s[2 * kk][2], s[2 * kk][3], ph1, pl1);
      split2(s[2 * kk + 1][0], s[2 * kk + 1][1], ph2, pl2);
      split2(s[2 * kk + 1][2], s[2 * kk + 1][3], ph3, pl3);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const uint32_t* vh = Vh + (i * 8 + g) * kTcVSW + kk * 8 + tq;
        const uint32_t* vl = Vl + (i * 8 + g) * kTcVSW + kk * 8 + tq;
        const uint32_t bh0 = vh[0], bh1 = vh[4], bl0 = vl[0], bl1 = vl[4];
        mma_bf16_16816(o[i], ph0, ph1, ph2, ph3, bh0, bh1);
        mma_bf16_16816(o[i], pl0, pl1, pl2, pl3, bh0, bh1);
        mma_bf16_16816(o[i], ph0, ph1, ph2, ph3, bl0, bl1);
      }
    }
  }
  la += __shfl_xor_sync(0xffffffffu, la, 1);
  la += __shfl_xor_sync(0xffffffffu, la, 2);
  lb += __shfl_xor_sync(0xffffffffu, lb, 1);
  lb += __shfl_xor_sync(0xffffffffu, lb, 2);
  const float inva = 1.0f / la, invb = 1.0f / lb;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c = i * 8 + 2 * tq;
    if (ta < T) {
      float* orow = out + (ta * H + h) * vd;
      if (c < vd) orow[c] = o[i][0] * inva;
      if (c + 1 < vd) orow[c + 1] = o[i][1] * inva;
    }
    if (tb < T) {
      float* orow = out + (tb * H + h) * vd;
      if (c < vd) orow[c] = o[i][2] * invb;
      if (c + 1 < vd) orow[c + 1] = o[i][3] * invb;
    }
  }
}

__global__ void indexer_score_kernel(const float* __restrict__ q, const float* __restrict__ wts,
                                     const float* __restrict__ keys, int64_t nI, int64_t d, int64_t n_keys,
                                     int64_t pos0, const int32_t* __restrict__ pos0_dev, int64_t topk, float scale,
                                     float wscale, float* __restrict__ scores) {
  pdl_begin();
  extern __shared__ float sm[];
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t t = blockIdx.y, n_causal = pos0 + t + 1, u0 = int64_t(blockIdx.x) * 32;
  if (n_causal <= topk || u0 >= n_causal) return;  // whole block: uniform
  const int64_t dp = d + 1;
  float* qs = sm;                // [nI][d]
  float* ks = qs + nI * d;       // [32][dp]
  float* part = ks + 32 * dp;    // [32][nI + 1]
  for (int64_t i = threadIdx.x; i < nI * d; i += blockDim.x) qs[i] = q[t * nI * d + i];
  for (int64_t i = threadIdx.x; i < 32 * d; i += blockDim.x) {
    const int64_t j = i / d, x = i % d, u = u0 + j;
    ks[j * dp + x] = u < n_causal ? keys[u * d + x] : 0.0f;
  }
  __syncthreads();
  for (int64_t p = threadIdx.x; p < 32 * nI; p += blockDim.x) {
    const int64_t j = p & 31, jh = p >> 5;
    float acc = 0.0f;  // as the CPU reference: sequential, unfused multiply then add
    for (int64_t x = 0; x < d; ++x) acc = __fadd_rn(acc, __fmul_rn(qs[jh * d + x], ks[j * dp + x]));
    const float dd = __fmul_rn(acc, scale);
    part[j * (nI + 1) + jh] = __fmul_rn(__fmul_rn(wts[t * nI + jh], wscale), fmaxf(dd, 0.0f));
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int64_t u = u0 + threadIdx.x;
    if (u < n_causal) {
      float s = 0.0f;
      for (int64_t jh = 0; jh < nI; ++jh) s = __fadd_rn(s, part[threadIdx.x * (nI + 1) + jh]);
      scores[t * n_keys + u] = s;
    }
  }
}

// The same scores, bit for bit (each dot product still a sequential unfused multiply-add over x,
// heads summed in order), blocked for shared-memory bandwidth: lane j owns key u0 + j, warp w
// heads kV4H w .. kV4H w + kV4H - 1 (+32 per round), and x advances 4 at a time with 16-byte
// loads (the query rows are broadcast). Per 4 x-steps a warp loads 1 key vector and kV4H query
// vectors for kV4H x 32 dot products, against 2 scalar loads per product before. 16 warps of 2
// heads rather than 8 of 4: a block per SM (4096 keys: 128 blocks), so the warps, not the blocks,
// hide the load and dependent-add latency (8 warps of 4 heads: 7.9 cycles between a warp's
// instructions, 12.7 us at 4096 keys; 16 of 2: 10.1 us; 32 of 1, 1024 threads: the same as 16 of
// 2, 12.97 against 12.94 us for indexer_select in CudaBench and even end to end, session 38).
// Needs d % 4 == 0. The grid covers only the rows that select (t >= t_first: more causal keys
// than topk); key blocks past a row's causal keys exit at once.
constexpr int kV4H = 2, kV4Threads = 512;
__global__ void __launch_bounds__(kV4Threads)
    indexer_score_v4_kernel(const float* __restrict__ q, const float* __restrict__ wts, const float* __restrict__ keys,
                            int64_t nI, int64_t d, int64_t n_keys, int64_t pos0, const int32_t* __restrict__ pos0_dev,
                            int64_t topk, float scale, float wscale, int64_t t_first, float* __restrict__ scores) {
  pdl_begin();
  extern __shared__ float4 sm4[];
  if (pos0_dev) pos0 = *pos0_dev;  // then t_first is 0 and the grid covers the bound's keys
  const int64_t t = t_first + blockIdx.y, n_causal = pos0 + t + 1, u0 = int64_t(blockIdx.x) * 32;
  if (n_causal <= topk || u0 >= n_causal) return;  // whole block: uniform
  const int64_t d4 = d / 4, kp4 = d4 + 1;          // key rows padded by 16 bytes: conflict-free
  float4* qs = sm4;                                // [nI][d4]
  float4* ks = qs + nI * d4;                       // [32][kp4]
  float* part = reinterpret_cast<float*>(ks + 32 * kp4);  // [32][nI + 1]
  const float4* q4 = reinterpret_cast<const float4*>(q + t * nI * d);
  const float4* k4 = reinterpret_cast<const float4*>(keys);
  for (int64_t i = threadIdx.x; i < nI * d4; i += blockDim.x) qs[i] = q4[i];
  for (int64_t i = threadIdx.x; i < 32 * d4; i += blockDim.x) {
    const int64_t j = i / d4, x = i % d4, u = u0 + j;
    ks[j * kp4 + x] = u < n_causal ? k4[u * d4 + x] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  __syncthreads();
  const int warp = int(threadIdx.x >> 5), j = int(threadIdx.x & 31);
  for (int64_t h0 = int64_t(warp) * kV4H; h0 < nI; h0 += (kV4Threads / 32) * kV4H) {
    float acc[kV4H] = {};
    const float4* kr = ks + j * kp4;
    for (int64_t x = 0; x < d4; ++x) {
      const float4 kv = kr[x];
#pragma unroll
      for (int i = 0; i < kV4H; ++i) {
        if (h0 + i >= nI) break;
        const float4 qv = qs[(h0 + i) * d4 + x];
        float a = acc[i];
        a = __fadd_rn(a, __fmul_rn(qv.x, kv.x));
        a = __fadd_rn(a, __fmul_rn(qv.y, kv.y));
        a = __fadd_rn(a, __fmul_rn(qv.z, kv.z));
        a = __fadd_rn(a, __fmul_rn(qv.w, kv.w));
        acc[i] = a;
      }
    }
#pragma unroll
    for (int i = 0; i < kV4H; ++i)
      if (h0 + i < nI) {
        const float dd = __fmul_rn(acc[i], scale);
        part[j * (nI + 1) + h0 + i] = __fmul_rn(__fmul_rn(wts[t * nI + h0 + i], wscale), fmaxf(dd, 0.0f));
      }
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int64_t u = u0 + threadIdx.x;
    if (u < n_causal) {
      float s = 0.0f;  // unrolled: the shared loads issue ahead of the (ordered) adds
#pragma unroll 8
      for (int64_t jh = 0; jh < nI; ++jh) s = __fadd_rn(s, part[threadIdx.x * (nI + 1) + jh]);
      scores[t * n_keys + u] = s;
    }
  }
}

// Total order: higher score first, then lower position. -0 and +0 compare equal (as floats do).
__device__ __forceinline__ uint64_t select_key(float s, int64_t u) {
  uint32_t b = __float_as_uint(s + 0.0f);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (uint64_t(b) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(u));
}

__global__ void __launch_bounds__(512) indexer_topk_kernel(const float* __restrict__ scores, int64_t n_keys,
                                                           int64_t pos0, const int32_t* __restrict__ pos0_dev,
                                                           int64_t topk, int32_t* __restrict__ selected,
                                                           int32_t* __restrict__ counts, int64_t cache_cap) {
  pdl_begin();
  extern __shared__ uint64_t key_cache[];  // [cache_cap]: the row's keys, when they fit
  if (pos0_dev) pos0 = *pos0_dev;
  const int64_t t = blockIdx.x, n = pos0 + t + 1;
  int32_t* sel = selected + t * topk;
  if (n <= topk) {  // every causal key: sparse equals dense
    for (int64_t u = threadIdx.x; u < n; u += blockDim.x) sel[u] = int32_t(u);
    if (threadIdx.x == 0) counts[t] = int32_t(n);
    return;
  }
  const float* sr = scores + t * n_keys;
  // The 8 passes below read every key: from shared memory when the row fits.
  const bool cached = n <= cache_cap;
  if (cached)
    for (int64_t u = threadIdx.x; u < n; u += blockDim.x) key_cache[u] = select_key(sr[u], u);
  __syncthreads();
  auto key_at = [&](int64_t u) { return cached ? key_cache[u] : select_key(sr[u], u); };
  __shared__ unsigned hist[256];
  __shared__ int s_bin;
  __shared__ long long s_rem;
  uint64_t prefix = 0, pmask = 0;
  long long rem = topk;
  // Radix select of the topk-th largest key, 8 bits at a time from the top.
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    // Keys agree on their top bits, so most land in a few bins: lanes with the same bin combine
    // their counts first (one shared-memory atomic per distinct bin per warp, not per key).
    for (int64_t c0 = 0; c0 < n; c0 += blockDim.x) {
      const int64_t u = c0 + threadIdx.x;
      int bin = -1;
      if (u < n) {
        const uint64_t key = key_at(u);
        if ((key & pmask) == prefix) bin = int((key >> shift) & 255u);
      }
      const unsigned same = __match_any_sync(0xffffffffu, bin);
      if (bin >= 0 && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], unsigned(__popc(same)));
    }
    __syncthreads();
    // The bin holding the rem-th largest key, counting from bin 255 down: warp 0, lane l owns
    // bins 255 - 8l .. 248 - 8l; a scan over lanes finds the lane, the lane walks its 8 bins.
    if (threadIdx.x < 32) {
      const int lane = int(threadIdx.x);
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
      const unsigned reach = __ballot_sync(0xffffffffu, (long long)inc >= rem);
      if (lane == __ffs(reach) - 1) {  // the matching keys number >= rem, so some lane reaches it
        long long cum = (long long)(inc - tot);
        int b = 255 - lane * 8;
        for (int i = 0; i < 8; ++i) {
          b = 255 - (lane * 8 + i);
          if (b == 0 || cum + (long long)c[i] >= rem) break;
          cum += c[i];
        }
        s_bin = b;
        s_rem = rem - cum;
      }
    }
    __syncthreads();
    prefix |= uint64_t(s_bin) << shift;
    pmask |= uint64_t(255) << shift;
    rem = s_rem;
    __syncthreads();
  }
  // Keys >= the threshold are exactly the top k (keys are distinct); write them in position order.
  __shared__ int warp_counts[32];
  __shared__ int base;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int64_t c0 = 0; c0 < n; c0 += blockDim.x) {
    const int64_t u = c0 + threadIdx.x;
    const bool f = u < n && key_at(u) >= prefix;
    const unsigned ballot = __ballot_sync(0xffffffffu, f);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int off = base;
    for (int w = 0; w < warp; ++w) off += warp_counts[w];
    if (f) sel[off + __popc(ballot & ((1u << lane) - 1u))] = int32_t(u);
    __syncthreads();
    if (threadIdx.x == 0) {
      int tot = 0;
      for (int w = 0; w < nw; ++w) tot += warp_counts[w];
      base += tot;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) counts[t] = int32_t(topk);
}

constexpr int kMaxGroups = 64, kMaxTopK = 64;

// One block per token: sigmoid in parallel; group scores and the topk_group groups by one warp;
// then the top_k experts exactly as the CPU reference chooses them (the largest score, the lower
// index on ties; NaN scores only when nothing else is left, lowest index first, since the
// reference's order is undefined for them) by rank: each thread counts the experts that come
// before its own in that order, and those of rank < top_k are taken. Ids ascending, weights
// normalized in that order. (One thread choosing took 10 us a layer at 16 experts; a warp taking
// the top_k one argmax after another, 8.5 us: K dependent rounds of shuffles. H200, ncu.)
__device__ __forceinline__ bool route_before(float a, int ia, float b, int ib) {
  if (a != a) return b != b && ia < ib;  // NaN: after every number, by index among NaNs
  if (b != b) return true;
  return a > b || (a == b && ia < ib);
}
__global__ void moe_route_kernel(const float* __restrict__ logits, int E, int G, int topk_group, int K,
                                 const float* __restrict__ bias, bool norm, float rsf, int32_t* __restrict__ ids,
                                 float* __restrict__ weights) {
  pdl_begin();
  extern __shared__ float sm[];
  float* p = sm;
  float* ch = sm + E;
  unsigned char* taken = reinterpret_cast<unsigned char*>(sm + 2 * E);
  __shared__ int id[kMaxTopK];
  const int64_t t = blockIdx.x;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float pv = 1.0f / (1.0f + expf(-logits[t * E + e]));
    p[e] = pv;
    ch[e] = pv + (bias ? bias[e] : 0.0f);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, per_group = E / G;
  if (G > 1 && threadIdx.x < 32) {  // lane holds groups lane and lane + 32 (G <= kMaxGroups = 64)
    float gs[2];
    bool keep[2] = {false, false};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int g = lane + 32 * h;
      float m1 = -INFINITY, m2 = -INFINITY;
      if (g < G)
        for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
          const float v = ch[e];
          if (v > m1) { m2 = m1; m1 = v; } else if (v > m2) { m2 = v; }
        }
      gs[h] = per_group >= 2 ? m1 + m2 : m1;
    }
    for (int i = 0; i < topk_group; ++i) {
      Best b{0.0f, -1};
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (lane + 32 * h < G && !keep[h]) consider(b, gs[h], lane + 32 * h);
      b = warp_best(b);
      if (b.i < 0) {  // only NaN scores left: the lowest group not kept
        const unsigned low = __ballot_sync(0xffffffffu, lane < G && !keep[0]);
        b.i = low ? __ffs(low) - 1 : 32 + __ffs(__ballot_sync(0xffffffffu, lane + 32 < G && !keep[1])) - 1;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (b.i == lane + 32 * h) keep[h] = true;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (lane + 32 * h < G && !keep[h])
        for (int e = (lane + 32 * h) * per_group; e < (lane + 32 * h + 1) * per_group; ++e) ch[e] = -INFINITY;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float v = ch[e];
    int rank = 0;
    for (int f = 0; f < E; ++f) rank += route_before(ch[f], f, v, e) ? 1 : 0;
    taken[e] = rank < K ? 1 : 0;
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  int k = 0;  // the taken experts in ascending order, 32 at a time
  for (int e0 = 0; e0 < E; e0 += 32) {
    const bool mine = e0 + lane < E && taken[e0 + lane];
    const unsigned m = __ballot_sync(0xffffffffu, mine);
    if (mine) id[k + __popc(m & ((1u << lane) - 1u))] = e0 + lane;
    k += __popc(m);
  }
  __syncwarp();
  if (lane != 0) return;
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) sum += p[id[k]];
  for (int k = 0; k < K; ++k) {
    float v = p[id[k]];
    if (norm) v /= (sum + 1e-20f);
    ids[t * K + k] = id[k];
    weights[t * K + k] = v * rsf;
  }
}

}  // namespace

// Process-wide (tests switch it with cuda_set_absorb_ahead); VIREO_ABSORB_AHEAD=0: W_UK read after
// the wait (A/B runs).
static bool g_absorb_ahead = env_switch("VIREO_ABSORB_AHEAD");
static int64_t g_absorb_staged = 0;  // launches of the staged form (tests check it is taken)
void set_absorb_ahead(bool on) { g_absorb_ahead = on; }
int64_t absorb_staged_launches() { return g_absorb_staged; }

void absorb_q(const float* q, int64_t T, int64_t H, int64_t qw, int64_t nope, const DevW& kvb, int64_t hw, int64_t L,
              float* qlat, cudaStream_t st, AbsorbRope rope, bool stage_ahead) {
  if (rope.q && (rope.q != q || !absorb_rope_fits(qw - nope)))
    fail("absorb_q: the fused RoPE takes q itself and a rope part of at most 64 (even), not ", qw - nope);
  if (kvb_rows_vectorizable(kvb, L)) {
    const int n = 16 / (kvb.dt == W_F32 ? 4 : kvb.dt == W_FP8 ? 1 : 2);
    const dim3 grid(unsigned(H), unsigned((L + 32 * n - 1) / (32 * n)), unsigned(T));
    // The staged form (FP8 W_UK, the measured case): every row's chunk for each thread (96 KB at
    // GLM-5 shapes, leaving room on the SM for q_b's blocks beside it), at least the partial
    // sums' 32 KB (they reuse it).
    constexpr size_t kStageMax = 128 * 1024;
    const size_t stage = std::max<size_t>(size_t((nope + kAqW - 1) / kAqW) * kAqW * 32 * 16, size_t(kAqW) * 32 * 64);
    const bool ahead = stage_ahead && g_absorb_ahead && kvb.dt == W_FP8 && stage <= kStageMax;
    auto go = [&](auto dt) {
      constexpr int DT = decltype(dt)::value;
      if constexpr (DT == W_FP8) {
        if (ahead) {
          allow_dynamic_smem<absorb_q_vec_kernel<DT, true>, kStageMax>();
          launch(absorb_q_vec_kernel<DT, true>, grid, kAqW * 32, stage, st, q, H, qw, nope, kvb, hw, L, qlat, rope);
          ++g_absorb_staged;
          return;
        }
      }
      launch(absorb_q_vec_kernel<DT>, grid, kAqW * 32, 0, st, q, H, qw, nope, kvb, hw, L, qlat, rope);
    };
    switch (kvb.dt) {
      case W_F32: go(std::integral_constant<int, W_F32>{}); break;
      case W_BF16: go(std::integral_constant<int, W_BF16>{}); break;
      case W_F16: go(std::integral_constant<int, W_F16>{}); break;
      default: go(std::integral_constant<int, W_FP8>{}); break;
    }
  } else {
    launch(absorb_q_kernel, dim3(unsigned(H), unsigned(T)), 256, size_t(nope) * 4, st, q, H, qw, nope, kvb, hw, L, qlat,
           rope);
  }
  VIREO_CUDA_LAUNCHED();
}

static_assert(kSplit == CudaBufferSizes::kDecodeSplitKeys, "the decode splits' rule (cuda_backend.h) counts these");

void mla_decode(const DecodeAttnArgs& a, cudaStream_t st) {
  if (a.fast && mla_decode_fast(a, st)) return;
  const size_t smem = size_t(kHG * a.kvw + kChunk * (a.kvw + 1) + kHG * kSplit) * 4 + size_t(kSplit) * 4;
  static bool configured = false;
  if (!configured) {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(mla_decode_partial_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          200 * 1024));
    configured = true;
  }
  if (smem > 200 * 1024 || a.L > 1024)
    fail("mla_attention: latent width ", a.kvw, " is too wide for the decode kernel");
  dim3 grid(unsigned(a.nsplit), unsigned((a.H + kHG - 1) / kHG), unsigned(a.T));
  launch(mla_decode_partial_kernel, grid, 256, smem, st, a.qlat, a.q, a.H, a.qw, a.nope, a.L, a.kv, a.kvw, a.pos0,
         a.pos0_dev, a.sel, a.counts, a.sel_stride, a.scale, a.nsplit, a.opart, a.mpart, a.lpart);
  VIREO_CUDA_LAUNCHED();
  // q_lat is not read after the partial kernel: the merged o_lat goes in its place.
  float* olat = const_cast<float*>(a.qlat);
  launch(mla_decode_combine_kernel, dim3(unsigned(a.H), unsigned(a.T)), 256, 0, st, a.opart, a.mpart, a.lpart, a.nsplit,
         a.H, a.L, olat);
  VIREO_CUDA_LAUNCHED();
  const bool vec = kvb_rows_vectorizable(a.kvb, a.L);
  switch (a.kvb.dt) {
    case W_F32: launch_wuv<W_F32>(vec, olat, a.T, a.H, a.L, a.kvb, a.hw, a.nope, a.vd, a.out, st); break;
    case W_BF16: launch_wuv<W_BF16>(vec, olat, a.T, a.H, a.L, a.kvb, a.hw, a.nope, a.vd, a.out, st); break;
    case W_F16: launch_wuv<W_F16>(vec, olat, a.T, a.H, a.L, a.kvb, a.hw, a.nope, a.vd, a.out, st); break;
    default: launch_wuv<W_FP8>(vec, olat, a.T, a.H, a.L, a.kvb, a.hw, a.nope, a.vd, a.out, st); break;
  }
  VIREO_CUDA_LAUNCHED();
}

void build_mask(const int32_t* sel, const int32_t* counts, int64_t T, int64_t stride, int64_t mwords, uint32_t* mask,
                cudaStream_t st) {
  VIREO_CUDA_CHECK(cudaMemsetAsync(mask, 0, size_t(T * mwords) * 4, st));
  launch(build_mask_kernel, unsigned(T), 256, 0, st, sel, counts, stride, mwords, mask);
  VIREO_CUDA_LAUNCHED();
}

namespace {

template <int NV>
bool launch_prefill_tc(const PrefillAttnArgs& a, cudaStream_t st) {
  const int64_t qp = (a.qw + 15) / 16 * 16, qsw = qp / 2 + 4;
  const size_t smem = size_t(2 * (kTcBQ + kTcBK) * qsw + 2 * 8 * NV * kTcVSW) * 4;
  if (smem > size_t(227) * 1024) return false;
  static bool configured = false;
  if (!configured) {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(mla_prefill_tc_kernel<NV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          227 * 1024));
    configured = true;
  }
  dim3 grid(unsigned((a.T + kTcBQ - 1) / kTcBQ), unsigned(a.H));
  launch(mla_prefill_tc_kernel<NV>, grid, 256, smem, st, a.q, a.T, a.H, a.qw, qp, a.nope, a.vd, a.L, a.kv, a.kvw, a.kvx,
         a.hw, a.n_keys, a.pos0, a.mask, a.mwords, a.scale, a.out);
  VIREO_CUDA_LAUNCHED();
  return true;
}

}  // namespace

bool mla_prefill_tc(const PrefillAttnArgs& a, cudaStream_t st) {
  if (a.vd <= 32) return launch_prefill_tc<4>(a, st);
  if (a.vd <= 64) return launch_prefill_tc<8>(a, st);
  if (a.vd <= 128) return launch_prefill_tc<16>(a, st);
  if (a.vd <= 256) return launch_prefill_tc<32>(a, st);
  return false;
}

void mla_prefill(const PrefillAttnArgs& a, cudaStream_t st) {
  const size_t smem = size_t((kQT + kKT) * (a.qw + 1) + (kKT + kQT) * a.vd) * 4;
  static bool configured = false;
  if (!configured) {
    VIREO_CUDA_CHECK(
        cudaFuncSetAttribute(mla_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    configured = true;
  }
  if (smem > 220 * 1024) fail("mla_attention: head dims ", a.qw, "/", a.vd, " are too wide for the prefill kernel");
  dim3 grid(unsigned((a.T + kQT - 1) / kQT), unsigned(a.H));
  launch(mla_prefill_kernel, grid, 256, smem, st, a.q, a.T, a.H, a.qw, a.nope, a.vd, a.L, a.kv, a.kvw, a.kvx, a.hw,
         a.n_keys, a.pos0, a.mask, a.mwords, a.scale, a.out);
  VIREO_CUDA_LAUNCHED();
}

void indexer_scores(const float* q, const float* wts, const float* keys, int64_t T, int64_t nI, int64_t d,
                    int64_t n_keys, int64_t pos0, const int32_t* pos0_dev, int64_t topk, float scale, float wscale,
                    float* scores, cudaStream_t st, bool fast) {
  const bool aligned = reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(keys) % 16 == 0;
  const size_t smem4 = size_t(nI * d + 32 * (d + 4) + 32 * (nI + 1)) * 4;
  // Run-time positions (a recorded decode step): every row and the bound's key blocks are
  // launched, rows and blocks past the real causal count exit at once.
  if ((fast || !pos0_dev) && d % 4 == 0 && aligned && smem4 <= 200 * 1024) {
    static bool configured4 = false;
    if (!configured4) {
      VIREO_CUDA_CHECK(
          cudaFuncSetAttribute(indexer_score_v4_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
      configured4 = true;
    }
    // Rows before t_first take every causal key (no scores needed).
    const int64_t t_first = pos0_dev ? 0 : std::max<int64_t>(0, topk - pos0);
    if (t_first >= T) return;
    dim3 grid(unsigned((n_keys + 31) / 32), unsigned(T - t_first));
    launch(indexer_score_v4_kernel, grid, kV4Threads, smem4, st, q, wts, keys, nI, d, n_keys, pos0, pos0_dev, topk,
           scale, wscale, t_first, scores);
    VIREO_CUDA_LAUNCHED();
    return;
  }
  const size_t smem = size_t(nI * d + 32 * (d + 1) + 32 * (nI + 1)) * 4;
  static bool configured = false;
  if (!configured) {
    VIREO_CUDA_CHECK(
        cudaFuncSetAttribute(indexer_score_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    configured = true;
  }
  if (smem > 200 * 1024) fail("indexer: ", nI, " heads x ", d, " are too wide for the score kernel");
  dim3 grid(unsigned((n_keys + 31) / 32), unsigned(T));
  launch(indexer_score_kernel, grid, 256, smem, st, q, wts, keys, nI, d, n_keys, pos0, pos0_dev, topk, scale, wscale,
         scores);
  VIREO_CUDA_LAUNCHED();
}

void indexer_topk(const float* scores, int64_t T, int64_t n_keys, int64_t pos0, const int32_t* pos0_dev, int64_t topk,
                  int32_t* selected, int32_t* counts, cudaStream_t st, bool fast) {
  if (fast && indexer_topk_fast(scores, T, n_keys, pos0, pos0_dev, topk, selected, counts, st)) return;
  constexpr int64_t kMaxCached = 12288;  // keys (96 KiB of shared memory)
  static bool configured = false;
  if (!configured) {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(indexer_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(kMaxCached * 8)));
    configured = true;
  }
  const int64_t cap = std::min(n_keys, kMaxCached);
  launch(indexer_topk_kernel, unsigned(T), 512, size_t(cap) * 8, st, scores, n_keys, pos0, pos0_dev, topk, selected,
         counts, cap);
  VIREO_CUDA_LAUNCHED();
}

void moe_route(const float* logits, int64_t T, int E, int G, int topk_group, int K, const float* bias, bool norm,
               float rsf, int32_t* ids, float* weights, cudaStream_t st) {
  if (G > kMaxGroups || K > kMaxTopK || G < 1 || E % G != 0 || topk_group > G || K > E)
    fail("moe_route: unsupported routing shape (", E, " experts, ", G, " groups, top ", topk_group, " groups, top_k ",
         K, ")");
  const size_t smem = size_t(E) * 8 + size_t(E);
  launch(moe_route_kernel, unsigned(T), 256, smem, st, logits, E, G, topk_group, K, bias, norm, rsf, ids, weights);
  VIREO_CUDA_LAUNCHED();
}

}  // namespace vireo::cuda
