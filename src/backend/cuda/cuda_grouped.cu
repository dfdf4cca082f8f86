// Grouped expert products for prefill (cuda_grouped.h): all routed experts of a MoE pass in one
// launch per product, on warpgroup MMA.
//
// Why: at 512 prompt tokens an expert of the 16-expert bench gets ~256 rows (a GLM-5 expert ~16):
// its gate | up product fills 32 of cuBLASLt's tiles and its down product 48, under a wave of
// 132 SMs each, and every expert costs 4-5 launches and an event pair on a side stream (session
// 10's profile: gate | up 35.8 us at 372 TFLOP/s, down 24.5 us, gather 11.6 us, SwiGLU 7 us, the
// scatter-add 16.9 us, per expert and layer). Here every expert's tiles are one grid, the SwiGLU
// runs in the gate | up epilogue (a tile's 256 weight rows are 128 gate rows and the same 128 up
// rows, so a thread holds both of a column), the down epilogue scales by the routing weight, and
// one launch adds every token's rows in job order.
//
// The GEMM kernel: y [rows, N] = a [rows, K] w^T, w [N, K], both K-major bf16, f32 accumulation.
// A block computes a 128 x 256 tile as 2 warpgroups of 64 rows (wgmma m64n256k16, A and B from
// shared memory); K in steps of 64 (one 128-byte swizzled line a row) through a ring of kStages
// stages. Two forms load the ring: by TMA (the default where the driver's tensor-map encoder is
// found), a producer warp issuing each stage's boxes as soon as all 8 math warps have released
// it (mbarriers), up to kStages - 1 steps ahead; or by cp.async from all 256 threads, kStages - 2
// ahead with one block barrier a step (a stage is refilled two steps after the MMA that read it
// was issued, once every warpgroup has waited for it). Rows past a tile's job are never written
// (the cp.async form zero-fills them; TMA loads the next job's rows, or zeros past the run).
//
// Bound: a step moves 48 KB from L2 into shared memory for 4.2 MFLOP. The cp.async form keeps 2
// steps (96 KB) in flight an SM, which at ~1.9 us of L2 latency under load is ~50 GB/s an SM,
// ~6.7 TB/s: its 661 TFLOP/s (7.7 TB/s) at 2048 rows an expert sat at that limit, not at L2's
// bandwidth (a 128 x 128 variant with 128 KB in flight moved 9.1 TB/s). Measured (H200): cp.async
// gate | up 512 / 661 TFLOP/s at 256 / 2048 rows an expert, down 433 / 586 (session 11); TMA 518
// / 710 and 487 / 635 (session 12). At 256 rows an expert what is left is the tiles themselves:
// an expert of 257-300 rows takes a third tile for a few rows, and 704 tiles are 5.3 waves of
// 132 (BENCHMARKS, session 12). FP8 experts have two tile forms (grouped_fp8_kernel and
// grouped_fp8_tokens_kernel, chosen per run by how well the rows fill 128-row tiles).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "backend/cuda/cuda_fp8_gemm.h"
#include "backend/cuda/cuda_grouped.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_wgmma.cuh"
#include "core/error.h"

namespace vireo::cuda {

namespace {

constexpr int kTM = 128, kTN = 256, kTK = 64;  // tile rows, columns, k-step
constexpr int kStages = 4;                     // ring depth: 2 steps of loads in flight
constexpr int kThreads = 256;                  // 2 warpgroups of 64 rows
constexpr uint32_t kABytes = kTM * kTK * 2, kStageBytes = kABytes + kTN * kTK * 2;  // 16 + 32 KB
constexpr size_t kSmem = size_t(kStages) * kStageBytes + 1024;
static_assert((kTN / 2) % kTK == 0, "D and I multiples of the tile's columns must be multiples of the k-step");

struct JobW {
  const __nv_bfloat16* gate;
  const __nv_bfloat16* up;
  const __nv_bfloat16* down;
  const float* gate_s;  // FP8: the block scales, row stride K / 128
  const float* up_s;
  const float* down_s;
};

// Where a block's loads of one tile come from: this thread's 16-byte chunk of 4 rows of A (rows
// lr + 32 i) and 8 rows of B, k-step 0; A rows past the tile's job are zero-filled.
struct TileLoads {
  static constexpr int kB = kTN / 32;
  const __nv_bfloat16* ap[4];
  const __nv_bfloat16* bp[kB];
  bool aok[4];
  __device__ void at(const __nv_bfloat16* a, int K, const JobW& jw, int4 t, bool swiglu, int lr, int c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = t.y + lr + 32 * i;
      aok[i] = row < t.z;
      ap[i] = a + int64_t(aok[i] ? row : t.y) * K + c * 8;
    }
#pragma unroll
    for (int i = 0; i < kB; ++i) {
      const int r = lr + 32 * i;  // gate | up: rows 0..127 gate, 128..255 up, of the same columns
      const __nv_bfloat16* w = !swiglu       ? jw.down + int64_t(t.w + r) * K
                               : r < kTN / 2 ? jw.gate + int64_t(t.w + r) * K
                                             : jw.up + int64_t(t.w + r - kTN / 2) * K;
      bp[i] = w + c * 8;
    }
  }
  __device__ void load(uint32_t stage, uint32_t soff, int kt) const {
    const uint32_t sa = stage + soff, sb = stage + kABytes + soff;
#pragma unroll
    for (int i = 0; i < 4; ++i) cp_async16_zfill(sa + uint32_t(i) * 4096u, ap[i] + int64_t(kt) * kTK, aok[i]);
#pragma unroll
    for (int i = 0; i < kB; ++i) cp_async16_zfill(sb + uint32_t(i) * 4096u, bp[i] + int64_t(kt) * kTK, true);
  }
};

// A tile's epilogue from the accumulators: d[nt][e] is row 16 warp + g (+ 8 for e >= 2) of the
// warpgroup's 64, column 8 nt + 2 tq (+ 1); NT / 2 column tiles of gate, then as many of up.
// kF32H: the SwiGLU output is written in f32 (the FP8 path quantizes it next), else in bf16.
template <int NT, bool kF32H>
__device__ __forceinline__ void store_tile(const float (&d)[NT][4], int4 t, int wgi, int warp, int lane, bool swiglu,
                                           const float* __restrict__ scale, int n_out, void* __restrict__ out) {
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = t.y + wgi * 64 + warp * 16 + g + 8 * half;
    if (row >= t.z) continue;
    if (swiglu) {  // the tile's first half of columns gate, the second up, of the same intermediate columns
#pragma unroll
      for (int nt = 0; nt < NT / 2; ++nt) {
        const float g0 = d[nt][2 * half], g1 = d[nt][2 * half + 1];
        const float u0 = d[nt + NT / 2][2 * half], u1 = d[nt + NT / 2][2 * half + 1];
        // swiglu_kernel's arithmetic, rounded once to bf16 (the fast modes' operand) or kept
        const float h0 = g0 / (1.0f + expf(-g0)) * u0, h1 = g1 / (1.0f + expf(-g1)) * u1;
        if constexpr (kF32H)
          reinterpret_cast<float2*>(static_cast<float*>(out) + int64_t(row) * n_out + t.w)[nt * 4 + tq] =
              make_float2(h0, h1);
        else
          (static_cast<__nv_bfloat162*>(out) + (int64_t(row) * n_out + t.w) / 2)[nt * 4 + tq] =
              __floats2bfloat162_rn(h0, h1);
      }
    } else {  // the routing weight applied as scatter_add_rows does: s * y, rounded
      const float sc = scale[row];
      auto* y = reinterpret_cast<float2*>(static_cast<float*>(out) + int64_t(row) * n_out + t.w);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        y[nt * 4 + tq] = make_float2(__fmul_rn(sc, d[nt][2 * half]), __fmul_rn(sc, d[nt][2 * half + 1]));
    }
  }
}

// A warpgroup's MMAs of one k-step: its 64 rows of the stage's A against the stage's 256 B rows,
// issued and committed, not waited for (the caller's wgmma_wait stays outside the branch: inside
// one, ptxas serializes every wgmma, warning C7518).
template <int TN = kTN>
__device__ __forceinline__ void step_mma(float (&d)[TN / 8][4], uint32_t st, int wgi, bool active) {
  const uint64_t da = gmma_desc(st + uint32_t(wgi * 64 * 128), 16, 1024), db = gmma_desc(st + kABytes, 16, 1024);
  if (active) {
    pin(d);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTK / 16; ++kk) {
      if constexpr (TN == 256)
        wgmma_ss_m64n256(d, da + desc_off(uint32_t(kk * 32)), db + desc_off(uint32_t(kk * 32)), 1);
      else wgmma_ss_m64n128(d, da + desc_off(uint32_t(kk * 32)), db + desc_off(uint32_t(kk * 32)), 1);
    }
    wgmma_commit();
  }
}

// One tile a block. (A persistent form, each block's k-steps one ring across its tiles so the
// next tile's loads overlap this one's epilogue, measured 10-25% slower: BENCHMARKS, session 11.)
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __nv_bfloat16* __restrict__ a, int K, const JobW* __restrict__ jobs,
                        const int4* __restrict__ tiles, bool swiglu, const float* __restrict__ scale, int n_out,
                        void* __restrict__ out) {
  pdl_begin();
  constexpr int NT = kTN / 8;
  extern __shared__ unsigned char gg_smem[];
  const uint32_t raw = smem_u32(gg_smem), sbase = (raw + 1023u) & ~1023u;
  const int tid = int(threadIdx.x), wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int c = tid & 7, lr = tid >> 3;
  const uint32_t soff = uint32_t(lr * 128 + ((c ^ (lr & 7)) << 4));
  const int4 t = tiles[blockIdx.x];
  if (t.x < 0) return;  // past a device-made run's tiles (grouped_device_tiles)
  // A warpgroup whose 64 rows are all past the job (an expert's last tile of <= 64 rows) skips
  // its MMAs; it still loads and waits with the other.
  const bool active = t.y + wgi * 64 < t.z;
  TileLoads ld;
  ld.at(a, K, jobs[t.x], t, swiglu, lr, c);
  const int KT = K / kTK;
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < KT) ld.load(sbase + uint32_t(s) * kStageBytes, soff, s);
    cp_async_commit();  // (empty groups keep the count: group s is step s)
  }
  float d[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.0f;
  for (int kt = 0; kt < KT; ++kt) {
    // Groups committed so far: steps 0 .. kt + kStages - 3; this step's must be complete.
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 3) : "memory");
    fence_proxy_async();
    __syncthreads();                     // this step's stage visible to both warpgroups; both are done with kt - 2's
    const int ahead = kt + kStages - 2;  // into step kt - 2's stage
    if (ahead < KT) ld.load(sbase + uint32_t(ahead % kStages) * kStageBytes, soff, ahead);
    cp_async_commit();
    const uint32_t st = sbase + uint32_t(kt % kStages) * kStageBytes;
    step_mma(d, st, wgi, active);
    wgmma_wait<1>();  // step kt - 1's MMA is done: its stage may be refilled after the next barrier
    pin(d);
  }
  wgmma_wait<0>();
  pin(d);
  store_tile<NT, false>(d, t, wgi, warp, lane, swiglu, scale, n_out, out);
}

// The same tile, its operands brought by the tensor memory accelerator (TMA): a producer warp
// issues a stage's 2-3 box loads as soon as all 8 math warps have released it (an mbarrier a
// stage each way), so up to kStages - 1 steps are in flight instead of the cp.async form's 2,
// and the 256 math threads issue no loads and meet at no block barrier. Why: the cp.async form
// moved 96 KB in flight a multiprocessor, which at ~1.9 us of L2 latency under load is ~50 GB/s
// an SM, ~6.7 TB/s in all: its 7.7 TB/s at 661 TFLOP/s is that limit, not L2's bandwidth (its
// 128 x 128 variant, 128 KB in flight, moved 9.1 TB/s). maps: the run's tensor maps (A's, then
// each job's gate, up, down); job_maps[j]: job j's (gate, up, down) map indices.
constexpr int kTmaThreads = kThreads + 32;  // + the producer warp
constexpr uint32_t kMathWarps = kThreads / 32;
// A math warp's release of a stage it has read (empty[s] completes once all 8 have). Every warp
// arrives, not one a warpgroup: a warpgroup with no rows in the tile issues no MMA, so nothing
// keeps its warps together, and with one arrival for all four a warp still waiting on a stage's
// `full` barrier could see the stage refilled and its phase pass twice; a parity wait then never
// returns (measured: a hang in one run of several at 32 rows an expert).
__device__ __forceinline__ void release(uint32_t empty_bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(empty_bar);
}
// The ring's barriers, made by thread 0 before the block's first barrier: full[s] completes on
// the producer's expect_tx and the stage's bytes, empty[s] on every math warp's release.
template <int Stages>
__device__ __forceinline__ void ring_init(uint64_t (&full)[Stages], uint64_t (&empty)[Stages], int tid) {
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < Stages; ++s) {
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), kMathWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
}
// A loading lane's first use of a tile's tensor maps (c may be null).
__device__ __forceinline__ void acquire_maps(const CUtensorMap* a, const CUtensorMap* b, const CUtensorMap* c) {
  tensormap_acquire(a);
  tensormap_acquire(b);
  if (c) tensormap_acquire(c);
}
// Before a producer refills stage kt % Stages: its last use was step kt - Stages, whose release by
// the math warps is that phase of empty[s].
template <int Stages>
__device__ __forceinline__ void wait_stage_free(uint64_t (&empty)[Stages], int kt) {
  if (kt >= Stages) mbar_wait(smem_u32(&empty[kt % Stages]), uint32_t((kt / Stages) + 1) & 1u);
}
// The producer warp's one loading lane: each k-step's boxes into stage kt % Stages once every
// math warp has released that stage's previous use. A stage of the tile t (job, first row, end
// row, first column) is A's TM rows x TK columns at 0, then B's TN rows at ABytes: the job's gate
// rows and then the same rows of up (swiglu), or its down rows. maps / a_map / job_maps: as
// grouped_gemm_tma_kernel takes them.
// kg: the ring's k-steps before this tile's (the block's earlier tiles where it walks, tma_grid).
template <int Stages, int TK, int TN, uint32_t ABytes, uint32_t StageBytes>
__device__ __forceinline__ void ring_produce_tile(uint64_t (&full)[Stages], uint64_t (&empty)[Stages], uint32_t sbase,
                                                  const CUtensorMap* __restrict__ maps, int a_map,
                                                  const int4* __restrict__ job_maps, int4 t, bool swiglu, int KT,
                                                  int kg) {
  const int4 jm = job_maps[t.x];
  const CUtensorMap* ma = maps + a_map;
  const CUtensorMap* mb = maps + (swiglu ? jm.x : jm.z);
  const CUtensorMap* mu = maps + jm.y;
  acquire_maps(ma, mb, swiglu ? mu : nullptr);
  for (int kt = 0; kt < KT; ++kt) {
    const int s = (kg + kt) % Stages;
    wait_stage_free(empty, kg + kt);
    const uint32_t st = sbase + uint32_t(s) * StageBytes, fb = smem_u32(&full[s]);
    mbar_expect_tx(fb, StageBytes);
    tma_load_2d(st, ma, kt * TK, t.y, fb);  // A: the tile's rows (zeros past the run)
    if (swiglu) {                           // B: TN / 2 gate rows, then the same rows of up
      tma_load_2d(st + ABytes, mb, kt * TK, t.w, fb);
      tma_load_2d(st + ABytes + uint32_t(TN / 2) * 128u, mu, kt * TK, t.w, fb);
    } else {
      tma_load_2d(st + ABytes, mb, kt * TK, t.w, fb);
    }
  }
}
// The producer's whole share of a block: the tiles it walks (tiles blockIdx.x, + gridDim.x, ...
// up to n_tiles or a device-made table's first padding entry, job -1), one ring across them.
template <int Stages, int TK, int TN, uint32_t ABytes, uint32_t StageBytes>
__device__ __forceinline__ void ring_produce(uint64_t (&full)[Stages], uint64_t (&empty)[Stages], uint32_t sbase,
                                             const CUtensorMap* __restrict__ maps, int a_map,
                                             const int4* __restrict__ job_maps, const int4* __restrict__ tiles,
                                             int n_tiles, bool swiglu, int KT) {
  for (int i = int(blockIdx.x), kg = 0; i < n_tiles && tiles[i].x >= 0; i += int(gridDim.x), kg += KT)
    ring_produce_tile<Stages, TK, TN, ABytes, StageBytes>(full, empty, sbase, maps, a_map, job_maps, tiles[i], swiglu,
                                                          KT, kg);
}
// TN: the tile's columns (256). Tiles of 128 columns, 3 stages and two blocks a multiprocessor
// gave the same bits and were slower end to end (session 14: 8-layer bf16 prefill at 512 tokens
// 47.1-47.2% against 50.3-50.4%), so only the wide form is launched.
template <int TN, int Stages, int MinBlocks>
__global__ void __launch_bounds__(kTmaThreads, MinBlocks)
    grouped_gemm_tma_kernel(const CUtensorMap* __restrict__ maps, int a_map, int K, const int4* __restrict__ job_maps,
                            const int4* __restrict__ tiles, int n_tiles, bool swiglu, const float* __restrict__ scale,
                            int n_out, void* __restrict__ out) {
  pdl_begin();
  constexpr int NT = TN / 8;
  constexpr uint32_t StageBytes = kABytes + uint32_t(TN) * kTK * 2;
  extern __shared__ unsigned char gg_smem[];
  __shared__ alignas(8) uint64_t full[Stages], empty[Stages];
  const uint32_t raw = smem_u32(gg_smem), sbase = (raw + 1023u) & ~1023u;
  const int tid = int(threadIdx.x), wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  if (tiles[blockIdx.x].x < 0) return;  // past a device-made run's tiles (grouped_device_tiles)
  const int KT = K / kTK;
  ring_init(full, empty, tid);
  if (wgi == 2) {  // the producer warp: one lane issues every load
    if (lane == 0)
      ring_produce<Stages, kTK, TN, kABytes, StageBytes>(full, empty, sbase, maps, a_map, job_maps, tiles, n_tiles,
                                                         swiglu, KT);
    return;
  }
  for (int i = int(blockIdx.x), kg = 0; i < n_tiles; i += int(gridDim.x), kg += KT) {
    const int4 t = tiles[i];
    if (t.x < 0) break;
    const bool active = t.y + wgi * 64 < t.z;  // as the cp.async form
    float d[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.0f;
    for (int kt = 0; kt < KT; ++kt) {
      const int s = (kg + kt) % Stages;
      mbar_wait(smem_u32(&full[s]), uint32_t((kg + kt) / Stages) & 1u);
      const uint32_t st = sbase + uint32_t(s) * StageBytes;
      step_mma<TN>(d, st, wgi, active);
      wgmma_wait<1>();  // step kt - 1's MMA is done: release its stage
      pin(d);
      if (kt > 0) release(smem_u32(&empty[(kg + kt - 1) % Stages]), lane);
    }
    wgmma_wait<0>();
    pin(d);
    release(smem_u32(&empty[(kg + KT - 1) % Stages]), lane);  // the tile's last stage, for the next tile's loads
    store_tile<NT, false>(d, t, wgi, warp, lane, swiglu, scale, n_out, out);
  }
}

// FP8 experts: the same tile scheme on e4m3 operands (wgmma k-step 32), a stage one 128-deep
// k-block (a 128-byte line a row, as the bf16 tiles' 64), tiles of 128 rows x 128 columns (gate |
// up: 64 gate and the same 64 up columns). Each k-block's sums go into a second set of
// accumulators, which is scaled by the rows' activation scales times the weight block's scale and
// added to the first after the block's MMAs are done (the scales change at every k-block, so they
// cannot be applied once at the end): twice the accumulator registers, hence 128 columns, not 256.
// While one warpgroup scales its block, the other's MMAs keep the tensor cores busy.
// Bound: a stage moves 32 KB for 4.2 MFLOP (the bf16 tile's 48 KB); e4m3 MMA runs at twice the
// bf16 rate, so the tiles need ~2x the bf16 kernel's bytes a second from L2, which the deeper ring
// (6 stages, 5 in flight) is for.
constexpr int kF8TM = 128, kF8TN = 128, kF8TK = 128;
constexpr int kF8Stages = 6;
constexpr uint32_t kF8ABytes = kF8TM * kF8TK, kF8StageBytes = kF8ABytes + kF8TN * kF8TK;  // 16 + 16 KB
constexpr size_t kF8Smem = size_t(kF8Stages) * kF8StageBytes + 1024;

// One row tile of grouped_fp8_kernel's (the math warpgroups' part), its k-blocks steps kg .. kg +
// KT - 1 of the block's ring.
// The k-loop is kept short: between a warpgroup's MMAs completing and its next MMAs only the
// other warpgroup's 4 MMAs keep the tensor cores busy, and ncu's source view (session 29, 512
// tokens) had this loop at 168 instructions a warp for 4 MMAs, the tensor pipe 41% busy, and
// samples on the loop's own instructions (address math, the stage's division, an S2R rebuilding
// the barriers' shared-window address every step) as well as on the MMA and barrier waits. Now
// the stage and its parity are a wrapping counter, the scales' addresses pointers that step,
// the barriers' addresses opaque to the compiler (kept in registers), and the scaling runs
// whether or not the warpgroup has rows (p starts at 0; sums of rows past the job are never
// stored): 144 instructions, the same MMAs and sums in the same order (the same bits), gate | up
// 335-337 us a layer against 347 and down 177-179 against 182 (H200, 2 layers, 512 tokens).
__device__ __forceinline__ void fp8_tile(int4 t, int kg, int KT, int R, const float* __restrict__ a_scale,
                                         const JobW* __restrict__ jobs, uint32_t sbase, uint64_t (&full)[kF8Stages],
                                         uint64_t (&empty)[kF8Stages], bool swiglu, const float* __restrict__ scale,
                                         int n_out, float* __restrict__ out, int wgi, int warp, int lane) {
  constexpr int NT = kF8TN / 8;
  const bool active = __shfl_sync(0xffffffffu, t.y + wgi * 64 < t.z, 0);
  // This thread's two rows (clamped for the scale reads: rows past the run are never stored) and
  // the weight scales of the tile's columns (one 128-row block: gate | up tiles sit in one).
  const int g = lane >> 2, row0 = t.y + wgi * 64 + warp * 16 + g;
  const float* sa0 = a_scale + min(row0, R - 1);
  const float* sa1 = a_scale + min(row0 + 8, R - 1);
  const JobW jw = jobs[t.x];
  const float* sbg = (swiglu ? jw.gate_s : jw.down_s) + int64_t(t.w / 128) * KT;
  const float* sbu = swiglu ? jw.up_s + int64_t(t.w / 128) * KT : sbg;
  const uint64_t da = gmma_desc(sbase + uint32_t(wgi * 64 * 128), 16, 1024),
                 db = gmma_desc(sbase + kF8ABytes, 16, 1024);
  // The barriers' addresses, opaque to the compiler: otherwise it rebuilt them every step from
  // the CTA's shared window (an S2R on the path between a step's MMAs and the next's).
  uint32_t full0 = smem_u32(&full[0]), empty0 = smem_u32(&empty[0]);
  asm volatile("" : "+r"(full0), "+r"(empty0));
  float d[NT][4], p[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) d[i][0] = d[i][1] = d[i][2] = d[i][3] = p[i][0] = p[i][1] = p[i][2] = p[i][3] = 0.0f;
  int s = kg % kF8Stages;                       // the ring's stage of this k-block
  uint32_t ph = uint32_t(kg / kF8Stages) & 1u;  // and the parity of its fill
  for (int kt = 0; kt < KT; ++kt) {
    const float a0 = __ldg(sa0), a1 = __ldg(sa1), bg = __ldg(sbg), bu = __ldg(sbu);
    sa0 += R;
    sa1 += R;
    ++sbg;
    ++sbu;
    mbar_wait(full0 + uint32_t(s) * 8u, ph);
    const uint64_t so = desc_off(uint32_t(s) * kF8StageBytes);
    if (active) {
      pin(p);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kF8TK / 32; ++kk)
        wgmma_e4m3_m64nk32<128>(p, da + so + desc_off(uint32_t(kk * 32)), db + so + desc_off(uint32_t(kk * 32)),
                                kk > 0);
      wgmma_commit();
    }
    wgmma_wait<0>();
    pin(p);
    release(empty0 + uint32_t(s) * 8u, lane);  // the stage is read
    const float g0 = a0 * bg, g1 = a1 * bg, u0 = a0 * bu, u1 = a1 * bu;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float s0 = nt < NT / 2 ? g0 : u0, s1 = nt < NT / 2 ? g1 : u1;
      d[nt][0] = fmaf(p[nt][0], s0, d[nt][0]);
      d[nt][1] = fmaf(p[nt][1], s0, d[nt][1]);
      d[nt][2] = fmaf(p[nt][2], s1, d[nt][2]);
      d[nt][3] = fmaf(p[nt][3], s1, d[nt][3]);
    }
    if (++s == kF8Stages) {
      s = 0;
      ph ^= 1u;
    }
  }
  store_tile<NT, true>(d, t, wgi, warp, lane, swiglu, scale, n_out, out);
}

__global__ void __launch_bounds__(kTmaThreads, 1)
    grouped_fp8_kernel(const CUtensorMap* __restrict__ maps, int a_map, const float* __restrict__ a_scale, int R, int K,
                       const int4* __restrict__ job_maps, const JobW* __restrict__ jobs, const int4* __restrict__ tiles,
                       int n_tiles, bool swiglu, const float* __restrict__ scale, int n_out, float* __restrict__ out) {
  pdl_begin();
  extern __shared__ unsigned char gg_smem[];
  __shared__ alignas(8) uint64_t full[kF8Stages], empty[kF8Stages];
  const uint32_t raw = smem_u32(gg_smem), sbase = (raw + 1023u) & ~1023u;
  const int tid = int(threadIdx.x), wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  if (tiles[blockIdx.x].x < 0) return;  // past a device-made run's tiles (grouped_device_tiles)
  const int KT = K / kF8TK;
  ring_init(full, empty, tid);
  if (wgi == 2) {  // the producer warp, as grouped_gemm_tma_kernel's
    if (lane == 0)
      ring_produce<kF8Stages, kF8TK, kF8TN, kF8ABytes, kF8StageBytes>(full, empty, sbase, maps, a_map, job_maps, tiles,
                                                                      n_tiles, swiglu, KT);
    return;
  }
  for (int i = int(blockIdx.x), kg = 0; i < n_tiles; i += int(gridDim.x), kg += KT) {
    const int4 t = tiles[i];
    if (t.x < 0) break;
    // (wgi from lane 0: the form measured in session 29; the compiler lays the loop out by it.)
    fp8_tile(t, kg, KT, R, a_scale, jobs, sbase, full, empty, swiglu, scale, n_out, out,
             __shfl_sync(0xffffffffu, wgi, 0), warp, lane);
  }
}

// The FP8 products with the operands' roles swapped ("token columns"): a tile's 128 weight rows
// are the MMA's M side (64 a warpgroup: gate | up tiles give one warpgroup the 64 gate rows, the
// other the same 64 rows of up) and its n <= 128 tokens the N side, rounded up to 16 instead of
// to the 128 rows of an M tile. Why: an expert's rows fill its 128-row M tiles only partly (the
// 16-expert bench at 512 tokens: 1472 gate | up tiles for 1024 tiles' worth of rows; a GLM-5
// expert's ~16 rows fill an eighth of one), and an M tile's MMAs, loads and time do not shrink
// with its rows, where these do: the MMAs run N = 16 .. 128 columns and the token box is 32, 64
// or 128 rows. Same sums, in the same order, as grouped_fp8_kernel: each k-block's partial sums
// scaled by (token scale x weight block scale) and added to the accumulators. Measured (H200, 2
// layers, 512 tokens, BENCHMARKS session 24): gate | up 15% and down 7% faster at 256 experts
// (~16 rows each), 10% and 5% at 64; ~10% slower on full tiles (~256 rows an expert, and at 4096
// tokens), with a third fewer MMAs: hence the choice per run (GroupedFp8Form).
// The producer warp (all 32 lanes) also copies each stage's scales into shared memory: the
// tokens' activation scales and the two warpgroups' weight block scales, so the math warps read
// no global memory in the loop; full[s] completes on the 32 lanes' copies and the TMA bytes.
constexpr int kTcTokens = 128;               // a tile's tokens at most (a tile row range, grouped_tables)
constexpr uint32_t kTcWBytes = 128 * kF8TK;  // 16 KB of weight rows
constexpr uint32_t kTcStageBytes = kTcWBytes + kTcTokens * kF8TK;  // + up to 16 KB of tokens
constexpr int kTcScales = kTcTokens + 2;                           // floats a stage: tokens', then 2 weights'
constexpr size_t kTcSmem = size_t(kF8Stages) * kTcStageBytes + size_t(kF8Stages) * kTcScales * 4 + 1024;

// A warpgroup's k-loop for tiles of NB token columns: d (+)= the scaled k-blocks.
template <int NB>
__device__ __forceinline__ void token_columns_loop(float (&d)[16][4], uint64_t (&full)[kF8Stages],
                                                   uint64_t (&empty)[kF8Stages], uint32_t sbase,
                                                   const float* __restrict__ sscale, int wgi, int lane, int KT) {
  constexpr int NT = NB / 8;
  const int tq = lane & 3;
  const uint64_t dw = gmma_desc(sbase + uint32_t(wgi * 64 * 128), 16, 1024),
                 dx = gmma_desc(sbase + kTcWBytes, 16, 1024);
  float p[16][4];
  for (int kt = 0; kt < KT; ++kt) {
    const int s = kt % kF8Stages;
    mbar_wait(smem_u32(&full[s]), uint32_t(kt / kF8Stages) & 1u);
    const uint64_t so = desc_off(uint32_t(s) * kTcStageBytes);
    pin(p);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kF8TK / 32; ++kk)
      wgmma_e4m3_m64nk32<NB>(p, dw + so + desc_off(uint32_t(kk * 32)), dx + so + desc_off(uint32_t(kk * 32)), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    pin(p);
    const float* sc = sscale + s * kTcScales;
    const float ws = sc[kTcTokens + wgi];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      // grouped_fp8_kernel's products: activation scale x weight scale, then one fma a sum
      const float2 a = *reinterpret_cast<const float2*>(sc + 8 * nt + 2 * tq);
      const float s0 = a.x * ws, s1 = a.y * ws;
      d[nt][0] = fmaf(p[nt][0], s0, d[nt][0]);
      d[nt][1] = fmaf(p[nt][1], s1, d[nt][1]);
      d[nt][2] = fmaf(p[nt][2], s0, d[nt][2]);
      d[nt][3] = fmaf(p[nt][3], s1, d[nt][3]);
    }
    release(smem_u32(&empty[s]), lane);  // the stage (and its scales) is read
  }
}

__global__ void __launch_bounds__(kTmaThreads, 1)
    grouped_fp8_tokens_kernel(const CUtensorMap* __restrict__ maps, int4 a_maps, const float* __restrict__ a_scale,
                              int R, int K, const int4* __restrict__ job_maps, const JobW* __restrict__ jobs,
                              const int4* __restrict__ tiles, bool swiglu, const float* __restrict__ scale, int n_out,
                              float* __restrict__ out) {
  pdl_begin();
  extern __shared__ unsigned char gg_smem[];
  __shared__ alignas(8) uint64_t full[kF8Stages], empty[kF8Stages];
  const uint32_t raw = smem_u32(gg_smem), sbase = (raw + 1023u) & ~1023u;
  float* sscale = reinterpret_cast<float*>(gg_smem + (sbase - raw) + size_t(kF8Stages) * kTcStageBytes);
  const int tid = int(threadIdx.x), wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int4 t = tiles[blockIdx.x];
  if (t.x < 0) return;                      // past a device-made run's tiles (grouped_device_tiles)
  const int n = min(t.z - t.y, kTcTokens);  // the tile's tokens
  const int KT = K / kF8TK;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kF8Stages; ++s) {
      mbar_init(smem_u32(&full[s]), 33);  // the 32 lanes' scale copies, lane 0's expect_tx
      mbar_init(smem_u32(&empty[s]), kMathWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wgi == 2) {  // the producer warp
    const int4 jm = job_maps[t.x];
    const JobW jw = jobs[t.x];
    const int box = n <= 32 ? 32 : n <= 64 ? 64 : 128;  // the token box: 32, 64 or 128 rows
    const CUtensorMap* mx = maps + (box == 32 ? a_maps.z : box == 64 ? a_maps.y : a_maps.x);
    const CUtensorMap* mw = maps + (swiglu ? jm.x : jm.z);
    const CUtensorMap* mu = maps + jm.y;
    // weight block scales: gate and up (or down's one block for both warpgroups) of column block t.w / 128
    const float* sw0 = (swiglu ? jw.gate_s : jw.down_s) + int64_t(t.w / 128) * KT;
    const float* sw1 = swiglu ? jw.up_s + int64_t(t.w / 128) * KT : sw0;
    if (lane == 0) acquire_maps(mx, mw, swiglu ? mu : nullptr);
    for (int kt = 0; kt < KT; ++kt) {
      const int s = kt % kF8Stages;
      wait_stage_free(empty, kt);
      // The scales by cp.async, whose completion is one of full[s]'s arrivals (a load waited for
      // here put an L2 round trip into every stage's issue: 20% slower than grouped_fp8_kernel).
      // Tokens past the tile read a clamped row: their sums are never stored.
      const uint32_t sc = smem_u32(sscale + s * kTcScales);
      for (int i = lane; i < kTcTokens; i += 32)
        cp_async4(sc + uint32_t(i) * 4u, a_scale + int64_t(kt) * R + min(t.y + i, R - 1));
      if (lane < 2) cp_async4(sc + uint32_t(kTcTokens + lane) * 4u, (lane == 0 ? sw0 : sw1) + kt);
      const uint32_t st = sbase + uint32_t(s) * kTcStageBytes, fb = smem_u32(&full[s]);
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(fb) : "memory");
      if (lane == 0) {
        mbar_expect_tx(fb, kTcWBytes + uint32_t(box) * kF8TK);
        tma_load_2d(st, mw, kt * kF8TK, t.w, fb);                            // gate's 64 rows (down's 128)
        if (swiglu) tma_load_2d(st + 64u * kF8TK, mu, kt * kF8TK, t.w, fb);  // then the same 64 rows of up
        tma_load_2d(st + kTcWBytes, mx, kt * kF8TK, t.y, fb);  // the tokens (zeros past the run)
      }
    }
    return;
  }
  float d[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i) d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.0f;
  switch ((n + 15) / 16) {
    case 1: token_columns_loop<16>(d, full, empty, sbase, sscale, wgi, lane, KT); break;
    case 2: token_columns_loop<32>(d, full, empty, sbase, sscale, wgi, lane, KT); break;
    case 3: token_columns_loop<48>(d, full, empty, sbase, sscale, wgi, lane, KT); break;
    case 4: token_columns_loop<64>(d, full, empty, sbase, sscale, wgi, lane, KT); break;
    case 5: token_columns_loop<80>(d, full, empty, sbase, sscale, wgi, lane, KT); break;
    case 6: token_columns_loop<96>(d, full, empty, sbase, sscale, wgi, lane, KT); break;
    case 7: token_columns_loop<112>(d, full, empty, sbase, sscale, wgi, lane, KT); break;
    default: token_columns_loop<128>(d, full, empty, sbase, sscale, wgi, lane, KT); break;
  }
  // d[nt][e]: weight row 16 warp + g (+ 8 for e >= 2) of the warpgroup's 64, token 8 nt + 2 tq (+ 1).
  const int g = lane >> 2, tq = lane & 3;
  float* xch = reinterpret_cast<float*>(gg_smem + (sbase - raw));
  if (swiglu) {
    // The up warpgroup hands its sums to the gate one through shared memory (the ring is read:
    // every stage's MMAs were waited for before the barrier), element v of thread i at v * 128 + i.
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    if (wgi == 1) {
#pragma unroll
      for (int v = 0; v < 64; ++v) xch[v * 128 + (tid & 127)] = d[v / 4][v % 4];
    }
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    if (wgi == 1) return;
  }
  const int col0 = t.w + (swiglu ? 0 : wgi * 64) + warp * 16 + g, i = tid & 127;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = 8 * nt + 2 * tq + (e & 1);
      if (tok >= n) continue;
      const float v = d[nt][e];
      // gate | up: swiglu_kernel's arithmetic, kept in f32 (act_quant of h follows), as store_tile's;
      // down: the routing weight applied as scatter_add_rows does
      out[int64_t(t.y + tok) * n_out + col0 + 8 * (e >> 1)] =
          swiglu ? v / (1.0f + expf(-v)) * xch[(nt * 4 + e) * 128 + i] : __fmul_rn(scale[t.y + tok], v);
    }
}

// xb[r] = bf16(x[index[r]]), one block a row.                      x [*, D], xb [R, D]; D % 4 == 0
__global__ void grouped_gather_kernel(const float* __restrict__ x, const int32_t* __restrict__ index, int64_t D,
                                      __nv_bfloat162* __restrict__ xb) {
  pdl_begin();
  const int64_t r = blockIdx.x;
  const float4* src = reinterpret_cast<const float4*>(x + int64_t(index[r]) * D);
  __nv_bfloat162* dst = xb + r * D / 2;
  for (int64_t j = threadIdx.x; j < D / 4; j += blockDim.x) {
    const float4 v = src[j];
    dst[2 * j] = __floats2bfloat162_rn(v.x, v.y);
    dst[2 * j + 1] = __floats2bfloat162_rn(v.z, v.w);
  }
}

// xb[r] = xq[index[r]] (e4m3 rows, 16 bytes a thread) and xs[kb][r] = xqs[kb][index[r]]: the
// gathered rows of an x quantized once. One block a row.      xq [T, D], xb [R, D]; D % 16 == 0
__global__ void grouped_gather_q8_kernel(const uint4* __restrict__ xq, const float* __restrict__ xqs, int64_t T,
                                         const int32_t* __restrict__ index, int64_t D, int64_t R,
                                         uint4* __restrict__ xb, float* __restrict__ xs) {
  pdl_begin();
  const int64_t r = blockIdx.x, t = index[r], n16 = D / 16;
  const uint4* src = xq + t * n16;
  uint4* dst = xb + r * n16;
  for (int64_t j = threadIdx.x; j < n16; j += blockDim.x) dst[j] = src[j];
  for (int64_t kb = threadIdx.x; kb < D / 128; kb += blockDim.x) xs[kb * R + r] = xqs[kb * T + t];
}

// grouped_device_tiles' one block: the spans of the jobs (routed job j: offsets[j] .. offsets[j + 1];
// a dense last job: dense_rows rows after the routed ones), their row tiles' prefix, then each
// warp writes its jobs' tiles in grouped_tables' order (a job's column tiles one after another,
// a column's row tiles adjacent), and the entries past the last tile up to the grids' sizes get
// job -1 (their blocks leave). Shared: rows, row0 [n_jobs], the tiles' prefix [n_jobs + 1].
__global__ void grouped_tiles_kernel(const int32_t* __restrict__ offsets, int n_routed, int dense_rows, int n_jobs,
                                     int tm, int gu_cols, int gu_step, int dn_cols, int dn_step,
                                     int2* __restrict__ spans, int4* __restrict__ gu, int gu_grid,
                                     int4* __restrict__ dn, int dn_grid) {
  pdl_begin();
  extern __shared__ int32_t tl[];
  int32_t* rows = tl;
  int32_t* row0 = tl + n_jobs;
  int32_t* pre = tl + 2 * n_jobs;
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5, warps = int(blockDim.x >> 5);
  for (int j = tid; j < n_jobs; j += int(blockDim.x)) {
    const int r0 = j < n_routed ? offsets[j] : offsets[n_routed];
    const int rw = j < n_routed ? offsets[j + 1] - r0 : dense_rows;
    rows[j] = rw;
    row0[j] = r0;
    spans[j] = make_int2(r0, rw);
  }
  __syncthreads();
  if (warp == 0) {
    int carry = 0;
    for (int j0 = 0; j0 < n_jobs; j0 += 32) {
      const int j = j0 + lane;
      const int v = j < n_jobs ? (rows[j] + tm - 1) / tm : 0;
      int inc = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += u;
      }
      if (j < n_jobs) pre[j] = carry + inc - v;
      carry += __shfl_sync(0xffffffffu, inc, 31);
    }
    if (lane == 0) pre[n_jobs] = carry;
  }
  __syncthreads();
  for (int j = warp; j < n_jobs; j += warps) {
    const int nt = (rows[j] + tm - 1) / tm, end = row0[j] + rows[j];
    for (int k = lane; k < nt * gu_cols; k += 32)
      gu[int64_t(pre[j]) * gu_cols + k] = make_int4(j, row0[j] + (k % nt) * tm, end, (k / nt) * gu_step);
    for (int k = lane; k < nt * dn_cols; k += 32)
      dn[int64_t(pre[j]) * dn_cols + k] = make_int4(j, row0[j] + (k % nt) * tm, end, (k / nt) * dn_step);
  }
  for (int i = pre[n_jobs] * gu_cols + tid; i < gu_grid; i += int(blockDim.x)) gu[i] = make_int4(-1, 0, 0, 0);
  for (int i = pre[n_jobs] * dn_cols + tid; i < dn_grid; i += int(blockDim.x)) dn[i] = make_int4(-1, 0, 0, 0);
}

// A chunk's index and scale when its last job is dense (every token, scale 1: a shared
// expert): the routed rows' entries copied, then (t, 1) for t < rows - routed.
__global__ void grouped_dense_rows_kernel(const int32_t* __restrict__ index, const float* __restrict__ scale,
                                          int64_t routed, int64_t rows, int32_t* __restrict__ index_out,
                                          float* __restrict__ scale_out) {
  pdl_begin();
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    index_out[r] = r < routed ? index[r] : int32_t(r - routed);
    scale_out[r] = r < routed ? scale[r] : 1.0f;
  }
}

// out[t] += y rows of token t in job order (y already scaled): the same roundings, in the same
// order, as one scatter_add_rows per job. by_token: block t, for every token of x (those without
// a row in the chunk leave). Else block r: row r's token t; the block of t's first row (the
// lowest job holding t: rows are numbered job by job) does the additions, the others leave
// (a block a row spent most of its time in the searches of blocks that then left: 4608 blocks
// for 512 tokens' additions at GLM-5's 9 rows a token). Each thread binary-searches t in its
// jobs' strictly increasing token lists. Shared: the found row of every job [n_jobs], then the
// found rows in job order.
__global__ void grouped_combine_kernel(const int32_t* __restrict__ index, const int2* __restrict__ spans, int n_jobs,
                                       bool by_token, bool overwrite, const float4* __restrict__ y, int64_t D4,
                                       float4* __restrict__ out) {
  pdl_begin();
  extern __shared__ int32_t found[];
  int32_t* order = found + n_jobs;
  __shared__ int n_found;
  const int r = by_token ? -1 : int(blockIdx.x), t = by_token ? int(blockIdx.x) : index[r];
  bool earlier = false;
  for (int j = int(threadIdx.x); j < n_jobs; j += blockDim.x) {
    const int2 s = spans[j];
    int lo = s.x, hi = s.x + s.y;  // first position with index >= t
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (index[mid] < t) lo = mid + 1;
      else hi = mid;
    }
    const int at = lo < s.x + s.y && index[lo] == t ? lo : -1;
    found[j] = at;
    earlier |= at >= 0 && at < r;  // (never by token: r = -1)
  }
  if (__syncthreads_or(earlier)) return;  // not the token's first row
  if (threadIdx.x < 32) {                 // warp 0 lists the found rows in job order
    int n = 0;
    for (int j0 = 0; j0 < n_jobs; j0 += 32) {
      const int j = j0 + int(threadIdx.x);
      const bool hit = j < n_jobs && found[j] >= 0;
      const unsigned m = __ballot_sync(0xffffffffu, hit);
      if (hit) order[n + __popc(m & ((1u << threadIdx.x) - 1u))] = found[j];
      n += __popc(m);
    }
    if (threadIdx.x == 0) n_found = n;
  }
  __syncthreads();
  const int n = n_found;
  if (n == 0) return;  // (by token: not in this chunk)
  float4* o = out + int64_t(t) * D4;
  // Up to kBatch rows' loads in flight before their additions (one row at a time was a round
  // trip per row: 54 us a GLM-5 layer at 512 tokens, 9 rows a token; H200).
  constexpr int kBatch = 8;
  for (int64_t c = threadIdx.x; c < D4; c += blockDim.x) {
    float4 acc = overwrite ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : o[c];  // (0 + a: the bits a fill of 0 gave)
    for (int k0 = 0; k0 < n; k0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (k0 + u < n) v[u] = y[int64_t(order[k0 + u]) * D4 + c];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (k0 + u < n) {
          acc.x = __fadd_rn(acc.x, v[u].x);
          acc.y = __fadd_rn(acc.y, v[u].y);
          acc.z = __fadd_rn(acc.z, v[u].z);
          acc.w = __fadd_rn(acc.w, v[u].w);
        }
    }
    o[c] = acc;
  }
}

template <class T>
const T* table_at(const GroupedRun& r, size_t off) {
  return reinterpret_cast<const T*>(r.table + off);
}

// The TMA forms' grid: a tile a block, or (walking) a block an SM, each walking tiles
// blockIdx.x, + gridDim.x, ... through one ring, so that the producer warp loads the next tile's
// first k-steps while the math warps finish the tile before (their last MMAs, the epilogue's
// stores) and no block after the first wave starts with an empty ring. The same tiles, each summed
// as before: the same bits either way. Which products walk (BENCHMARKS, session 28): the FP8 down
// products (K 2048: 16 k-blocks a tile, where the ring's fill and the epilogue weigh most; 202 ->
// 186 us a 512-token layer at 16 experts). The FP8 gate | up (48 k-blocks) measured the same; the
// bf16 down products 2-3% faster alone, but the bf16 prefill measured slower with them walking,
// so bf16 keeps a tile a block. VIREO_GROUPED_PERSISTENT=0: never, =1: every TMA product (A/B).
// walk_mode / walk_blocks: set by grouped_set_walk (tests; -1 / 0: the environment's mode, the SMs).
int walk_mode = -1, walk_blocks = 0;
unsigned tma_grid(int tiles, bool swiglu, bool fp8) {
  static const int env_mode = [] {
    const char* e = std::getenv("VIREO_GROUPED_PERSISTENT");
    return e && *e ? std::atoi(e) : 2;  // 2: the FP8 down products
  }();
  static const int sms = [] {
    int dev = 0, n = 0;
    VIREO_CUDA_CHECK(cudaGetDevice(&dev));
    VIREO_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  const int mode = walk_mode >= 0 ? walk_mode : env_mode;
  const bool walk = mode == 1 || (mode == 2 && fp8 && !swiglu);
  return unsigned(walk ? std::min(tiles, walk_blocks > 0 ? walk_blocks : sms) : tiles);
}

// One bf16 TMA form's launch (its shared-memory size set once a process).
template <int TN, int Stages, int MinBlocks>
void launch_tma(const GroupedRun& r, bool swiglu, int tiles, cudaStream_t st) {
  constexpr size_t smem = size_t(Stages) * (kABytes + uint32_t(TN) * kTK * 2) + 1024;
  auto* kernel = grouped_gemm_tma_kernel<TN, Stages, MinBlocks>;
  static bool configured = false;
  if (!configured) {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    configured = true;
  }
  launch(kernel, tma_grid(tiles, swiglu, false), kTmaThreads, smem, st, table_at<CUtensorMap>(r, r.tables->maps_at),
         swiglu ? 0 : 1, int(swiglu ? r.D : r.I), table_at<int4>(r, r.tables->job_maps_at),
         table_at<int4>(r, swiglu ? r.tables->gate_up_at : r.tables->down_at), tiles, swiglu, r.scale,
         int(swiglu ? r.I : r.D), swiglu ? r.h : static_cast<void*>(r.y));
  VIREO_CUDA_LAUNCHED();
}

void gemm(const GroupedRun& r, bool swiglu, cudaStream_t st) {
  const int tiles = swiglu ? r.tables->gate_up_tiles : r.tables->down_tiles;
  if (tiles == 0) return;
  if (r.tables->fp8) {
    if (r.tables->n_maps == 0) fail("grouped FP8 experts: no tensor maps (the FP8 products load by TMA only)");
    // Token columns where the rows fill less than 60% of their row tiles (GroupedFp8Form);
    // VIREO_FP8_TOKEN_COLUMNS=0 keeps row tiles everywhere (A/B runs).
    static const bool token_columns_allowed = env_switch("VIREO_FP8_TOKEN_COLUMNS");
    const bool token_columns =
        r.fp8_form == GroupedFp8Form::TokenColumns || (r.fp8_form == GroupedFp8Form::Auto && token_columns_allowed &&
                                                       r.tables->rows * 10 < r.tables->row_tiles * kF8TM * 6);
    if (token_columns && r.tables->n_maps > 2 + 3 * r.tables->n_jobs) {
      allow_dynamic_smem<grouped_fp8_tokens_kernel, kTcSmem>();
      const int small = 2 + 3 * r.tables->n_jobs;  // the token boxes of 64 and 32 rows (grouped_tables)
      const int4 a_maps = swiglu ? make_int4(0, small, small + 1, 0) : make_int4(1, small + 2, small + 3, 0);
      launch(grouped_fp8_tokens_kernel, unsigned(tiles), kTmaThreads, kTcSmem, st,
             table_at<CUtensorMap>(r, r.tables->maps_at), a_maps, swiglu ? r.xs : r.hs, int(r.R),
             int(swiglu ? r.D : r.I), table_at<int4>(r, r.tables->job_maps_at), table_at<JobW>(r, r.tables->jobs_at),
             table_at<int4>(r, swiglu ? r.tables->gate_up_at : r.tables->down_at), swiglu, r.scale,
             int(swiglu ? r.I : r.D), swiglu ? r.h32 : r.y);
      VIREO_CUDA_LAUNCHED();
      return;
    }
    static bool fp8_configured = false;
    if (!fp8_configured) {
      VIREO_CUDA_CHECK(
          cudaFuncSetAttribute(grouped_fp8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kF8Smem)));
      fp8_configured = true;
    }
    launch(grouped_fp8_kernel, tma_grid(tiles, swiglu, true), kTmaThreads, kF8Smem, st,
           table_at<CUtensorMap>(r, r.tables->maps_at), swiglu ? 0 : 1, swiglu ? r.xs : r.hs, int(r.R),
           int(swiglu ? r.D : r.I), table_at<int4>(r, r.tables->job_maps_at), table_at<JobW>(r, r.tables->jobs_at),
           table_at<int4>(r, swiglu ? r.tables->gate_up_at : r.tables->down_at), tiles, swiglu, r.scale,
           int(swiglu ? r.I : r.D), swiglu ? r.h32 : r.y);
    VIREO_CUDA_LAUNCHED();
    return;
  }
  if (r.tables->n_maps > 0) return launch_tma<kTN, kStages, 1>(r, swiglu, tiles, st);
  static bool configured = false;
  if (!configured) {
    VIREO_CUDA_CHECK(
        cudaFuncSetAttribute(grouped_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    configured = true;
  }
  const auto* a = static_cast<const __nv_bfloat16*>(swiglu ? r.xb : r.h);
  launch(grouped_gemm_kernel, unsigned(tiles), kThreads, kSmem, st, a, int(swiglu ? r.D : r.I),
         table_at<JobW>(r, r.tables->jobs_at), table_at<int4>(r, swiglu ? r.tables->gate_up_at : r.tables->down_at),
         swiglu, r.scale, int(swiglu ? r.I : r.D), swiglu ? r.h : static_cast<void*>(r.y));
  VIREO_CUDA_LAUNCHED();
}

}  // namespace

void grouped_set_walk(int mode, int max_blocks) {
  VIREO_ASSERT(mode >= -1 && mode <= 2 && max_blocks >= 0);
  walk_mode = mode;
  walk_blocks = max_blocks;
}

bool grouped_experts_fit(int64_t D, int64_t I, const std::vector<GroupedJob>& jobs, bool fp8) {
  // (Multiples of the tile's columns are multiples of the k-step too; the FP8 tiles' 128 columns
  // and k-blocks divide the bf16 tiles' 256.)
  if (D <= 0 || I <= 0 || D % kTN != 0 || I % (kTN / 2) != 0 || D > (1 << 20) || I > (1 << 20)) return false;
  int64_t rows = 0;
  for (const GroupedJob& j : jobs) {
    for (const void* p : {j.gate, j.up, j.down})
      if (!p || reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
    if (fp8 && (!j.gate_s || !j.up_s || !j.down_s)) return false;
    if (j.rows < 0 || j.row0 != rows) return false;
    rows += j.rows;
  }
  return rows < (int64_t(1) << 30);
}

namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return PFN_cuTensorMapEncodeTiled_v12000(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A row-major bf16 (or, fp8, one-byte e4m3) matrix [rows, cols] read in boxes of one 128-byte
// swizzled line (64 bf16 or 128 e4m3 columns) by box_rows rows, as the tile loads lay them out
// in shared memory.
bool encode_map(CUtensorMap* m, const void* p, int64_t rows, int64_t cols, int box_rows, bool fp8 = false) {
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * (fp8 ? 1 : 2)};
  const cuuint32_t box[2] = {cuuint32_t(fp8 ? kF8TK : kTK), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return tensor_map_encoder()(m, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                              const_cast<void*>(p), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// encode_map for weights, through a cache: a map depends only on the pointer and the shape, so
// it stays right for as long as that pointer holds a matrix of that shape (a streamed expert's
// slot included). Encoding all of a run's maps took the host ~0.5 us each while the device,
// which had just handed back the run's row counts, waited for the launches.
bool weight_map(CUtensorMap* m, const void* p, int64_t rows, int64_t cols, int box_rows, bool fp8) {
  struct Key {
    const void* p;
    int64_t rows, cols;
    int box;
    bool fp8;
    bool operator==(const Key&) const = default;
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.p) ^ (size_t(k.rows) * 0x9E3779B97F4A7C15ull) ^ (size_t(k.cols) << 20) ^
             size_t(k.box) ^ (size_t(k.fp8) << 40);
    }
  };
  static std::mutex mu;
  static std::unordered_map<Key, CUtensorMap, Hash> cache;
  const Key key{p, rows, cols, box_rows, fp8};
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) {
    *m = it->second;
    return true;
  }
  if (!encode_map(m, p, rows, cols, box_rows, fp8)) return false;
  if (cache.size() >= (size_t(1) << 16)) cache.clear();  // (weights come and go in a test process)
  cache.emplace(key, *m);
  return true;
}

}  // namespace

bool grouped_tma_available() { return tensor_map_encoder() != nullptr; }

GroupedTables grouped_tables(const std::vector<GroupedJob>& jobs, int64_t D, int64_t I, const GroupedTmaOperands* tma,
                             bool fp8) {
  GroupedTables t;
  t.fp8 = fp8;
  t.n_jobs = int(jobs.size());
  // Tile shapes: bf16 128 rows x 256 columns (gate | up: 128 of each), FP8 128 x 128 (64 of each).
  const int tm = fp8 ? kF8TM : kTM, tn = fp8 ? kF8TN : kTN;
  // The tensor maps first (TMA wants them 64-byte aligned; the buffer's base is): A of the gate |
  // up product (xb [R, D]), A of the down product (h [R, I]), then each job's gate, up, down.
  std::vector<CUtensorMap> maps;
  std::vector<int4> jm;
  if (tma && tensor_map_encoder()) {
    bool ok = true;
    maps.resize(2 + 3 * jobs.size());
    ok = ok && encode_map(&maps[0], tma->xb, tma->R, D, tm, fp8);
    ok = ok && encode_map(&maps[1], tma->h, tma->R, I, tm, fp8);
    for (size_t j = 0; ok && j < jobs.size(); ++j) {
      const int b = int(2 + 3 * j);
      ok = ok && weight_map(&maps[size_t(b)], jobs[j].gate, I, D, tn / 2, fp8);
      ok = ok && weight_map(&maps[size_t(b + 1)], jobs[j].up, I, D, tn / 2, fp8);
      ok = ok && weight_map(&maps[size_t(b + 2)], jobs[j].down, D, I, tn, fp8);
      jm.push_back(make_int4(b, b + 1, b + 2, 0));
    }
    if (fp8) {  // the token-column form's smaller token boxes: xb by 64 and 32 rows, then h
      maps.resize(maps.size() + 4);
      const size_t m = maps.size() - 4;
      ok = ok && encode_map(&maps[m], tma->xb, tma->R, D, 64, fp8) &&
           encode_map(&maps[m + 1], tma->xb, tma->R, D, 32, fp8);
      ok = ok && encode_map(&maps[m + 2], tma->h, tma->R, I, 64, fp8) &&
           encode_map(&maps[m + 3], tma->h, tma->R, I, 32, fp8);
    }
    if (!ok) maps.clear(), jm.clear();
  }
  std::vector<JobW> jw;
  std::vector<int2> spans;
  std::vector<int4> gu, dn;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const GroupedJob& e = jobs[j];
    jw.push_back({static_cast<const __nv_bfloat16*>(e.gate), static_cast<const __nv_bfloat16*>(e.up),
                  static_cast<const __nv_bfloat16*>(e.down), e.gate_s, e.up_s, e.down_s});
    spans.push_back(make_int2(e.row0, e.rows));
    t.rows += e.rows;
    t.row_tiles += (e.rows + tm - 1) / tm;
    // The m-tiles of one column tile adjacent: blocks on the chip together share its weight rows
    // in L2 (each weight byte comes from DRAM about once per job).
    for (int64_t n0 = 0; n0 < I; n0 += tn / 2)
      for (int64_t m0 = e.row0; m0 < e.row0 + e.rows; m0 += tm)
        gu.push_back(make_int4(int(j), int(m0), e.row0 + e.rows, int(n0)));
    for (int64_t n0 = 0; n0 < D; n0 += tn)
      for (int64_t m0 = e.row0; m0 < e.row0 + e.rows; m0 += tm)
        dn.push_back(make_int4(int(j), int(m0), e.row0 + e.rows, int(n0)));
  }
  t.gate_up_tiles = int(gu.size());
  t.down_tiles = int(dn.size());
  auto put = [&](const void* p, size_t bytes) {
    const size_t off = (t.bytes.size() + 15) / 16 * 16;
    t.bytes.resize(off + bytes);
    if (bytes) std::memcpy(t.bytes.data() + off, p, bytes);
    return off;
  };
  t.n_maps = int(maps.size());
  t.maps_at = put(maps.data(), maps.size() * sizeof(CUtensorMap));
  t.job_maps_at = put(jm.data(), jm.size() * sizeof(int4));
  t.jobs_at = put(jw.data(), jw.size() * sizeof(JobW));
  t.spans_at = put(spans.data(), spans.size() * sizeof(int2));
  t.gate_up_at = put(gu.data(), gu.size() * sizeof(int4));
  t.down_at = put(dn.data(), dn.size() * sizeof(int4));
  return t;
}

int64_t grouped_max_row_tiles(int64_t routed, int n_routed, int64_t dense) {
  // sum ceil(m_j / 128) over at most min(n_routed, routed) non-empty jobs of routed rows together
  const int64_t used = std::min<int64_t>(n_routed, routed);
  return (routed + used * 127) / 128 + (dense + 127) / 128;
}

GroupedTables grouped_tables_device(const std::vector<GroupedJob>& jobs, int64_t max_row_tiles, int64_t D, int64_t I,
                                    const GroupedTmaOperands* tma, bool fp8) {
  std::vector<GroupedJob> empty = jobs;
  for (GroupedJob& j : empty) j.row0 = 0, j.rows = 0;
  GroupedTables t = grouped_tables(empty, D, I, tma, fp8);
  const int tn = fp8 ? kF8TN : kTN;
  const int64_t gu = max_row_tiles * (I / (tn / 2)), dn = max_row_tiles * (D / tn);
  auto room = [&](size_t bytes) {
    const size_t off = (t.bytes.size() + 15) / 16 * 16;
    t.bytes.resize(off + bytes);
    return off;
  };
  t.spans_at = room(jobs.size() * sizeof(int2));
  t.gate_up_at = room(size_t(gu) * sizeof(int4));
  t.down_at = room(size_t(dn) * sizeof(int4));
  t.max_row_tiles = max_row_tiles;
  return t;
}

GroupedTables grouped_device_tiles(const GroupedTables& made, char* table, const int32_t* offsets, int n_routed,
                                   int64_t routed_rows, int64_t dense_rows, int64_t D, int64_t I, cudaStream_t st) {
  GroupedTables t;  // (no bytes: those are on the device)
  t.fp8 = made.fp8;
  t.n_jobs = made.n_jobs;
  t.n_maps = made.n_maps;
  t.maps_at = made.maps_at, t.job_maps_at = made.job_maps_at, t.jobs_at = made.jobs_at;
  t.spans_at = made.spans_at, t.gate_up_at = made.gate_up_at, t.down_at = made.down_at;
  const int tm = made.fp8 ? kF8TM : kTM, tn = made.fp8 ? kF8TN : kTN;
  const int64_t max_tiles = grouped_max_row_tiles(routed_rows, n_routed, dense_rows);
  if (max_tiles > made.max_row_tiles || t.n_jobs != n_routed + (dense_rows > 0 ? 1 : 0))
    fail("grouped experts: a device-made run of ", routed_rows, " + ", dense_rows, " rows needs up to ", max_tiles,
         " row tiles; its tables hold ", made.max_row_tiles);
  const int gu_cols = int(I / (tn / 2)), dn_cols = int(D / tn);
  t.gate_up_tiles = int(max_tiles * gu_cols);
  t.down_tiles = int(max_tiles * dn_cols);
  // For the FP8 form's choice (rows against their row tiles): the row tiles of evenly spread rows.
  t.rows = routed_rows + dense_rows;
  const int64_t used = std::min<int64_t>(n_routed, routed_rows);
  t.row_tiles = (used > 0 ? used * ((routed_rows / used + tm - 1) / tm) : 0) + (dense_rows + tm - 1) / tm;
  launch(grouped_tiles_kernel, 1, 1024, size_t(3 * t.n_jobs + 1) * sizeof(int32_t), st, offsets, n_routed,
         int(dense_rows), t.n_jobs, tm, gu_cols, tn / 2, dn_cols, tn, reinterpret_cast<int2*>(table + t.spans_at),
         reinterpret_cast<int4*>(table + t.gate_up_at), t.gate_up_tiles, reinterpret_cast<int4*>(table + t.down_at),
         t.down_tiles);
  VIREO_CUDA_LAUNCHED();
  return t;
}

void grouped_gather(const GroupedRun& r, cudaStream_t st) {
  if (r.R == 0) return;
  if (r.tables->fp8 && r.xq) {
    launch(grouped_gather_q8_kernel, unsigned(r.R), 128, 0, st, reinterpret_cast<const uint4*>(r.xq), r.xqs, r.n_tokens,
           r.index, r.D, r.R, static_cast<uint4*>(r.xb), r.xs);
    VIREO_CUDA_LAUNCHED();
    return;
  }
  if (r.tables->fp8) return act_quant(r.x, r.R, r.R, r.D, static_cast<uint8_t*>(r.xb), r.xs, st, r.index);
  launch(grouped_gather_kernel, unsigned(r.R), 256, 0, st, r.x, r.index, r.D, static_cast<__nv_bfloat162*>(r.xb));
  VIREO_CUDA_LAUNCHED();
}
void grouped_dense_rows(const int32_t* index, const float* scale, int64_t routed, int64_t rows, int32_t* index_out,
                        float* scale_out, cudaStream_t st) {
  if (rows <= 0) return;
  launch(grouped_dense_rows_kernel, unsigned(std::min<int64_t>((rows + 255) / 256, 1024)), 256, 0, st, index, scale,
         routed, rows, index_out, scale_out);
  VIREO_CUDA_LAUNCHED();
}
void grouped_quantize_h(const GroupedRun& r, cudaStream_t st) {
  if (r.R > 0) act_quant(r.h32, r.R, r.R, r.I, static_cast<uint8_t*>(r.h), r.hs, st);
}
void grouped_gate_up(const GroupedRun& r, cudaStream_t st) { gemm(r, true, st); }
void grouped_down(const GroupedRun& r, cudaStream_t st) { gemm(r, false, st); }

void grouped_combine(const GroupedRun& r, cudaStream_t st) {
  if (r.R == 0) return;
  const int n = r.tables->n_jobs;
  const bool by_token = r.n_tokens > 0;
  launch(grouped_combine_kernel, unsigned(by_token ? r.n_tokens : r.R), 256, size_t(2 * n) * sizeof(int32_t), st,
         r.index, table_at<int2>(r, r.tables->spans_at), n, by_token, by_token && r.out_overwrite,
         reinterpret_cast<const float4*>(r.y), r.D / 4, reinterpret_cast<float4*>(r.out));
  VIREO_CUDA_LAUNCHED();
}

}  // namespace vireo::cuda
