#pragma once
// Device-side helpers shared by the CUDA backend's kernels: stored-dtype weight access, reductions.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace vireo::cuda {

enum : int { W_F32 = 0, W_BF16 = 1, W_F16 = 2, W_FP8 = 3 };

// A stored-dtype weight [out, in] on the device; FP8: s = scale_inv [ceil(out/128), s_cols].
struct DevW {
  const void* w = nullptr;
  const float* s = nullptr;
  int64_t out = 0, in = 0, s_cols = 0;
  int dt = W_F32;
};

// D += A B on the tensor cores (mma.sync m16n8k16: bf16 in, f32 accumulate), fragments in the
// PTX layout: a0..a3 the 16 x 16 A tile's pairs (rows g, g + 8; k 2q, 2q + 8), b0, b1 the 16 x 8
// B tile's (k 2q and 2q + 8, column g).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The same with e4m3 operands (mma.sync m16n8k32, f32 accumulate): a0..a3 hold 4 bytes each of
// rows g, g + 8, g, g + 8 at k 4q.. (a0, a1) and 16 + 4q.. (a2, a3); b0, b1 column g at k 4q.. and
// 16 + 4q...
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// (x, y) -> bf16x2 with x in the low half (the lower k / column index of a fragment pair).
__device__ __forceinline__ uint32_t pack_bf16x2(float x, float y) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Programmatic dependent launch (PDL). `launch` (cuda_internal.h) lets a kernel's blocks start
// while the kernel before it in the stream is still running, so the launch and the block dispatch
// of a decode step's ~20 kernels a layer overlap the kernel before instead of following it. Every
// kernel calls this first, before it reads or writes anything another kernel touches and before
// any early return: griddepcontrol.wait returns once the kernels this one depends on have finished
// and their writes are visible (at once where it was launched without the attribute); a kernel
// that returned before waiting could finish before its predecessor, and the kernel after it,
// which waits only for this one, would read stale data. Then launch_dependents lets the next
// kernel's blocks be dispatched while this one runs (they wait in their own pdl_begin).
// wait = false only in a kernel that synchronizes with its predecessor through counters in memory
// instead (moe_down_slots2_kernel waits for each slot's gate | up blocks to have written it), so
// that its blocks start on the work already done while the predecessor's last blocks still run.
// Such a kernel's dependents still launch as before.
__device__ __forceinline__ void pdl_begin(bool wait = true) {
  if (wait) asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// pdl_begin() after `ahead`, the argument, is evaluated: a kernel's first statement may issue loads
// of what no kernel writes (its weights) before the wait, so that they land while the kernel
// before it finishes (pdl_begin_after(first_loads(...))). Nothing else may be read there.
// wait = false only in a product launched early (Backend::ProductLaunch::Early): its inputs were
// complete before the kernel before it passed its own wait, and it writes nothing that kernel
// touches; the kernels after it must not read what the kernel before it writes (they wait for
// this one only).
template <class T>
__device__ __forceinline__ T pdl_begin_after(T ahead, bool wait = true) {
  pdl_begin(wait);
  return ahead;
}

// Spins until *count >= need (an acquire load, so what the counting blocks wrote before their
// fence is visible after). A count that never comes would hang the GPU: after ~2^26 tries (seconds)
// the kernel traps, and the launch's error names it.
__device__ __forceinline__ void wait_count(const int* count, int need) {
  for (unsigned tries = 0;; ++tries) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
    if (v >= need) return;
    if (tries == (1u << 26)) __trap();
    __nanosleep(100);
  }
}

// *p read through L2 (ld.global.cg, 8 bytes at a time): see wait_count's callers.
template <class T>
__device__ __forceinline__ T load_cg(const T* p) {
  static_assert(sizeof(T) % 8 == 0 && alignof(T) >= 8, "8-byte words");
  T v;
  const unsigned long long* src = reinterpret_cast<const unsigned long long*>(p);
  unsigned long long* dst = reinterpret_cast<unsigned long long*>(&v);
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / 8); ++i) dst[i] = __ldcg(src + i);
  return v;
}

template <int DT> __host__ __device__ constexpr int elem_bytes() { return DT == W_F32 ? 4 : DT == W_FP8 ? 1 : 2; }

// e4m3 -> f16 by moving sign, exponent and mantissa into place: the f16 holds the e4m3 value
// times 2^-8 (exponent bias 15 vs 7), exactly, subnormals included; the 256 goes back on after.
__device__ __forceinline__ float fp8_to_f32(uint32_t b) {
  const unsigned short h = (unsigned short)(((b & 0x7Fu) << 7) | ((b & 0x80u) << 8));
  return __half2float(__ushort_as_half(h)) * 256.0f;
}

template <int DT>
__device__ __forceinline__ float wget(const DevW& w, int64_t r, int64_t c) {
  const int64_t i = r * w.in + c;
  if constexpr (DT == W_F32) return static_cast<const float*>(w.w)[i];
  else if constexpr (DT == W_BF16) return __uint_as_float(uint32_t(static_cast<const uint16_t*>(w.w)[i]) << 16);
  else if constexpr (DT == W_F16) return __half2float(static_cast<const __half*>(w.w)[i]);
  else return fp8_to_f32(static_cast<const uint8_t*>(w.w)[i]) * w.s[(r >> 7) * w.s_cols + (c >> 7)];
}

__device__ __forceinline__ float wget_rt(const DevW& w, int64_t r, int64_t c) {
  switch (w.dt) {
    case W_F32: return wget<W_F32>(w, r, c);
    case W_BF16: return wget<W_BF16>(w, r, c);
    case W_F16: return wget<W_F16>(w, r, c);
    default: return wget<W_FP8>(w, r, c);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // `part` may still be read by a previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < nw ? part[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// A candidate of an argmax: the largest value wins, the lower index among equals.
struct Best {
  float v;
  int32_t i;  // -1: nothing yet
};

__device__ __forceinline__ Best better(Best a, Best b) {
  if (b.i < 0) return a;
  if (a.i < 0 || b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Best other;
    other.v = __shfl_xor_sync(0xffffffffu, b.v, o);
    other.i = __shfl_xor_sync(0xffffffffu, b.i, o);
    b = better(b, other);
  }
  return b;
}

// Offer x[i] (i ascending per thread, so ties keep the lower index); NaN is never taken.
__device__ __forceinline__ void consider(Best& b, float v, int64_t i) {
  if (v == v && (b.i < 0 || v > b.v)) b = {v, int32_t(i)};
}

// RMS norm of one row by one block: y[i] = w[i] * (x[i] * inv), inv = 1 / sqrt(mean(x^2) + eps).
// Thread t sums x[t], x[t + blockDim], ... in that order, then block_sum, so results depend only
// on the block size. Rows of up to kNormRegs x blockDim elements are held in registers: every load
// of x and w is in flight at once and x is read once (a 6144-wide row took 12 us as a strided
// loop of dependent loads on one SM; H200, ncu). `load(i)` gives x[i], `keep(i, x)` (optional)
// is called with it once every load of the thread is issued (e.g. to write the residual: a store
// inside `load` would order each later load after it), `reload(i)` gives x[i] again for longer
// rows, `store(i, y)` writes.
constexpr int kNormRegs = 16;
struct KeepNothing {
  __device__ void operator()(int64_t, float) const {}
};
template <typename Load, typename Reload, typename Store, typename Keep = KeepNothing>
__device__ __forceinline__ void rms_norm_row(int64_t n, const float* __restrict__ w, float eps, Load load,
                                             Reload reload, Store store, Keep keep = {}) {
  const int64_t t = threadIdx.x, bd = blockDim.x;
  float ss = 0.0f;
  if (n <= kNormRegs * bd) {
    float v[kNormRegs], wv[kNormRegs];
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k) {
      const int64_t i = t + k * bd;
      v[k] = i < n ? load(i) : 0.0f;
      wv[k] = i < n ? w[i] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k)
      if (t + k * bd < n) keep(t + k * bd, v[k]);
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k)
      if (t + k * bd < n) ss += v[k] * v[k];
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / float(n) + eps);
#pragma unroll
    for (int k = 0; k < kNormRegs; ++k)
      if (t + k * bd < n) store(t + k * bd, wv[k] * (v[k] * inv));
    return;
  }
  for (int64_t i = t; i < n; i += bd) {
    const float v = load(i);
    keep(i, v);
    ss += v * v;
  }
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / float(n) + eps);
  for (int64_t i = t; i < n; i += bd) store(i, w[i] * (reload(i) * inv));
}

// The mean of per-thread partial sums in f64 (blockDim a multiple of 32, <= 1024; every thread gets
// it): the layer norm's reductions, a fixed tree (xor shuffles in each warp, then the warps' sums
// in warp order), so deterministic for a given block size. (Thread 0 adding the 256 partials one
// after another made the indexer's key append 6 us a token on its own; H200, ncu.)
__device__ __forceinline__ double block_mean_f64(double v, int64_t n) {
  __shared__ double red[33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double m = 0;
    for (int i = 0; i < nw; ++i) m += red[i];
    red[32] = m / double(n);
  }
  __syncthreads();
  const double r = red[32];
  __syncthreads();  // `red` may be written again by the next call
  return r;
}

// y = (x - mean) / sqrt(var + eps) * w + b over one row, by the whole block (blockDim a multiple of
// 32, <= 1024).
__device__ __forceinline__ void layer_norm_row(const float* __restrict__ xr, int64_t n, const float* __restrict__ w,
                                               const float* __restrict__ b, float eps, float* __restrict__ yr) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
  const double mean = block_mean_f64(s, n);
  double v = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v += (xr[i] - mean) * (xr[i] - mean);
  const float inv = float(1.0 / sqrt(block_mean_f64(v, n) + eps));
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = float(xr[i] - mean) * inv * w[i] + b[i];
}

// A 16-byte weight load that does not displace activations in L1 (each weight byte is read once).
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// ldg_stream as a volatile asm: kept ahead of pdl_begin_after's wait (an ordinary asm with no
// memory clobber could be moved past it).
__device__ __forceinline__ uint4 ldg_stream_ahead(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// --- GEMV building blocks: 16-byte weight loads converted in registers ------------------------

template <int DT> struct GemvVec { static constexpr int n = 16 / elem_bytes<DT>(); };

// Two e4m3 bytes (bits 0-15) -> their values, exactly, by the hardware's e4m3x2 -> f16x2
// conversion (one instruction; sm_89+).
__device__ __forceinline__ __half2 e4m3x2_to_half2(uint32_t u) {
  return __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(u & 0xffffu), __NV_E4M3));
}
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t x) { return __half22float2(e4m3x2_to_half2(x)); }

// The N weights of one 16-byte load, as f32 (FP8: the e4m3 values; the block scale comes after).
template <int DT>
__device__ __forceinline__ void unpack16(const uint4& v, float* wf) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  if constexpr (DT == W_F32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) wf[i] = __uint_as_float(u[i]);
  } else if constexpr (DT == W_BF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      wf[2 * i] = __uint_as_float(u[i] << 16);
      wf[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
  } else if constexpr (DT == W_F16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &u[i], 4);
      const float2 f = __half22float2(h);
      wf[2 * i] = f.x;
      wf[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = fp8x2_to_float2(u[i]);        // bytes 0, 1
      const float2 b = fp8x2_to_float2(u[i] >> 16);  // bytes 2, 3
      wf[4 * i] = a.x;
      wf[4 * i + 1] = a.y;
      wf[4 * i + 2] = b.x;
      wf[4 * i + 3] = b.y;
    }
  }
}

template <int DT, int TT>
__device__ __forceinline__ void gemv_consume(const uint4& v, const float* __restrict__ x, int64_t in, int64_t k,
                                             const float* srow, float (&acc)[TT]) {
  constexpr int N = GemvVec<DT>::n;
  float wf[N];
  unpack16<DT>(v, wf);
  float scale = 1.0f;
  if constexpr (DT == W_FP8) scale = srow[k >> 7];
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    const float4* xp = reinterpret_cast<const float4*>(x + t * in + k);
    float p = 0.0f;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 xv = __ldg(xp + i);
      p += wf[4 * i] * xv.x + wf[4 * i + 1] * xv.y + wf[4 * i + 2] * xv.z + wf[4 * i + 3] * xv.w;
    }
    if constexpr (DT == W_FP8) acc[t] += scale * p;
    else acc[t] += p;
  }
}

// RoPE of one (token, head)'s rope part v[0 : 2 half] by cos_sin c ([half, 2]): pair i is read by
// one thread (rope_pair_read), and after every thread of the item has read its pair (the item's
// pairs overlap in the interleaved layout) written de-interleaved (rope_pair_write). rope_kernel
// and the absorbed queries' fused rotation both use these, so they write the same bits.
__device__ __forceinline__ float2 rope_pair_read(const float* v, int i, int half, bool interleaved) {
  return interleaved ? make_float2(v[2 * i], v[2 * i + 1]) : make_float2(v[i], v[half + i]);
}
__device__ __forceinline__ void rope_pair_write(float* v, int i, int half, float2 ab, const float* c) {
  const float co = c[2 * i], si = c[2 * i + 1];
  v[i] = ab.x * co - ab.y * si;
  v[half + i] = ab.y * co + ab.x * si;
}

// Where a GEMV lane's x comes from, as float4 number q of the input row. XGlobal: through L1.
// XShared: from the block's copy in shared memory, swizzled so that the 8 lanes of a quarter-warp
// reading float4 j of their 64-byte chunks (an FP8 lane's 16 weights) hit 8 different bank groups.
// Why: through L1 those reads touch 16 cache lines an instruction (lanes 64 bytes apart), 64
// wavefronts for the 2 KB of x a warp's 512 FP8 weight bytes need; from shared memory, 16.
struct XGlobal {
  const float* x;
  __device__ __forceinline__ float4 operator()(int64_t q) const {
    return __ldg(reinterpret_cast<const float4*>(x) + q);
  }
};
__device__ __forceinline__ int xs_slot(int q) { return q ^ ((q >> 3) & 3); }
struct XShared {
  const float4* xs;
  int q0;  // first float4 of this input within the staged rows
  __device__ __forceinline__ float4 operator()(int64_t q) const { return xs[xs_slot(q0 + int(q))]; }
  __device__ __forceinline__ XShared at(int64_t elems) const { return {xs, q0 + int(elems / 4)}; }
};
// The block copies n floats (n % 4 == 0, 16-byte aligned) into xs, swizzled; then a barrier.
// COHERENT: loads through L2 only (x may have been written by a kernel still running, see
// pdl_begin(false)); else the read-only path.
template <bool COHERENT = false>
__device__ __forceinline__ void stage_x(const float* __restrict__ x, int64_t n, float4* xs) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int q = int(threadIdx.x); q < int(n / 4); q += int(blockDim.x))
    xs[xs_slot(q)] = COHERENT ? __ldcg(x4 + q) : __ldg(x4 + q);
  __syncthreads();
}

// One 16-byte chunk of a weight row against its N inputs (already loaded), summed as
// gemv_consume sums (the block scale, for FP8, is applied by the caller).
template <int DT>
__device__ __forceinline__ float dot_chunk(const uint4& w, const float4* xv) {
  constexpr int N = GemvVec<DT>::n;
  float wf[N];
  unpack16<DT>(w, wf);
  float p = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 4; ++i) p += wf[4 * i] * xv[i].x + wf[4 * i + 1] * xv[i].y + wf[4 * i + 2] * xv[i].z + wf[4 * i + 3] * xv[i].w;
  return p;
}

// --- One token's FP8 products on f16 x (fast-fp8) ---------------------------------------------
// x staged as f16 of x / 2^e per 128-column block, 2^e the least power of two above the block's
// amax (exact: a power of two), so |x / 2^e| < 1. A 16-byte FP8 chunk's 16 products are summed by
// 8 f16x2 FMAs (each half adds 8 products, |sum| <= 8 * 448: no overflow), then its two halves in
// f32. Why: the f32 form takes ~40 instructions a chunk a row (8 conversions to f16x2, 16 to f32,
// 16 FMAs); this one ~20, and half the shared-memory reads of x. The error (f16's 2^-11 on x and on
// the partial sums) stays far under fast-fp8's own e4m3 rounding of x (2^-4).
// Swizzle: lane l reads uint4s 2l and 2l + 1 of its 32-byte chunk; flipping bit 0 of every second
// group of 8 puts a quarter-warp's 8 reads on 8 different bank groups.
__device__ __forceinline__ int xh_slot(int q) { return q ^ ((q >> 3) & 1); }
__device__ __forceinline__ __half2 u32_as_half2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, 4);
  return h;
}
// The block stages n floats of x (n % 128 == 0) as f16 into xh (n / 8 uint4s, swizzled) and the
// blocks' scales 2^e into xsc (n / 128 floats); then a barrier. A warp a 128-column block.
template <bool COHERENT = false>
__device__ __forceinline__ void stage_x_f16(const float* __restrict__ x, int64_t n, uint4* xh, float* xsc) {
  const int lane = threadIdx.x & 31, warps = int(blockDim.x >> 5), nb = int(n / 128);
  const float4* x4 = reinterpret_cast<const float4*>(x);
  constexpr int kBatch = 4;  // a warp's blocks loaded together: o_proj's x is 4 blocks a warp at 32 warps
  for (int b0 = int(threadIdx.x >> 5); b0 < nb; b0 += kBatch * warps) {
    float4 v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int b = b0 + i * warps;
      if (b < nb) v[i] = COHERENT ? __ldcg(x4 + b * 32 + lane) : __ldg(x4 + b * 32 + lane);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int b = b0 + i * warps;
      if (b >= nb) break;  // (the same for the whole warp)
      const float a = warp_max(fmaxf(fmaxf(fabsf(v[i].x), fabsf(v[i].y)), fmaxf(fabsf(v[i].z), fabsf(v[i].w))));
      // e with a = m 2^e, m in [0.5, 1) (frexp's, from the exponent field), held to [-126, 126] so
      // that 2^e and 2^-e are normal floats (a zero or subnormal block: 2^-126, its values stay
      // below 1; a block past 2^126: values below 4, still far inside f16 after the products).
      const int e = max(-126, min(126, int((__float_as_uint(a) >> 23) & 0xffu) - 126));
      const float inv = __uint_as_float(uint32_t(127 - e) << 23);
      const __half2 h0 = __floats2half2_rn(v[i].x * inv, v[i].y * inv),
                    h1 = __floats2half2_rn(v[i].z * inv, v[i].w * inv);
      uint2 pk;
      memcpy(&pk.x, &h0, 4);
      memcpy(&pk.y, &h1, 4);
      reinterpret_cast<uint2*>(xh + xh_slot(b * 16 + (lane >> 1)))[lane & 1] = pk;
      if (lane == 0) xsc[b] = __uint_as_float(uint32_t(127 + e) << 23);
    }
  }
  __syncthreads();
}
// Where a GEMV lane's x comes from in the f16 form: the block's staged halves and scales.
struct XSharedH {
  const uint4* xh;   // stage_x_f16's halves, swizzled (xh_slot)
  const float* xsc;  // their 128-column blocks' scales
  int q0;            // first uint4 (8 halves) of this input within the staged rows (a multiple of 16)
  __device__ __forceinline__ XSharedH at(int64_t elems) const { return {xh, xsc, q0 + int(elems / 8)}; }
};
// x staged for the shared-x GEMVs, in f32 (H false: XShared) or f16 with block scales (XSharedH),
// in the block's dynamic shared memory smem (n * 4 bytes, or staged_f16_bytes(n)).
__host__ __device__ constexpr size_t staged_f16_bytes(int64_t n) { return size_t(n) * 2 + size_t(n) / 32; }
template <bool H, bool COHERENT = false>
__device__ __forceinline__ auto stage_x_as(const float* __restrict__ x, int64_t n, float4* smem) {
  if constexpr (H) {
    uint4* xh = reinterpret_cast<uint4*>(smem);
    float* xsc = reinterpret_cast<float*>(xh + n / 8);
    stage_x_f16<COHERENT>(x, n, xh, xsc);
    return XSharedH{xh, xsc, 0};
  } else {
    stage_x<COHERENT>(x, n, smem);
    return XShared{smem, 0};
  }
}

// One 16-byte FP8 chunk against its 16 staged f16 inputs (x0: the first 8, x1: the next 8),
// unscaled (the caller applies the weight's and x's block scales).
__device__ __forceinline__ float dot_chunk_h(const uint4& w, const uint4& x0, const uint4& x1) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w}, xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
  __half2 acc = __hmul2(e4m3x2_to_half2(u[0]), u32_as_half2(xv[0]));
  acc = __hfma2(e4m3x2_to_half2(u[0] >> 16), u32_as_half2(xv[1]), acc);
#pragma unroll
  for (int i = 1; i < 4; ++i) {
    acc = __hfma2(e4m3x2_to_half2(u[i]), u32_as_half2(xv[2 * i]), acc);
    acc = __hfma2(e4m3x2_to_half2(u[i] >> 16), u32_as_half2(xv[2 * i + 1]), acc);
  }
  const float2 f = __half22float2(acc);
  return f.x + f.y;
}

// DeepSeek's act_quant for one (token, 128-column) block held by a warp, 4 values a lane: the
// block's scale s = amax / 448 (1 for an all-zero block) and this lane's 4 values as e4m3 bytes
// (byte i = value i) of v / s, IEEE f32 division, rounded to nearest even, saturating to +-448.
// The prefill's act_quant kernel and the decode's e4m3 products both quantize through this, so a
// token's e4m3 x is the same bytes on either path.
__device__ __forceinline__ uint32_t act_quant_lane(const float (&v)[4], float& scale) {
  const float a = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
  scale = a > 0.0f ? a / 448.0f : 1.0f;
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    packed |= uint32_t(uint8_t(__nv_cvt_float_to_fp8(v[i] / scale, __NV_SATFINITE, __NV_E4M3))) << (8 * i);
  return packed;
}

// --- Asynchronous copies into shared memory (cp.async, sm_80+) ------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// 16 bytes from global to shared memory; copy = false: 16 zero bytes (nothing is read; src must
// still be a valid address).
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool copy) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(copy ? 16 : 0) : "memory");
}
// 4 bytes from global to shared memory (through L1: .ca is the only form of this size).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

}  // namespace vireo::cuda
