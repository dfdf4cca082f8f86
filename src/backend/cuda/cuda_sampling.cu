// Backend::sample_rows on the GPU, equal token for token to the reference sample_row
// (backend/sampling.cpp): the same candidate order, the same float/double operations
// (core/portable_math.h), the same summation levels and the same prefix searches.
//
// Per call, every row at once:
//  1. keys: (row << 32 | sample_order_key(logit)) and the token id, one per logit;
//  2. one stable radix sort of all of them (CUB, from the CUDA toolkit): per row ascending key =
//     descending logit, equal logits in ascending id, as the reference's sort of (key << 32 | id);
//  3. weights: exp(x/T - x0/T) over the row's candidates, x decoded from the sorted key (so no
//     gather by id), and level 1 of their sums; many blocks per row;
//  4. levels 2.. of the weights (one block per row): their total;
//  5. probabilities = weight / total and level 1 of their sums, plus the first candidate below
//     the min-p floor; many blocks per row;
//  6. one block per row: levels 2.. of the probabilities, the top-p cutoff, the min-p cut, the
//     kept prefix's levels (only the last entry of each level changes), and the draw.
// Level-1 sums are taken per warp over 1024 values staged through shared memory: each lane adds
// its own 32 values sequentially, the reference's order, with coalesced loads.
// Only the token ids are written back.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_sampling.h"

namespace vireo::cuda {

namespace {

static_assert(kSumBlock == 32, "a warp takes one level entry per lane");
constexpr int kTileWarps = 8;                          // warps per block of the per-value kernels
constexpr int64_t kTile = kSumBlock * kSumBlock;       // values per warp: 32 level-1 entries
constexpr int kRowThreads = 256;                       // the one-block-per-row kernels

__device__ __forceinline__ int64_t candidates(const SampleRowArgs& a, int64_t n) {
  return a.temperature == 0.0f ? 1 : sample_candidates(a, n);
}

// The logit a sort key was made from. -0 comes back as +0, which gives the same weight (x / T - x0
// / T is then +-0 or the same nonzero value, and exp(+-0) = 1), so the weights equal the
// reference's, computed from the logits themselves.
__device__ __forceinline__ float key_logit(uint64_t key) {
  const uint32_t u = ~uint32_t(key);
  return pm::bits_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

__global__ void sample_keys_kernel(const float* __restrict__ x, int64_t rows, int64_t n, uint64_t* __restrict__ keys,
                                   int32_t* __restrict__ ids) {
  pdl_begin();
  const int64_t total = rows * n;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / n;
    keys[i] = (uint64_t(r) << 32) | sample_order_key(x[i]);
    ids[i] = int32_t(i - r * n);
  }
}

// One warp: values[t0 .. t0 + 1024) = value_of(i) (those below `count`), and their level-1 sums
// level1[t0 / 32 + lane] (sequential, from 0.0, as level_block_sum). `sh` is the warp's [32][33].
template <typename F>
__device__ void tile_level1(int64_t t0, int64_t count, float* values, double* level1, float (*sh)[kSumBlock + 1],
                            F value_of) {
  const int lane = int(threadIdx.x & 31);
#pragma unroll 4
  for (int q = 0; q < kSumBlock; ++q) {
    const int64_t i = t0 + q * kSumBlock + lane;
    float v = 0.0f;
    if (i < count) {
      v = value_of(i);
      values[i] = v;
    }
    sh[q][lane] = v;
  }
  __syncwarp();
  const int64_t start = t0 + int64_t(lane) * kSumBlock;
  if (start < count) {
    const int m = int(count - start < kSumBlock ? count - start : kSumBlock);
    double s = 0.0;
    for (int k = 0; k < m; ++k) s = pm::add(s, double(sh[lane][k]));
    level1[start / kSumBlock] = s;
  }
  __syncwarp();
}

// Entry j of level l >= 2 (children: doubles), all children loaded before the sequential adds.
__device__ double level_block_sum_loaded(const double* sums, const SumLevels& L, int l, int64_t j) {
  const int64_t a = j * kSumBlock;
  const int64_t cnt = L.size[l - 1] - a < kSumBlock ? L.size[l - 1] - a : kSumBlock;
  const double* child = sums + L.offset[l - 1] + a;
  double v[kSumBlock];
#pragma unroll
  for (int k = 0; k < kSumBlock; ++k) v[k] = k < cnt ? child[k] : 0.0;
  double s = 0.0;
#pragma unroll
  for (int k = 0; k < kSumBlock; ++k)
    if (k < cnt) s = pm::add(s, v[k]);
  return s;
}

// Levels 2 .. L.count from level 1, by the whole block.
__device__ void build_upper_levels(double* sums, const SumLevels& L) {
  for (int l = 2; l <= L.count; ++l) {
    for (int64_t j = threadIdx.x; j < L.size[l]; j += blockDim.x)
      sums[L.offset[l] + j] = level_block_sum_loaded(sums, L, l, j);
    __syncthreads();
  }
}

// level_block_sum by one warp (lane k loads child k; every lane adds them in order).
__device__ double warp_level_block_sum(const float* values, const double* sums, const SumLevels& L, int l, int64_t j) {
  const int lane = int(threadIdx.x & 31);
  const int64_t a = j * kSumBlock, b = a + kSumBlock < L.size[l - 1] ? a + kSumBlock : L.size[l - 1];
  const double mine = a + lane < b ? level_entry(values, sums, L, l - 1, a + lane) : 0.0;
  double s = 0.0;
  for (int64_t k = a; k < b; ++k) s = pm::add(s, __shfl_sync(0xffffffffu, mine, int(k - a)));
  return s;
}

// level_search (sampling.h) by one warp: the lanes load one level's children at once, then every
// lane runs the same sequential additions on them (so all lanes agree).
__device__ int64_t warp_level_search(const float* values, const double* sums, const SumLevels& L, double threshold,
                                     bool strict) {
  const int lane = int(threadIdx.x & 31);
  double c = 0.0;
  int64_t j = 0;
  for (int l = L.count; l >= 1; --l) {
    const int64_t a = j * kSumBlock, b = a + kSumBlock < L.size[l - 1] ? a + kSumBlock : L.size[l - 1];
    const double mine = a + lane < b ? level_entry(values, sums, L, l - 1, a + lane) : 0.0;
    j = b - 1;
    for (int64_t k = a; k < b - 1; ++k) {
      const double t = pm::add(c, __shfl_sync(0xffffffffu, mine, int(k - a)));
      if (strict ? t > threshold : t >= threshold) {
        j = k;
        break;
      }
      c = t;
    }
  }
  return j;
}

// Per-row scratch: weights and probabilities [rows, n] (candidate order), their level sums
// [rows, stride] each, and the first candidate below the min-p floor [rows].
struct SampleScratch {
  const uint64_t* keys;  // sorted
  const int32_t* ids;    // sorted
  float *weight, *prob;
  double *weight_sums, *prob_sums;
  int64_t stride;
  unsigned long long* first_below;
};

// Step 3. grid (blocks per row, rows), kTileWarps warps.
__global__ void __launch_bounds__(kTileWarps * 32)
    sample_weights_kernel(int64_t n, const SampleRowArgs* __restrict__ args, SampleScratch s) {
  pdl_begin();
  __shared__ float sh[kTileWarps][kSumBlock][kSumBlock + 1];
  const int64_t r = blockIdx.y;
  const SampleRowArgs a = args[r];
  const int64_t cand = candidates(a, n);
  if (cand == 1) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) s.first_below[r] = (unsigned long long)cand;
  const int w = int(threadIdx.x >> 5);
  const int64_t t0 = (int64_t(blockIdx.x) * kTileWarps + w) * kTile;
  if (t0 >= cand) return;
  const uint64_t* keys = s.keys + r * n;
  const float inv_t = pm::div(1.0f, a.temperature), x0 = key_logit(keys[0]);
  tile_level1(t0, cand, s.weight + r * n, s.weight_sums + r * s.stride, sh[w],
              [&](int64_t i) { return sample_weight(key_logit(keys[i]), x0, inv_t); });
}

// Step 4. One block per row.
__global__ void __launch_bounds__(kRowThreads)
    sample_weight_total_kernel(int64_t n, const SampleRowArgs* __restrict__ args, SampleScratch s) {
  pdl_begin();
  const int64_t r = blockIdx.x;
  const int64_t cand = candidates(args[r], n);
  if (cand == 1) return;
  build_upper_levels(s.weight_sums + r * s.stride, sum_levels(cand));
}

// Step 5. grid (blocks per row, rows), kTileWarps warps.
__global__ void __launch_bounds__(kTileWarps * 32)
    sample_probs_kernel(int64_t n, const SampleRowArgs* __restrict__ args, SampleScratch s) {
  pdl_begin();
  __shared__ float sh[kTileWarps][kSumBlock][kSumBlock + 1];
  const int64_t r = blockIdx.y;
  const SampleRowArgs a = args[r];
  const int64_t cand = candidates(a, n);
  if (cand == 1) return;
  const int w = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const int64_t t0 = (int64_t(blockIdx.x) * kTileWarps + w) * kTile;
  if (t0 >= cand) return;
  const SumLevels L = sum_levels(cand);
  const float* weight = s.weight + r * n;
  const double total = s.weight_sums[r * s.stride + L.offset[L.count]];
  const float floor = pm::mul(a.min_p, pm::to_float(pm::div(double(weight[0]), total)));
  int64_t below = cand;  // this lane's first candidate (after the best) below the floor
  tile_level1(t0, cand, s.prob + r * n, s.prob_sums + r * s.stride, sh[w], [&](int64_t i) {
    const float p = pm::to_float(pm::div(double(weight[i]), total));
    if (a.min_p > 0.0f && i > 0 && p < floor && i < below) below = i;
    return p;
  });
  if (a.min_p > 0.0f) {
    for (int o = 16; o > 0; o >>= 1) below = min(below, (int64_t)__shfl_xor_sync(0xffffffffu, below, o));
    if (lane == 0 && below < cand) atomicMin(s.first_below + r, (unsigned long long)below);
  }
}

// Step 6. One block per row.
__global__ void __launch_bounds__(kRowThreads)
    sample_draw_kernel(int64_t n, const SampleRowArgs* __restrict__ args, SampleScratch s, int32_t* __restrict__ out) {
  pdl_begin();
  const int64_t r = blockIdx.x;
  const SampleRowArgs a = args[r];
  const int64_t cand = candidates(a, n);
  const int32_t* ids = s.ids + r * n;
  if (cand == 1) {  // greedy or top-k 1: the first candidate, as the reference
    if (threadIdx.x == 0) out[r] = ids[0];
    return;
  }
  const float* p = s.prob + r * n;
  double* sums = s.prob_sums + r * s.stride;
  SumLevels L = sum_levels(cand);
  build_upper_levels(sums, L);
  if (threadIdx.x >= 32) return;  // the rest is sequential: one warp
  int64_t keep = cand;
  if (a.top_p < 1.0f) keep = warp_level_search(p, sums, L, double(a.top_p), false) + 1;
  if (a.min_p > 0.0f) keep = min(keep, int64_t(s.first_below[r]));
  if (keep != cand) {
    // The kept prefix's levels: only the last entry of each level covers fewer values now.
    L = resize_levels(L, keep);
    for (int l = 1; l <= L.count; ++l) {
      const int64_t j = L.size[l] - 1;
      const double v = warp_level_block_sum(p, sums, L, l, j);
      if (threadIdx.x == 0) sums[L.offset[l] + j] = v;
      __syncwarp();  // the next level reads it
    }
  }
  const double target = pm::mul(a.uniform, sums[L.offset[L.count]]);
  const int64_t i = warp_level_search(p, sums, L, target, true);
  if (threadIdx.x == 0) out[r] = ids[i];
}

}  // namespace

void* SampleRowsOp::Buffer::get(size_t need) {
  need = std::max<size_t>(need, 1);
  if (need > bytes) {
    if (p) VIREO_CUDA_CHECK(cudaFree(p));  // waits for the work that may still use it
    p = nullptr;
    bytes = 0;
    const cudaError_t e = cudaMalloc(&p, need);
    if (e != cudaSuccess) fail("cuda: out of device memory allocating ", need, " bytes for sampling");
    bytes = need;
  }
  return p;
}

SampleRowsOp::~SampleRowsOp() {
  for (Buffer* b : {&keys_, &keys_sorted_, &ids_, &ids_sorted_, &weight_, &prob_, &sums_, &args_, &sort_temp_})
    if (b->p) cudaFree(b->p);
  if (args_host_) cudaFreeHost(args_host_);
  if (args_copied_) cudaEventDestroy(args_copied_);
}

void SampleRowsOp::run(const float* x, int64_t rows, int64_t n, const SampleRowArgs* args, int32_t* out,
                       cudaStream_t st) {
  if (rows <= 0) return;
  if (n <= 0) fail("sample_rows: empty rows");
  const int64_t total = rows * n;
  if (total > int64_t(INT32_MAX) || n > int64_t(UINT32_MAX) || rows > 65535)  // CUB's int count; grid.y
    fail("sample_rows: ", rows, " rows of ", n, " logits are too many for one call");
  SampleScratch s;
  s.stride = sum_levels(n).doubles;
  auto* keys = static_cast<uint64_t*>(keys_.get(size_t(total) * 8));
  auto* keys_sorted = static_cast<uint64_t*>(keys_sorted_.get(size_t(total) * 8));
  auto* ids = static_cast<int32_t*>(ids_.get(size_t(total) * 4));
  auto* ids_sorted = static_cast<int32_t*>(ids_sorted_.get(size_t(total) * 4));
  s.keys = keys_sorted;
  s.ids = ids_sorted;
  s.weight = static_cast<float*>(weight_.get(size_t(total) * 4));
  s.prob = static_cast<float*>(prob_.get(size_t(total) * 4));
  // Weight levels, probability levels, then the per-row first-below-floor counters.
  auto* sums = static_cast<double*>(sums_.get(size_t(rows) * (2 * size_t(s.stride) + 1) * 8));
  s.weight_sums = sums;
  s.prob_sums = sums + rows * s.stride;
  s.first_below = reinterpret_cast<unsigned long long*>(sums + 2 * rows * s.stride);

  // The arguments go through pinned memory, so the copy queues behind the step's work instead of
  // waiting for it; the buffer is refilled only once the previous copy has run.
  if (!args_copied_) VIREO_CUDA_CHECK(cudaEventCreateWithFlags(&args_copied_, cudaEventDisableTiming));
  VIREO_CUDA_CHECK(cudaEventSynchronize(args_copied_));
  if (size_t(rows) > args_host_rows_) {
    if (args_host_) VIREO_CUDA_CHECK(cudaFreeHost(args_host_));
    args_host_ = nullptr;
    VIREO_CUDA_CHECK(cudaMallocHost(&args_host_, size_t(rows) * sizeof(SampleRowArgs)));
    args_host_rows_ = size_t(rows);
  }
  std::copy(args, args + rows, static_cast<SampleRowArgs*>(args_host_));
  auto* args_dev = static_cast<SampleRowArgs*>(args_.get(size_t(rows) * sizeof(SampleRowArgs)));
  VIREO_CUDA_CHECK(
      cudaMemcpyAsync(args_dev, args_host_, size_t(rows) * sizeof(SampleRowArgs), cudaMemcpyHostToDevice, st));
  VIREO_CUDA_CHECK(cudaEventRecord(args_copied_, st));

  const unsigned grid = unsigned(std::clamp<int64_t>((total + 255) / 256, 1, 4096));
  launch(sample_keys_kernel, grid, 256, 0, st, x, rows, n, keys, ids);
  VIREO_CUDA_LAUNCHED();
  // Bits that vary: the 32 of the logit key and enough for the row index above them.
  const int end_bit = 32 + int(std::bit_width(uint64_t(rows - 1)));
  size_t temp_bytes = 0;
  VIREO_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, keys_sorted, ids, ids_sorted, int(total),
                                                   0, end_bit, st));
  void* temp = sort_temp_.get(temp_bytes);
  VIREO_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, keys_sorted, ids, ids_sorted, int(total), 0,
                                                   end_bit, st));
  const dim3 tiles(unsigned((n + kTile * kTileWarps - 1) / (kTile * kTileWarps)), unsigned(rows));
  launch(sample_weights_kernel, tiles, kTileWarps * 32, 0, st, n, args_dev, s);
  VIREO_CUDA_LAUNCHED();
  launch(sample_weight_total_kernel, unsigned(rows), kRowThreads, 0, st, n, args_dev, s);
  VIREO_CUDA_LAUNCHED();
  launch(sample_probs_kernel, tiles, kTileWarps * 32, 0, st, n, args_dev, s);
  VIREO_CUDA_LAUNCHED();
  launch(sample_draw_kernel, unsigned(rows), kRowThreads, 0, st, n, args_dev, s, out);
  VIREO_CUDA_LAUNCHED();
}

}  // namespace vireo::cuda
