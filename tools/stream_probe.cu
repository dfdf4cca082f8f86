// vireo_stream_probe: what feeds the one-token FP8 GEMVs best, and what L2 keeps. Session 48
// (BENCHMARKS.md "Session 48") asked three questions of the decode step's FP8 walks (gate | up 201
// MB, down 113 MB, o_proj 100 MB a layer at 3.5-4.0 TB/s, where staying blocks of plain loads read
// ~4.1-4.25 at those sizes):
//  1. Is the gap the FP8 arithmetic? Forms, each one block of 16 warps an SM, a warp a unit (a
//     pair of rows of R FP8 bytes, the walks' unit, dealt u = warp * grid + block), x (R floats)
//     staged in shared memory as the walks stage it, each unit's two dots written out:
//       reg      the walks' lane_dot2: four 16-byte chunks of each row in flight a lane;
//       reg fold the same loads, no arithmetic (each chunk folded into a word);
//       bulk D   each warp a ring of D stages in shared memory filled by cp.async.bulk (lane 0
//                issues, an mbarrier a stage), consumed as reg consumes (checked: reg's bits);
//       mma      x as e4m3 bytes (fast-fp8's act_quant), each lane's 16 weight bytes a column of
//                B and its x bytes a row of A of two mma.sync m16n8k32 (the diagonal is the dot;
//                checked against the host's sums);
//       f16 x    x staged as f16 with a power-of-two scale a 128-column block (the backend's
//                stage_x_f16), each chunk summed by 8 f16x2 FMAs (dot_chunk_h; session 49,
//                which took it into fast-fp8's one-token products; checked against reg's sums).
//  2. Does a bulk-copy ring beat the warps' own loads? (No: every ring form read slower.)
//  3. Does L2 keep a weight's first bytes through other streaming reads ("L2 keep")? A prefix of
//     P MB touched by plain loads, by loads with an evict_last policy or by prefetch.global.L2::
//     evict_last, then 64 MB of other reads, then the prefix read as o_proj's rows, timed alone.
//  4. (Session 65) Does o_proj read faster whole when the first W KB of each row are in L2 ("o_proj
//     warm")? The answer says whether warming its row heads beside the attention can gain at all.
// Each form row: the median of 9 timed replays of a round robin over enough copies of the weights
// that none is in L2 when read again; GB/s counts each weight byte read once.
//
//   build-cuda/vireo_stream_probe [FORM]  (built with the CUDA backend; needs an sm_90 GPU)
// FORM: only the forms whose name holds it (and reg, their reference), no L2-keep or o_proj-warm
// section; `warm`: the o_proj-warm section alone.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cuda/cuda_kernels.cuh"  // the engine's own FP8 dot, x swizzle and staging
#include "backend/cuda/cuda_wgmma.cuh"    // its mbarrier helpers
#include "probe_check.h"

using namespace vireo::cuda;

constexpr const char* kProbeName = "vireo_stream_probe";
constexpr int kWarps = 16;

// bytes (a multiple of 16) from global src to shared dst, counted on bar; the L2 told to keep the
// lines first in line for eviction (each weight byte is read once).
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

// Four 16-byte chunks of each of a unit's two rows, a lane's share of one trip (lane_dot2's).
__device__ __forceinline__ void load_pair4(const uint4* ar, const uint4* br, int v, uint4 (&wa)[4], uint4 (&wb)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    wa[i] = ld16(ar + v + 32 * i);
    wb[i] = ld16(br + v + 32 * i);
  }
}

// The walks' form. FOLD: no arithmetic.
template <bool FOLD>
__global__ void __launch_bounds__(32 * kWarps, 1) walk_reg(const uint8_t* __restrict__ w, int64_t units, int R,
                                                           const float* __restrict__ x, float* __restrict__ out) {
  extern __shared__ float4 xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  stage_x(x, R, xs);
  const int nv = R / 16;
  for (int64_t u = int64_t(warp) * gridDim.x + blockIdx.x; u < units; u += int64_t(gridDim.x) * kWarps) {
    const uint4* ar = reinterpret_cast<const uint4*>(w + u * 2 * R);
    const uint4* br = ar + nv;
    float acc_a = 0.0f, acc_b = 0.0f;
    unsigned f = 0;
    for (int v = lane; v < nv; v += 128) {
      uint4 wa[4], wb[4];
      load_pair4(ar, br, v, wa, wb);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (FOLD) {
          f ^= fold(wa[i]) ^ fold(wb[i]);
        } else {
          float4 xv[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) xv[j] = xs[xs_slot((v + 32 * i) * 4 + j)];
          acc_a += dot_chunk<W_FP8>(wa[i], xv);
          acc_b += dot_chunk<W_FP8>(wb[i], xv);
        }
      }
    }
    if constexpr (FOLD) acc_a = float(f & 1u);
    acc_a = warp_sum(acc_a);
    acc_b = warp_sum(acc_b);
    if (lane == 0) {
      out[2 * u] = acc_a;
      out[2 * u + 1] = acc_b;
    }
  }
}

// The bulk-copy ring: warp w's stages [w D, (w + 1) D) of 2 sb bytes each (row a's next sb bytes,
// then row b's), an mbarrier a stage. Stage number j of the warp (over all its units) lives in ring
// slot j % D and completes phase (j / D) & 1 of that slot's barrier.
template <bool FOLD>
__global__ void __launch_bounds__(32 * kWarps, 1)
    walk_bulk(const uint8_t* __restrict__ w, int64_t units, int R, const float* __restrict__ x, float* __restrict__ out,
              int D, int sb) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float4* xs = reinterpret_cast<float4*>(smem);
  unsigned char* ring = smem + size_t(R) * 4 + size_t(warp) * D * 2 * sb;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + size_t(R) * 4 + size_t(kWarps) * D * 2 * sb) + warp * D;
  const uint64_t policy = evict_first_policy();
  const int64_t stride = int64_t(gridDim.x) * kWarps, u0 = int64_t(warp) * gridDim.x + blockIdx.x;
  const int per_unit = R / sb;
  const int64_t my_units = u0 < units ? (units - u0 + stride - 1) / stride : 0, stages = my_units * per_unit;
  // Stage j: unit u0 + (j / per_unit) stride, bytes [(j % per_unit) sb, + sb) of each row.
  auto issue = [&](int64_t j) {
    const int slot = int(j % D);
    const int64_t u = u0 + (j / per_unit) * stride;
    const uint8_t* a = w + u * 2 * R + (j % per_unit) * sb;
    const uint32_t bar = smem_u32(bars + slot), dst = smem_u32(ring + size_t(slot) * 2 * sb);
    mbar_expect_tx(bar, 2 * sb);
    bulk_copy(dst, a, sb, bar, policy);
    bulk_copy(dst + sb, a + R, sb, bar, policy);
  };
  if (lane == 0) {
    for (int s = 0; s < D; ++s) mbar_init(smem_u32(bars + s), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int64_t j = 0; j < D && j < stages; ++j) issue(j);
  }
  __syncwarp();
  stage_x(x, R, xs);
  float acc_a = 0.0f, acc_b = 0.0f;
  unsigned f = 0;
  const int cpl = sb / 512;  // chunks a lane a stage (of each row)
  for (int64_t j = 0; j < stages; ++j) {
    const int slot = int(j % D);
    mbar_wait(smem_u32(bars + slot), uint32_t((j / D) & 1));
    const uint4* sa = reinterpret_cast<const uint4*>(ring + size_t(slot) * 2 * sb);
    const uint4* sbp = sa + sb / 16;
    const int v0 = int(j % per_unit) * (sb / 16);
    for (int i = 0; i < cpl; ++i) {
      const uint4 wa = sa[lane + 32 * i], wb = sbp[lane + 32 * i];
      if constexpr (FOLD) {
        f ^= fold(wa) ^ fold(wb);
      } else {
        const int v = v0 + lane + 32 * i;
        float4 xv[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) xv[q] = xs[xs_slot(v * 4 + q)];
        acc_a += dot_chunk<W_FP8>(wa, xv);
        acc_b += dot_chunk<W_FP8>(wb, xv);
      }
    }
    __syncwarp();  // every lane's reads of this slot are done: refill it
    if (lane == 0 && j + D < stages) issue(j + D);
    if (j % per_unit == per_unit - 1) {
      const int64_t u = u0 + (j / per_unit) * stride;
      if constexpr (FOLD) acc_a = float(f & 1u);
      const float a = warp_sum(acc_a), b = warp_sum(acc_b);
      if (lane == 0) {
        out[2 * u] = a;
        out[2 * u + 1] = b;
      }
      acc_a = acc_b = 0.0f;
    }
  }
}

// --- Does L2 keep a prefetched prefix through other streaming reads? ---------------------------
// mode 0: plain streaming loads (as ld16); 1: loads with an evict_first policy; 2: loads with an
// evict_last policy; 3: prefetch.global.L2::evict_last a 128-byte line a thread (no loads);
// 4: applypriority evict_normal (undo 2 and 3 on these lines).
__device__ __forceinline__ uint4 ld16_policy(const uint4* p, uint64_t pol) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(pol));
  return r;
}
__global__ void __launch_bounds__(512, 1)
    touch(const uint8_t* __restrict__ buf, size_t bytes, int mode, unsigned* sink) {
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x, nt = size_t(gridDim.x) * blockDim.x;
  uint64_t pol = 0;
  if (mode == 1) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  if (mode == 2) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
  unsigned acc = 0;
  if (mode <= 2) {
    const uint4* p = reinterpret_cast<const uint4*>(buf);
    const size_t n16 = bytes / 16;
    size_t i = tid;
    for (; i + 7 * nt < n16; i += 8 * nt) {
      uint4 a[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] = mode == 0 ? ld16(p + i + k * nt) : ld16_policy(p + i + k * nt, pol);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc ^= fold(a[k]);
    }
    for (; i < n16; i += nt) acc ^= fold(mode == 0 ? ld16(p + i) : ld16_policy(p + i, pol));
  } else {
    for (size_t l = tid; l < bytes / 128; l += nt) {
      const uint8_t* a = buf + l * 128;
      if (mode == 3) asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(a));
      else asm volatile("applypriority.global.L2::evict_normal [%0], 128;\n" ::"l"(a));
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The first `prefix` bytes of each of `rows` rows (row_bytes apart) touched by loads in `mode`
// (touch's 0: plain, 2: evict_last policy): a warming kernel's work on o_proj's row heads.
__global__ void __launch_bounds__(512, 1) touch_prefix(const uint8_t* __restrict__ buf, int64_t rows, int64_t row_bytes,
                                                       int64_t prefix, int mode, unsigned* sink) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, nt = int64_t(gridDim.x) * blockDim.x;
  const int64_t cpr = prefix / 16, n = rows * cpr;
  uint64_t pol = 0;
  if (mode == 2) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
  auto at = [&](int64_t i) { return reinterpret_cast<const uint4*>(buf + (i / cpr) * row_bytes) + i % cpr; };
  unsigned acc = 0;
  int64_t i = tid;
  for (; i + 7 * nt < n; i += 8 * nt) {
    uint4 a[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) a[k] = mode == 0 ? ld16(at(i + k * nt)) : ld16_policy(at(i + k * nt), pol);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= fold(a[k]);
  }
  for (; i < n; i += nt) acc ^= fold(mode == 0 ? ld16(at(i)) : ld16_policy(at(i), pol));
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The unit loop of the forms below: each warp's units u = warp * grid + block, ... (a pair of
// rows of R bytes, row b after row a), four 16-byte chunks of each row a lane a trip (load_pair4);
// chunk(wa, wb, c, acc_a, acc_b) adds chunk c of both rows, keep(lane) says whose sums the warp adds.
template <int WARPS = kWarps, class Chunk, class Keep>
__device__ __forceinline__ void walk_pairs(const uint8_t* __restrict__ w, int64_t units, int R, float* __restrict__ out,
                                           Chunk chunk, Keep keep) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nv = R / 16;
  for (int64_t u = int64_t(warp) * gridDim.x + blockIdx.x; u < units; u += int64_t(gridDim.x) * WARPS) {
    const uint4* ar = reinterpret_cast<const uint4*>(w + u * 2 * R);
    const uint4* br = ar + nv;
    float acc_a = 0.0f, acc_b = 0.0f;
    for (int v = lane; v < nv; v += 128) {
      uint4 wa[4], wb[4];
      load_pair4(ar, br, v, wa, wb);
#pragma unroll
      for (int i = 0; i < 4; ++i) chunk(u, wa[i], wb[i], v + 32 * i, acc_a, acc_b);
    }
    acc_a = warp_sum(keep(lane) ? acc_a : 0.0f);
    acc_b = warp_sum(keep(lane) ? acc_b : 0.0f);
    if (lane == 0) {
      out[2 * u] = acc_a;
      out[2 * u + 1] = acc_b;
    }
  }
}

// e4m3 x e4m3 on the tensor cores for ONE token (fast-fp8's arithmetic: x quantized per 128
// columns): lane l's 16 weight bytes of a row are B's column g = l / 4 (k = the lane's two 8-byte
// halves, one mma each), x's matching 16 bytes A's row g; D[g][g] is then the dot of the 64 bytes
// of lanes 4g..4g+3 (one 128-column block), held by lane (g, g / 2); the other D entries are
// cross terms, dropped. Each chunk's diagonal is scaled by the weight's and x's block scales and
// added in f32. Same loads as walk_reg (512 contiguous bytes a warp a row), ~6 instructions a
// 16-byte chunk instead of ~45.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float chunk_diag(const uint4& w, const uint4& xq, bool odd) {
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_e4m3(d, xq.x, xq.y, w.x, w.y);
  mma_e4m3(d, xq.z, xq.w, w.z, w.w);
  return odd ? d[1] : d[0];
}
__global__ void __launch_bounds__(32 * kWarps, 1)
    walk_mma(const uint8_t* __restrict__ w, int64_t units, int R, const uint8_t* __restrict__ xq_g,
             const float* __restrict__ xs_g, const float* __restrict__ ws_g, float* __restrict__ out) {
  extern __shared__ float4 sm4[];
  uint4* xq = reinterpret_cast<uint4*>(sm4);           // R e4m3 bytes
  float* xsc = reinterpret_cast<float*>(sm4) + R / 4;  // R / 128 scales
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  for (int q = int(threadIdx.x); q < R / 16; q += int(blockDim.x)) xq[q] = reinterpret_cast<const uint4*>(xq_g)[q];
  for (int q = int(threadIdx.x); q < R / 128; q += int(blockDim.x)) xsc[q] = xs_g[q];
  __syncthreads();
  const bool diag = tig == (g >> 1), odd = g & 1;
  const int nb = R / 128;
  walk_pairs(
      w, units, R, out,
      [&](int64_t u, const uint4& wa, const uint4& wb, int c, float& acc_a, float& acc_b) {
        const float* sa = ws_g + ((2 * u) >> 7) * nb;  // the rows' block scales (one 128-row block)
        const uint4 x = xq[c];
        const float s = sa[c >> 3] * xsc[c >> 3];
        acc_a += s * chunk_diag(wa, x, odd);
        acc_b += s * chunk_diag(wb, x, odd);
      },
      [&](int) { return diag; });
}

// fast-fp8 candidate: x staged as f16 per 128-column block (stage_x_f16), each chunk summed by 8
// f16x2 FMAs (dot_chunk_h), scaled by x's block scale in f32 (the weights' scales are 1 here, as
// reg applies none). Checked against reg's sums (max |diff| / max |reg|). WARPS 32: the shape of
// o_proj's blocks in the step (one of 32 warps an SM, a row pair a warp: its 3072 pairs in one
// wave), not their kernel (cold it reads ~2.6 TB/s on an H100, below the step's o_proj).
template <int WARPS = kWarps>
__global__ void __launch_bounds__(32 * WARPS, 1)
    walk_h(const uint8_t* __restrict__ w, int64_t units, int R, const float* __restrict__ x, float* __restrict__ out) {
  extern __shared__ float4 sm4[];
  uint4* xh = reinterpret_cast<uint4*>(sm4);           // R halves
  float* xsc = reinterpret_cast<float*>(sm4) + R / 2;  // R / 128 scales
  stage_x_f16(x, R, xh, xsc);
  walk_pairs<WARPS>(
      w, units, R, out,
      [&](int64_t, const uint4& wa, const uint4& wb, int c, float& acc_a, float& acc_b) {
        const uint4 x0 = xh[xh_slot(2 * c)], x1 = xh[xh_slot(2 * c + 1)];
        const float s = xsc[c >> 3];
        acc_a += s * dot_chunk_h(wa, x0, x1);
        acc_b += s * dot_chunk_h(wb, x0, x1);
      },
      [](int) { return true; });
}

// Nine trials of: prep(t) (untimed), touch(t) (timed: *touch_us), between(t), read(t) (timed:
// *read_us); the medians. t picks the trial's copy of the weights. A failed CUDA call exits (CHECK).
template <class Prep, class Touch, class Between, class Read>
void touch_then_read(cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, Prep prep, Touch touch_fn, Between between,
                     Read read, float* read_us, float* touch_us) {
  std::vector<float> us, tus;
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  for (int t = 0; t < 9; ++t) {
    prep(t);
    CHECK(cudaEventRecord(t0, st));
    touch_fn(t);
    CHECK(cudaEventRecord(t1, st));
    between(t);
    CHECK(cudaEventRecord(e0, st));
    read(t);
    CHECK(cudaEventRecord(e1, st));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0, tms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    CHECK(cudaEventElapsedTime(&tms, t0, t1));
    us.push_back(ms * 1e3f);
    tus.push_back(tms * 1e3f);
  }
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  CHECK(cudaGetLastError());
  std::sort(us.begin(), us.end());
  std::sort(tus.begin(), tus.end());
  *read_us = us[4];
  *touch_us = tus[4];
}

int main(int argc, char** argv) {
  // An argument: only the forms whose name holds it (reg always, as the others' reference), and no
  // L2-keep or o_proj-warm section; `warm`: the o_proj-warm section alone.
  const char* only = argc > 1 ? argv[1] : nullptr;
  const bool warm_only = only && std::strcmp(only, "warm") == 0;  // the o_proj warm-prefix section alone
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB, smem/block optin %zu KB\n", prop.name, sms, prop.l2CacheSize >> 20,
              prop.sharedMemPerBlockOptin >> 10);
  const size_t pool_bytes = size_t(2) << 30;
  uint8_t* pool;
  CHECK(cudaMalloc(&pool, pool_bytes));
  {  // e4m3 bytes with varied finite values (no NaN: 0x7f / 0xff avoided)
    std::vector<uint8_t> h(size_t(64) << 20);
    uint32_t s = 12345;
    for (auto& b : h) {
      s = s * 1664525u + 1013904223u;
      b = uint8_t((s >> 24) % 0x70);
      if (s & 0x100) b |= 0x80;
    }
    for (size_t off = 0; off < pool_bytes; off += h.size())
      CHECK(cudaMemcpy(pool + off, h.data(), std::min(h.size(), pool_bytes - off), cudaMemcpyHostToDevice));
  }
  float *x, *out_ref, *out;
  CHECK(cudaMalloc(&x, 16384 * 4));
  {
    std::vector<float> hx(16384);
    for (int i = 0; i < 16384; ++i) hx[size_t(i)] = float((i * 37) % 101 - 50) / 64.0f;
    CHECK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
  }
  // fast-fp8's one-token inputs: x's e4m3 bytes, its block scales, the weights' block scales.
  uint8_t* xq8;
  float *xsc, *wsc;
  CHECK(cudaMalloc(&xq8, 16384));
  CHECK(cudaMemcpy(xq8, pool + 12345 * 16, 16384, cudaMemcpyDeviceToDevice));
  CHECK(cudaMalloc(&xsc, 128 * 4));
  CHECK(cudaMalloc(&wsc, size_t(1) << 24));
  {
    std::vector<float> ones(size_t(1) << 22, 1.0f);
    CHECK(cudaMemcpy(xsc, ones.data(), 128 * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(wsc, ones.data(), size_t(1) << 24, cudaMemcpyHostToDevice));
  }
  const size_t max_units = size_t(1) << 20;
  CHECK(cudaMalloc(&out_ref, max_units * 8));
  CHECK(cudaMalloc(&out, max_units * 8));
  cudaStream_t st;
  CHECK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const int smem_max = int(prop.sharedMemPerBlockOptin);
  for (auto k : {walk_reg<false>, walk_reg<true>})
    CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
  for (auto k : {walk_bulk<false>, walk_bulk<true>})
    CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
  CHECK(cudaFuncSetAttribute(walk_mma, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
  for (auto k : {walk_h<kWarps>, walk_h<32>})
    CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));

  struct Shape {
    const char* name;
    int R;
    size_t bytes;
  };
  const Shape shapes[] = {{"gate|up 6 KB rows", 6144, size_t(201326592)},
                          {"down 2 KB rows", 2048, size_t(113246208)},
                          {"o_proj 16 KB rows", 16384, size_t(100663296)}};
  struct Form {
    const char* name;
    bool bulk, fold;
    int D, sb;
    bool mma = false, h16 = false;
  };
  const Form forms[] = {
      {"reg", false, false, 0, 0},
      {"reg fold", false, true, 0, 0},
      {"bulk D2 sb2048", true, false, 2, 2048},
      {"bulk D3 sb2048", true, false, 3, 2048},
      {"bulk D2 sb3072", true, false, 2, 3072},
      {"bulk D4 sb1024", true, false, 4, 1024},
      {"bulk D6 sb1024", true, false, 6, 1024},
      {"bulk D3 sb2048 fold", true, true, 3, 2048},
      {"mma e4m3 (x e4m3)", false, false, 0, 0, true},
      {"f16 x, hfma2", false, false, 0, 0, false, true},
  };
  for (const Shape& sh : shapes) {
    if (warm_only) break;
    const int64_t units = int64_t(sh.bytes / (2 * size_t(sh.R)));
    const int copies =
        int(std::max<size_t>(1, std::min<size_t>(pool_bytes / sh.bytes, (size_t(400) << 20) / sh.bytes + 1)));
    for (const Form& f : forms) {
      if (f.bulk && sh.R % f.sb != 0) continue;
      if (only && !std::strstr(f.name, only) && std::strcmp(f.name, "reg") != 0) continue;
      const size_t smem = f.mma   ? size_t(sh.R) + size_t(sh.R) / 32
                          : f.h16 ? size_t(sh.R) * 2 + size_t(sh.R) / 32
                                  : size_t(sh.R) * 4 + (f.bulk ? size_t(kWarps) * f.D * (2 * f.sb + 8) : 0);
      if (smem > size_t(smem_max)) continue;
      auto run = [&](int c, float* o) {
        const uint8_t* p = pool + size_t(c % copies) * sh.bytes;
        if (f.h16) {
          walk_h<kWarps><<<sms, 32 * kWarps, smem, st>>>(p, units, sh.R, x, o);
        } else if (f.mma) {
          walk_mma<<<sms, 32 * kWarps, smem, st>>>(p, units, sh.R, xq8, xsc, wsc, o);
        } else if (!f.bulk) {
          if (f.fold) walk_reg<true><<<sms, 32 * kWarps, smem, st>>>(p, units, sh.R, x, o);
          else walk_reg<false><<<sms, 32 * kWarps, smem, st>>>(p, units, sh.R, x, o);
        } else {
          if (f.fold) walk_bulk<true><<<sms, 32 * kWarps, smem, st>>>(p, units, sh.R, x, o, f.D, f.sb);
          else walk_bulk<false><<<sms, 32 * kWarps, smem, st>>>(p, units, sh.R, x, o, f.D, f.sb);
        }
      };
      // The same sums as reg's, bit for bit (copy 0).
      const char* same = "";
      if (f.mma) {  // against the host's sum of the e4m3 products (scales 1), units 0..7
        run(0, out);
        CHECK(cudaStreamSynchronize(st));
        std::vector<uint8_t> hw(size_t(16) * sh.R), hx(size_t(sh.R));
        std::vector<float> got(16);
        CHECK(cudaMemcpy(hw.data(), pool, hw.size(), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(hx.data(), xq8, hx.size(), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(got.data(), out, 64, cudaMemcpyDeviceToHost));
        auto e4m3 = [](uint8_t b) {
          const int e = (b >> 3) & 15, m = b & 7;
          const double v = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
          return b & 0x80 ? -v : v;
        };
        double worst = 0;
        for (int r = 0; r < 16; ++r) {
          double ref = 0, mag = 0;
          for (int k = 0; k < sh.R; ++k) {
            ref += e4m3(hw[size_t(r) * sh.R + k]) * e4m3(hx[size_t(k)]);
            mag += std::fabs(e4m3(hw[size_t(r) * sh.R + k]) * e4m3(hx[size_t(k)]));
          }
          worst = std::max(worst, std::fabs(got[size_t(r)] - ref) / mag);
        }
        static char msg[64];
        std::snprintf(msg, sizeof msg, "  (vs host: worst |err| / sum|p| %.1e)", worst);
        same = msg;
      }
      if (f.h16) {  // against reg's f32 sums (out_ref, written by the reg form ahead of this one)
        run(0, out);
        CHECK(cudaStreamSynchronize(st));
        std::vector<float> a(size_t(2 * units)), b(size_t(2 * units));
        CHECK(cudaMemcpy(a.data(), out_ref, a.size() * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(b.data(), out, b.size() * 4, cudaMemcpyDeviceToHost));
        double dmax = 0, rmax = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          dmax = std::max(dmax, double(std::fabs(a[i] - b[i])));
          rmax = std::max(rmax, double(std::fabs(a[i])));
        }
        static char msg[64];
        std::snprintf(msg, sizeof msg, "  (vs reg: max |diff| / max |reg| %.1e)", dmax / rmax);
        same = msg;
      }
      if (!f.fold && !f.mma && !f.h16) {
        if (!f.bulk) {
          run(0, out_ref);
        } else {
          run(0, out);
          CHECK(cudaStreamSynchronize(st));
          std::vector<float> a(size_t(2 * units)), b(size_t(2 * units));
          CHECK(cudaMemcpy(a.data(), out_ref, a.size() * 4, cudaMemcpyDeviceToHost));
          CHECK(cudaMemcpy(b.data(), out, b.size() * 4, cudaMemcpyDeviceToHost));
          same = std::memcmp(a.data(), b.data(), a.size() * 4) == 0 ? "  (reg's bits)" : "  (BITS DIFFER)";
        }
      }
      const int reps = std::max(copies, int((size_t(800) << 20) / sh.bytes));
      float m = 0;
      CHECK(median_replay_us(
          st, e0, e1, reps, [&](int i) { run(i, out); }, &m));
      std::printf("%6.1f MB  %-18s %-22s %8.1f us  %6.0f GB/s%s\n", double(sh.bytes) / 1048576.0, sh.name, f.name, m,
                  double(sh.bytes) / 1e3 / m, same);
    }
  }

  // L2 keep: [demote + flush] [touch P bytes of a weight copy in mode a] [stream 64 MB in mode b]
  // then the timed read of the P bytes as o_proj's rows (reg fold, 16 KB rows).
  if (!only) {
    unsigned* sink;
    CHECK(cudaMalloc(&sink, 4));
    const size_t S = size_t(64) << 20, flush = size_t(256) << 20;
    uint8_t* fbuf = pool + pool_bytes - flush;
    uint8_t* sbuf = fbuf - S;
    struct Mode {
      const char* name;
      int a, b;  // a < 0: no touch of the prefix (cold)
    };
    const Mode modes[] = {{"cold", -1, 0},
                          {"touched, then 64 MB plain", 0, 0},
                          {"evict_last loads, 64 MB plain", 2, 0},
                          {"evict_last loads, 64 MB evict_first", 2, 1},
                          {"evict_last prefetch, 64 MB evict_first", 3, 1},
                          {"evict_last prefetch, 64 MB plain", 3, 0},
                          {"touched, no stream", 0, -1},
                          {"evict_last prefetch, no stream", 3, -1}};
    for (size_t P : {size_t(16) << 20, size_t(32) << 20, size_t(48) << 20}) {
      for (const Mode& m : modes) {
        auto copy = [&](int t) { return pool + size_t(t % 4) * (size_t(64) << 20); };
        float us = 0, tus = 0;
        touch_then_read(
            st, e0, e1,
            [&](int) {
              // Every copy's lines demoted (an earlier trial's evict_last lines would otherwise hold
              // part of L2 through the flush: the first form, demoting only this copy, read 9.6 to
              // 12.2 us for the same 32 MB row on different runs), then L2 flushed by other reads.
              touch<<<sms, 512, 0, st>>>(pool, size_t(4) * (size_t(64) << 20), 4, sink);
              touch<<<sms, 512, 0, st>>>(fbuf, flush, 0, sink);
            },
            [&](int t) {
              if (m.a >= 0) touch<<<sms, 512, 0, st>>>(copy(t), P, m.a, sink);
            },
            [&](int) {
              if (m.b >= 0) touch<<<sms, 512, 0, st>>>(sbuf, S, m.b, sink);
            },
            [&](int t) {
              walk_reg<true><<<sms, 32 * kWarps, 16384 * 4, st>>>(copy(t), int64_t(P / 32768), 16384, x, out);
            },
            &us, &tus);
        std::printf("L2 keep %4zu MB  %-42s read %7.1f us (%5.0f GB/s)  touch %7.1f us\n", P >> 20, m.name, us,
                    double(P) / 1e3 / us, tus);
      }
    }
  }
  // o_proj with warm row heads: o_proj's 6144 rows of 16 KB (100.7 MB) read whole as the step's
  // blocks read them (walk_h<32>: one block of 32 warps an SM, a row pair a warp, f16 x), after
  // the first W KB of every row were loaded with an evict_last policy (or plainly) just before,
  // optionally with S MB of other reads between. Session 48's step trace found o_proj's advance
  // unchanged with 4 KB a row warmed ~24 us earlier: if its time is its DRAM bytes, W KB of 16 in
  // L2 should take ~W/16 of it off ("if DRAM-bound"); if not, warming o_proj cannot gain.
  if (!only || warm_only) {
    unsigned* sink;
    CHECK(cudaMalloc(&sink, 4));
    const int64_t R = 16384, rows = 6144, units = rows / 2;
    const size_t bytes = size_t(rows * R), span = size_t(128) << 20, flush = size_t(256) << 20, S = size_t(16) << 20;
    uint8_t* fbuf = pool + pool_bytes - flush;
    uint8_t* sbuf = fbuf - S;
    const size_t smem = size_t(R) * 2 + size_t(R) / 32;
    struct Warm {
      const char* name;
      int64_t W;     // bytes a row warmed (0: none)
      int mode;      // touch_prefix's
      bool between;  // S MB read plainly between the warming and o_proj
    };
    const Warm warms[] = {{"cold", 0, 0, false},
                          {"2 KB a row evict_last", 2048, 2, false},
                          {"4 KB a row evict_last", 4096, 2, false},
                          {"8 KB a row evict_last", 8192, 2, false},
                          {"4 KB a row evict_last, 16 MB between", 4096, 2, true},
                          {"4 KB a row plain loads", 4096, 0, false},
                          {"8 KB a row plain loads", 8192, 0, false}};
    float cold_us = 0;
    for (const Warm& m : warms) {
      auto copy = [&](int t) { return pool + size_t(t % 4) * span; };
      float us = 0, tus = 0;
      touch_then_read(
          st, e0, e1,
          [&](int) {
            touch<<<sms, 512, 0, st>>>(pool, 4 * span, 4, sink);  // every copy's lines demoted
            touch<<<sms, 512, 0, st>>>(fbuf, flush, 0, sink);     // and L2 flushed
          },
          [&](int t) {
            if (m.W > 0) touch_prefix<<<sms, 512, 0, st>>>(copy(t), rows, R, m.W, m.mode, sink);
          },
          [&](int) {
            if (m.between) touch<<<sms, 512, 0, st>>>(sbuf, S, 0, sink);
          },
          [&](int t) { walk_h<32><<<sms, 32 * 32, smem, st>>>(copy(t), units, int(R), x, out); }, &us, &tus);
      if (m.W == 0) cold_us = us;
      std::printf("o_proj warm  %-40s read %6.1f us (%5.0f GB/s; if DRAM-bound %6.1f)  warm %6.1f us\n", m.name, us,
                  double(bytes) / 1e3 / us, double(cold_us) * (1.0 - double(m.W) / double(R)), tus);
    }
    touch<<<sms, 512, 0, st>>>(pool, 4 * span, 4, sink);
    CHECK(cudaStreamSynchronize(st));
  }
  {
    double gbs = 0;
    CHECK(copy_gbs(reinterpret_cast<char*>(pool), pool_bytes, st, e0, e1, &gbs));
    std::printf("copy 1 GiB d2d: %.0f GB/s (read + written)\n", gbs);
  }
  return 0;
}
