// The fast math mode's prefill GEMM on FP8 weights (cuda_fp8_gemm.h): x quantized to e4m3 per
// (token, 128-column block) with scale amax / 448, then an e4m3 x e4m3 block-scaled cuBLASLt GEMM.
// Checked two ways, by NMSE (sum (got - want)^2 / sum want^2):
//  - against a host reference that quantizes x exactly as act_quant does (same f32 divisions,
//    vireo's f32_to_fp8_e4m3, checked below to round like __nv_cvt_float_to_fp8 with satfinite)
//    and multiplies the quantized operands in double. What is left is the GPU's accumulation:
//    Hopper's FP8 MMA keeps ~14 bits inside each 128-deep block before cuBLASLt adds the scaled
//    block sums in f32 (DeepSeek-V3 report, 3.3.2): measured 0.85e-8 to 3.9e-8 on the H200
//    (cuBLASLt 13.1, f32 D); threshold 1e-7. With bf16 D
//    (where cuBLASLt has no f32-output algorithm) the output's own rounding adds ~2^-18 / 3:
//    threshold 1e-5.
//  - against the CPU backend's exact f32 matmul: the difference is the e4m3 rounding of x
//    (3 mantissa bits: a relative error up to 2^-4, ~5.6e-4 NMSE for values spread over a binade;
//    the weights are the same e4m3 bytes on both sides): measured 4.5e-4 to 6.4e-4; threshold 2e-3.
// Shapes cuBLASLt refuses (or that the path's alignment rules exclude) fall back to the bf16
// dequantizing GEMM: checked against the exact matmul at its bf16 level (1e-4). Which path ran is
// read from the op profile's path name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/matmul.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_fp8_gemm.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "backend_test_util.h"
#include "cuda_test_util.h"

#ifdef VIREO_HAVE_CUDA
#include <cuda_fp8.h>
#include <cuda_runtime.h>

using namespace vireo;
using vireo::test::nmse;

namespace {


// An FP8 weight [out, in] with 128x128 block scales amax / 448, from values whose magnitude
// varies by block (so the scales differ), owning its bytes.
struct Fp8Weight {
  std::vector<uint8_t> q;
  std::vector<float> s;
  Weight w;
};
Fp8Weight fp8_weight(int64_t out, int64_t in, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), mag(0.02f, 0.3f);
  const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
  std::vector<float> bm(size_t(so * si));
  for (float& m : bm) m = mag(g);
  std::vector<float> v(size_t(out * in));
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j) v[size_t(i * in + j)] = u(g) * bm[size_t((i / 128) * si + j / 128)];
  Fp8Weight h;
  h.s.resize(size_t(so * si));
  h.q.resize(v.size());
  vireo::test::fp8_quantize_blocks(v, out, in, h.q.data(), h.s.data());
  h.w.w = Tensor(h.q.data(), DType::F8_E4M3, {out, in});
  h.w.scale_inv = Tensor(h.s.data(), DType::F32, {so, si});
  return h;
}

// Activations [T, in]: magnitudes varying by token and block, one all-zero block (scale 1 on the
// GPU; nothing to round) and one outlier per token-block row 3 (its block's amax).
std::vector<float> activations(int64_t T, int64_t in, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), mag(0.1f, 4.0f);
  std::vector<float> x(size_t(T * in));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < in; b += 128) {
      const float m = mag(g);
      for (int64_t j = b; j < std::min(in, b + 128); ++j) x[size_t(t * in + j)] = u(g) * m;
    }
  // (Fewer than 4 tokens: the zero block in the last row, the outlier in its second block.)
  const int64_t zr = std::min<int64_t>(1, T - 1), orow = std::min<int64_t>(3, T - 1);
  for (int64_t j = 0; j < std::min<int64_t>(in, 128); ++j) x[size_t(zr * in + j)] = 0.0f;
  x[size_t(orow * in + (T < 4 && in > 128 ? 133 : 5))] = 37.0f;
  return x;
}

// DeepSeek's act_quant on the host, as the kernel does it: per (token, 128-column block)
// s = amax / 448 (1 for a zero block), q = e4m3(x / s); returns the dequantized q * s (exact in
// double).
std::vector<double> act_quant_host(const std::vector<float>& x, int64_t T, int64_t in) {
  std::vector<double> r(x.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < in; b += 128) {
      const int64_t e = std::min(in, b + 128);
      float a = 0.0f;
      for (int64_t j = b; j < e; ++j) a = std::max(a, std::fabs(x[size_t(t * in + j)]));
      const float s = a > 0.0f ? a / 448.0f : 1.0f;
      for (int64_t j = b; j < e; ++j)
        r[size_t(t * in + j)] = double(fp8_e4m3_to_f32(f32_to_fp8_e4m3(x[size_t(t * in + j)] / s))) * double(s);
    }
  return r;
}

// y[t, o] = sum_k xq[t, k] * W[o, k] in double, W = q * its block scale.
std::vector<double> ref_matmul(const std::vector<double>& xq, int64_t T, const Fp8Weight& h, int64_t out,
                               int64_t in) {
  const int64_t si = (in + 127) / 128;
  std::vector<double> w(size_t(out * in));
  for (int64_t o = 0; o < out; ++o)
    for (int64_t k = 0; k < in; ++k)
      w[size_t(o * in + k)] = double(fp8_e4m3_to_f32(h.q[size_t(o * in + k)])) * double(h.s[size_t((o / 128) * si + k / 128)]);
  std::vector<double> y(size_t(T * out));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      const double* xr = &xq[size_t(t * in)];
      const double* wr = &w[size_t(o * in)];
      for (int64_t k = 0; k < in; ++k) acc += xr[k] * wr[k];
      y[size_t(t * out + o)] = acc;
    }
  return y;
}

bool is_hopper() {
  cudaDeviceProp p{};
  return cudaGetDeviceProperties(&p, 0) == cudaSuccess && p.major == 9;
}

struct Result {
  std::string path;  // "f32-out", "bf16-out" or "fallback"
  double vs_quant = 0, vs_exact = 0;
};

// One fast-mode matmul on the GPU: the path it took and its NMSE against both references.
// x_off / y_off: element offsets into the device buffers (16-byte but not 256-byte aligned y;
// unaligned x takes act_quant's scalar loads).
Result run_case(Backend& gpu, int64_t out, int64_t in, int64_t T, uint32_t seed, int64_t x_off = 0,
                int64_t y_off = 0) {
  Fp8Weight h = fp8_weight(out, in, seed);
  const std::vector<float> x = activations(T, in, seed + 1);
  std::vector<float> exact_f(size_t(T * out));
  cpu_matmul(x.data(), T, h.w, exact_f.data(), ThreadPool::global());
  const std::vector<double> exact(exact_f.begin(), exact_f.end());
  const std::vector<double> want = ref_matmul(act_quant_host(x, T, in), T, h, out, in);

  auto xb = gpu.alloc_f32(size_t(T * in + x_off));
  auto yb = gpu.alloc_f32(size_t(T * out + y_off));
  gpu.copy_from_host(xb.get() + x_off, x.data(), x.size());
  gpu.fill(yb.get() + y_off, NAN, T * out);  // poison: every output must be written
  const Weight gw = gpu.upload_weight(h.w);
  cuda_set_gemm_mode(gpu, CudaGemmMode::Fp8);
  cuda_set_profile(gpu, true);
  gpu.matmul(xb.get() + x_off, T, gw, yb.get() + y_off);
  const std::string report = cuda_profile_report(gpu, 1.0);
  cuda_set_profile(gpu, false);
  cuda_set_gemm_mode(gpu, CudaGemmMode::Split);
  std::vector<float> got(size_t(T * out));
  gpu.copy_to_host(got.data(), yb.get() + y_off, got.size());

  Result r;
  r.path = report.find("fp8xfp8 f32-out") != std::string::npos    ? "f32-out"
           : report.find("fp8xfp8 bf16-out") != std::string::npos ? "bf16-out"
           : report.find("gemv e4m3") != std::string::npos        ? "e4m3 gemv"
                                                                  : "fallback";
  r.vs_quant = nmse(got, want);
  r.vs_exact = nmse(got, exact);
  std::printf("  fp8 fast %4lldx%-4lld T %4lld x+%lld y+%lld: %-9s NMSE vs quantized ref %.3g, vs exact %.3g\n",
              (long long)out, (long long)in, (long long)T, (long long)x_off, (long long)y_off, r.path.c_str(),
              r.vs_quant, r.vs_exact);
  return r;
}

void check(const Result& r, bool expect_fast, const std::string& what) {
  if (r.path == "fallback") {
    EXPECT_FALSE(expect_fast) << what << ": expected the FP8 x FP8 path on this GPU";
    EXPECT_LT(r.vs_exact, 1e-4) << what << " (fallback)";
    return;
  }
  EXPECT_LT(r.vs_quant, r.path == "bf16-out" ? 1e-5 : 1e-7) << what << " " << r.path;
  EXPECT_LT(r.vs_exact, 2e-3) << what << " " << r.path;
}

}  // namespace

// vireo's f32_to_fp8_e4m3 (the host reference's rounding) against CUDA's __nv_cvt_float_to_fp8
// with satfinite (the kernel's), on the values where roundings differ: every code, every midpoint
// between neighbouring codes (ties go to the even code) and one f32 ulp either side, the subnormal
// range, past 448, and random values. Host-side only (cuda_fp8.h's conversions are host-callable).
TEST(CudaOps, Fp8FastQuantRounding) {
  std::vector<float> vals;
  for (int c = 0; c < 0x7f; ++c) {
    const float a = fp8_e4m3_to_f32(uint8_t(c)), b = c + 1 < 0x7f ? fp8_e4m3_to_f32(uint8_t(c + 1)) : 480.0f;
    const float mid = 0.5f * (a + b);
    for (float v : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), b}) {
      vals.push_back(v);
      vals.push_back(-v);
    }
  }
  for (float v : {448.0f, 448.5f, 464.0f, 465.0f, 1e6f, 1e-12f, 0.0f, -0.0f}) {
    vals.push_back(v);
    vals.push_back(-v);
  }
  std::mt19937 g(7);
  std::uniform_real_distribution<float> e(-14.0f, 9.0f);
  for (int i = 0; i < 20000; ++i) vals.push_back((i & 1 ? -1.0f : 1.0f) * std::exp2(e(g)));
  int bad = 0;
  for (float v : vals) {
    const uint8_t mine = f32_to_fp8_e4m3(v);
    const uint8_t cuda = uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    const bool zeros = (mine & 0x7f) == 0 && (cuda & 0x7f) == 0;  // +-0: the same in a product
    if (mine != cuda && !zeros && bad++ < 10)
      ADD_FAILURE() << "f32_to_fp8_e4m3(" << v << ") = " << int(mine) << ", CUDA: " << int(cuda);
  }
  EXPECT_EQ(bad, 0);
}

// Shapes: whole 128-blocks; partial blocks in both dims (296 x 400); k-block counts that are not a
// multiple of 4 (640: 5, 208: 2, the weight scales' padded copy); T from just past the decode
// kernels (9: not a multiple of 4, so the GEMM runs on 12 rows, 3 of them zero, into scratch) to
// a long prompt.
TEST(CudaOps, Fp8FastMatmul) {
  REQUIRE_CUDA();
  auto gpu = make_cuda_backend();
  const bool hopper = is_hopper();
  struct S { int64_t out, in; };
  for (S s : {S{256, 512}, S{296, 400}, S{512, 640}, S{384, 208}})
    for (int64_t T : {9, 100, 1000}) {
      const Result r = run_case(*gpu, s.out, s.in, T, uint32_t(s.out * 31 + s.in + T));
      check(r, hopper, std::to_string(s.out) + "x" + std::to_string(s.in) + " T " + std::to_string(T));
    }
}

// Pointers off their allocation's start: x at +1 float (act_quant's scalar path), y at +4 floats
// (16-byte aligned only: the planned algorithms must not assume more), T = 36 (a multiple of 4:
// cuBLASLt writes y itself); y at +1 float is not 16-byte aligned and must take the fallback.
TEST(CudaOps, Fp8FastMatmulOffsets) {
  REQUIRE_CUDA();
  auto gpu = make_cuda_backend();
  const bool hopper = is_hopper();
  check(run_case(*gpu, 256, 512, 36, 11, 1, 4), hopper, "x+1 y+4");
  check(run_case(*gpu, 256, 512, 33, 12, 0, 1), false, "y+1");
}

// Shapes the path leaves to the bf16 dequantizing GEMM: out % 8 != 0, in % 16 != 0, and (for now,
// see fp8_fast_plan) out or in under 128.
// act_quant's three forms at a prefill size, 1001 tokens x 2192 columns (18 blocks, the last of
// 16 columns; 4 padding rows): the plain form against the host's bytes and scales, the gathered
// form against the host's on the gathered rows, and the SwiGLU form against the plain form of the
// backend's swiglu output (the same f32 arithmetic; the host's expf may differ by an ulp).
TEST(CudaOps, Fp8ActQuantForms) {
  REQUIRE_CUDA();
  auto gpu = make_cuda_backend();
  const int64_t T = 1001, Tp = 1004, K = 2192, KB = (K + 127) / 128;
  const std::vector<float> x = activations(T, K, 61), up = activations(T, K, 62);
  std::vector<int32_t> index(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) index[size_t(t)] = int32_t((t * 37 + 5) % T);
  auto xd = gpu->alloc_f32(x.size()), ud = gpu->alloc_f32(up.size()), hd = gpu->alloc_f32(x.size());
  auto id = gpu->alloc_i32(index.size());
  gpu->copy_from_host(xd.get(), x.data(), x.size());
  gpu->copy_from_host(ud.get(), up.data(), up.size());
  gpu->copy_from_host_i32(id.get(), index.data(), index.size());
  gpu->swiglu(xd.get(), ud.get(), hd.get(), T * K);
  cuda_synchronize(*gpu);
  auto quantize = [&](const float* src, const int32_t* ix, const float* u) {
    uint8_t* q = nullptr;
    float* sc = nullptr;
    EXPECT_EQ(cudaMalloc(&q, size_t(Tp * K)), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&sc, size_t(KB * Tp) * 4), cudaSuccess);
    vireo::cuda::act_quant(src, T, Tp, K, q, sc, nullptr, ix, u);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::pair<std::vector<uint8_t>, std::vector<float>> r{std::vector<uint8_t>(size_t(Tp * K)),
                                                          std::vector<float>(size_t(KB * Tp))};
    cudaMemcpy(r.first.data(), q, r.first.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(r.second.data(), sc, r.second.size() * 4, cudaMemcpyDeviceToHost);
    cudaFree(q);
    cudaFree(sc);
    return r;
  };
  // The host's bytes and scales of rows src[row(t)].
  auto host = [&](const std::vector<float>& src, auto row) {
    std::pair<std::vector<uint8_t>, std::vector<float>> r{std::vector<uint8_t>(size_t(Tp * K), 0),
                                                          std::vector<float>(size_t(KB * Tp), 1.0f)};
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < KB; ++b) {
        const float* xr = &src[size_t(row(t) * K)];
        const int64_t e = std::min(K, (b + 1) * 128);
        float a = 0.0f;
        for (int64_t j = b * 128; j < e; ++j) a = std::max(a, std::fabs(xr[j]));
        const float sc = a > 0.0f ? a / 448.0f : 1.0f;
        r.second[size_t(b * Tp + t)] = sc;
        for (int64_t j = b * 128; j < e; ++j) r.first[size_t(t * K + j)] = f32_to_fp8_e4m3(xr[j] / sc);
      }
    return r;
  };
  auto same_codes = [](const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
    size_t bad = 0;  // +-0 are one value
    for (size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i] && ((a[i] | b[i]) & 0x7f) != 0;
    return bad;
  };
  const auto plain = quantize(xd.get(), nullptr, nullptr), want = host(x, [](int64_t t) { return t; });
  EXPECT_EQ(same_codes(plain.first, want.first), 0u);
  EXPECT_EQ(plain.second, want.second);
  const auto gathered = quantize(xd.get(), id.get(), nullptr);
  const auto want_g = host(x, [&](int64_t t) { return int64_t(index[size_t(t)]); });
  EXPECT_EQ(same_codes(gathered.first, want_g.first), 0u);
  EXPECT_EQ(gathered.second, want_g.second);
  const auto fused = quantize(xd.get(), nullptr, ud.get()), of_h = quantize(hd.get(), nullptr, nullptr);
  EXPECT_EQ(fused.first, of_h.first);
  EXPECT_EQ(fused.second, of_h.second);
}

TEST(CudaOps, Fp8FastMatmulFallbackShapes) {
  REQUIRE_CUDA();
  auto gpu = make_cuda_backend();
  check(run_case(*gpu, 300, 512, 50, 21), false, "300x512");
  check(run_case(*gpu, 256, 520, 50, 22), false, "256x520");
  check(run_case(*gpu, 64, 320, 50, 23), false, "64x320");
  check(run_case(*gpu, 320, 64, 50, 24), false, "320x64");
}
#endif

#ifdef VIREO_HAVE_CUDA
// Products sharing an input (an expert's gate and up): matmul_many quantizes x once and runs each
// FP8 x FP8 GEMM on it; the results equal separate matmuls bit for bit (same e4m3 x, same plans).
TEST(CudaOps, Fp8FastMatmulManySharesX) {
  REQUIRE_CUDA();
  auto gpu = make_cuda_backend();
  const int64_t T = 37, in = 512;
  Fp8Weight a = fp8_weight(256, in, 31), b = fp8_weight(384, in, 32);
  const std::vector<float> x = activations(T, in, 33);
  auto xb = gpu->alloc_f32(x.size());
  gpu->copy_from_host(xb.get(), x.data(), x.size());
  const Weight ga = gpu->upload_weight(a.w), gb = gpu->upload_weight(b.w);
  auto ya = gpu->alloc_f32(size_t(T * 256)), yb = gpu->alloc_f32(size_t(T * 384));
  auto sa = gpu->alloc_f32(size_t(T * 256)), sb = gpu->alloc_f32(size_t(T * 384));
  cuda_set_gemm_mode(*gpu, CudaGemmMode::Fp8);
  cuda_set_profile(*gpu, true);
  const Weight* ws[2] = {&ga, &gb};
  float* ys[2] = {ya.get(), yb.get()};
  gpu->matmul_many(xb.get(), T, ws, ys, 2);
  const std::string report = cuda_profile_report(*gpu, 1.0);
  cuda_set_profile(*gpu, false);
  gpu->matmul(xb.get(), T, ga, sa.get());
  gpu->matmul(xb.get(), T, gb, sb.get());
  cuda_set_gemm_mode(*gpu, CudaGemmMode::Split);
  auto down = [&](const float* p, size_t n) {
    std::vector<float> h(n);
    gpu->copy_to_host(h.data(), p, n);
    return h;
  };
  if (is_hopper()) {
    EXPECT_NE(report.find("fp8xfp8 f32-out (x shared)"), std::string::npos) << report;
  }
  EXPECT_EQ(down(ya.get(), size_t(T * 256)), down(sa.get(), size_t(T * 256)));
  EXPECT_EQ(down(yb.get(), size_t(T * 384)), down(sb.get(), size_t(T * 384)));
}
#endif

#ifdef VIREO_HAVE_CUDA
// Decode products of 2..8 rows in fast-fp8: the e4m3 kernels of cuda_q8_gemv.cu, against the same
// two references as the prefill GEMM (the e4m3 x is the same act_quant; what is left against the
// quantized reference is the tensor cores' accumulation inside each 128-deep block: measured
// ~1e-15, the f32 sums of exact e4m3 products). Shapes: whole tiles and blocks; rows ending in a
// partial 16-row tile (296, 40); a row length ending in half a k-block (192, 704 = 5.5 blocks);
// GLM-5's o_proj row length with T = 8 (16 KB of e4m3 x a token in shared memory); one token
// column and several. One row stays on the f32-math GEMV (exact), as does x at +1 float (not
// 16-byte aligned); x at +4 floats takes the kernel.
TEST(CudaOps, Fp8FastDecodeProducts) {
  REQUIRE_CUDA();
  auto gpu = make_cuda_backend();
  struct S { int64_t out, in; };
  for (S s : {S{256, 512}, S{296, 192}, S{40, 704}, S{2048, 256}, S{128, 16384}})
    for (int64_t T : {2, 3, 5, 8}) {
      const Result r = run_case(*gpu, s.out, s.in, T, uint32_t(s.out * 7 + s.in + T));
      const std::string what = std::to_string(s.out) + "x" + std::to_string(s.in) + " T " + std::to_string(T);
      EXPECT_EQ(r.path, "e4m3 gemv") << what;
      check(r, true, what);
    }
  // More one-tile blocks than two an SM hold (4800 rows of 16384: 300 blocks), which run at three
  // an SM (q8_gemv), where the shapes above run at two.
  {
    const Result r = run_case(*gpu, 4800, 16384, 2, 40);
    EXPECT_EQ(r.path, "e4m3 gemv") << "4800x16384 T 2";
    check(r, true, "4800x16384 T 2");
  }
  check(run_case(*gpu, 256, 512, 2, 41, 4, 4), true, "x+4 y+4");
  for (auto [T, x_off] : {std::pair<int64_t, int64_t>{1, 0}, {2, 1}}) {
    const Result r = run_case(*gpu, 256, 512, T, 42, x_off, 0);
    EXPECT_EQ(r.path, "fallback") << "T " << T << " x+" << x_off;
    EXPECT_LT(r.vs_exact, 1e-10) << "T " << T << " x+" << x_off << ": the f32-math GEMV";
  }
}
#endif

#ifdef VIREO_HAVE_CUDA
// x quantized once by act_quant and copied into each block (cuda_set_q8_prequant) gives the bits
// of the blocks quantizing x themselves. At >= 8192 columns and 5-8 rows, where it is taken (the
// profile shows the act_quant); at 4 rows neither form quantizes ahead.
TEST(CudaOps, Fp8FastDecodePrequantizedXSameBits) {
  REQUIRE_CUDA();
  auto gpu = make_cuda_backend();
  struct S {
    int64_t out, in, T;
  };
  for (S s : {S{512, 8192, 5}, S{512, 8192, 8}, S{272, 16384, 8}, S{512, 8192, 4}}) {
    const std::string what = std::to_string(s.out) + "x" + std::to_string(s.in) + " T " + std::to_string(s.T);
    Fp8Weight h = fp8_weight(s.out, s.in, uint32_t(s.out + s.T));
    const std::vector<float> x = activations(s.T, s.in, uint32_t(s.in + s.T));
    auto xb = gpu->alloc_f32(x.size());
    auto yb = gpu->alloc_f32(size_t(s.T * s.out));
    gpu->copy_from_host(xb.get(), x.data(), x.size());
    const Weight gw = gpu->upload_weight(h.w);
    cuda_set_gemm_mode(*gpu, CudaGemmMode::Fp8);
    std::vector<float> got[2];
    std::string report[2];
    for (int pre = 0; pre < 2; ++pre) {
      cuda_set_q8_prequant(pre == 1);
      gpu->fill(yb.get(), NAN, s.T * s.out);
      cuda_set_profile(*gpu, true);
      gpu->matmul(xb.get(), s.T, gw, yb.get());
      report[pre] = cuda_profile_report(*gpu, 1.0);
      cuda_set_profile(*gpu, false);
      got[pre].resize(size_t(s.T * s.out));
      gpu->copy_to_host(got[pre].data(), yb.get(), got[pre].size());
    }
    cuda_set_q8_prequant(true);
    cuda_set_gemm_mode(*gpu, CudaGemmMode::Split);
    EXPECT_EQ(report[0].find("act_quant"), std::string::npos) << what;
    EXPECT_EQ(report[1].find("act_quant") != std::string::npos, s.T > 4) << what << ": quantized ahead";
    EXPECT_NE(report[1].find("gemv e4m3"), std::string::npos) << what;
    size_t differ = 0;
    for (size_t i = 0; i < got[0].size(); ++i) differ += !(got[0][i] == got[1][i]);  // NaN: unwritten
    EXPECT_EQ(differ, 0u) << what;
  }
}
#endif

#ifdef VIREO_HAVE_CUDA
// The fast-fp8 prefill attention's kv_b expansion on an FP8 weight: act_quant of the latent, then
// the block-scaled FP8 x FP8 GEMM writing bf16 itself (as DeepSeek's reference runs wkv_b). GLM-5
// head dims with 8 heads (kv_b 3584 x 512), 333 queries over 560 keys. Against the CPU reference
// given the latent as act_quant rounds it, what is left is fast mode's bf16 roundings (kv_b's
// output, Q, P: ~1e-5, as CudaFastAttention.PrefillMatchesCpu); against the CPU on the unrounded
// latent, the e4m3 rounding shows (~1e-3), which tells that the FP8 path ran.
TEST(CudaOps, Fp8FastPrefillAttentionKvbOnFp8) {
  REQUIRE_CUDA();
  auto cpu = make_cpu_backend();
  auto gpu = make_cuda_backend();
  const int64_t H = 8, nope = 192, rope = 64, vd = 256, L = 512, N = 560, T = 333, pos0 = N - T;
  const int64_t qw = nope + rope, kvw = L + rope, hw = nope + vd;
  Fp8Weight kvb = fp8_weight(H * hw, L, 51);
  std::vector<float> kv = vireo::test::randv(size_t(N * kvw), 52), q = vireo::test::randv(size_t(T * H * qw), 53);
  // The latent as act_quant rounds it, per key row (the rope part is not quantized).
  std::vector<float> latent(size_t(N * L)), kv_quant = kv;
  for (int64_t n = 0; n < N; ++n) std::copy_n(kv.begin() + n * kvw, L, latent.begin() + n * L);
  const std::vector<double> lq = act_quant_host(latent, N, L);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < L; ++j) kv_quant[size_t(n * kvw + j)] = float(lq[size_t(n * L + j)]);
  const MlaAttentionArgs a =
      vireo::test::mla_shape(T, H, nope, rope, vd, L, N, pos0, 1.0f / std::sqrt(float(qw)), false);
  const std::vector<float> want = vireo::test::cpu_mla_attention(*cpu, a, q, kv, kvb.w, nullptr);
  const std::vector<float> want_q = vireo::test::cpu_mla_attention(*cpu, a, q, kv_quant, kvb.w, nullptr);

  vireo::test::Dev dev(*gpu);
  const Weight gkvb = gpu->upload_weight(kvb.w);
  MlaAttentionArgs g = a;
  g.q = dev.up(q);
  g.kv = dev.up(kv);
  g.kv_b = &gkvb;
  g.out = dev.up(std::vector<float>(want.size(), NAN));
  cuda_set_gemm_mode(*gpu, CudaGemmMode::Fp8);
  cuda_set_profile(*gpu, true);
  gpu->mla_attention(g);
  const std::string report = cuda_profile_report(*gpu, 1.0);
  cuda_set_profile(*gpu, false);
  cuda_set_gemm_mode(*gpu, CudaGemmMode::Split);
  const std::vector<float> got = dev.down(g.out, want.size());
  const double e_q = nmse(got, want_q), e = nmse(got, want);
  std::printf("  kv_b fp8 3584x512, T %lld: NMSE vs CPU on the act_quant latent %.3g, on the latent %.3g\n",
              (long long)T, e_q, e);
  if (!is_hopper()) GTEST_SKIP() << "the FP8 x FP8 path needs sm_90";
  EXPECT_NE(report.find("3584x512 lt fp8xfp8 bf16-out"), std::string::npos) << report;
  EXPECT_LT(e_q, 1e-4);
  EXPECT_GT(e, 3 * e_q);
  EXPECT_LT(e, 1e-2);
}
#endif

#ifdef VIREO_HAVE_CUDA
// fast-fp8's one-token FP8 products on f16 x (cuda_set_one_token_f16_x; stage_x_f16 in
// cuda_kernels.cuh): the large GEMV (>= 4096 rows: gemv_rows2 in its three launch forms, at the
// layer input's and o_proj's row lengths) and the routed and shared experts' walks, against the
// CPU's exact f32 products. x has blocks of different magnitudes, a zero block and an outlier
// (activations), so a wrong block scale shows. Checked: the NMSE against exact (f16's 2^-11 rounding of x
// and of the 8-term partial sums) stays under 1e-6, 500 times under fast-fp8's own e4m3 rounding of x
// (~5e-4); the f32 form's bits differ (the f16 form ran); with the switch off, fast-fp8 gives exact
// mode's bits (the same f32 kernels).
TEST(CudaOps, Fp8FastOneTokenProductsOnF16X) {
  REQUIRE_CUDA();
  auto gpu = make_cuda_backend();
  auto cpu = make_cpu_backend();
  // One token's product in `mode` (f16 x on or off), y poisoned first; then an op that touches
  // neither, which an Early product may start beside (its own wait covered the poisoning).
  auto scratch = gpu->alloc_f32(64);
  auto product = [&](const float* gx, const Weight& gw, float* gy, int64_t out, CudaGemmMode mode, bool f16,
                     Backend::ProductLaunch form) {
    gpu->fill(gy, NAN, out);
    gpu->fill(scratch.get(), 0.0f, 64);
    cuda_set_gemm_mode(*gpu, mode);
    cuda_set_one_token_f16_x(f16);
    gpu->matmul_launched(gx, 1, gw, gy, form);
    cuda_set_one_token_f16_x(true);
    cuda_set_gemm_mode(*gpu, CudaGemmMode::Split);
    std::vector<float> y(static_cast<size_t>(out));
    gpu->copy_to_host(y.data(), gy, y.size());
    return y;
  };
  struct S {
    int64_t out, in;
  };
  for (S s : {S{4096, 6144}, S{6144, 16384}}) {
    Fp8Weight h = fp8_weight(s.out, s.in, uint32_t(s.in + 3));
    const std::vector<float> x = activations(1, s.in, uint32_t(s.in + 4));
    std::vector<float> want(static_cast<size_t>(s.out));
    cpu_matmul(x.data(), 1, h.w, want.data(), ThreadPool::global());
    const Weight gw = gpu->upload_weight(h.w);
    auto xb = gpu->alloc_f32(x.size());
    auto yb = gpu->alloc_f32(size_t(s.out));
    gpu->copy_from_host(xb.get(), x.data(), x.size());
    using PL = Backend::ProductLaunch;
    for (PL form : {PL::InOrder, PL::HalfSm, PL::Early}) {
      const std::string what =
          std::to_string(s.out) + "x" + std::to_string(s.in) + " form " + std::to_string(int(form));
      const auto exact = product(xb.get(), gw, yb.get(), s.out, CudaGemmMode::Split, true, form);
      const auto f32 = product(xb.get(), gw, yb.get(), s.out, CudaGemmMode::Fp8, false, form);
      const auto f16 = product(xb.get(), gw, yb.get(), s.out, CudaGemmMode::Fp8, true, form);
      const double e = nmse(f16, want);
      std::printf("  one-token fp8 %s: f16 x NMSE vs exact %.3g (f32 x %.3g)\n", what.c_str(), e, nmse(f32, want));
      EXPECT_LT(e, 1e-6) << what;
      EXPECT_LT(nmse(exact, want), 1e-10) << what;
      EXPECT_EQ(f32, exact) << what << ": fast-fp8 with f16 x off";
      EXPECT_NE(f16, f32) << what << ": the f16 form did not run";
    }
  }
  // The experts at one token: 8 routed of 16 and one shared, the walks' shapes (D, I % 128 == 0).
  const int64_t D = 2048, I = 1024;
  const int K = 8, E = 16;
  ExpertBank cb, gb;
  cb.n_shared = gb.n_shared = 1;
  std::vector<vireo::test::HostWeight> hw;
  hw.reserve(size_t(3 * (E + 1)));
  for (int e = 0; e <= E; ++e)
    for (int m = 0; m < 3; ++m) {
      hw.push_back(m < 2 ? vireo::test::make_weight(DType::F8_E4M3, I, D, uint32_t(500 + 3 * e + m), 0.1f, true)
                         : vireo::test::make_weight(DType::F8_E4M3, D, I, uint32_t(500 + 3 * e + m), 0.1f, true));
      (m == 0 ? cb.gate : m == 1 ? cb.up : cb.down).push_back(hw.back().w);
      (m == 0 ? gb.gate : m == 1 ? gb.up : gb.down).push_back(gpu->upload_weight(hw.back().w));
    }
  const std::vector<int32_t> ids = {1, 3, 4, 7, 9, 10, 12, 15};
  const std::vector<float> x = activations(1, D, 77), wts = vireo::test::randv(size_t(K), 78);
  std::vector<float> want(static_cast<size_t>(D));
  cpu->moe_experts(x.data(), 1, ids.data(), wts.data(), K, cb, want.data());
  auto xb = gpu->alloc_f32(size_t(D));
  auto wb = gpu->alloc_f32(size_t(K));
  auto ib = gpu->alloc_i32(size_t(K));
  auto ob = gpu->alloc_f32(size_t(D));
  gpu->copy_from_host(xb.get(), x.data(), x.size());
  gpu->copy_from_host(wb.get(), wts.data(), wts.size());
  gpu->copy_from_host_i32(ib.get(), ids.data(), ids.size());
  auto experts = [&](CudaGemmMode mode, bool f16, bool shared_ahead) {
    gpu->fill(ob.get(), NAN, D);
    cuda_set_gemm_mode(*gpu, mode);
    cuda_set_one_token_f16_x(f16);
    if (shared_ahead) gpu->moe_shared_gate_up(xb.get(), 1, K, gb);  // the decode step's branch
    gpu->moe_experts(xb.get(), 1, ib.get(), wb.get(), K, gb, ob.get());
    cuda_set_one_token_f16_x(true);
    cuda_set_gemm_mode(*gpu, CudaGemmMode::Split);
    std::vector<float> y(static_cast<size_t>(D));
    gpu->copy_to_host(y.data(), ob.get(), y.size());
    return y;
  };
  const int64_t walks = cuda_moe_down_walk_launches();
  const auto exact = experts(CudaGemmMode::Split, true, false), f32 = experts(CudaGemmMode::Fp8, false, false);
  const auto f16 = experts(CudaGemmMode::Fp8, true, false), f16_ahead = experts(CudaGemmMode::Fp8, true, true);
  const char* down_walk_env = std::getenv("VIREO_MOE_DOWN_WALK");
  if (!(down_walk_env && std::string(down_walk_env) == "0")) {
    EXPECT_EQ(cuda_moe_down_walk_launches() - walks, 4) << "the down walk not taken";
  }
  const double e = nmse(f16, want);
  std::printf("  one-token fp8 experts D %lld I %lld: f16 x NMSE vs exact %.3g (f32 x %.3g)\n", (long long)D,
              (long long)I, e, nmse(f32, want));
  EXPECT_LT(e, 1e-6);
  EXPECT_LT(nmse(exact, want), 1e-10);
  EXPECT_EQ(f32, exact) << "fast-fp8 experts with f16 x off";
  EXPECT_NE(f16, f32) << "the f16 walks did not run";
  EXPECT_EQ(f16_ahead, f16) << "the shared gate | up queued ahead";
}
#endif
