#pragma once
// Prefill GEMMs on FP8 weights in the fast math mode, as DeepSeek's reference inference runs them:
// the activations are quantized to e4m3 per (token, 128-column block) with scale = amax / 448
// (their `act_quant`), and cuBLASLt multiplies the two e4m3 operands with block scaling, the
// weight's 128x128 `weight_scale_inv` used as stored (shared/notes/cublaslt-fp8-block.md records
// which layouts and scale modes the H200 runs). The product is the exact one of the quantized
// operands up to f32 accumulation: the only loss against f32 math is the e4m3 rounding of x
// (~2^-4 relative per element, NMSE ~5e-4 on the output).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace vireo::cuda {

// x f32 [T, K] (row stride K) -> q e4m3 [Tp, K] and scales s [ceil(K/128), Tp] (index
// kb * Tp + t, the K-block-major order cuBLASLt's VEC128 scale mode reads), Tp >= T. Each
// (token, block) gets s = amax / 448 (1 for an all-zero block) and q = e4m3(x / s), round to
// nearest even, saturating; rows [T, Tp) are zero (s = 1).
// index: row t reads x row index[t] (a gather); up: the value quantized is silu(x) * up, row t of
// both (SwiGLU, as the backend's swiglu computes it).
void act_quant(const float* x, int64_t T, int64_t Tp, int64_t K, uint8_t* q, float* s, cudaStream_t st,
               const int32_t* index = nullptr, const float* up = nullptr);
// bf16 [n] -> f32 [n].
void widen_bf16(const void* src, int64_t n, float* dst, cudaStream_t st);

// Plans (one per shape, cached) and runs D[N, M] = B[N, K] A[M, K]^T (all row-major) with
// A, B e4m3: A with 128x128 block scales [ceil(M/128), round_up(ceil(K/128), 4)] (row-major: the
// row stride is padded to a multiple of 4, as cuBLASLt reads it), B with the 1x128 scales of
// act_quant [ceil(K/128), N]. Measured on the H200 (cuBLASLt 13.1): no algorithm unless
// N % 4 == 0 (N = 9, 33: none; 100, 1000: found), so callers pad N.
class Fp8BlockGemm {
 public:
  enum class Out { None, F32, Bf16 };  // None: cuBLASLt has no algorithm for the shape
  // Algorithms are chosen for a workspace of ws_bytes; each run brings its own (its stream's).
  // placeholder: any device address, for the scale pointers the heuristic query needs.
  Fp8BlockGemm(cublasLtHandle_t lt, const void* placeholder, size_t ws_bytes)
      : lt_(lt), placeholder_(placeholder), ws_bytes_(ws_bytes) {}
  ~Fp8BlockGemm();
  Fp8BlockGemm(const Fp8BlockGemm&) = delete;
  Fp8BlockGemm& operator=(const Fp8BlockGemm&) = delete;

  // The output type the shape runs with: f32 when cuBLASLt has an algorithm writing f32 D, else
  // bf16 D (the caller widens it), else None; with bf16_out, bf16 D or None. Asked once per shape
  // and request; later calls read the cache.
  Out plan(int64_t M, int64_t N, int64_t K, bool bf16_out = false);
  // Runs a planned shape; D is f32 or bf16 as plan() said. False if cuBLASLt refuses the call
  // (the shape is then marked None).
  bool run(int64_t M, int64_t N, int64_t K, bool bf16_out, const void* A, const float* a_scale, const void* B,
           const float* b_scale, void* D, void* workspace, cudaStream_t st);

 private:
  struct Entry {
    Out out = Out::None;
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  bool try_plan(Entry& e, int64_t M, int64_t N, int64_t K, cudaDataType_t dt);
  static void destroy(Entry& e);

  cublasLtHandle_t lt_;
  const void* placeholder_;
  size_t ws_bytes_;
  std::map<std::tuple<int64_t, int64_t, int64_t, bool>, Entry> cache_;
};

}  // namespace vireo::cuda
