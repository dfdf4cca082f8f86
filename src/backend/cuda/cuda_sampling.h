#pragma once
// Backend::sample_rows on the GPU (cuda_sampling.cu): the reference sample_row
// (backend/sampling.h) reproduced bit for bit, with every row's candidates sorted on the device.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/sampling.h"

namespace vireo::cuda {

// The op and its device buffers, which grow to the largest call and are kept: a decode step
// allocates nothing. Not used inside recordings, so its buffers never invalidate one.
class SampleRowsOp {
 public:
  SampleRowsOp() = default;
  ~SampleRowsOp();
  SampleRowsOp(const SampleRowsOp&) = delete;
  SampleRowsOp& operator=(const SampleRowsOp&) = delete;

  // out[r] = sample_row(x[r, :], args[r]) for r < rows. x, out: device; args: host (validated).
  void run(const float* x, int64_t rows, int64_t n, const SampleRowArgs* args, int32_t* out, cudaStream_t st);

 private:
  struct Buffer {
    void* p = nullptr;
    size_t bytes = 0;
    void* get(size_t need);
  };
  Buffer keys_, keys_sorted_, ids_, ids_sorted_, weight_, prob_, sums_, args_, sort_temp_;
  void* args_host_ = nullptr;  // pinned staging for args
  size_t args_host_rows_ = 0;
  cudaEvent_t args_copied_ = nullptr;  // the last copy out of args_host_ has run
};

}  // namespace vireo::cuda
