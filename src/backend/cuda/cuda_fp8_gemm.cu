// FP8 x FP8 block-scaled GEMMs for the fast math mode's prefill (cuda_fp8_gemm.h).
#include "backend/cuda/cuda_fp8_gemm.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_kernels.cuh"

namespace vireo::cuda {

namespace {

// One warp per (token, 128-column block), 8 per thread block. VEC: each lane takes 4 consecutive
// columns with one 16-byte load (x 16-byte aligned, K % 4 == 0, so a group of 4 is wholly inside
// or wholly past K) and writes them as one 4-byte word; else lanes stride by 32 with scalar
// accesses. Columns past K (the last block of a K that is no multiple of 128) count as 0.
// s = amax / 448 and q = x / s, both IEEE f32 divisions as in DeepSeek's act_quant (nvcc's default
// -prec-div=true), then __nv_cvt_float_to_fp8: round to nearest even, saturating to +-448 (x / s
// can come out a rounding above 448 for the block's largest element). Rows t in [T, Tp) are
// padding: q = 0, s = 1, x not read.
// The value quantized is produced in the same pass, so no f32 copy of it is written first:
// row t of x, or row index[t] of x (an expert's gathered tokens), or, with `up`, the SwiGLU
// silu(x) * up of row t with swiglu_kernel's arithmetic (an expert's down-product input).
template <bool VEC>
__global__ void __launch_bounds__(256) act_quant_kernel(const float* __restrict__ x, const int32_t* __restrict__ index,
                                                        const float* __restrict__ up, int64_t T, int64_t Tp,
                                                        int64_t K, int KB, uint8_t* __restrict__ q,
                                                        float* __restrict__ s) {
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = int64_t(blockIdx.x) * 8 + warp;
  if (item >= Tp * KB) return;
  const int64_t t = item / KB;
  const int kb = int(item % KB);
  const int64_t c0 = int64_t(kb) * 128;
  const int64_t src = t < T && index ? int64_t(index[t]) : t;
  const float* xr = x + src * K;
  const float* ur = up ? up + t * K : nullptr;
  float v[4];
  if (t >= T) {
    v[0] = v[1] = v[2] = v[3] = 0.0f;
  } else if constexpr (VEC) {
    const int64_t c = c0 + 4 * lane;
    const float4 f = c < K ? *reinterpret_cast<const float4*>(xr + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
    if (ur) {
      const float4 g = c < K ? *reinterpret_cast<const float4*>(ur + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      v[0] = v[0] / (1.0f + expf(-v[0])) * g.x;
      v[1] = v[1] / (1.0f + expf(-v[1])) * g.y;
      v[2] = v[2] / (1.0f + expf(-v[2])) * g.z;
      v[3] = v[3] / (1.0f + expf(-v[3])) * g.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t c = c0 + lane + 32 * i;
      v[i] = c < K ? xr[c] : 0.0f;
      if (ur && c < K) v[i] = v[i] / (1.0f + expf(-v[i])) * ur[c];
    }
  }
  float sc;
  const uint32_t packed = act_quant_lane(v, sc);
  uint8_t* qr = q + t * K;
  if constexpr (VEC) {
    const int64_t c = c0 + 4 * lane;
    if (c < K) *reinterpret_cast<uint32_t*>(qr + c) = packed;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t c = c0 + lane + 32 * i;
      if (c < K) qr[c] = uint8_t(packed >> (8 * i));
    }
  }
  if (lane == 0) s[int64_t(kb) * Tp + t] = sc;
}

__global__ void widen_bf16_kernel(const __nv_bfloat16* __restrict__ src, int64_t n, float* __restrict__ dst) {
  pdl_begin();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __bfloat162float(src[i]);
}

}  // namespace

void act_quant(const float* x, int64_t T, int64_t Tp, int64_t K, uint8_t* q, float* s, cudaStream_t st,
               const int32_t* index, const float* up) {
  const int KB = int((K + 127) / 128);
  const unsigned blocks = unsigned((Tp * KB + 7) / 8);
  const bool vec = K % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(up) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(q) % 4 == 0;
  if (vec) launch(act_quant_kernel<true>, blocks, 256, 0, st, x, index, up, T, Tp, K, KB, q, s);
  else launch(act_quant_kernel<false>, blocks, 256, 0, st, x, index, up, T, Tp, K, KB, q, s);
}

void widen_bf16(const void* src, int64_t n, float* dst, cudaStream_t st) {
  const unsigned blocks = unsigned(std::clamp<int64_t>((n + 255) / 256, 1, 65536));
  launch(widen_bf16_kernel, blocks, 256, 0, st, static_cast<const __nv_bfloat16*>(src), n, dst);
}

Fp8BlockGemm::~Fp8BlockGemm() {
  for (auto& [k, e] : cache_) destroy(e);
}

void Fp8BlockGemm::destroy(Entry& e) {
  if (e.la) cublasLtMatrixLayoutDestroy(e.la);
  if (e.lb) cublasLtMatrixLayoutDestroy(e.lb);
  if (e.ld) cublasLtMatrixLayoutDestroy(e.ld);
  if (e.op) cublasLtMatmulDescDestroy(e.op);
  e = Entry{};
}

// The layouts as in lt_matmul (cuda_matmul.cu): cuBLASLt is column-major, so A = the row-major
// weight [M, K] is a K x M matrix read transposed (TRANSA = T, lda = K), B = the row-major
// activations [N, K] a K x N matrix (ldb = K), D = the row-major output [N, M] an M x N matrix
// (ldd = M). The scale modes are the ones measured to work (shared/notes): BLK128x128 for the
// weight, VEC128 (K-block-major) for the activations.
bool Fp8BlockGemm::try_plan(Entry& e, int64_t M, int64_t N, int64_t K, cudaDataType_t dt) {
  bool ok = false;
  do {
    if (cublasLtMatmulDescCreate(&e.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) break;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cublasLtMatmulMatrixScale_t sa = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                      sb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    // Scale pointers: placeholders (any device address) for the heuristic; run() sets the real ones.
    const void* dummy = placeholder_;
    if (cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &sa, sizeof sa) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &sb, sizeof sb) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dummy, sizeof dummy) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dummy, sizeof dummy) !=
            CUBLAS_STATUS_SUCCESS)
      break;
    if (cublasLtMatrixLayoutCreate(&e.la, CUDA_R_8F_E4M3, uint64_t(K), uint64_t(M), K) != CUBLAS_STATUS_SUCCESS) break;
    if (cublasLtMatrixLayoutCreate(&e.lb, CUDA_R_8F_E4M3, uint64_t(K), uint64_t(N), K) != CUBLAS_STATUS_SUCCESS) break;
    if (cublasLtMatrixLayoutCreate(&e.ld, dt, uint64_t(M), uint64_t(N), M) != CUBLAS_STATUS_SUCCESS) break;
    // The callers guarantee 16-byte alignment of every pointer (not the 256 the heuristic would
    // otherwise assume: y can be a row of a larger buffer).
    ok = lt_heuristic(lt_, e.op, e.la, e.lb, e.ld, ws_bytes_, 16, e.algo);
  } while (false);
  if (!ok) destroy(e);
  return ok;
}

Fp8BlockGemm::Out Fp8BlockGemm::plan(int64_t M, int64_t N, int64_t K, bool bf16_out) {
  const auto key = std::make_tuple(M, N, K, bf16_out);
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second.out;
  Entry e;
  // f32 D first: y is f32, so no bf16 rounding of the output and no widening pass. On the H200
  // (cuBLASLt 13.1) the heuristic found an f32-output algorithm for every shape tried (the tests'
  // and the GLM-5 prefill's, N % 4 == 0): bf16 D plus widening is the fallback for a library or
  // GPU without one, not exercised there.
  if (!bf16_out && try_plan(e, M, N, K, CUDA_R_32F)) e.out = Out::F32;
  else if (try_plan(e, M, N, K, CUDA_R_16BF)) e.out = Out::Bf16;
  cache_.emplace(key, e);
  return e.out;
}

bool Fp8BlockGemm::run(int64_t M, int64_t N, int64_t K, bool bf16_out, const void* A, const float* a_scale,
                       const void* B, const float* b_scale, void* D, void* workspace, cudaStream_t st) {
  auto it = cache_.find(std::make_tuple(M, N, K, bf16_out));
  if (it == cache_.end() || it->second.out == Out::None) return false;
  Entry& e = it->second;
  const float alpha = 1.0f, beta = 0.0f;
  bool ok = cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale) ==
                CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale) ==
                CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmul(lt_, e.op, &alpha, A, e.la, B, e.lb, &beta, D, e.ld, D, e.ld, &e.algo, workspace, ws_bytes_, st) ==
                CUBLAS_STATUS_SUCCESS;
  if (!ok) destroy(e);  // out = None: this shape takes the other path from now on
  return ok;
}

}  // namespace vireo::cuda
