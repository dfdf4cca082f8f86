// vireo_size_probe: a read-bandwidth probe for the decode products' question: how fast can the H200's SMs pull a
// buffer of a given size, in a given launch form, with no arithmetic to speak of? The bf16
// lm_head's GEMV (1.9 GB, thousands of 16-warp blocks) reads ~4.6 TB/s inside the decode step
// while the FP8 products (25-200 MB, one 16- or 32-warp block an SM) read ~3.3-3.9: is that the
// bytes' size, the launch form (warps and loads in flight an SM) or the FP8 arithmetic?
//
// Each row of the output: one buffer size and launch form, the median of 9 timed replays of a
// round robin over enough copies of the buffer that none is in L2 when read again (>= 200 MB
// touched a round). GB/s counts each byte read once.
//
//   build-cuda/vireo_size_probe        (built with the CUDA backend; needs an sm_90 GPU)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

constexpr const char* kProbeName = "vireo_size_probe";

// Grid-stride: LOADS 16-byte loads a lane in flight, then folded into one word (kept live by a
// store that never happens unless the fold hits a magic value).
template <int LOADS>
__global__ void flat_read(const uint4* __restrict__ p, size_t n16, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (LOADS - 1) * stride < n16; i += LOADS * stride) {
    uint4 a[LOADS];
#pragma unroll
    for (int k = 0; k < LOADS; ++k) a[k] = ld16(p + i + k * stride);
#pragma unroll
    for (int k = 0; k < LOADS; ++k) acc ^= fold(a[k]);
  }
  for (; i < n16; i += stride) {
    const uint4 a = ld16(p + i);
    acc ^= fold(a);
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// Rows: a warp per row of `cols` bytes (the decode GEMVs' unit), rows dealt in order to warps;
// LOADS loads a lane in flight along its row.
template <int LOADS>
__global__ void row_read(const uint4* __restrict__ p, size_t rows, size_t cols16, unsigned* sink) {
  const size_t warps = size_t(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x & 31;
  unsigned acc = 0;
  for (size_t r = size_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const uint4* row = p + r * cols16;
    size_t v = lane;
    for (; v + 32 * (LOADS - 1) < cols16; v += 32 * LOADS) {
      uint4 a[LOADS];
#pragma unroll
      for (int k = 0; k < LOADS; ++k) a[k] = ld16(row + v + 32 * k);
#pragma unroll
      for (int k = 0; k < LOADS; ++k) acc ^= fold(a[k]);
    }
    for (; v < cols16; v += 32) {
      const uint4 a = ld16(row + v);
      acc ^= fold(a);
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  unsigned* sink;
  CHECK(cudaMalloc(&sink, 4));
  const size_t pool_bytes = size_t(2) << 30;  // 2 GiB, carved into copies of each size
  char* pool;
  CHECK(cudaMalloc(&pool, pool_bytes));
  CHECK(cudaMemset(pool, 0x5a, pool_bytes));
  cudaStream_t st;
  CHECK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  struct Form {
    const char* name;
    int kind;  // 0 flat, 1 rows
    int warps, blocks_per_sm, loads;
    size_t row_bytes;
  };
  const Form forms[] = {
      {"flat 16w x1/SM  8 ld", 0, 16, 1, 8, 0},
      {"flat 16w x2/SM  8 ld", 0, 16, 2, 8, 0},
      {"flat 16w x4/SM  8 ld", 0, 16, 4, 8, 0},
      {"flat 32w x1/SM  8 ld", 0, 32, 1, 8, 0},
      {"flat 32w x2/SM  8 ld", 0, 32, 2, 8, 0},
      {"flat 16w x4/SM  4 ld", 0, 16, 4, 4, 0},
      {"rows 6 KB 32w x1/SM 8 ld", 1, 32, 1, 8, 6144},
      {"rows 6 KB 16w x1/SM 8 ld", 1, 16, 1, 8, 6144},
      {"rows 6 KB 16w x4/SM 8 ld", 1, 16, 4, 8, 6144},
      {"rows 12 KB 16w x4/SM 8 ld", 1, 16, 4, 8, 12288},
      {"rows 16 KB 32w x1/SM 8 ld", 1, 32, 1, 8, 16384},
      {"rows 16 KB 16w x4/SM 8 ld", 1, 16, 4, 8, 16384},
      // The down products' shapes (session 45): 2 KB FP8 rows a warp (4 loads a lane), a pair of
      // them (4 KB, 8 loads), 16 warps x 2 blocks an SM as moe_down_slots2_kernel.
      {"rows 2 KB 16w x2/SM 4 ld", 1, 16, 2, 4, 2048},
      {"rows 2 KB 16w x4/SM 4 ld", 1, 16, 4, 4, 2048},
      {"rows 4 KB 16w x2/SM 8 ld", 1, 16, 2, 8, 4096},
      {"rows 4 KB 16w x4/SM 8 ld", 1, 16, 4, 8, 4096},
  };
  const size_t sizes[] = {size_t(12582912),  size_t(25165824),  size_t(100663296),
                          size_t(113246208), size_t(201326592), size_t(1903165440)};
  for (size_t bytes : sizes) {
    const int copies = int(std::max<size_t>(1, std::min<size_t>(pool_bytes / bytes, (size_t(400) << 20) / bytes + 1)));
    for (const Form& f : forms) {
      const unsigned grid = unsigned(f.blocks_per_sm * sms), threads = unsigned(32 * f.warps);
      auto run = [&](int c) {
        const uint4* p = reinterpret_cast<const uint4*>(pool + size_t(c % copies) * bytes);
        if (f.kind == 0) {
          if (f.loads == 8) flat_read<8><<<grid, threads, 0, st>>>(p, bytes / 16, sink);
          else flat_read<4><<<grid, threads, 0, st>>>(p, bytes / 16, sink);
        } else {
          if (f.loads == 4) row_read<4><<<grid, threads, 0, st>>>(p, bytes / f.row_bytes, f.row_bytes / 16, sink);
          else row_read<8><<<grid, threads, 0, st>>>(p, bytes / f.row_bytes, f.row_bytes / 16, sink);
        }
      };
      const int reps = std::max(copies, int((size_t(800) << 20) / bytes));
      float m = 0;
      CHECK(median_replay_us(st, e0, e1, reps, run, &m));  // (its first replay warms the clocks)
      std::printf("%8.1f MB  %-28s %8.1f us  %6.0f GB/s  (copies %d)\n", double(bytes) / 1048576.0, f.name, m,
                  double(bytes) / 1e3 / m, copies);
    }
  }
  // The copy line (vireo bench copies 2 GiB each way): here 1 GiB each way, read + written.
  {
    double gbs = 0;
    CHECK(copy_gbs(pool, pool_bytes, st, e0, e1, &gbs));
    std::printf("copy 1 GiB d2d: %.0f GB/s (read + written)\n", gbs);
  }
  return 0;
}
