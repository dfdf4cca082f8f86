// Backend::sample_rows on the GPU, equal token for token to the reference sample_row
// (backend/sampling.cpp): the same candidate order, the same float/double operations
// (core/portable_math.h), the same summation levels and the same prefix searches.
//
// Per call: (1) one key per logit, (row << 32 | sample_order_key), and its token id; (2) one
// stable radix sort of all rows at once (CUB, from the CUDA toolkit): within a row ascending key =
// descending logit, equal logits keep ascending ids, as the reference's sort of (key << 32 | id);
// (3) one block per row: weights, levels, probabilities, the top-p and min-p cutoffs and the draw.
// Only the token ids are written back.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_sampling.h"

namespace vireo::cuda {

namespace {

static_assert(kSumBlock == 32, "level searches run one child per lane of a warp");
constexpr int kSampleThreads = 1024;

__global__ void sample_keys_kernel(const float* __restrict__ x, int64_t rows, int64_t n, uint64_t* __restrict__ keys,
                                   int32_t* __restrict__ ids) {
  const int64_t total = rows * n;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / n;
    keys[i] = (uint64_t(r) << 32) | sample_order_key(x[i]);
    ids[i] = int32_t(i - r * n);
  }
}

// The levels above values[0..L.size[0]), each level's entries in parallel (level_block_sum: the
// reference's sequential sums), a barrier between levels.
__device__ void build_levels(const float* values, double* sums, const SumLevels& L) {
  for (int l = 1; l <= L.count; ++l) {
    for (int64_t j = threadIdx.x; j < L.size[l]; j += blockDim.x)
      sums[L.offset[l] + j] = level_block_sum(values, sums, L, l, j);
    __syncthreads();
  }
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

// One block per row. `sorted` holds each row's ids in candidate order; `prob` [rows, n] and
// `sums` [rows, sums_stride] are scratch.
__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* __restrict__ x, int64_t n, const SampleRowArgs* __restrict__ args,
                  const int32_t* __restrict__ sorted, float* prob, double* sums_all,
                  int64_t sums_stride, int32_t* __restrict__ out) {
  __shared__ int64_t keep_shared;
  __shared__ unsigned long long first_below;
  const int64_t r = blockIdx.x;
  const SampleRowArgs a = args[r];
  const float* xr = x + r * n;
  const int32_t* ids = sorted + r * n;
  float* p = prob + r * n;
  double* sums = sums_all + r * sums_stride;
  const int64_t cand = a.temperature == 0.0f ? 1 : sample_candidates(a, n);
  if (cand == 1) {  // greedy or top-k 1: the first candidate, as the reference
    if (threadIdx.x == 0) out[r] = ids[0];
    return;
  }
  const float inv_t = pm::div(1.0f, a.temperature), x0 = xr[ids[0]];
  for (int64_t i = threadIdx.x; i < cand; i += blockDim.x) p[i] = sample_weight(xr[ids[i]], x0, inv_t);
  __syncthreads();
  SumLevels L = sum_levels(cand);
  build_levels(p, sums, L);
  const double weight_total = sums[L.offset[L.count]];
  for (int64_t i = threadIdx.x; i < cand; i += blockDim.x) p[i] = pm::to_float(pm::div(double(p[i]), weight_total));
  __syncthreads();
  build_levels(p, sums, L);

  int64_t keep = cand;
  if (a.top_p < 1.0f) {
    if (threadIdx.x < 32) {
      const int64_t last = warp_level_search(p, sums, L, double(a.top_p), false);
      if (threadIdx.x == 0) keep_shared = last + 1;
    }
    __syncthreads();
    keep = keep_shared;
  }
  if (a.min_p > 0.0f) {  // the first candidate after the best below the floor, if any
    const float floor = pm::mul(a.min_p, p[0]);
    if (threadIdx.x == 0) first_below = (unsigned long long)keep;
    __syncthreads();
    for (int64_t i = int64_t(threadIdx.x) + 1; i < keep; i += blockDim.x)
      if (p[i] < floor) {
        atomicMin(&first_below, (unsigned long long)i);
        break;  // this thread's later indices are larger
      }
    __syncthreads();
    keep = int64_t(first_below);
  }
  if (keep != cand) {
    L = sum_levels(keep);
    build_levels(p, sums, L);
  }
  if (threadIdx.x < 32) {
    const double target = pm::mul(a.uniform, sums[L.offset[L.count]]);
    const int64_t i = warp_level_search(p, sums, L, target, true);
    if (threadIdx.x == 0) out[r] = ids[i];
  }
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
  for (Buffer* b : {&keys_, &keys_sorted_, &ids_, &ids_sorted_, &prob_, &sums_, &args_, &sort_temp_})
    if (b->p) cudaFree(b->p);
}

void SampleRowsOp::run(const float* x, int64_t rows, int64_t n, const SampleRowArgs* args, int32_t* out,
                       cudaStream_t st) {
  if (rows <= 0) return;
  if (n <= 0) fail("sample_rows: empty rows");
  const int64_t total = rows * n;
  if (total > int64_t(INT32_MAX) || n > int64_t(UINT32_MAX) || rows > int64_t(UINT32_MAX))
    fail("sample_rows: ", rows, " rows of ", n, " logits are too many for one call");
  const int64_t sums_stride = sum_levels(n).doubles;
  auto* keys = static_cast<uint64_t*>(keys_.get(size_t(total) * 8));
  auto* keys_sorted = static_cast<uint64_t*>(keys_sorted_.get(size_t(total) * 8));
  auto* ids = static_cast<int32_t*>(ids_.get(size_t(total) * 4));
  auto* ids_sorted = static_cast<int32_t*>(ids_sorted_.get(size_t(total) * 4));
  auto* prob = static_cast<float*>(prob_.get(size_t(total) * 4));
  auto* sums = static_cast<double*>(sums_.get(size_t(rows * sums_stride) * 8));
  auto* args_dev = static_cast<SampleRowArgs*>(args_.get(size_t(rows) * sizeof(SampleRowArgs)));
  // From pageable memory: staged before the call returns, so `args` may go right away.
  VIREO_CUDA_CHECK(cudaMemcpyAsync(args_dev, args, size_t(rows) * sizeof(SampleRowArgs), cudaMemcpyHostToDevice, st));

  const unsigned grid = unsigned(std::clamp<int64_t>((total + 255) / 256, 1, 4096));
  sample_keys_kernel<<<grid, 256, 0, st>>>(x, rows, n, keys, ids);
  VIREO_CUDA_LAUNCHED();
  // Bits that vary: the 32 of the logit key and enough for the row index above them.
  const int end_bit = 32 + int(std::bit_width(uint64_t(rows - 1)));
  size_t temp_bytes = 0;
  VIREO_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, keys_sorted, ids, ids_sorted, int(total),
                                                   0, end_bit, st));
  void* temp = sort_temp_.get(temp_bytes);
  VIREO_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, keys_sorted, ids, ids_sorted, int(total), 0,
                                                   end_bit, st));
  sample_kernel<<<unsigned(rows), kSampleThreads, 0, st>>>(x, n, args_dev, ids_sorted, prob, sums, sums_stride, out);
  VIREO_CUDA_LAUNCHED();
}

}  // namespace vireo::cuda
