// vireo_read_probe: how fast the GPU streams bytes laid out as the decode step's weights are,
// next to how fast it streams one flat buffer. Reads only (each 16-byte load XORed into a value
// the compiler cannot drop); no vireo code. BENCHMARKS.md "Session 21" has its numbers on an H200.
//
//   build-cuda/vireo_read_probe        (built with the CUDA backend; needs an sm_90 GPU)
//
// The bytes: GLM-5's routed gate | up of one token, 8 experts x 2 matrices of 2048 rows x 6144
// FP8 bytes (201 MB, four times the L2), in 16 allocations as uploaded weights are; two such
// sets, alternated, so that no run reads what the previous one left in L2. Each pattern's time
// is the median of 20 runs (CUDA events).
//
// Why: the decode GEMVs read 3.3-3.5 TB/s under ncu while a device-to-device copy moves 4.2 TB/s;
// this says which access shapes reach what, before a kernel is rewritten for bandwidth.
// Session 26: the flat kernels now read their whole buffer (they skipped up to DEPTH - 1 strides
// at the end: 14% of the bytes at 4 x 512 threads an SM), and every shape reads ~3.9-4.0 TB/s.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

namespace {

constexpr const char* kProbeName = "vireo_read_probe";

constexpr int64_t kRows = 2048, kRowBytes = 6144, kSlots = 8;
constexpr int64_t kMatBytes = kRows * kRowBytes;
constexpr double kBytes = double(2 * kSlots * kMatBytes);

// Flat: thread i of the grid reads uint4 i, i + stride, ... (stride = the grid's threads): at any
// moment the whole GPU reads one narrow window of each buffer. NB buffers side by side.
template <int DEPTH, int NB>
__global__ void flat_kernel(const uint4* const* bufs, int64_t n, unsigned* sink) {
  unsigned acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + stride * (DEPTH - 1) < n; i += stride * DEPTH) {
    uint4 w[DEPTH][NB];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
#pragma unroll
      for (int b = 0; b < NB; ++b) w[d][b] = ld16(bufs[b] + i + stride * d);
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
#pragma unroll
      for (int b = 0; b < NB; ++b) acc ^= fold(w[d][b]);
  }
  // The tail (up to DEPTH - 1 strides): session 21's form stopped before it and so read 86% of
  // the bytes at 4 blocks of 512 an SM, which made this shape look 12% faster than it is.
  for (; i < n; i += stride)
#pragma unroll
    for (int b = 0; b < NB; ++b) acc ^= fold(ld16(bufs[b] + i));
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The 16 matrices as one sequence, flat (one matrix's window at a time).
__global__ void flat_concat_kernel(const uint4* const* mats, unsigned* sink) {
  constexpr int DEPTH = 8;
  constexpr int64_t per = kMatBytes / 16, n = per * 2 * kSlots;
  unsigned acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + stride * (DEPTH - 1) < n; i += stride * DEPTH) {
    uint4 w[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int64_t k = i + stride * d;
      w[d] = ld16(mats[k / per] + k % per);
    }
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) acc ^= fold(w[d]);
  }
  for (; i < n; i += stride) acc ^= fold(ld16(mats[i / per] + i % per));  // the tail, as above
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The decode GEMV's shape (moe_gate_up_kernel): block (row group, slot), a warp per row of gate
// and of up, DEPTH 16-byte loads of each row a lane in flight, along the rows.
template <int DEPTH, int WARPS>
__global__ void __launch_bounds__(32 * WARPS) rows_kernel(const uint4* const* mats, unsigned* sink) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * WARPS + warp, nv = kRowBytes / 16;
  const uint4* a = mats[2 * blockIdx.y] + row * nv;
  const uint4* b = mats[2 * blockIdx.y + 1] + row * nv;
  unsigned acc = 0;
  for (int64_t v = lane; v + 32 * (DEPTH - 1) < nv; v += 32 * DEPTH) {
    uint4 wa[DEPTH], wb[DEPTH];
#pragma unroll
    for (int i = 0; i < DEPTH; ++i) {
      wa[i] = ld16(a + v + 32 * i);
      wb[i] = ld16(b + v + 32 * i);
    }
#pragma unroll
    for (int i = 0; i < DEPTH; ++i) acc ^= fold(wa[i]) ^ fold(wb[i]);
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// Block-contiguous: the same blocks, but a block reads its rows of gate, then of up, as one
// region (thread t takes uint4 t, t + 512, ...): a block's loads of one instruction are adjacent.
__global__ void __launch_bounds__(512) block_region_kernel(const uint4* const* mats, unsigned* sink) {
  constexpr int DEPTH = 8, NT = 512;
  const int64_t n = 16 * kRowBytes / 16;
  unsigned acc = 0;
  for (int m = 0; m < 2; ++m) {
    const uint4* a = mats[2 * blockIdx.y + m] + int64_t(blockIdx.x) * n;
    for (int64_t i = threadIdx.x; i < n; i += NT * DEPTH) {
      uint4 w[DEPTH];
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) w[d] = i + NT * d < n ? ld16(a + i + NT * d) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) acc ^= fold(w[d]);
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// Grid-ordered rows: unit u = (slot, row) on block u % grid at step u / grid, 384 threads x 16
// bytes = one row of gate and one of up a unit: each step, the grid reads adjacent rows.
__global__ void __launch_bounds__(384) grid_rows_kernel(const uint4* const* mats, unsigned* sink) {
  constexpr int DEPTH = 4;
  constexpr int units = int(kSlots * kRows), nv = int(kRowBytes / 16);
  unsigned acc = 0;
  for (int u0 = blockIdx.x; u0 < units; u0 += DEPTH * gridDim.x) {
    uint4 wa[DEPTH], wb[DEPTH];
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) {
      const int u = u0 + j * gridDim.x;
      wa[j] = wb[j] = make_uint4(0, 0, 0, 0);
      if (u < units) {
        const int s = u / int(kRows), row = u % int(kRows);
        wa[j] = ld16(mats[2 * s] + int64_t(row) * nv + threadIdx.x);
        wb[j] = ld16(mats[2 * s + 1] + int64_t(row) * nv + threadIdx.x);
      }
    }
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) acc ^= fold(wa[j]) ^ fold(wb[j]);
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// Bulk copies (cp.async.bulk) into a shared-memory ring: one block an SM, a producer thread
// copying RPS rows of gate and of up a stage, 8 warps reading each stage: ~192 KB in flight an
// SM without registers holding it.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
template <int RPS, int NS>
__global__ void __launch_bounds__(288, 1) bulk_ring_kernel(const uint4* const* mats, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t full[NS], empty[NS];
  constexpr uint32_t stage_bytes = uint32_t(2 * RPS * kRowBytes);
  constexpr int groups = int(kRows / RPS), units = int(kSlots) * groups;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NS; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(&full[i])) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 8;\n" ::"r"(smem_addr(&empty[i])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (warp == 8) {  // the producer
    if (lane != 0) return;
    int k = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x, ++k) {
      const int st = k % NS, s = u / groups;
      if (k >= NS) mbar_wait(smem_addr(&empty[st]), uint32_t((k / NS - 1) & 1));
      const uint32_t dst = smem_addr(ring + size_t(st) * stage_bytes), bar = smem_addr(&full[st]);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(stage_bytes) : "memory");
      for (int m = 0; m < 2; ++m)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                         dst + uint32_t(m * RPS * kRowBytes)),
                     "l"(mats[2 * s + m] + int64_t(u % groups) * RPS * kRowBytes / 16), "r"(uint32_t(RPS * kRowBytes)),
                     "r"(bar)
                     : "memory");
    }
    return;
  }
  unsigned acc = 0;
  int k = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x, ++k) {
    const int st = k % NS;
    mbar_wait(smem_addr(&full[st]), uint32_t((k / NS) & 1));
    const uint4* src = reinterpret_cast<const uint4*>(ring + size_t(st) * stage_bytes) + warp * (stage_bytes / 128);
    for (int i = lane; i < int(stage_bytes / 128); i += 32) acc ^= fold(src[i]);
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(&empty[st])) : "memory");
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

template <class F>
double median_us(F&& run) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  run();
  CHECK(cudaDeviceSynchronize());
  std::vector<float> ms(20);
  for (float& m : ms) {
    CHECK(cudaEventRecord(a));
    run();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaEventElapsedTime(&m, a, b));
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return 1e3 * ms[ms.size() / 2];
}

}  // namespace

int main() {
  int sms = 0, major = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) {
    std::fprintf(stderr, "vireo_read_probe: needs an sm_90 GPU (bulk copies, built for sm_90a); this one is sm_%d0\n",
                 major);
    return 1;
  }
  // Two sets of the 16 matrices (alternated between runs), and one flat buffer of the same bytes.
  std::vector<const uint4*> mats(4 * kSlots);
  for (auto& m : mats) {
    void* p = nullptr;
    CHECK(cudaMalloc(&p, kMatBytes));
    CHECK(cudaMemset(p, 1, kMatBytes));
    m = static_cast<const uint4*>(p);
  }
  const uint4** dmats = nullptr;
  CHECK(cudaMalloc(&dmats, mats.size() * sizeof(void*)));
  CHECK(cudaMemcpy(dmats, mats.data(), mats.size() * sizeof(void*), cudaMemcpyHostToDevice));
  const int64_t flat_bytes = int64_t(kBytes);
  void* flat = nullptr;
  CHECK(cudaMalloc(&flat, flat_bytes));
  CHECK(cudaMemset(flat, 1, flat_bytes));
  const uint4* halves[2] = {static_cast<const uint4*>(flat), static_cast<const uint4*>(flat) + flat_bytes / 32};
  const uint4* whole[1] = {static_cast<const uint4*>(flat)};
  const uint4 **dhalves = nullptr, **dwhole = nullptr;
  CHECK(cudaMalloc(&dhalves, sizeof(halves)));
  CHECK(cudaMalloc(&dwhole, sizeof(whole)));
  CHECK(cudaMemcpy(dhalves, halves, sizeof(halves), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dwhole, whole, sizeof(whole), cudaMemcpyHostToDevice));
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&sink, sizeof(unsigned)));

  // The reference, as `vireo bench` measures it: a device-to-device copy of 2 GiB each way (a
  // copy of the 201 MB alone read 3.85 TB/s on an H200, 8% below the long copy).
  double copy_gbs = 0;
  {
    const size_t copy_bytes = size_t(1) << 31;
    void *src = nullptr, *dst = nullptr;
    CHECK(cudaMalloc(&src, copy_bytes));
    CHECK(cudaMalloc(&dst, copy_bytes));
    CHECK(cudaMemset(src, 1, copy_bytes));
    const double us = median_us([&] { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); });
    copy_gbs = 2.0 * double(copy_bytes) / us / 1e3;
    CHECK(cudaFree(src));
    CHECK(cudaFree(dst));
  }
  // After the copy (and on a GPU fresh from idle) reads ran at ~3.4 TB/s whatever the shape for
  // the next ~10 ms (H200, session 26): the first shapes measured read below the rest. Reads first.
  for (int i = 0; i < 1000; ++i) rows_kernel<4, 8><<<dim3(kRows / 8, kSlots), 256>>>(dmats, sink);
  CHECK(cudaDeviceSynchronize());
  std::printf("%d SMs; %.0f MB read a run\n", sms, kBytes / 1e6);
  std::printf("%-62s %6.0f GB/s (read + write)\n", "device-to-device copy, 2 GiB each way", copy_gbs);
  int set = 0;
  auto next = [&] { return dmats + 2 * kSlots * (set ^= 1); };
  auto report = [&](const char* what, double us) {
    std::printf("%-62s %8.1f us %6.0f GB/s %5.1f%% of copy\n", what, us, kBytes / us / 1e3,
                100.0 * kBytes / us / 1e3 / copy_gbs);
  };
  const int64_t n = flat_bytes / 16;
  report("flat, one buffer, 4 blocks of 512 an SM, 8 loads in flight",
         median_us([&] { flat_kernel<8, 1><<<4 * sms, 512>>>(dwhole, n, sink); }));
  report("flat, one buffer, 2 blocks of 512 an SM, 8 loads in flight",
         median_us([&] { flat_kernel<8, 1><<<2 * sms, 512>>>(dwhole, n, sink); }));
  report("flat, one buffer, 2 blocks of 512 an SM, 4 loads in flight",
         median_us([&] { flat_kernel<4, 1><<<2 * sms, 512>>>(dwhole, n, sink); }));
  report("flat, two buffers side by side, 4 blocks an SM, 4 + 4 loads",
         median_us([&] { flat_kernel<4, 2><<<4 * sms, 512>>>(dhalves, n / 2, sink); }));
  report("flat over the 16 matrices in order, 4 blocks an SM, 8 loads",
         median_us([&] { flat_concat_kernel<<<4 * sms, 512>>>(next(), sink); }));
  report("GEMV rows: a warp a row of gate and up, 16 warps, 4 + 4 loads",
         median_us([&] { rows_kernel<4, 16><<<dim3(kRows / 16, kSlots), 512>>>(next(), sink); }));
  report("GEMV rows: a warp a row of gate and up, 8 warps, 4 + 4 loads",
         median_us([&] { rows_kernel<4, 8><<<dim3(kRows / 8, kSlots), 256>>>(next(), sink); }));
  report("GEMV rows: whole rows in flight (12 + 12 loads), 16 warps",
         median_us([&] { rows_kernel<12, 16><<<dim3(kRows / 16, kSlots), 512>>>(next(), sink); }));
  report("block-contiguous: a block's 16 rows as one region, 8 loads",
         median_us([&] { block_region_kernel<<<dim3(kRows / 16, kSlots), 512>>>(next(), sink); }));
  report("grid-ordered rows: each step the grid reads adjacent rows",
         median_us([&] { grid_rows_kernel<<<4 * sms, 384>>>(next(), sink); }));
  constexpr int kRing = 2 * 4 * int(kRowBytes) * 4;
  CHECK(cudaFuncSetAttribute(bulk_ring_kernel<4, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, kRing));
  report("bulk copies into a 192 KB shared ring, a block an SM",
         median_us([&] { bulk_ring_kernel<4, 4><<<sms, 288, kRing>>>(next(), sink); }));
  return 0;
}
