// The fast-mode prefill attention (CudaGemmMode::Bf16: cuda_prefill_fast.cu) against the CPU
// reference: GLM-5 head dims (qk 192 + 64, v 256, kv_lora 512) with fewer heads, and a small-dims
// case, pos0 = 0 and > 0, with and without a DSA selection.
// Tolerance: in this mode the GPU rounds to bf16 once (relative error up to 2^-9, ~2^-9/sqrt(3)
// rms) the kv_b GEMM's input, then Q, K, V and the probabilities P before the tensor-core
// products; each rounding adds ~1.3e-6 relative variance, and they compound through
// q.k (scores ~O(1), so exp() turns score errors into similar relative errors of P) and P V, for an
// expected NMSE of a few 1e-6 to ~1e-5. 1e-4 leaves headroom for that while still catching any
// layout, masking or softmax bug (those give NMSE ~1e-2 and up). The exact (split) mode is
// checked to be a different kernel with a much smaller error on the same data.
// VIREO_TIME_ATTN=1 also runs CudaFastAttention.TimingGlm5: the fast and exact kernels at H 64,
// T 4096 (cudaEvent times through the backend's op profile).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/dtype.h"
#include "backend_test_util.h"
#include "cuda_test_util.h"

using namespace vireo;
using vireo::test::Dev;
using vireo::test::nmse;
using vireo::test::randv;

#ifdef VIREO_HAVE_CUDA
namespace {




// A DSA-like selection: each query keeps its own key plus up to stride - 1 random earlier ones
// (all of its causal keys when they fit), ascending.
void make_selection(int64_t T, int64_t pos0, int64_t stride, uint32_t seed, std::vector<int32_t>& keys,
                    std::vector<int32_t>& counts) {
  std::mt19937 gen(seed);
  keys.assign(size_t(T * stride), 0);
  counts.assign(size_t(T), 0);
  std::vector<int32_t> pool;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t self = pos0 + t, n = self + 1;
    int32_t* row = keys.data() + t * stride;
    if (n <= stride) {
      for (int64_t u = 0; u < n; ++u) row[u] = int32_t(u);
      counts[size_t(t)] = int32_t(n);
      continue;
    }
    pool.resize(size_t(self));
    for (int64_t u = 0; u < self; ++u) pool[size_t(u)] = int32_t(u);
    for (int64_t i = 0; i < stride - 1; ++i) {  // partial Fisher-Yates: stride - 1 distinct keys
      std::uniform_int_distribution<int64_t> d(i, self - 1);
      std::swap(pool[size_t(i)], pool[size_t(d(gen))]);
    }
    std::copy(pool.begin(), pool.begin() + (stride - 1), row);
    row[stride - 1] = int32_t(self);
    std::sort(row, row + stride);
    counts[size_t(t)] = int32_t(stride);
  }
}


struct Shape {
  int64_t H, nope, rope, vd, L;
  const char* name;
};

MlaAttentionArgs prefill_args(const Shape& s, int64_t T, int64_t N, int64_t pos0) {
  return test::mla_shape(T, s.H, s.nope, s.rope, s.vd, s.L, N, pos0, 1.0f / std::sqrt(float(s.nope + s.rope)), false);
}

}  // namespace

TEST(CudaFastAttention, PrefillMatchesCpu) {
  REQUIRE_CUDA();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> gpu = make_cuda_backend();
  Dev dev(*gpu);
  // GLM-5 head dims with 8 heads (the CPU reference stays quick); a small fixture-like shape that
  // the kernel pads (qk 24, v 16 -> 64).
  for (const Shape& s : {Shape{8, 192, 64, 256, 512, "glm5 dims"}, Shape{4, 64, 32, 128, 128, "d 128"},
                         Shape{4, 16, 8, 16, 64, "small dims"}}) {
    const int64_t qw = s.nope + s.rope, kvw = s.L + s.rope, hw = s.nope + s.vd, N = 560;
    // kv_b entries scaled so k_nope and v come out O(1) (like the unit-scale rope part).
    test::HostWeight kvb = test::make_weight(DType::BF16, s.H * hw, s.L, 71, 1.7f / std::sqrt(float(s.L)));
    Weight gkvb = gpu->upload_weight(kvb.w);
    const std::vector<float> kv = randv(size_t(N * kvw), 72);
    float* gkv = dev.up(kv);
    for (int64_t T : {N, int64_t(333)})
      for (bool dsa : {false, true}) {
        const int64_t pos0 = N - T, stride = 192;
        const std::vector<float> q = randv(size_t(T * s.H * qw), uint32_t(73 + T));
        std::vector<int32_t> keys, counts;
        if (dsa) make_selection(T, pos0, stride, uint32_t(74 + T), keys, counts);
        const MlaAttentionArgs base = prefill_args(s, T, N, pos0);
        std::vector<float> want(size_t(T * s.H * s.vd));
        MlaAttentionArgs c = base;
        c.q = q.data();
        c.kv = kv.data();
        c.kv_b = &kvb.w;
        c.out = want.data();
        if (dsa) c.selection = KeySelection{keys.data(), counts.data(), stride};
        cpu->mla_attention(c);

        MlaAttentionArgs g = base;
        g.q = dev.up(q);
        g.kv = gkv;
        g.kv_b = &gkvb;
        g.out = dev.up(std::vector<float>(want.size(), 0.0f));
        if (dsa) g.selection = KeySelection{dev.up_i(keys), dev.up_i(counts), stride};
        // The two fast kernels (wgmma, mma.sync), then the exact one.
        double err[3] = {0, 0, 0};
        const CudaGemmMode modes[3] = {CudaGemmMode::Bf16, CudaGemmMode::Bf16, CudaGemmMode::Split};
        const bool wgmma[3] = {true, false, true};
        const char* kernels[3] = {"bf16 wgmma", "bf16 one pass", "tensor cores"};
        std::vector<float> got[3];
        for (int m = 0; m < 3; ++m) {
          cuda_set_gemm_mode(*gpu, modes[m]);
          cuda_set_prefill_wgmma(*gpu, wgmma[m]);
          gpu->fill(g.out, NAN, int64_t(want.size()));
          gpu->mla_attention(g);
          EXPECT_EQ(cuda_last_prefill_attention(*gpu), kernels[m]) << s.name;
          got[m] = dev.down(g.out, want.size());
          err[m] = nmse(got[m], want);
        }
        cuda_set_gemm_mode(*gpu, CudaGemmMode::Split);
        cuda_set_prefill_wgmma(*gpu, true);
        std::printf("  %-10s T %3lld pos0 %3lld %-9s NMSE fast (bf16) wgmma %.3g, mma.sync %.3g, exact (split) %.3g\n",
                    s.name, (long long)T, (long long)pos0, dsa ? "DSA" : "causal", err[0], err[1], err[2]);
        for (int m = 0; m < 2; ++m) {
          EXPECT_LT(err[m], 1e-4) << kernels[m] << " " << s.name << " T " << T << " dsa " << dsa;
          // The fast path really ran: its bf16 rounding shows, far above the split kernel's ~1e-10.
          EXPECT_GT(err[m], 1e-9) << kernels[m] << " " << s.name << " T " << T << " dsa " << dsa;
          EXPECT_NE(got[m], got[2]);
        }
        EXPECT_LT(err[2], 1e-8) << s.name << " T " << T << " dsa " << dsa;
      }
  }
}

// Times the fast (wgmma, mma.sync) and the exact prefill attention at GLM-5 shapes (H 64, qk 256, v 256, T = N =
// 4096, pos0 0), causal and with a DSA selection of 2048 keys for rows >= 2048. Measures, checks
// only that the fast path ran; skipped unless VIREO_TIME_ATTN=1.
TEST(CudaFastAttention, TimingGlm5) {
  REQUIRE_CUDA();
  if (!std::getenv("VIREO_TIME_ATTN")) GTEST_SKIP() << "set VIREO_TIME_ATTN=1 to run";
  std::unique_ptr<Backend> gpu = make_cuda_backend();
  Dev dev(*gpu);
  const Shape s{64, 192, 64, 256, 512, "glm5"};
  const int64_t T = 4096, N = T, qw = s.nope + s.rope, kvw = s.L + s.rope, hw = s.nope + s.vd, stride = 2048;
  test::HostWeight kvb = test::make_weight(DType::BF16, s.H * hw, s.L, 81, 1.7f / std::sqrt(float(s.L)));
  Weight gkvb = gpu->upload_weight(kvb.w);
  MlaAttentionArgs g = prefill_args(s, T, N, 0);
  g.q = dev.up(randv(size_t(T * s.H * qw), 82));
  g.kv = dev.up(randv(size_t(N * kvw), 83));
  g.kv_b = &gkvb;
  g.out = dev.up(std::vector<float>(size_t(T * s.H * s.vd), 0.0f));
  std::vector<int32_t> keys, counts;
  make_selection(T, 0, stride, 84, keys, counts);
  const KeySelection sel{dev.up_i(keys), dev.up_i(counts), stride};
  // FLOPs of the attention counting every causal key (DSA rows attend fewer; same count, as the
  // profile does): 2 T^2 / 2 H (qw + vd) x 2.
  const double flops = 2.0 * double(T) * double(T + 1) / 2.0 * double(s.H) * double(qw + s.vd);
  struct Kernel { CudaGemmMode mode; bool wgmma; const char* name; };
  for (bool dsa : {false, true})
    for (const Kernel& k : {Kernel{CudaGemmMode::Bf16, true, "bf16 wgmma"},
                            Kernel{CudaGemmMode::Bf16, false, "bf16 one pass"},
                            Kernel{CudaGemmMode::Split, true, "tensor cores"}}) {
      const CudaGemmMode m = k.mode;
      cuda_set_gemm_mode(*gpu, m);
      cuda_set_prefill_wgmma(*gpu, k.wgmma);
      g.selection = dsa ? sel : KeySelection{};
      gpu->mla_attention(g);  // warm-up: scratch, kernel attributes, clocks
      gpu->mla_attention(g);
      cuda_synchronize(*gpu);
      const int reps = m == CudaGemmMode::Bf16 ? 5 : 2;
      cuda_set_profile(*gpu, true);
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) gpu->mla_attention(g);
      cuda_synchronize(*gpu);
      const double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      const std::string kernel = cuda_last_prefill_attention(*gpu);
      std::printf("== %s, %s kernel, T %lld, H %lld, %d calls (attention FLOPs/call %.3g, causal keys)\n%s",
                  dsa ? "DSA 2048" : "causal", kernel.c_str(), (long long)T, (long long)s.H, reps, flops,
                  cuda_profile_report(*gpu, wall).c_str());
      cuda_set_profile(*gpu, false);
      EXPECT_EQ(kernel, k.name);
    }
  cuda_set_gemm_mode(*gpu, CudaGemmMode::Split);
  cuda_set_prefill_wgmma(*gpu, true);
}
#endif
