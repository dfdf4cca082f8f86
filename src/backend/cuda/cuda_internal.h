#pragma once
// Host-side declarations shared by the CUDA backend's translation units.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "backend/cuda/cuda_kernels.cuh"
#include "backend/backend.h"
#include "core/env.h"
#include "core/error.h"

namespace vireo::cuda {

#define VIREO_CUDA_CHECK(call)                                                                   \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) ::vireo::fail("CUDA error: ", cudaGetErrorString(e_), " (", #call, ")"); \
  } while (0)
#define VIREO_CUDA_LAUNCHED() VIREO_CUDA_CHECK(cudaGetLastError())

using ::vireo::env_switch;  // (core/env.h)

// Programmatic dependent launches on or off for the whole process (default on; VIREO_PDL=0 turns
// them off, for A/B runs). Results do not depend on it: kernels wait for their predecessors in
// pdl_begin either way; only when their blocks are dispatched changes.
bool programmatic_launch();
void set_programmatic_launch(bool on);

// Timing experiments only: VIREO_SKIP_KERNELS=a,b,... drops every launch of the kernels so named
// (as in the source: rope_kernel, gemv_rows2_kernel for all its instances), so that
// `tools/kernel-costs.sh` or `tools/ab-bench.sh - VIREO_SKIP_KERNELS=rope_kernel` measure what a
// kernel costs inside the recorded step, PDL overlap included, where ncu times it alone. Results
// are wrong while it is set; stderr says so, and names each kernel the first time it is dropped
// or launched, and again the first time in a recorded graph (a decode step), marked so (a name
// that matches nothing, e.g. VIREO_SKIP_KERNELS=none, lists what a run launches).
inline bool skipping_kernels() {
  static const bool on = [] {
    const char* e = std::getenv("VIREO_SKIP_KERNELS");
    return e && *e;
  }();
  return on;
}
// cuda_backend.cu: listed in VIREO_SKIP_KERNELS (cuda_kernel_listed); st: where it would run.
bool skip_launch(const void* kernel, cudaStream_t st);

// kernel<<<grid, block, smem, st>>>(args...), as a programmatic dependent launch when
// programmatic_launch() is on (the kernel must begin with pdl_begin(); tests/test_cuda_sources.cpp
// checks that every kernel does). Launch errors fail at once. launch_clustered puts the blocks in
// clusters of cluster_x along x (> 0): for a kernel whose cluster size is chosen at its launch (a
// template whose unclustered instances keep plain launches) rather than by __cluster_dims__.
template <typename... Params, typename... Args>
void launch_clustered(unsigned cluster_x, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t st, Args&&... args) {
  if (skipping_kernels() && skip_launch(reinterpret_cast<const void*>(kernel), st)) return;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = programmatic_launch() ? 1 : 0;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cluster_x;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cfg.attrs = attr;
  cfg.numAttrs = cluster_x > 0 ? 2 : 1;
  VIREO_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args&&... args) {
  launch_clustered(0, kernel, grid, block, smem, st, std::forward<Args>(args)...);
}

// Lets `Kernel` take up to Bytes of dynamic shared memory (the attribute is set once per kernel
// and process).
template <auto Kernel, size_t Bytes>
void allow_dynamic_smem() {
  static const bool done = [] {
    VIREO_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Bytes)));
    return true;
  }();
  (void)done;
}

// The device's multiprocessor count (cuda_backend.cu; asked once a process).
int multiprocessors();

// Median time in ms of `runs` copies of `bytes` on `st`, after `warmup` untimed ones (cuda_backend.cu).
double median_copy_ms(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t st, int warmup,
                      int runs);

// Matrix products (cuda_matmul.cu).
// T <= 8. x_shared: BF16/FP8 products of 2..8 rows read x from a copy in shared memory where it
// fits (else through L1; the same sums).
void matmul_small(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st, int sms, bool x_shared);
void matmul_simt(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st);
// Many rows against at most 32 BF16 or F32 weight rows (routers): f32 CUDA-core products, x read
// once. False (nothing run) for other shapes and dtypes.
bool matmul_skinny_fits(const float* x, int64_t T, const DevW& w);
bool matmul_skinny(const float* x, int64_t T, const DevW& w, float* y, cudaStream_t st);
void split_bf16(const float* x, int64_t n, void* hi, void* lo, cudaStream_t st);  // lo may be null
// Rows [row0, row0 + rows) of an FP8 weight as bf16 hi + lo of the f32 w * scale ([rows, in]
// each; lo may be null). Needs in % 4 == 0.
void dequant_split_fp8(const DevW& w, int64_t row0, int64_t rows, void* hi, void* lo, cudaStream_t st);
// The heuristic's first algorithm for op on these layouts (D also as C) within ws_bytes of
// workspace; min_align > 0: the callers guarantee that alignment of every pointer (else cuBLASLt
// assumes 256 bytes). False when there is none.
bool lt_heuristic(cublasLtHandle_t lt, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                  cublasLtMatrixLayout_t ld, size_t ws_bytes, uint32_t min_align, cublasLtMatmulAlgo_t& algo);
// batch > 1: `batch` products sharing B (stride 0), A and D strided by stride_a / stride_d
// elements (>= 0: A + i stride_a, D + i stride_d).
bool lt_matmul(cublasLtHandle_t lt, void* workspace, size_t ws_bytes, cudaStream_t st, int64_t m, int64_t n,
               int64_t k, const void* A, cudaDataType_t at, const void* B, cudaDataType_t bt, void* D,
               cudaDataType_t dt, float alpha, float beta, int64_t ldd = 0, int batch = 1, int64_t stride_a = 0,
               int64_t stride_d = 0);

// The CUDA backend's one compute stream (cuda_backend.cu); fails for another backend.
cudaStream_t compute_stream_of(Backend& b);

}  // namespace vireo::cuda
