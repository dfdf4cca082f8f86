// Decode-step kernels: the pieces that let a whole decode step run on the device with no host
// round trip (so it can be recorded as one CUDA graph) and with fewer passes over memory.
//
// Routed experts by id: the router's (token, k) slots are read on the device. Gate and up rows
// read together with silu(g) * u applied in registers (no g/u buffers), then the down rows of
// every slot side by side and a small pass that sums a token's slots in order of k, weighted, into
// the output row (no scatter). Every weight byte is read once, 16 bytes a load.
#include "backend/cuda/cuda_decode.h"
#include "backend/cuda/cuda_internal.h"

#include <cooperative_groups.h>
#include <cstdlib>
#include <string>
#include <type_traits>

namespace vireo::cuda {

namespace {

// Blocks of WARPS warps a multiprocessor must hold (registers permitting) for the kernels that
// stage x in shared memory (XS): 32 warps' worth, at most 64 registers a thread. Left alone, nvcc
// gave them ~100 registers: one 16-warp block an SM, too few loads in flight. 0: no minimum, as
// the other kernels were measured with (an explicit minimum of 1 doubled their registers).
template <bool XS, int WARPS> constexpr int kMinBlocks = XS ? 32 / WARPS : 0;

// The unit of work (a row, or a pair of rows) of this warp. In order: block b holds units
// [b WARPS, (b + 1) WARPS). Spread (spread_blocks): unit u on warp u / gridDim.x of block
// u % gridDim.x, so that every block, and so every SM, holds the same number of units to within one.
__device__ __forceinline__ int64_t warp_unit(int spread, int warp, int warps) {
  return spread ? int64_t(warp) * gridDim.x + blockIdx.x : int64_t(blockIdx.x) * warps + warp;
}

// A warp's first loads of a row (lane_dot) or a row pair (lane_dot2), issued before the kernel's
// wait (pdl_begin_after); `on` false where the row has fewer chunks than the first batch.
struct RowAhead {
  uint4 a[8];
  bool on = false;
};
struct PairAhead {
  uint4 a[4], b[4];
  bool on = false;
};
template <int DT>
__device__ __forceinline__ RowAhead row_ahead(const DevW& w, int64_t row, int lane, bool want) {
  RowAhead r;
  r.on = want && row < w.out && lane + 224 < w.in / GemvVec<DT>::n;
  if (r.on) {
    const uint4* wr = reinterpret_cast<const uint4*>(static_cast<const char*>(w.w) + row * w.in * elem_bytes<DT>());
#pragma unroll
    for (int i = 0; i < 8; ++i) r.a[i] = ldg_stream_ahead(wr + lane + 32 * i);
  }
  return r;
}
template <int DT>
__device__ __forceinline__ PairAhead pair_ahead(const DevW& w, int64_t row, int lane, bool want) {
  PairAhead r;
  r.on = want && row < w.out && lane + 96 < w.in / GemvVec<DT>::n;
  if (r.on) {
    const uint4* ar = reinterpret_cast<const uint4*>(static_cast<const char*>(w.w) + row * w.in * elem_bytes<DT>());
    const uint4* br = ar + w.in * elem_bytes<DT>() / 16;  // the next row
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      r.a[i] = ldg_stream_ahead(ar + lane + 32 * i);
      r.b[i] = ldg_stream_ahead(br + lane + 32 * i);
    }
  }
  return r;
}

// This lane's share of dot(w[row, :], x) (reduce over the warp afterwards). XF: where x comes
// from (a raw pointer: through L1; or an XShared copy). ahead: the first eight chunks, loaded.
template <int DT, bool VEC, class XF = const float*>
__device__ __forceinline__ float lane_dot(const DevW& w, int64_t row, XF x, int lane, const RowAhead* ahead = nullptr) {
  float acc[1] = {0.0f};
  if constexpr (VEC) {
    constexpr int N = GemvVec<DT>::n;
    const uint4* wr = reinterpret_cast<const uint4*>(static_cast<const char*>(w.w) + row * w.in * elem_bytes<DT>());
    const float* srow = DT == W_FP8 ? w.s + (row >> 7) * w.s_cols : nullptr;
    const int64_t nv = w.in / N;
    // Chunk v of the row into acc: gemv_consume's sum (x through L1), or the same expression over
    // the shared copy (dot_chunk sums as gemv_consume does).
    auto consume = [&](const uint4& a, int64_t v) {
      if constexpr (std::is_same_v<XF, const float*>) {
        gemv_consume<DT, 1>(a, x, w.in, v * N, srow, acc);
      } else {
        float4 xv[N / 4];
#pragma unroll
        for (int j = 0; j < N / 4; ++j) xv[j] = x(v * (N / 4) + j);
        const float p = dot_chunk<DT>(a, xv);
        if constexpr (DT == W_FP8) acc[0] += srow[(v * N) >> 7] * p;
        else acc[0] += p;
      }
    };
    int64_t v = lane;
    if (ahead && ahead->on) {  // the first eight, loaded before the kernel's wait
#pragma unroll
      for (int i = 0; i < 8; ++i) consume(ahead->a[i], v + 32 * i);
      v += 256;
    }
    for (; v + 224 < nv; v += 256) {  // eight (then four) loads in flight before the first use
      uint4 a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = ldg_stream(wr + v + 32 * i);
#pragma unroll
      for (int i = 0; i < 8; ++i) consume(a[i], v + 32 * i);
    }
    for (; v + 96 < nv; v += 128) {
      const uint4 a0 = ldg_stream(wr + v), a1 = ldg_stream(wr + v + 32), a2 = ldg_stream(wr + v + 64),
                  a3 = ldg_stream(wr + v + 96);
      consume(a0, v);
      consume(a1, v + 32);
      consume(a2, v + 64);
      consume(a3, v + 96);
    }
    for (; v < nv; v += 32) consume(ldg_stream(wr + v), v);
  } else {
    static_assert(std::is_same_v<XF, const float*>, "scalar GEMV rows read x through L1");
    for (int64_t k = lane; k < w.in; k += 32) acc[0] += wget<DT>(w, row, k) * x[k];
  }
  return acc[0];
}

// Slot k of a token: routed expert ids[t, k] for k < K, else shared expert n_routed + k - K.
__device__ __forceinline__ int slot_expert(const int32_t* ids, int64_t t, int k, int K, int n_routed) {
  return k < K ? ids[t * K + k] : n_routed + (k - K);
}

// This lane's shares of dot(a[row, :], x) and dot(b[row, :], x), reading x once for both rows:
// the GEMV's x reads come from L1 and, at 2-4x the weight bytes, are what L1 is busy with (ncu,
// FP8 experts: L1 95.8% busy, DRAM 35%). ahead: the first four chunks of each row, loaded.
template <int DT, bool VEC, class XF = XGlobal>
__device__ __forceinline__ float2 lane_dot2(const DevW& a, const DevW& b, int64_t row, const XF& xf, int lane,
                                            const PairAhead* ahead = nullptr) {
  float acc_a = 0.0f, acc_b = 0.0f;
  if constexpr (VEC) {
    constexpr int N = GemvVec<DT>::n;
    const size_t off = size_t(row * a.in) * elem_bytes<DT>();
    const uint4* ar = reinterpret_cast<const uint4*>(static_cast<const char*>(a.w) + off);
    const uint4* br = reinterpret_cast<const uint4*>(static_cast<const char*>(b.w) + off);
    const float* sa = DT == W_FP8 ? a.s + (row >> 7) * a.s_cols : nullptr;
    const float* sb = DT == W_FP8 ? b.s + (row >> 7) * b.s_cols : nullptr;
    const int64_t nv = a.in / N;
    auto consume = [&](const uint4& wa, const uint4& wb, int64_t v) {
      if constexpr (std::is_same_v<XF, XSharedH>) {  // f16 x (fast-fp8's one-token FP8 rows)
        static_assert(DT == W_FP8, "f16 x: FP8 rows");
        const int q = xf.q0 + 2 * int(v);
        const uint4 x0 = xf.xh[xh_slot(q)], x1 = xf.xh[xh_slot(q + 1)];
        const float sx = xf.xsc[q >> 4];
        acc_a += sa[(v * N) >> 7] * sx * dot_chunk_h(wa, x0, x1);
        acc_b += sb[(v * N) >> 7] * sx * dot_chunk_h(wb, x0, x1);
      } else {
        float4 xv[N / 4];
#pragma unroll
        for (int j = 0; j < N / 4; ++j) xv[j] = xf(v * (N / 4) + j);
        const float pa = dot_chunk<DT>(wa, xv), pb = dot_chunk<DT>(wb, xv);
        if constexpr (DT == W_FP8) {
          acc_a += sa[(v * N) >> 7] * pa;
          acc_b += sb[(v * N) >> 7] * pb;
        } else {
          acc_a += pa;
          acc_b += pb;
        }
      }
    };
    int64_t v = lane;
    if (ahead && ahead->on) {  // the first four of each, loaded before the kernel's wait
#pragma unroll
      for (int i = 0; i < 4; ++i) consume(ahead->a[i], ahead->b[i], v + 32 * i);
      v += 128;
    }
    for (; v + 96 < nv; v += 128) {  // four chunks of each row in flight
      uint4 wa[4], wb[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        wa[i] = ldg_stream(ar + v + 32 * i);
        wb[i] = ldg_stream(br + v + 32 * i);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) consume(wa[i], wb[i], v + 32 * i);
    }
    for (; v < nv; v += 32) consume(ldg_stream(ar + v), ldg_stream(br + v), v);
  } else {
    static_assert(std::is_same_v<XF, XGlobal>, "scalar GEMV rows read x through L1");
    const float* __restrict__ x = xf.x;
    for (int64_t k = lane; k < a.in; k += 32) {
      acc_a += wget<DT>(a, row, k) * x[k];
      acc_b += wget<DT>(b, row, k) * x[k];
    }
  }
  return make_float2(acc_a, acc_b);
}

// h[s, row] = silu(gate_e[row] . x[t]) * (up_e[row] . x[t]) for slot s = (t, k), k in the launch's
// slot range [k0, k0 + nk) of K + S (blockIdx.y = t nk + k - k0).
// A warp per row; XS: x[t] staged in shared memory by the block (D floats of dynamic shared memory).
// ready (may be null): each block adds 1 to ready[s] once its rows of h are written and visible
// (moe_down_slots2_kernel waits for a slot's count instead of for this whole grid).
template <int DT, bool VEC, bool XS = false, int WARPS = 8>
__global__ void __launch_bounds__(32 * WARPS, kMinBlocks<XS, WARPS>)
    moe_gate_up_kernel(const float* __restrict__ x, int64_t D, int64_t I, int K, int S, int n_routed, int k0, int nk,
                       const int32_t* __restrict__ ids, const DevExpert* __restrict__ bank, float* __restrict__ h,
                       int* __restrict__ ready) {
  pdl_begin();
  extern __shared__ float4 xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * WARPS + warp, t = blockIdx.y / nk, s = t * (K + S) + k0 + blockIdx.y % nk;
  if constexpr (XS) stage_x(x + t * D, D, xs);
  if (row < I) {
    const DevExpert& e = bank[slot_expert(ids, t, int(s % (K + S)), K, n_routed)];
    float2 gu;
    if constexpr (XS) gu = lane_dot2<DT, true>(e.gate, e.up, row, XShared{xs, 0}, lane);
    else gu = lane_dot2<DT, VEC>(e.gate, e.up, row, XGlobal{x + t * D}, lane);
    const float g = warp_sum(gu.x), u = warp_sum(gu.y);
    if (lane == 0) h[s * I + row] = g / (1.0f + expf(-g)) * u;
  }
  if (ready) {  // the same for every thread of the block
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();  // (cumulative: covers the block's stores the barrier ordered before it)
      atomicAdd(ready + s, 1);
    }
  }
}

// h[s, row] as moe_gate_up_kernel for one token (decode at B = 1) with FP8 weights, in blocks that
// stay: one block of kWalkWarps warps an SM, x staged once a block, each warp walking units
// u = g, g + W, g + 2W, ... (unit u: slot k0 + u / I, row u % I; g the warp's place over the grid,
// W the grid's warps) with lane_dot2's sums, so h has moe_gate_up_kernel's bits. Why: at the 64
// registers two 16-warp blocks an SM allow, the FP8 form spills (ptxas: 60 bytes; four local
// reloads a trip of its loop, `tools/sass_loops.py --loads`). Here a thread may hold 128 (123
// used, no spills). H200, 8 layers fp8 (BENCHMARKS, session 35): walking at 64 registers, spilling
// as much, measured even; without spills (16 warps at 123 registers, or 24 at 80) +1.4 to +1.7
// points of decode at context 0; so the spills, not the loads in flight (6 of the loop's 8 here, 4
// of 8 there with twice the warps an SM). Six or twelve chunks a trip, two blocks an SM, and a
// ring of loads running ahead across rows measured less. BF16's blocks do not spill, and walking
// lost 2.8 points there. No slot counts: a count a row cost a fence a row (the step 2.2 points
// slower than waiting for the whole launch), and the down products' blocks could not start beside
// these whole-SM blocks anyway.
constexpr int kWalkWarps = 16;
// XH: x staged as f16 (stage_x_f16, fast-fp8; D % 128 == 0), other sums.
template <int DT, bool XH = false>
__global__ void __launch_bounds__(32 * kWalkWarps, 1)
    moe_gate_up_walk_kernel(const float* __restrict__ x, int64_t D, int64_t I, int K, int n_routed, int k0, int nk,
                            const int32_t* __restrict__ ids, const DevExpert* __restrict__ bank,
                            float* __restrict__ h) {
  pdl_begin();
  extern __shared__ float4 xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const auto xf = stage_x_as<XH>(x, D, xs);
  const int64_t units = int64_t(nk) * I, stride = int64_t(gridDim.x) * kWalkWarps;
  for (int64_t u = int64_t(warp) * gridDim.x + blockIdx.x; u < units; u += stride) {
    const int k = k0 + int(u / I);
    const int64_t row = u % I;
    const DevExpert& e = bank[slot_expert(ids, 0, k, K, n_routed)];
    const float2 gu = lane_dot2<DT, true>(e.gate, e.up, row, xf, lane);
    const float g = warp_sum(gu.x), up = warp_sum(gu.y);
    if (lane == 0) h[k * I + row] = g / (1.0f + expf(-g)) * up;
  }
}

// out[t, row] = (0 + w0 * down_e0[row] . h[t, 0]) + w1 * ... in order of k, shared ones last.
template <int DT, bool VEC>
__global__ void __launch_bounds__(256) moe_down_kernel(const float* __restrict__ h, int64_t D, int64_t I, int K,
                                                       int S, int n_routed, const int32_t* __restrict__ ids,
                                                       const float* __restrict__ wts,
                                                       const DevExpert* __restrict__ bank, float* __restrict__ out) {
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * 8 + warp, t = blockIdx.y;
  if (row >= D) return;
  float acc = 0.0f;
  for (int k = 0; k < K + S; ++k) {
    const int64_t s = t * (K + S) + k;
    const float y = warp_sum(lane_dot<DT, VEC>(bank[slot_expert(ids, t, k, K, n_routed)].down, row, h + s * I, lane));
    acc = k < K ? __fadd_rn(acc, __fmul_rn(wts[t * K + k], y)) : __fadd_rn(acc, y);
  }
  if (lane == 0) out[t * D + row] = acc;
}

// As moe_down_kernel, a warp per two output rows (2i, 2i + 1): each slot's h read once for both.
// XS: the token's K + S rows of h staged in shared memory by the block ((K + S) x I floats).
template <int DT, bool XS = false, int WARPS = 8>
__global__ void __launch_bounds__(32 * WARPS, kMinBlocks<XS, WARPS>)
    moe_down2_kernel(const float* __restrict__ h, int64_t D, int64_t I, int K, int S, int n_routed,
                     const int32_t* __restrict__ ids, const float* __restrict__ wts,
                     const DevExpert* __restrict__ bank, float* __restrict__ out) {
  pdl_begin();
  extern __shared__ float4 xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = (int64_t(blockIdx.x) * WARPS + warp) * 2, t = blockIdx.y;
  if constexpr (XS) stage_x(h + t * (K + S) * I, (K + S) * I, xs);
  if (row >= D) return;
  float acc0 = 0.0f, acc1 = 0.0f;
  for (int k = 0; k < K + S; ++k) {
    const int64_t s = t * (K + S) + k;
    const DevW& w = bank[slot_expert(ids, t, k, K, n_routed)].down;
    DevW next = w;
    next.w = static_cast<const char*>(w.w) + size_t(w.in) * elem_bytes<DT>();
    float2 v;
    if constexpr (XS) v = lane_dot2<DT, true>(w, next, row, XShared{xs, int(k * I / 4)}, lane);
    else v = lane_dot2<DT, true>(w, next, row, XGlobal{h + s * I}, lane);
    const float y0 = warp_sum(v.x), y1 = warp_sum(v.y);
    if (k < K) {
      acc0 = __fadd_rn(acc0, __fmul_rn(wts[t * K + k], y0));
      acc1 = __fadd_rn(acc1, __fmul_rn(wts[t * K + k], y1));
    } else {
      acc0 = __fadd_rn(acc0, y0);
      acc1 = __fadd_rn(acc1, y1);
    }
  }
  if (lane == 0) {
    out[t * D + row] = acc0;
    out[t * D + row + 1] = acc1;
  }
}

// y[s, row] = down_e[row] . h[s] for slot s = (t, k) (blockIdx.y = k, blockIdx.z = t), rows 2i and
// 2i + 1 a warp (ppw such pairs, down_pairs_a_warp): every slot's down product side by side in one
// launch, h[s] staged in shared memory (I floats). moe_down2_kernel walks a warp through the K + S
// slots one after another, each a dependent round trip to DRAM for 4 KB (FP8), and took 50 us for
// GLM-5's 9 slots (113 MB, 2.3 TB/s; ncu, H200) where one slot alone as a dense product took 3.8.
// The same lane sums and warp reductions as moe_down2_kernel, so moe_down_combine_kernel's sum has
// the same bits.
//
// ready (may be null: then the kernel waits for its predecessor, the gate | up, as every kernel
// does): the gate | up blocks' counts per slot, need of them for each slot k < k_wait (the
// slots that launch wrote; slots past it were written before it began). Waiting per slot lets
// the blocks of the slots done first run while the gate | up's last blocks still stream (they
// are dispatched slot by slot, so by its last wave most slots are done). The gate | up's blocks
// have all begun by the time these are dispatched (PDL), so waiting on them cannot deadlock.
// Slot k of token t's down weight descriptor, read through L2, as h: without griddepcontrol.wait
// (the slot counts' path) nothing invalidates what this SM's L1 kept of the last layer's ids (the
// same buffer), and a streaming store rewrites the table.
__device__ __forceinline__ DevW slot_down(const int32_t* ids, const DevExpert* bank, int64_t t, int k, int K,
                                          int n_routed) {
  const int e = k < K ? __ldcg(ids + t * K + k) : n_routed + (k - K);
  return load_cg(&bank[e].down);
}
template <int DT, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, kMinBlocks<true, WARPS>)
    moe_down_slots2_kernel(const float* __restrict__ h, int64_t D, int64_t I, int K, int S, int n_routed,
                           const int32_t* __restrict__ ids, const DevExpert* __restrict__ bank, float* __restrict__ y,
                           const int* __restrict__ ready, int need, int k_wait, int ppw) {
  pdl_begin(ready == nullptr);
  extern __shared__ float4 xs[];
  __shared__ DevW down;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = blockIdx.z, s = t * (K + S) + blockIdx.y;
  // ppw row pairs a warp, one after another: the block's lookups and h's copy serve more rows.
  int64_t row = (int64_t(blockIdx.x) * WARPS * ppw + warp) * 2;
  if (threadIdx.x == 0) {
    if (ready && int(blockIdx.y) < k_wait) wait_count(ready + s, need);
    down = slot_down(ids, bank, t, int(blockIdx.y), K, n_routed);
  }
  // No thread reads h before the wait is over (stage_x's own barrier comes after its loads: the
  // first form, without this one, read unwritten rows in the tiny test models' decode).
  if (ready) __syncthreads();
  stage_x<true>(h + s * I, I, xs);  // its barrier also publishes down
  DevW next = down;
  next.w = static_cast<const char*>(down.w) + size_t(down.in) * elem_bytes<DT>();
  for (int j = 0; j < ppw && row < D; ++j, row += 2 * WARPS) {
    const float2 v = lane_dot2<DT, true>(down, next, row, XShared{xs, 0}, lane);
    const float y0 = warp_sum(v.x), y1 = warp_sum(v.y);
    if (lane == 0) {
      y[s * D + row] = y0;
      y[s * D + row + 1] = y1;
    }
  }
}

// One token's down products in blocks that stay (as many as fit, two an SM at 16 warps), block b
// taking the row pairs [b ppb, (b + 1) ppb) of the slots' pairs in slot order: at most two slots
// a block (ppb <= D / 2), their h staged once (<= 16 KB: the slots' h are adjacent). The same lane
// sums and warp reductions as moe_down_slots2_kernel, so the same y bits for
// moe_down_combine_kernel. Why: slots2's 864 blocks (GLM-5, 9 slots) each pay a serial start (the
// expert id, its descriptor, h's copy) before 128 KB of loads, over ~3.3 waves: 37 us a layer for
// 113 MB (3.05 TB/s, H200) where the size probe reads 2 KB rows of that size in one wave of
// staying blocks at ~4.1 TB/s (27.5 us). This form: 31 us, +1.4 points of fp8 decode at 8 layers
// at both contexts (BENCHMARKS "Session 45"). Sessions 37 and 44 had walked with every slot's h
// (73.7 KB) staged first: a serial prologue on every SM, no gain.
// XH: h staged as f16 (stage_x_f16, fast-fp8; I % 128 == 0), other sums.
template <int DT, int WARPS, bool XH = false, int MINB = kMinBlocks<true, WARPS>>
__global__ void __launch_bounds__(32 * WARPS, MINB)
    moe_down_walk_kernel(const float* __restrict__ h, int64_t D, int64_t I, int K, int S, int n_routed,
                         const int32_t* __restrict__ ids, const DevExpert* __restrict__ bank, float* __restrict__ y,
                         int64_t ppb) {
  pdl_begin();
  extern __shared__ float4 xs[];
  __shared__ DevW down[2];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t P = D / 2, total = int64_t(K + S) * P;
  const int64_t u0 = int64_t(blockIdx.x) * ppb, u1 = u0 + ppb < total ? u0 + ppb : total;
  if (u0 >= total) return;
  const int s0 = int(u0 / P), s1 = int((u1 - 1) / P);
  if (threadIdx.x < 2) down[threadIdx.x] = slot_down(ids, bank, 0, threadIdx.x == 0 ? s0 : s1, K, n_routed);
  // (its barrier also publishes down)
  const auto xf = stage_x_as<XH, true>(h + int64_t(s0) * I, int64_t(s1 - s0 + 1) * I, xs);
  // This block's pairs of slot s0 + j: [a, b).
  for (int j = 0; j <= s1 - s0; ++j) {
    const int64_t k = s0 + j, a = (u0 > k * P ? u0 : k * P) - k * P, b = (u1 < (k + 1) * P ? u1 : (k + 1) * P) - k * P;
    const DevW w = down[j];
    DevW next = w;
    next.w = static_cast<const char*>(w.w) + size_t(w.in) * elem_bytes<DT>();
    float* yk = y + k * D;
    for (int64_t row = (a + warp) * 2; row < 2 * b; row += 2 * WARPS) {
      const float2 v = lane_dot2<DT, true>(w, next, row, xf.at(j * I), lane);
      const float y0 = warp_sum(v.x), y1 = warp_sum(v.y);
      if (lane == 0) {
        yk[row] = y0;
        yk[row + 1] = y1;
      }
    }
  }
}

// out[t, row] = (0 + w0 y[t, 0, row]) + w1 y[t, 1, row] + ... in order of k, shared slots last
// with weight 1: moe_down2_kernel's sum.
// ready (may be null): the slots' counts moe_down_slots2_kernel waited on, zeroed for the next
// layer (every gate | up block has counted by now: the down products, done, waited for them).
__global__ void __launch_bounds__(256)
    moe_down_combine_kernel(const float* __restrict__ y, int64_t D, int K, int S, const float* __restrict__ wts,
                            float* __restrict__ out, int* __restrict__ ready) {
  pdl_begin();
  if (ready && blockIdx.x == 0 && blockIdx.y == 0)
    for (int i = int(threadIdx.x); i < int(gridDim.y) * (K + S); i += int(blockDim.x)) ready[i] = 0;
  const int64_t t = blockIdx.y, row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= D) return;
  float acc = 0.0f;
  for (int k = 0; k < K + S; ++k) {
    const float v = y[(t * (K + S) + k) * D + row];
    acc = k < K ? __fadd_rn(acc, __fmul_rn(wts[t * K + k], v)) : __fadd_rn(acc, v);
  }
  out[t * D + row] = acc;
}

// This lane's shares of the dot products of G x RG weight rows with one input x: rows r0 ..
// r0 + RG - 1 of each of G matrices of row length `in` (base[g] points at row r0 of matrix g;
// r0 % RG == 0 and RG divides 128, so an FP8 group shares one 128-row scale block, srow[g]).
// Each x chunk is read once for all G x RG rows, and DEPTH x G x RG 16-byte weight loads are in
// flight per lane: ncu on the FP8 expert kernels with two rows per x read still showed L1 72-89%
// busy next to DRAM 40-61% and 1-2 chunks per lane in flight per row.
template <int DT, int G, int RG, int DEPTH>
__device__ __forceinline__ void lane_dot_group(const char* const (&base)[G], const float* const (&srow)[G],
                                               int64_t in, const float* __restrict__ x, int lane,
                                               float (&acc)[G][RG]) {
  constexpr int N = GemvVec<DT>::n;
  const int64_t nv = in / N, row_bytes = in * elem_bytes<DT>();
  auto consume = [&](const uint4 (&w)[G][RG], int64_t v) {
    const float4* xp = reinterpret_cast<const float4*>(x + v * N);
    float4 xv[N / 4];
#pragma unroll
    for (int j = 0; j < N / 4; ++j) xv[j] = __ldg(xp + j);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float scale = 1.0f;
      if constexpr (DT == W_FP8) scale = srow[g][(v * N) >> 7];
#pragma unroll
      for (int i = 0; i < RG; ++i) {
        const float p = dot_chunk<DT>(w[g][i], xv);
        if constexpr (DT == W_FP8) acc[g][i] += scale * p;
        else acc[g][i] += p;
      }
    }
  };
  auto load = [&](uint4 (&w)[G][RG], int64_t v) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int i = 0; i < RG; ++i) w[g][i] = ldg_stream(reinterpret_cast<const uint4*>(base[g] + i * row_bytes) + v);
  };
  int64_t v = lane;
  for (; v + 32 * (DEPTH - 1) < nv; v += 32 * DEPTH) {
    uint4 w[DEPTH][G][RG];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) load(w[d], v + 32 * d);
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) consume(w[d], v + 32 * d);
  }
  for (; v < nv; v += 32) {
    uint4 w[G][RG];
    load(w, v);
    consume(w, v);
  }
}

// h[s, row] as moe_gate_up_kernel, a warp per RG rows of one slot's gate and up (x read once for
// all 2 x RG rows). Needs I % RG == 0 and 16-byte rows.
template <int DT, int RG, int DEPTH>
__global__ void __launch_bounds__(256)
    moe_gate_up_rows_kernel(const float* __restrict__ x, int64_t D, int64_t I, int K, int S, int n_routed, int k0,
                            int nk, const int32_t* __restrict__ ids, const DevExpert* __restrict__ bank,
                            float* __restrict__ h) {
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = (int64_t(blockIdx.x) * 8 + warp) * RG, t = blockIdx.y / nk,
                s = t * (K + S) + k0 + blockIdx.y % nk;
  if (row >= I) return;
  const DevExpert& e = bank[slot_expert(ids, t, int(s % (K + S)), K, n_routed)];
  const size_t off = size_t(row * D) * elem_bytes<DT>();
  const char* const base[2] = {static_cast<const char*>(e.gate.w) + off, static_cast<const char*>(e.up.w) + off};
  const float* const srow[2] = {DT == W_FP8 ? e.gate.s + (row >> 7) * e.gate.s_cols : nullptr,
                                DT == W_FP8 ? e.up.s + (row >> 7) * e.up.s_cols : nullptr};
  float acc[2][RG] = {};
  lane_dot_group<DT, 2, RG, DEPTH>(base, srow, D, x + t * D, lane, acc);
#pragma unroll
  for (int i = 0; i < RG; ++i) {
    const float g = warp_sum(acc[0][i]), u = warp_sum(acc[1][i]);
    if (lane == i) h[s * I + row + i] = g / (1.0f + expf(-g)) * u;
  }
}

// out[t, row] as moe_down_kernel. A block per RD output rows of one token, a warp per slot k
// (blockDim = 32 x (K + S)): each warp streams RD consecutive down rows of its expert (x = h[s]
// read once for all of them), then the slots' results are summed in order of k, as the other
// kernels do. Needs D % RD == 0, K + S <= 16, 16-byte rows.
template <int DT, int RD, int DEPTH>
__global__ void __launch_bounds__(512) moe_down_slots_kernel(const float* __restrict__ h, int64_t D, int64_t I,
                                                             int K, int S, int n_routed,
                                                             const int32_t* __restrict__ ids,
                                                             const float* __restrict__ wts,
                                                             const DevExpert* __restrict__ bank,
                                                             float* __restrict__ out) {
  pdl_begin();
  __shared__ float y[16][RD];
  const int k = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * RD, t = blockIdx.y, s = t * (K + S) + k;
  const DevW& w = bank[slot_expert(ids, t, k, K, n_routed)].down;
  const char* const base[1] = {static_cast<const char*>(w.w) + size_t(row * I) * elem_bytes<DT>()};
  const float* const srow[1] = {DT == W_FP8 ? w.s + (row >> 7) * w.s_cols : nullptr};
  float acc[1][RD] = {};
  lane_dot_group<DT, 1, RD, DEPTH>(base, srow, I, h + s * I, lane, acc);
#pragma unroll
  for (int i = 0; i < RD; ++i) {
    const float v = warp_sum(acc[0][i]);
    if (lane == i) y[k][i] = v;
  }
  __syncthreads();
  if (threadIdx.x < RD) {
    float a = 0.0f;
    for (int j = 0; j < K + S; ++j)
      a = j < K ? __fadd_rn(a, __fmul_rn(wts[t * K + j], y[j][threadIdx.x])) : __fadd_rn(a, y[j][threadIdx.x]);
    out[t * D + row + threadIdx.x] = a;
  }
}

// FP8 experts: the 2-byte kernels above left them at 2.6 and 1.9 TB/s (ncu: gate/up L1 89% busy
// with DRAM at 61%, down DRAM 40% at 22% occupancy). With 4 gate/up rows per x read and a warp
// per slot for down (8 and 16 loads in flight per lane), FP8 decode went from 63.6-64.3% to
// 66.1-66.7% of the copy bandwidth (H200, 2 layers x 16 experts). The same layouts for BF16
// measured 71-78% against the 2-byte kernels' 78.1-78.5% (these run at 4.0 and 3.8 TB/s, DRAM
// 85% / 81%: nothing to gain there), so BF16, F16 and F32 keep them.
constexpr int kFp8GateUpRows = 2, kFp8DownRows = 8, kFp8Depth = 2;

// FP8 and BF16 GEMVs with x staged in shared memory (XShared, x_shared): blocks of kXsWarps warps,
// so that a block's copy of x (read from L2) is small next to the weight rows it serves; inputs up
// to kXsMaxBytes (larger ones, and F32/F16 weights, read x through L1). Measured on the H200
// (session 8, 8 layers x 16 experts, % of copy at context 0): fp8 58.7 -> 61.7%, bf16 76.3-76.8 ->
// 78.0%. 16 warps a block measured better than 8 (fp8 61.5-61.6% vs 60.7-61.1%; o_proj 28.6 vs
// 32.3 us, expert down 37.6 vs 40.7 us).
constexpr int kXsWarps = 16;
constexpr size_t kXsMaxBytes = 96 << 10;
// Lets `Kernel` take up to kXsMaxBytes of dynamic shared memory.
template <auto Kernel>
void allow_xs() {
  allow_dynamic_smem<Kernel, kXsMaxBytes>();
}

// Grid for `units` warp tasks of a kernel with x in shared memory, spread evenly over the SMs.
// In order, ceil(units / WARPS) blocks leave some SMs with one block more than others whenever
// there are more blocks than SMs and not a multiple of them: o_proj's 3072 row pairs in blocks of
// 16 warps made 192 blocks on 132 SMs, 60 SMs streaming two blocks' rows and 72 one, so the
// product ended when the 60 did. Spread: b blocks an SM (the fewest that hold every unit, when the
// SM can hold them at once) and units dealt round-robin over the blocks (warp_unit). 0: keep the
// order (fewer blocks than SMs, a multiple of them, more than one wave, or VIREO_GEMV_SPREAD=0).
template <auto Kernel>
unsigned spread_blocks(int64_t units, int warps, size_t smem) {
  static const bool on = env_switch("VIREO_GEMV_SPREAD");
  const int64_t sms = multiprocessors(), plain = (units + warps - 1) / warps;
  if (!on || plain <= sms || plain % sms == 0) return 0;
  const int64_t per_sm = (units + sms * warps - 1) / (sms * warps);
  int fit = 0;
  VIREO_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, Kernel, 32 * warps, smem));
  return per_sm <= fit ? unsigned(per_sm * sms) : 0;
}

// Grid for `units` warp tasks of a kernel with x in shared memory in blocks of kWideWarps warps,
// one block an SM (VIREO_GEMV_WIDE_BLOCKS): every SM copies x once and streams ~units / SMs, dealt
// round-robin (spread). Blocks of 8 or 16 warps spread 2-3 to an SM copied x 2-3 times over: for
// GLM-5's layer input (2752 rows of 6144) 396 blocks each copied x (24 KB) for ~7 rows of FP8
// weights (42 KB), 9.5 MB of copies for 16.9 MB of weights, each block's first weight loads behind
// its copy; o_proj's 264 blocks 17 MB of copies (x 64 KB). One block an SM: 3.2 and 8.4 MB. The
// same sums (a warp still sums a whole row). H200, 8 layers fp8: +0.8-1.0 / +0.4-0.9 points of
// decode at context 0 / 4096 (BENCHMARKS, session 27). 0 (the caller's grid): at most a unit an SM, or more
// than an SM holds at once (one block of 1024 threads at 64 registers fills its register file).
constexpr int kWideWarps = 32;
template <auto Kernel>
unsigned wide_blocks(int64_t units, size_t smem) {
  static const bool on = env_switch("VIREO_GEMV_WIDE_BLOCKS");
  const int64_t sms = multiprocessors();
  if (!on || units <= sms) return 0;
  const int64_t per_sm = (units + sms * kWideWarps - 1) / (sms * kWideWarps);
  int fit = 0;
  VIREO_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, Kernel, 32 * kWideWarps, smem));
  return per_sm <= fit ? unsigned(per_sm * sms) : 0;
}

// Whether the shared-x GEMVs (gemv_rows2's and gemv_many's) issue their warps' first weight loads
// before their wait (pdl_begin_after): a block dispatched while the kernel before still runs
// (programmatic launch) then has those bytes on the way by the time its input is ready, where the
// step's small kernels (a norm, the attention's merge) otherwise left the memory idle between two
// products. Results do not change. H200, 8 layers: BF16 decode +1.1 / +0.9 points at context 0 /
// 4096, FP8 -0.4 / -1.0 (BENCHMARKS, session 27): on for BF16 weights only (a BF16 model's
// products, an FP8 model's lm_head). VIREO_WEIGHTS_AHEAD=0: never, =1: every dtype (A/B runs).
int weights_ahead(int dt) {
  static const int mode = [] {
    const char* e = std::getenv("VIREO_WEIGHTS_AHEAD");
    return e && *e ? std::atoi(e) : 2;  // 2: BF16 only
  }();
  return mode == 1 || (mode == 2 && dt == W_BF16) ? 1 : 0;
}

// VIREO_MOE_WALK=0: one token's FP8 gate | up in moe_gate_up_kernel's blocks instead of the
// walking ones (A/B runs; tests switch it with cuda_set_moe_walk).
bool g_moe_walk = env_switch("VIREO_MOE_WALK");

// VIREO_MOE_DOWN_SLOTS=0: the down products in moe_down2_kernel, slot after slot (A/B runs).
bool moe_down_slots() {
  static const bool on = env_switch("VIREO_MOE_DOWN_SLOTS");
  return on;
}

// Row pairs a warp of moe_down_slots2_kernel. One token's FP8 rows: two, so that the blocks'
// serial start (the slot's expert id, its descriptor, h's copy, each a round trip) serves twice
// the rows of 2 KB, and half as many blocks pass through each SM. H200, 8 layers, B = 1, decode at
// context 0 / 4096 against one pair a warp: fp8 +0.7 / +1.0 and +0.9 / +0.5 points (three pairs
// -0.2 / -0.6 against two, four +0.3 / +0.5 against one); bf16, whose rows are twice as long,
// -0.5 / -0.5: one (BENCHMARKS "Session 43"). Batched steps (N > 1) were not measured: one.
// VIREO_MOE_DOWN_PAIRS=N: N pairs everywhere (A/B runs; the sums are the same).
int down_pairs_a_warp(int dt, int64_t N) {
  static const int forced = [] {
    const char* e = std::getenv("VIREO_MOE_DOWN_PAIRS");
    return e && std::atoi(e) > 0 ? std::atoi(e) : 0;
  }();
  return forced ? forced : dt == W_FP8 && N == 1 ? 2 : 1;
}

int64_t g_down_walk_launches = 0;  // moe_down_walk_kernel's launches (tests check it is taken)

// moe_gate_up_walk_kernel's launch (Kernel: its form) with smem bytes of staged x.
template <auto Kernel>
void launch_gate_up_walk(size_t smem, const float* x, int64_t D, int64_t I, int K, int n_routed, int k0, int nk,
                         const int32_t* ids, const DevExpert* bank, float* h, cudaStream_t st) {
  allow_xs<Kernel>();
  int fit = 0;
  VIREO_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, Kernel, 32 * kWalkWarps, smem));
  const int64_t most = (int64_t(nk) * I + kWalkWarps - 1) / kWalkWarps;
  const unsigned blocks = unsigned(std::min<int64_t>(most, int64_t(std::max(fit, 1)) * multiprocessors()));
  launch(Kernel, blocks, 32 * kWalkWarps, smem, st, x, D, I, K, n_routed, k0, nk, ids, bank, h);
  VIREO_CUDA_LAUNCHED();
}

// moe_down_walk_kernel's launch (Kernel: its form) with smem bytes of staged h.
template <auto Kernel, int WARPS>
void launch_down_walk(size_t smem, float* h, int64_t D, int64_t I, int K, int S, int n_routed, const int32_t* ids,
                      const DevExpert* bank, float* y, cudaStream_t st) {
  allow_xs<Kernel>();
  int fit = 0;  // (two an SM at 16 warps at kMinBlocks' bound, one at a bound of 1)
  VIREO_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, Kernel, 32 * WARPS, smem));
  ++g_down_walk_launches;
  const int64_t total = int64_t(K + S) * (D / 2), blocks = int64_t(std::max(fit, 1)) * multiprocessors();
  const int64_t ppb = std::min<int64_t>((total + blocks - 1) / blocks, D / 2);
  launch(Kernel, unsigned((total + ppb - 1) / ppb), 32 * WARPS, smem, st, h, D, I, K, S, n_routed, ids, bank, y, ppb);
  VIREO_CUDA_LAUNCHED();
}

// ready (may be null): the slot counts the gate | up launch just before bumped, need per slot
// for its slots k < k_wait. after_walk: that launch was the walking gate | up. f16_x: one token's
// FP8 products on f16 x (fast-fp8; stage_x_f16).
template <int DT, int WARPS>
void launch_down_xs(float* h, int64_t N, int64_t D, int64_t I, int K, int S, int n_routed, const int32_t* ids,
                    const float* wts, const DevExpert* bank, float* out, int* ready, int need, int k_wait,
                    bool after_walk, bool f16_x, cudaStream_t st) {
  // After the walking gate | up (one token's FP8 rows, no slot counts): the down products walk too.
  static const bool down_walk = env_switch("VIREO_MOE_DOWN_WALK");  // 0: slots2 (A/B runs; the same bits)
  if (down_walk && moe_down_slots() && after_walk && !ready && N == 1 && D % 2 == 0 &&
      size_t(2 * I) * 4 <= kXsMaxBytes) {
    float* y = h + N * (K + S) * I;
    bool f16 = false;  // f16 h (fast-fp8) where h's rows are whole 128-column blocks
    if constexpr (DT == W_FP8) f16 = f16_x && I % 128 == 0;
    // The f16 form in one block an SM (128 registers: 106 used, no spills, eight loads in flight
    // a lane) where two blocks at 64 registers spilled 16 bytes and kept four in flight: H200, 8
    // layers fp8, +0.9 / +0.9 points at context 0 / 4096 (BENCHMARKS "Session 49").
    if (f16)
      launch_down_walk<moe_down_walk_kernel<W_FP8, WARPS, true, 1>, WARPS>(staged_f16_bytes(2 * I), h, D, I, K, S,
                                                                           n_routed, ids, bank, y, st);
    else
      launch_down_walk<moe_down_walk_kernel<DT, WARPS>, WARPS>(size_t(2 * I) * 4, h, D, I, K, S, n_routed, ids, bank, y,
                                                               st);
    launch(moe_down_combine_kernel, dim3(unsigned((D + 255) / 256), unsigned(N)), 256, 0, st, y, D, K, S, wts, out,
           ready);
    VIREO_CUDA_LAUNCHED();
    return;
  }
  if (moe_down_slots()) {
    constexpr auto kernel = moe_down_slots2_kernel<DT, WARPS>;
    allow_xs<kernel>();
    float* y = h + N * (K + S) * I;  // the slots' down products, after their gate | up products
    const int ppw = down_pairs_a_warp(DT, N);
    const int64_t per_block = int64_t(WARPS) * ppw;
    launch(kernel, dim3(unsigned((D / 2 + per_block - 1) / per_block), unsigned(K + S), unsigned(N)), 32 * WARPS,
           size_t(I) * 4, st, h, D, I, K, S, n_routed, ids, bank, y, static_cast<const int*>(ready), need, k_wait, ppw);
    VIREO_CUDA_LAUNCHED();
    launch(moe_down_combine_kernel, dim3(unsigned((D + 255) / 256), unsigned(N)), 256, 0, st, y, D, K, S, wts, out,
           ready);
    VIREO_CUDA_LAUNCHED();
    return;
  }
  allow_xs<moe_down2_kernel<DT, true, WARPS>>();
  const size_t h_bytes = size_t(K + S) * size_t(I) * 4;
  launch(moe_down2_kernel<DT, true, WARPS>, dim3(unsigned((D / 2 + WARPS - 1) / WARPS), unsigned(N)), 32 * WARPS,
         h_bytes, st, h, D, I, K, S, n_routed, ids, wts, bank, out);
  VIREO_CUDA_LAUNCHED();
}

template <int DT, bool VEC>
void launch_moe(bool x_shared, MoePart part, const float* x, int64_t N, int64_t D, int64_t I, int K, int S,
                int n_routed, const int32_t* ids, const float* wts, const DevExpert* bank, float* h, float* out,
                int* ready, bool f16_x, cudaStream_t st) {
  // The gate | up launch's slots of each token: [k0, k0 + nk).
  const int k0 = part == MoePart::SharedGateUp ? K : 0;
  const int nk = part == MoePart::All ? K + S : part == MoePart::SharedGateUp ? S : K;
  const bool down = part != MoePart::SharedGateUp;
  if (nk == 0 && !down) return;
  if constexpr ((DT == W_FP8 || DT == W_BF16) && VEC) {
    // The shared copies: x (gate | up), and each slot's h (down; all K + S of them at once in
    // moe_down2_kernel).
    const size_t x_bytes = size_t(D) * 4, h_bytes = size_t(moe_down_slots() ? 1 : K + S) * size_t(I) * 4;
    if (x_shared && D % 2 == 0 && x_bytes <= kXsMaxBytes && h_bytes <= kXsMaxBytes) {
      // The slot counts only where the down products wait on them (k0 = 0 then: Rest or All).
      // One token's FP8 gate | up walks (moe_gate_up_walk_kernel), and its down products wait for
      // all of it: no counts.
      const bool walk = DT == W_FP8 && N == 1 && g_moe_walk && nk > 0;
      if (!down || !moe_down_slots() || nk == 0 || walk) ready = nullptr;
      const unsigned row_blocks = unsigned((I + kXsWarps - 1) / kXsWarps);
      if (walk) {  // x in f16 (fast-fp8) where its rows are whole 128-column blocks
        if (f16_x && D % 128 == 0)
          launch_gate_up_walk<moe_gate_up_walk_kernel<W_FP8, true>>(staged_f16_bytes(D), x, D, I, K, n_routed, k0, nk,
                                                                    ids, bank, h, st);
        else
          launch_gate_up_walk<moe_gate_up_walk_kernel<W_FP8>>(x_bytes, x, D, I, K, n_routed, k0, nk, ids, bank, h, st);
      } else if (nk > 0) {
        allow_xs<moe_gate_up_kernel<DT, true, true, kXsWarps>>();
        launch(moe_gate_up_kernel<DT, true, true, kXsWarps>, dim3(row_blocks, unsigned(N * nk)), 32 * kXsWarps, x_bytes,
               st, x, D, I, K, S, n_routed, k0, nk, ids, bank, h, ready);
        VIREO_CUDA_LAUNCHED();
      }
      if (down)
        launch_down_xs<DT, kXsWarps>(h, N, D, I, K, S, n_routed, ids, wts, bank, out, ready, int(row_blocks), nk, walk,
                                     f16_x, st);
      return;
    }
    if (DT == W_FP8 && I % kFp8GateUpRows == 0 && D % kFp8DownRows == 0 && K + S <= 16) {
      if (nk > 0) {
        launch(moe_gate_up_rows_kernel<DT, kFp8GateUpRows, kFp8Depth>,
               dim3(unsigned((I / kFp8GateUpRows + 7) / 8), unsigned(N * nk)), 256, 0, st, x, D, I, K, S, n_routed, k0,
               nk, ids, bank, h);
        VIREO_CUDA_LAUNCHED();
      }
      if (down) {
        launch(moe_down_slots_kernel<DT, kFp8DownRows, kFp8Depth>, dim3(unsigned(D / kFp8DownRows), unsigned(N)),
               unsigned(32 * (K + S)), 0, st, h, D, I, K, S, n_routed, ids, wts, bank, out);
        VIREO_CUDA_LAUNCHED();
      }
      return;
    }
  }
  if (nk > 0) {
    launch(moe_gate_up_kernel<DT, VEC>, dim3(unsigned((I + 7) / 8), unsigned(N * nk)), 256, 0, st, x, D, I, K, S,
           n_routed, k0, nk, ids, bank, h, static_cast<int*>(nullptr));
    VIREO_CUDA_LAUNCHED();
  }
  if (!down) return;
  if (VEC && D % 2 == 0)
    launch(moe_down2_kernel<DT>, dim3(unsigned((D / 2 + 7) / 8), unsigned(N)), 256, 0, st, h, D, I, K, S, n_routed, ids,
           wts, bank, out);
  else
    launch(moe_down_kernel<DT, VEC>, dim3(unsigned((D + 7) / 8), unsigned(N)), 256, 0, st, h, D, I, K, S, n_routed, ids,
           wts, bank, out);
  VIREO_CUDA_LAUNCHED();
}

template <int DT>
void launch_moe_dt(bool vec, bool x_shared, MoePart part, const float* x, int64_t N, int64_t D, int64_t I, int K, int S,
                   int n_routed, const int32_t* ids, const float* wts, const DevExpert* bank, float* h, float* out,
                   int* ready, bool f16_x, cudaStream_t st) {
  if (vec) launch_moe<DT, true>(x_shared, part, x, N, D, I, K, S, n_routed, ids, wts, bank, h, out, ready, f16_x, st);
  else launch_moe<DT, false>(x_shared, part, x, N, D, I, K, S, n_routed, ids, wts, bank, h, out, ready, f16_x, st);
}

// y[row] for rows 2i and 2i + 1 by one warp, x read once for both (T = 1, rows 16-byte aligned).
// XS: x staged in shared memory by the block (w.in floats). ahead_on: 1 issues the first weight
// loads before the wait (weights_ahead); kRows2Early skips the wait (Rows2Launch::Early: x was
// complete before the kernel queued before this one passed its own wait) and reads x through L2.
constexpr int kRows2Early = 2;
// XH (with XS, FP8, w.in % 128 == 0): x staged as f16 (stage_x_f16, fast-fp8), other sums.
template <int DT, bool XS = false, int WARPS = 8, bool WALK = false, bool XH = false>
__global__ void __launch_bounds__(32 * WARPS, kMinBlocks<XS, WARPS>)
    gemv_rows2_kernel(const float* __restrict__ x, DevW w, float* __restrict__ y, int spread, int ahead_on) {
  const PairAhead ahead =
      pdl_begin_after(pair_ahead<DT>(w, warp_unit(spread, threadIdx.x >> 5, WARPS) * 2, threadIdx.x & 31, ahead_on),
                      ahead_on != kRows2Early);
  const bool early = ahead_on == kRows2Early;
  extern __shared__ float4 xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // WALK: each warp walks the row pairs gridDim.x * WARPS apart (a grid smaller than the pairs,
  // leaving room on the SMs to other kernels); else one pair a warp.
  int64_t row = warp_unit(spread, warp, WARPS) * 2;
  static_assert(!XH || (XS && DT == W_FP8), "f16 x: the shared-x FP8 form");
  // x staged (not through L1 when early: the wait would have invalidated it), or read through L1.
  const auto xf = [&] {
    if constexpr (XS) return early ? stage_x_as<XH, true>(x, w.in, xs) : stage_x_as<XH>(x, w.in, xs);
    else return XGlobal{x};
  }();
  DevW next = w;  // the same matrix one row on: FP8 rows 2i, 2i + 1 share a 128-row scale block
  next.w = static_cast<const char*>(w.w) + size_t(w.in) * elem_bytes<DT>();
  auto pair = [&](int64_t r, const PairAhead* first) {
    const float2 v = lane_dot2<DT, true>(w, next, r, xf, lane, first);
    const float a = warp_sum(v.x), b = warp_sum(v.y);
    if (lane == 0) {
      y[r] = a;
      y[r + 1] = b;
    }
  };
  if (row >= w.out) return;
  pair(row, &ahead);
  if constexpr (WALK)
    for (row += int64_t(gridDim.x) * WARPS * 2; row < w.out; row += int64_t(gridDim.x) * WARPS * 2) pair(row, nullptr);
}

// A warp per output row, or (PAIRS: every weight has an even row count) per two rows of one
// weight, x read once for both. Blocks of kManyWarps warps: a layer input's products (2784 rows
// at GLM-5 shapes) made 174 blocks of 8 warps, 1-2 per SM, a third of the SMs doing twice the
// work of the rest (bf16: 15.9 us for 34 MB, 2.1 TB/s; H200, ncu). With blocks of 2 warps the
// whole decode step moved by +0.5 points fp8 and none bf16 (one run: within run-to-run spread).
// XS: x staged in shared memory by blocks of WARPS warps, a warp per row (the shared copy makes
// x reads cheap, so rows need not share them in pairs: twice the warps in flight).
constexpr int kManyWarps = 2;
// The shared-x form's first loads of its warp's row, before the wait (the other forms: none).
template <int DT, bool PAIRS, bool XS, int WARPS>
__device__ __forceinline__ RowAhead many_ahead(const ManyW& m, int spread, bool want) {
  const int64_t r = warp_unit(spread, int(threadIdx.x >> 5), WARPS);
  if (!XS || PAIRS || !want || r >= m.row0[m.n]) return RowAhead{};
  int i = 0;
  while (r >= m.row0[i + 1]) ++i;
  return row_ahead<DT>(m.w[i], r - m.row0[i], int(threadIdx.x & 31), true);
}
// MIXED (XS, no pairs, DT = FP8): a weight's rows may also be BF16 (its DevW's dt says which).
template <int DT, bool PAIRS, bool XS = false, int WARPS = kManyWarps, bool MIXED = false>
__global__ void __launch_bounds__(32 * WARPS, kMinBlocks<XS, WARPS>)
    gemv_many_kernel(const float* __restrict__ x, ManyW m, int spread, int ahead_on) {
  const RowAhead ahead = pdl_begin_after(many_ahead<DT, PAIRS, XS, WARPS>(m, spread, ahead_on));
  static_assert(!MIXED || (XS && !PAIRS && DT == W_FP8), "mixed rows: the shared-x FP8 form");
  extern __shared__ float4 xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = warp_unit(spread, warp, WARPS) * (PAIRS ? 2 : 1);
  if constexpr (XS) stage_x(x, m.w[0].in, xs);
  if (r >= m.row0[m.n]) return;
  int i = 0;
  while (r >= m.row0[i + 1]) ++i;
  const int64_t row = r - m.row0[i];
  if constexpr (PAIRS) {
    DevW next = m.w[i];
    next.w = static_cast<const char*>(next.w) + size_t(next.in) * elem_bytes<DT>();
    const float2 v = lane_dot2<DT, true>(m.w[i], next, row, XGlobal{x}, lane);
    const float a = warp_sum(v.x), b = warp_sum(v.y);
    if (lane == 0) {
      m.y[i][row] = a;
      m.y[i][row + 1] = b;
    }
  } else {
    float v;
    if constexpr (MIXED) {
      if (m.w[i].dt == W_BF16) v = warp_sum(lane_dot<W_BF16, true>(m.w[i], row, XShared{xs, 0}, lane));
      else v = warp_sum(lane_dot<DT, true>(m.w[i], row, XShared{xs, 0}, lane, &ahead));
    } else if constexpr (XS) {
      v = warp_sum(lane_dot<DT, true>(m.w[i], row, XShared{xs, 0}, lane, &ahead));
    } else {
      v = warp_sum(lane_dot<DT, true>(m.w[i], row, x, lane));
    }
    if (lane == 0) m.y[i][row] = v;
  }
}

// Shared x, blocks of 8 warps, a warp per row: fp8 layer input's products 10.7 -> 9.2-10.0 us
// (H200, 2752 rows of 6144, ncu; session 8).
constexpr int kManyXsWarps = 8;
template <int DT>
void launch_many(const float* x, const ManyW& m, bool x_shared, cudaStream_t st) {
  if constexpr (DT == W_FP8 || DT == W_BF16) {
    const size_t x_bytes = size_t(m.w[0].in) * 4;
    if (x_shared && x_bytes <= kXsMaxBytes) {  // one block an SM where that holds every row
      constexpr auto kernel = gemv_many_kernel<DT, false, true, kWideWarps>;
      allow_xs<kernel>();
      if (const unsigned blocks = wide_blocks<kernel>(m.row0[m.n], x_bytes)) {
        launch(kernel, blocks, 32 * kWideWarps, x_bytes, st, x, m, 1, weights_ahead(DT));
        return;
      }
    }
    if (x_shared && x_bytes <= kXsMaxBytes) {
      constexpr auto kernel = gemv_many_kernel<DT, false, true, kManyXsWarps>;
      allow_xs<kernel>();
      const unsigned spread = spread_blocks<kernel>(m.row0[m.n], kManyXsWarps, x_bytes);
      launch(kernel, spread ? spread : unsigned((m.row0[m.n] + kManyXsWarps - 1) / kManyXsWarps), 32 * kManyXsWarps,
             x_bytes, st, x, m, spread ? 1 : 0, weights_ahead(DT));
      return;
    }
  }
  bool pairs = true;
  for (int i = 0; i <= m.n; ++i) pairs = pairs && m.row0[i] % 2 == 0;
  const unsigned blocks = unsigned((m.row0[m.n] / (pairs ? 2 : 1) + kManyWarps - 1) / kManyWarps);
  if (pairs) launch(gemv_many_kernel<DT, true>, blocks, 32 * kManyWarps, 0, st, x, m, 0, 0);
  else launch(gemv_many_kernel<DT, false>, blocks, 32 * kManyWarps, 0, st, x, m, 0, 0);
}

// Decode rows (T <= 8): each row spread over a cluster of kNormCluster blocks, where one block a
// row took 5.6-6.0 us for a 6144-wide add + norm and 3.7-3.9 us for a 2048-wide norm under ncu
// (H200), a serial chain of loads, a block reduction and stores on one SM. Each block squares its
// slice (a thread's elements in order, then block_sum), the blocks' sums meet through distributed
// shared memory in rank order (every block adds the same partials in the same order: one total,
// deterministic), then each block writes its slice. kAdd: h += x first (x then has h's stride n).
// kEmbed: h = the embedding rows of ids first (the step's lookup and first norm in one launch).
constexpr int kNormCluster = 8, kNormThreads = 256, kNormPer = 4;
template <bool kAdd, bool kEmbed = false>
__global__ void __cluster_dims__(kNormCluster, 1, 1) __launch_bounds__(kNormThreads)
    rms_norm_cluster_kernel(float* __restrict__ h, const float* __restrict__ x, int64_t xs, int64_t n,
                            const float* __restrict__ w, float eps, float* __restrict__ y, int64_t ys, DevW table,
                            const int32_t* __restrict__ ids) {
  pdl_begin();
  namespace cg = cooperative_groups;
  const cg::cluster_group cl = cg::this_cluster();
  __shared__ float part;
  const int64_t t = blockIdx.y, chunk = (n + kNormCluster - 1) / kNormCluster;
  const int64_t i0 = int64_t(cl.block_rank()) * chunk, i1 = min(n, i0 + chunk);
  float v[kNormPer], wv[kNormPer];
#pragma unroll
  for (int k = 0; k < kNormPer; ++k) {
    const int64_t i = i0 + threadIdx.x + k * kNormThreads;
    v[k] = 0.0f;
    wv[k] = 0.0f;
    if (i < i1) {
      if constexpr (kAdd) {
        v[k] = h[t * n + i] + x[t * n + i];
        h[t * n + i] = v[k];
      } else if constexpr (kEmbed) {
        v[k] = wget_rt(table, ids[t], i);
        h[t * n + i] = v[k];
      } else {
        v[k] = x[t * xs + i];
      }
      wv[k] = w[i];
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormPer; ++k) ss += v[k] * v[k];  // zeros past the slice add nothing
  ss = block_sum(ss);
  if (threadIdx.x == 0) part = ss;
  cl.sync();
  float total = 0.0f;
  for (int r = 0; r < kNormCluster; ++r) total += *cl.map_shared_rank(&part, r);
  cl.sync();  // no block leaves while another still reads its part
  const float inv = 1.0f / sqrtf(total / float(n) + eps);
#pragma unroll
  for (int k = 0; k < kNormPer; ++k) {
    const int64_t i = i0 + threadIdx.x + k * kNormThreads;
    if (i < i1) y[t * ys + i] = wv[k] * (v[k] * inv);
  }
}

// One block per row: h += x, then the same arithmetic as rms_norm_kernel on the new h.
__global__ void add_rms_norm_kernel(float* __restrict__ h, const float* __restrict__ x, int64_t n,
                                    const float* __restrict__ w, float eps, float* __restrict__ y) {
  pdl_begin();
  float* hr = h + int64_t(blockIdx.x) * n;
  const float* xr = x + int64_t(blockIdx.x) * n;
  float* yr = y + int64_t(blockIdx.x) * n;
  // The residual is written once the row's loads are issued (keep): written inside the load, each
  // store ordered every later load after it, 12 round trips a 6144-wide row (512 x 6144 in 36.6
  // us, ~1.4 TB/s; H200, prefill profile, session 19).
  rms_norm_row(
      n, w, eps, [&](int64_t i) { return hr[i] + xr[i]; }, [&](int64_t i) { return hr[i]; },
      [&](int64_t i, float v) { yr[i] = v; }, [&](int64_t i, float v) { hr[i] = v; });
}

// One block per token: rms-normalize the latent, rotate k_rope, both straight into the cache row.
// Same arithmetic as rms_norm_kernel + rope_kernel (bit-identical to running them in turn).
__global__ void mla_cache_append_kernel(const float* __restrict__ kva, int64_t L, int64_t rope,
                                        const float* __restrict__ w, float eps, const float* __restrict__ cs,
                                        int interleaved, float* __restrict__ cache, int64_t pos0,
                                        const int32_t* __restrict__ pos0_dev) {
  pdl_begin();
  const int64_t t = blockIdx.x, kvw = L + rope, half = rope / 2;
  const float* xr = kva + t * kvw;
  float* yr = cache + ((pos0_dev ? int64_t(*pos0_dev) : pos0) + t) * kvw;
  auto at = [&](int64_t i) { return xr[i]; };
  rms_norm_row(L, w, eps, at, at, [&](int64_t i, float v) { yr[i] = v; });
  const float* c = cs + t * rope;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float a = interleaved ? xr[L + 2 * i] : xr[L + i], b = interleaved ? xr[L + 2 * i + 1] : xr[L + half + i];
    const float co = c[2 * i], si = c[2 * i + 1];
    yr[L + i] = a * co - b * si;
    yr[L + half + i] = b * co + a * si;
  }
}

// One block (256 threads) per token: layer norm as layer_norm_kernel, then the first `rope` dims
// rotated as rope_kernel, written at the token's cache position.
__global__ void __launch_bounds__(256) index_key_append_kernel(const float* __restrict__ k, int64_t d,
                                                               const float* __restrict__ w,
                                                               const float* __restrict__ b, float eps, int64_t rope,
                                                               const float* __restrict__ cs, int interleaved,
                                                               float* __restrict__ keys, int64_t pos0,
                                                               const int32_t* __restrict__ pos0_dev) {
  pdl_begin();
  const int64_t t = blockIdx.x, half = rope / 2;
  const float* xr = k + t * d;
  float* yr = keys + ((pos0_dev ? int64_t(*pos0_dev) : pos0) + t) * d;
  layer_norm_row(xr, d, w, b, eps, yr);
  __syncthreads();
  const float* c = cs + t * rope;
  float x0 = 0, x1 = 0;
  const int64_t i = threadIdx.x;
  if (i < half) {
    x0 = interleaved ? yr[2 * i] : yr[i];
    x1 = interleaved ? yr[2 * i + 1] : yr[half + i];
  }
  __syncthreads();
  if (i < half) {
    const float co = c[2 * i], si = c[2 * i + 1];
    yr[i] = x0 * co - x1 * si;
    yr[half + i] = x1 * co + x0 * si;
  }
}

// Argmax as the CPU reference defines it: the largest value, the lowest index among equals; a
// NaN never wins, except that a row starting with NaN gives 0 (the reference compares against
// x[0] first). Both are order-independent, so the row is split over many blocks: one block
// reading a 620 KB vocabulary row alone took 65 us of a 1 ms decode step (H200, ncu), latency
// bound on one SM.
constexpr int kArgmaxThreads = 256, kArgmaxPerThread = 16;

// Block (b, row): the best of elements [b * chunk, (b + 1) * chunk) into part[row * gridDim.x + b].
__global__ void __launch_bounds__(kArgmaxThreads) argmax_part_kernel(const float* __restrict__ x, int64_t n,
                                                                     int64_t chunk, Best* __restrict__ part) {
  pdl_begin();
  const int64_t row = blockIdx.y;
  const float* xr = x + row * n;
  const int64_t lo = int64_t(blockIdx.x) * chunk, hi = min(n, lo + chunk);
  Best b{0.0f, -1};
  if ((reinterpret_cast<uintptr_t>(xr) & 15) == 0 && chunk % 4 == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    for (int64_t j = lo / 4 + threadIdx.x; j < hi / 4; j += kArgmaxThreads) {
      const float4 v = x4[j];
      consider(b, v.x, 4 * j);
      consider(b, v.y, 4 * j + 1);
      consider(b, v.z, 4 * j + 2);
      consider(b, v.w, 4 * j + 3);
    }
    for (int64_t i = max(lo, hi / 4 * 4) + threadIdx.x; i < hi; i += kArgmaxThreads) consider(b, xr[i], i);
  } else {
    for (int64_t i = lo + threadIdx.x; i < hi; i += kArgmaxThreads) consider(b, xr[i], i);
  }
  b = warp_best(b);
  __shared__ Best wb[kArgmaxThreads / 32];
  if ((threadIdx.x & 31) == 0) wb[threadIdx.x >> 5] = b;
  __syncthreads();
  if (threadIdx.x < 32) {
    b = threadIdx.x < kArgmaxThreads / 32 ? wb[threadIdx.x] : Best{0.0f, -1};
    b = warp_best(b);
    if (threadIdx.x == 0) part[row * gridDim.x + blockIdx.x] = b;
  }
}

// One warp per row: the best of the row's parts.
__global__ void argmax_final_kernel(const float* __restrict__ x, int64_t n, const Best* __restrict__ part, int parts,
                                    int32_t* __restrict__ out) {
  pdl_begin();
  const int64_t row = blockIdx.x;
  Best b{0.0f, -1};
  for (int j = threadIdx.x; j < parts; j += 32) b = better(b, part[row * parts + j]);
  b = warp_best(b);
  if (threadIdx.x == 0) out[row] = (b.i < 0 || x[row * n] != x[row * n]) ? 0 : b.i;
}

}  // namespace

void set_moe_walk(bool on) { g_moe_walk = on; }
int64_t moe_down_walk_launches() { return g_down_walk_launches; }

void moe_experts(const float* x, int64_t N, int64_t D, int64_t I, int K, int S, int n_routed, const int32_t* ids,
                 const float* weights, const DevExpert* bank, int dtype, bool vec, bool x_shared, MoePart part,
                 float* h, float* out, int* ready, cudaStream_t st, bool f16_x) {
  if (N <= 0) return;
  auto run = [&](auto launch_dt) {
    launch_dt(vec, x_shared, part, x, N, D, I, K, S, n_routed, ids, weights, bank, h, out, ready, f16_x, st);
  };
  switch (dtype) {
    case W_F32: run(launch_moe_dt<W_F32>); break;
    case W_BF16: run(launch_moe_dt<W_BF16>); break;
    case W_F16: run(launch_moe_dt<W_F16>); break;
    default: run(launch_moe_dt<W_FP8>); break;
  }
}

// The cluster kernels take decode steps (up to 8 rows, as the GEMVs) that fit kNormPer elements a thread.
static bool norm_by_cluster(int64_t T, int64_t n) {
  static const bool on = env_switch("VIREO_NORM_CLUSTER");  // 0: one block a row always (A/B runs)
  return on && T <= 8 && n <= int64_t(kNormCluster) * kNormThreads * kNormPer;
}

void add_rms_norm(float* h, const float* x, int64_t T, int64_t n, const float* w, float eps, float* y,
                  cudaStream_t st) {
  if (T <= 0) return;
  if (norm_by_cluster(T, n))
    launch(rms_norm_cluster_kernel<true>, dim3(kNormCluster, unsigned(T)), kNormThreads, 0, st, h, x, n, n, w, eps, y,
           n, DevW{}, nullptr);
  else launch(add_rms_norm_kernel, unsigned(T), n >= 2048 ? 512 : 256, 0, st, h, x, n, w, eps, y);
  VIREO_CUDA_LAUNCHED();
}

bool rms_norm_decode(const float* x, int64_t xs, int64_t T, int64_t n, const float* w, float eps, float* y, int64_t ys,
                     cudaStream_t st) {
  if (!norm_by_cluster(T, n)) return false;
  launch(rms_norm_cluster_kernel<false>, dim3(kNormCluster, unsigned(T)), kNormThreads, 0, st, nullptr, x, xs, n, w,
         eps, y, ys, DevW{}, nullptr);
  VIREO_CUDA_LAUNCHED();
  return true;
}

bool embed_rms_norm_fits(int64_t T, int64_t n) {
  static const bool on = env_switch("VIREO_EMBED_NORM");  // 0: the lookup and the norm apart (A/B runs)
  return on && norm_by_cluster(T, n);
}

void embed_rms_norm_decode(const DevW& table, const int32_t* ids, int64_t T, const float* w, float eps, float* h,
                           float* y, cudaStream_t st) {
  const int64_t n = table.in;
  launch(rms_norm_cluster_kernel<false, true>, dim3(kNormCluster, unsigned(T)), kNormThreads, 0, st, h, nullptr, n, n,
         w, eps, y, n, table, ids);
  VIREO_CUDA_LAUNCHED();
}

void mla_cache_append(const float* kva, int64_t T, int64_t L, int64_t rope, const float* norm_w, float eps,
                      const float* cs, bool interleaved, float* cache, int64_t pos0, const int32_t* pos0_dev,
                      cudaStream_t st) {
  if (T <= 0) return;
  launch(mla_cache_append_kernel, unsigned(T), L >= 2048 ? 512 : 256, 0, st, kva, L, rope, norm_w, eps, cs,
         interleaved ? 1 : 0, cache, pos0, pos0_dev);
  VIREO_CUDA_LAUNCHED();
}

void index_key_append(const float* k, int64_t T, int64_t d, const float* w, const float* b, float eps, int64_t rope,
                      const float* cs, bool interleaved, float* keys, int64_t pos0, const int32_t* pos0_dev,
                      cudaStream_t st) {
  if (T <= 0) return;
  if (rope / 2 > 256) fail("index_key_append: rope width ", rope, " is too wide");
  launch(index_key_append_kernel, unsigned(T), 256, 0, st, k, d, w, b, eps, rope, cs, interleaved ? 1 : 0, keys, pos0,
         pos0_dev);
  VIREO_CUDA_LAUNCHED();
}

namespace {
template <int DT, int WARPS, bool XH = false>
void launch_rows2_xs(const float* x, const DevW& w, float* y, cudaStream_t st, Rows2Launch form) {
  const size_t x_bytes = XH ? staged_f16_bytes(w.in) : size_t(w.in) * 4;
  if (form != Rows2Launch::InOrder) {  // blocks of 16 warps (two fill an SM's registers), one an SM at most
    // More FP8 pairs than that: a block an SM, each warp walking its pairs (q_b's 8192 pairs at
    // GLM-5 shapes: one pair a warp in 512 blocks took every SM's registers and starved the
    // indexer's branch beside it). BF16 rows keep a pair a warp: twice the bytes, and 16 warps an
    // SM then keep too few of them in flight (8 layers at 4096 cached, session 41: FP8 +1.2
    // points with the walk, BF16 -1.0 with it and +1.6 without; BENCHMARKS).
    const int64_t walk_blocks = multiprocessors(), blocks = (w.out / 2 + 15) / 16;
    const bool walk = DT == W_FP8 && blocks > walk_blocks;
    const int ahead = form == Rows2Launch::Early ? kRows2Early : weights_ahead(DT);
    if (walk) {
      constexpr auto kernel = gemv_rows2_kernel<DT, true, 16, true, XH>;
      allow_xs<kernel>();
      launch(kernel, unsigned(walk_blocks), 32 * 16, x_bytes, st, x, w, y, 0, ahead);
    } else {
      constexpr auto kernel = gemv_rows2_kernel<DT, true, 16, false, XH>;
      allow_xs<kernel>();
      launch(kernel, unsigned(blocks), 32 * 16, x_bytes, st, x, w, y, 0, ahead);
    }
    VIREO_CUDA_LAUNCHED();
    return;
  }
  {  // one block an SM where that holds every row pair
    constexpr auto kernel = gemv_rows2_kernel<DT, true, kWideWarps, false, XH>;
    allow_xs<kernel>();
    if (const unsigned blocks = wide_blocks<kernel>(w.out / 2, x_bytes)) {
      launch(kernel, blocks, 32 * kWideWarps, x_bytes, st, x, w, y, 1, weights_ahead(DT));
      VIREO_CUDA_LAUNCHED();
      return;
    }
  }
  constexpr auto kernel = gemv_rows2_kernel<DT, true, WARPS, false, XH>;
  allow_xs<kernel>();
  const unsigned spread = spread_blocks<kernel>(w.out / 2, WARPS, x_bytes);
  launch(kernel, spread ? spread : unsigned((w.out / 2 + WARPS - 1) / WARPS), 32 * WARPS, x_bytes, st, x, w, y,
         spread ? 1 : 0, weights_ahead(DT));
  VIREO_CUDA_LAUNCHED();
}

bool rows2_fits(const float* x, const DevW& w) {
  const int n = 16 / (w.dt == W_F32 ? 4 : w.dt == W_FP8 ? 1 : 2);
  return w.out % 2 == 0 && w.in % n == 0 && reinterpret_cast<uintptr_t>(w.w) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0;
}
bool rows2_xs_fits(const DevW& w, bool x_shared) {
  return x_shared && (w.dt == W_FP8 || w.dt == W_BF16) && size_t(w.in) * 4 <= kXsMaxBytes;
}
}  // namespace

bool gemv_rows2(const float* x, const DevW& w, float* y, bool x_shared, cudaStream_t st, Rows2Launch form, bool f16_x) {
  if (!rows2_fits(x, w)) return false;
  if (rows2_xs_fits(w, x_shared)) {
    if (w.dt == W_FP8 && f16_x && w.in % 128 == 0) launch_rows2_xs<W_FP8, kXsWarps, true>(x, w, y, st, form);
    else if (w.dt == W_FP8) launch_rows2_xs<W_FP8, kXsWarps>(x, w, y, st, form);
    else launch_rows2_xs<W_BF16, kXsWarps>(x, w, y, st, form);
    return true;
  }
  const unsigned blocks = unsigned((w.out / 2 + 7) / 8);
  switch (w.dt) {
    case W_F32: launch(gemv_rows2_kernel<W_F32>, blocks, 256, 0, st, x, w, y, 0, 0); break;
    case W_BF16: launch(gemv_rows2_kernel<W_BF16>, blocks, 256, 0, st, x, w, y, 0, 0); break;
    case W_F16: launch(gemv_rows2_kernel<W_F16>, blocks, 256, 0, st, x, w, y, 0, 0); break;
    default: launch(gemv_rows2_kernel<W_FP8>, blocks, 256, 0, st, x, w, y, 0, 0); break;
  }
  VIREO_CUDA_LAUNCHED();
  return true;
}

bool gemv_many_mixed(const float* x, const ManyW& m, bool x_shared, cudaStream_t st) {
  static const bool on = env_switch("VIREO_GEMV_MANY_MIXED");
  if (!on || !x_shared || m.n < 2) return false;
  for (int i = 0; i < m.n; ++i)
    if ((m.w[i].dt != W_FP8 && m.w[i].dt != W_BF16) || m.w[i].in != m.w[0].in) return false;
  const size_t x_bytes = size_t(m.w[0].in) * 4;
  if (x_bytes > kXsMaxBytes) return false;
  constexpr auto kernel = gemv_many_kernel<W_FP8, false, true, kWideWarps, true>;
  allow_xs<kernel>();
  const unsigned blocks = wide_blocks<kernel>(m.row0[m.n], x_bytes);
  if (!blocks) return false;
  launch(kernel, blocks, 32 * kWideWarps, x_bytes, st, x, m, 1, 0);  // (no loads before the wait: FP8's rule)
  VIREO_CUDA_LAUNCHED();
  return true;
}

void gemv_many(const float* x, const ManyW& m, bool x_shared, cudaStream_t st) {
  switch (m.w[0].dt) {
    case W_F32: launch_many<W_F32>(x, m, x_shared, st); break;
    case W_BF16: launch_many<W_BF16>(x, m, x_shared, st); break;
    case W_F16: launch_many<W_F16>(x, m, x_shared, st); break;
    default: launch_many<W_FP8>(x, m, x_shared, st); break;
  }
  VIREO_CUDA_LAUNCHED();
}

int argmax_parts(int64_t n) {
  const int64_t per_block = int64_t(kArgmaxThreads) * kArgmaxPerThread;
  return int(std::min<int64_t>(std::max<int64_t>((n + per_block - 1) / per_block, 1), 1024));
}

void argmax_rows(const float* x, int64_t rows, int64_t n, int32_t* out, void* parts_buf, cudaStream_t st) {
  if (rows <= 0) return;
  if (n <= 0 || n > INT32_MAX) fail("argmax_rows: row length ", n, " is outside 1..2^31-1");
  if (rows > 65535) fail("argmax_rows: ", rows, " rows (at most 65535)");
  const int parts = argmax_parts(n);
  const int64_t chunk = ((n + parts - 1) / parts + 3) / 4 * 4;  // a multiple of 4: float4 loads stay aligned
  Best* part = static_cast<Best*>(parts_buf);
  launch(argmax_part_kernel, dim3(unsigned(parts), unsigned(rows)), kArgmaxThreads, 0, st, x, n, chunk, part);
  VIREO_CUDA_LAUNCHED();
  launch(argmax_final_kernel, unsigned(rows), 32, 0, st, x, n, part, parts, out);
  VIREO_CUDA_LAUNCHED();
}

}  // namespace vireo::cuda
