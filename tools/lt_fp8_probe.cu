// vireo_lt_fp8_probe: every algorithm cuBLASLt's heuristic offers for the FP8 block-scaled
// products of vireo's 512-token prefill (GLM-5 shapes: o_proj, q_b, kv_b, the layer input's q_a /
// kv_a / indexer keys, and the three as one 2752-row product), f32 out, as cuda_fp8_gemm.cu calls
// them (weights BLK128x128, activations VEC128 K-block-major), each timed alone (median of 15
// CUDA-event runs) with its tile / split-K / stages config and its relative L2 difference from
// the first algorithm. No vireo code. BENCHMARKS.md "Session 24" has its numbers on an H200.
//
//   build-cuda/vireo_lt_fp8_probe      (built with the CUDA backend; needs an sm_90 GPU)
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cmath>
#define CK(x)                                                          \
  do {                                                                 \
    auto e = (x);                                                      \
    if (e != 0) {                                                      \
      printf("FAIL %s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)e); \
      exit(1);                                                         \
    }                                                                  \
  } while (0)
static void fill(void* p, size_t n, int seed, bool f8) {
  std::vector<unsigned char> h(n);
  srand(seed);
  if (f8)
    for (auto& v : h) {
      __nv_fp8_e4m3 f((rand() / (float)RAND_MAX - 0.5f) * 8);
      v = *reinterpret_cast<unsigned char*>(&f);
    }
  CK(cudaMemcpy(p, h.data(), n, cudaMemcpyHostToDevice));
}
int main(int argc, char** argv) {
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  int shapes[][3] = {{6144, 512, 16384}, {16384, 512, 2048},  {28672, 512, 512}, {2048, 512, 6144},
                     {576, 512, 6144},   {128, 512, 6144},    {2752, 512, 6144}, {6144, 512, 2048},
                     {4096, 256, 6144},  {6144, 4096, 16384}, {8192, 8192, 8192}};
  size_t wsz = 64 << 20;
  void* wsp;
  CK(cudaMalloc(&wsp, wsz));
  for (auto& s : shapes) {
    int M = s[0], N = s[1], K = s[2], KB = (K + 127) / 128, MB = (M + 127) / 128, KB4 = (KB + 3) / 4 * 4;
    void *W, *X;
    float *ws, *xs, *D, *D0;
    CK(cudaMalloc(&W, (size_t)M * K));
    CK(cudaMalloc(&X, (size_t)N * K));
    CK(cudaMalloc(&ws, (size_t)MB * KB4 * 4));
    CK(cudaMalloc(&xs, (size_t)N * KB * 4));
    CK(cudaMalloc(&D, (size_t)M * N * 4));
    CK(cudaMalloc(&D0, (size_t)M * N * 4));
    fill(W, (size_t)M * K, 1, true);
    fill(X, (size_t)N * K, 2, true);
    {
      std::vector<float> h((size_t)MB * KB4);
      for (auto& v : h) v = 0.5f + rand() / (float)RAND_MAX;
      CK(cudaMemcpy(ws, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
    {
      std::vector<float> h((size_t)N * KB);
      for (auto& v : h) v = 0.5f + rand() / (float)RAND_MAX;
      CK(cudaMemcpy(xs, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
    cublasLtMatmulDesc_t desc;
    CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof(tA)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof(tB)));
    cublasLtMatmulMatrixScale_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof(ma)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof(mb)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof(ws)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs, sizeof(xs)));
    cublasLtMatrixLayout_t la, lb, ld;
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, M, K));
    CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, N, K));
    CK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, M, N, M));
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof(wsz)));
    cublasLtMatmulHeuristicResult_t h[32];
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 32, h, &found);
    double fl = 2.0 * M * N * K;
    printf("== M %d N %d K %d: %d algos\n", M, N, K, found);
    float alpha = 1, beta = 0;
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int i = 0; i < found; ++i) {
      int tile = 0, splitk = 0, stages = 0, red = 0, swz = 0, cta = 0, algo_id = 0;
      size_t sz;
      cublasLtMatmulAlgoConfigGetAttribute(&h[i].algo, CUBLASLT_ALGO_CONFIG_ID, &algo_id, sizeof algo_id, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&h[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&h[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&h[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&h[i].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof red, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&h[i].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof swz, &sz);
      cublasLtMatmulAlgoConfigGetAttribute(&h[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cta, sizeof cta, &sz);
      float* out = i == 0 ? D0 : D;
      if (cublasLtMatmul(lt, desc, &alpha, W, la, X, lb, &beta, out, ld, out, ld, &h[i].algo, wsp, wsz, 0) != 0) {
        printf("  %2d: run failed\n", i);
        continue;
      }
      CK(cudaDeviceSynchronize());
      std::vector<float> t;
      for (int r = 0; r < 15; ++r) {
        cudaEventRecord(a);
        cublasLtMatmul(lt, desc, &alpha, W, la, X, lb, &beta, out, ld, out, ld, &h[i].algo, wsp, wsz, 0);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      double rel_l2 = 0;
      if (i > 0) {
        std::vector<float> r0((size_t)M * N), r1((size_t)M * N);
        CK(cudaMemcpy(r0.data(), D0, r0.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(r1.data(), D, r1.size() * 4, cudaMemcpyDeviceToHost));
        double num = 0, den = 0;
        int same = 0;
        for (size_t j = 0; j < r0.size(); ++j) {
          double d = r1[j] - r0[j];
          num += d * d;
          den += (double)r0[j] * r0[j];
          same += r0[j] == r1[j];
        }
        rel_l2 = sqrt(num / den);
        printf(
            "  %2d: id %d tile %d splitk %d red %d stages %d swz %d cluster %d ws %zu: %8.1f us %7.1f TFLOP/s  rel-L2 "
            "diff %.2e bitsame %.3f\n",
            i, algo_id, tile, splitk, red, stages, swz, cta, h[i].workspaceSize, t[7] * 1e3, fl / t[7] / 1e9, rel_l2,
            same / double(r0.size()));
      } else {
        printf("  %2d: id %d tile %d splitk %d red %d stages %d swz %d cluster %d ws %zu: %8.1f us %7.1f TFLOP/s\n", i,
               algo_id, tile, splitk, red, stages, swz, cta, h[i].workspaceSize, t[7] * 1e3, fl / t[7] / 1e9);
      }
    }
    cudaFree(W);
    cudaFree(X);
    cudaFree(ws);
    cudaFree(xs);
    cudaFree(D);
    cudaFree(D0);
  }
  return 0;
}
