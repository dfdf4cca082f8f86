// Op parity: every Backend op on the CUDA backend against the CPU reference, on random inputs,
// by normalized mean squared error (NMSE = sum (got - want)^2 / sum want^2), in the spirit of
// llama.cpp's test-backend-ops. Both sides do f32 math on the same stored weights, so the only
// differences are summation order (and, for the tensor-core prefill GEMMs on BF16/FP8 weights and
// the tensor-core prefill attention, the ~2^-16 of the bf16 hi + lo split): thresholds are 1e-10
// (f32 kernels) / 1e-9 (split), far below any format's own rounding (bf16 alone: ~1e-5).
// Selections (indexer top-k, MoE expert ids) must be identical.
// Without a GPU (or without CUDA in the build) every test skips, saying so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <chrono>
#include <set>
#include <sstream>
#include <memory>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend_test_util.h"
#include "cuda_test_util.h"
#include "test_helpers.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

using namespace vireo;
using vireo::test::Dev;
using vireo::test::HostWeight;
using vireo::test::make_weight;
using vireo::test::cpu_mla_attention;
using vireo::test::mla_shape;
using vireo::test::nmse;
using vireo::test::randv;

namespace {



struct Pair {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
#ifdef VIREO_HAVE_CUDA
  std::unique_ptr<Backend> gpu = make_cuda_backend();
#else
  std::unique_ptr<Backend> gpu;
#endif
  Dev c{*cpu}, g{*gpu};
};

const char* dt_name(DType d) { return dtype_name(d); }

}  // namespace

TEST(CudaOps, MatmulAllDtypesAndShapes) {
  REQUIRE_CUDA();
  Pair p;
  struct Shape { int64_t out, in; };
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3})
    // 4098 x 512 and x 1152: one token runs two rows per warp (large matrices; FP8 by 4-byte
    // words, 1152 = 9 words a lane: one unrolled pass and a tail), 300 x 520 the fallback.
    // 200 x 400: rows ending in a 16-element piece of a 128-element FP8 scale block. 16, 32 and 7
    // rows of 512, 256, 384 (routers): BF16 and F32 with more than 8 tokens on CUDA cores, a warp
    // per 4 or 2 tokens (70: a partial last warp). 256 x 6144: 8 tokens' x is 192 KB, the
    // largest copy in shared memory (several tokens), 3 tokens' 72 KB; 128 x 8192: 8 tokens' x
    // (256 KB) in two groups, FP8. 6144 x 512: one token's 3072 row pairs spread over the SMs
    // (more blocks than SMs; BF16 and FP8 with x in shared memory: one block of 32 warps an SM),
    // against L1's blocks in order; 12000 x 512: 6000 pairs, more than 132 SMs' blocks of 32 warps
    // hold at once (blocks of 16 spread).
    for (Shape s : {Shape{300, 520}, Shape{256, 1024}, Shape{1000, 384}, Shape{4098, 512}, Shape{4098, 1152},
                    Shape{200, 400}, Shape{16, 512}, Shape{32, 256}, Shape{7, 384}, Shape{256, 6144}, Shape{128, 8192},
                    Shape{6144, 512}, Shape{12000, 512}})
      for (int64_t T : {1, 3, 8, 9, 70}) {
        HostWeight hw = make_weight(dt, s.out, s.in, uint32_t(s.out * 7 + T));
        auto x = randv(size_t(T * s.in), uint32_t(T * 13 + s.in));
        std::vector<float> want(size_t(T * s.out));
        cpu_matmul(x.data(), T, hw.w, want.data(), ThreadPool::global());
        Weight gw = p.gpu->upload_weight(hw.w);
        float* gx = p.g.up(x);
        float* gy = p.g.zeros(want.size());
        p.gpu->matmul(gx, T, gw, gy);
        const std::vector<float> got = p.g.down(gy, want.size());
        const double e = nmse(got, want);
        EXPECT_LT(e, 1e-9) << dt_name(dt) << " out " << s.out << " in " << s.in << " T " << T;
#ifdef VIREO_HAVE_CUDA
        // x through L1 instead of shared memory: the same sums in the same order, the same bits.
        cuda_set_gemv_x_shared(*p.gpu, false);
        float* gy_l1 = p.g.zeros(want.size());
        p.gpu->matmul(gx, T, gw, gy_l1);
        cuda_set_gemv_x_shared(*p.gpu, true);
        EXPECT_EQ(p.g.down(gy_l1, want.size()), got) << dt_name(dt) << " x via L1, out " << s.out << " T " << T;
#endif
        // Host-resident weights (routed experts) are uploaded on first use.
        float* gy2 = p.g.zeros(want.size());
        p.gpu->matmul(gx, T, hw.w, gy2);
        EXPECT_LT(nmse(p.g.down(gy2, want.size()), want), 1e-9) << dt_name(dt) << " host weight";
      }
}

#ifdef VIREO_HAVE_CUDA
TEST(CudaOps, MatmulGemmModes) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t out = 512, in = 768, T = 200;
  for (DType dt : {DType::BF16, DType::F8_E4M3}) {
    HostWeight hw = make_weight(dt, out, in, 3);
    auto x = randv(size_t(T * in), 4);
    std::vector<float> want(size_t(T * out));
    cpu_matmul(x.data(), T, hw.w, want.data(), ThreadPool::global());
    float* gx = p.g.up(x);
    float* gy = p.g.zeros(want.size());
    struct M { CudaGemmMode m; double tol; const char* name; };
    // The fast mode rounds x to bf16 (~1e-5); fast-fp8 rounds it to e4m3 per 128-block for FP8
    // weights (DeepSeek's act_quant, ~5e-4: test_cuda_fp8_fast.cpp).
    const double fp8_tol = dt == DType::F8_E4M3 ? 2e-3 : 1e-4;
    for (M m : {M{CudaGemmMode::Split, 1e-9, "split"}, M{CudaGemmMode::Simt, 1e-10, "simt"},
                M{CudaGemmMode::Bf16, 1e-4, "bf16"}, M{CudaGemmMode::Fp8, fp8_tol, "fp8"}}) {
      cuda_set_gemm_mode(*p.gpu, m.m);
      p.gpu->fill(gy, NAN, int64_t(want.size()));  // poison: every output must be written
      p.gpu->matmul(gx, T, hw.w, gy);
      const double e = nmse(p.g.down(gy, want.size()), want);
      EXPECT_LT(e, m.tol) << dt_name(dt) << " " << m.name;
      std::printf("  %-8s gemm mode %-5s NMSE %.3g\n", dt_name(dt), m.name, e);
    }
    cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
  }
}

// The fast modes' BF16 products of 2-8 rows on cuBLASLt (cuda_set_bf16_lt_decode_rows): x rounded
// to bf16 as the fast modes' prefill, the GEMV's f32 math below the row bound and in exact mode.
TEST(CudaOps, MatmulBf16FastDecodeOnLt) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t out = 4100, in = 768;
  HostWeight hw = make_weight(DType::BF16, out, in, 31);
  const Weight gw = p.gpu->upload_weight(hw.w);
  for (int64_t T : {2, 5, 8}) {
    auto x = randv(size_t(T * in), 32 + uint32_t(T));
    std::vector<float> want(size_t(T * out));
    cpu_matmul(x.data(), T, hw.w, want.data(), ThreadPool::global());
    float* gx = p.g.up(x);
    float* gy = p.g.zeros(want.size());
    struct Case {
      CudaGemmMode mode;
      int64_t rows;
      const char* path;
      double tol;
    };
    for (Case c : {Case{CudaGemmMode::Bf16, 4096, " lt T=", 1e-4}, Case{CudaGemmMode::Fp8, 4100, " lt T=", 1e-4},
                   Case{CudaGemmMode::Bf16, 4101, " gemv T=", 1e-10}, Case{CudaGemmMode::Split, 1, " gemv T=", 1e-10},
                   Case{CudaGemmMode::Bf16, 0, " gemv T=", 1e-10}}) {
      cuda_set_gemm_mode(*p.gpu, c.mode);
      cuda_set_bf16_lt_decode_rows(*p.gpu, c.rows);
      p.gpu->fill(gy, NAN, int64_t(want.size()));  // poison: every output must be written
      cuda_set_profile(*p.gpu, true);
      p.gpu->matmul(gx, T, gw, gy);
      const std::string report = cuda_profile_report(*p.gpu, 1.0);
      cuda_set_profile(*p.gpu, false);
      const double e = nmse(p.g.down(gy, want.size()), want);
      EXPECT_LT(e, c.tol) << "T " << T << " rows " << c.rows << c.path;
      EXPECT_NE(report.find(c.path), std::string::npos) << "T " << T << " rows " << c.rows << "\n" << report;
      if (c.tol > 1e-10) {
        EXPECT_GT(e, 1e-12) << "T " << T << ": x not rounded to bf16?";
      }
    }
  }
  cuda_set_bf16_lt_decode_rows(*p.gpu, 0);
  cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
}

// FP8 on tensor cores dequantizes the weight into bf16 hi/lo scratch in row chunks (256 MiB by
// default; 1 MiB here): 600 x 1024 takes chunks of 256, 256 and 88 rows, each written at its
// column offset of y.
TEST(CudaOps, MatmulFp8TensorCoresChunked) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t out = 600, in = 1024, T = 33;
  HostWeight hw = make_weight(DType::F8_E4M3, out, in, 5);
  auto x = randv(size_t(T * in), 6);
  std::vector<float> want(size_t(T * out));
  cpu_matmul(x.data(), T, hw.w, want.data(), ThreadPool::global());
  float* gy = p.g.zeros(want.size());
  p.gpu->fill(gy, NAN, int64_t(want.size()));
  cuda_set_fp8_chunk_bytes(*p.gpu, size_t(1) << 20);
  p.gpu->matmul(p.g.up(x), T, p.gpu->upload_weight(hw.w), gy);
  cuda_set_fp8_chunk_bytes(*p.gpu, size_t(256) << 20);
  const double e = nmse(p.g.down(gy, want.size()), want);
  EXPECT_LT(e, 1e-9);
  std::printf("  fp8 %lldx%lld T %lld (three chunks) NMSE %.3g\n", (long long)out, (long long)in, (long long)T, e);
}
#endif

// RMS norms of decode steps (up to 8 rows: each row over a cluster of blocks on CUDA) and longer
// ones (a block a row), with and without the residual add, at widths around the cluster's slices
// (8 x 256 threads x 4) and GLM-5's (2048, 6144): against the CPU, every element written (output
// poisoned), h updated, and add_rms_norm the same bits as add then rms_norm.
TEST(CudaOps, RmsNormDecodeRowsAndAdd) {
  REQUIRE_CUDA();
  Pair p;
  for (int64_t n : {int64_t(7), int64_t(100), int64_t(2048), int64_t(6144), int64_t(8192), int64_t(8200)})
    for (int64_t T : {int64_t(1), int64_t(3), int64_t(8), int64_t(9)}) {
      const int64_t xs = n + 5, ys = n + 3;
      auto x = randv(size_t(T * xs), uint32_t(7 + n + T)), w = randv(size_t(n), uint32_t(8 + n));
      auto h = randv(size_t(T * n), uint32_t(9 + n + T)), d = randv(size_t(T * n), uint32_t(10 + n + T));
      std::vector<float> want(size_t(T * ys), 0.0f);
      p.cpu->rms_norm(x.data(), xs, T, n, w.data(), 1e-6f, want.data(), ys);
      float* gw = p.g.up(w);
      float* gy = p.g.zeros(want.size());
      p.gpu->fill(gy, NAN, int64_t(want.size()));
      p.gpu->rms_norm(p.g.up(x), xs, T, n, gw, 1e-6f, gy, ys);
      std::vector<float> got = p.g.down(gy, want.size());
      for (int64_t t = 0; t < T; ++t)  // the gaps between rows are not the op's to write
        for (int64_t i = n; i < ys; ++i) got[size_t(t * ys + i)] = 0.0f;
      EXPECT_LT(nmse(got, want), 1e-12) << "rms_norm n " << n << " T " << T;

      std::vector<float> hw = h, yw(size_t(T * n));
      p.cpu->add_rms_norm(hw.data(), d.data(), T, n, w.data(), 1e-6f, yw.data());
      float* gh = p.g.up(h);
      float* gd = p.g.up(d);
      float* gy2 = p.g.zeros(yw.size());
      p.gpu->fill(gy2, NAN, int64_t(yw.size()));
      p.gpu->add_rms_norm(gh, gd, T, n, gw, 1e-6f, gy2);
      const std::vector<float> y_fused = p.g.down(gy2, yw.size());
      EXPECT_LT(nmse(y_fused, yw), 1e-12) << "add_rms_norm n " << n << " T " << T;
      EXPECT_EQ(p.g.down(gh, hw.size()), hw) << "add_rms_norm's residual, n " << n << " T " << T;
      float* gh2 = p.g.up(h);
      p.gpu->add(gh2, gd, T * n);
      p.gpu->rms_norm(gh2, n, T, n, gw, 1e-6f, gy2, n);
      EXPECT_EQ(p.g.down(gy2, yw.size()), y_fused) << "add then rms_norm, n " << n << " T " << T;
    }
}

TEST(CudaOps, NormsRopeElementwise) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t T = 5, n = 700, stride = 777;
  auto x = randv(size_t(T * stride), 1), w = randv(size_t(n), 2), b = randv(size_t(n), 3);
  {  // rms_norm with row strides
    std::vector<float> want(size_t(T * stride), 0.0f);
    p.cpu->rms_norm(x.data(), stride, T, n, w.data(), 1e-6f, want.data(), stride);
    float* gy = p.g.zeros(want.size());
    p.gpu->rms_norm(p.g.up(x), stride, T, n, p.g.up(w), 1e-6f, gy, stride);
    EXPECT_LT(nmse(p.g.down(gy, want.size()), want), 1e-12);
  }
  {  // layer_norm
    std::vector<float> want(size_t(T * n));
    p.cpu->layer_norm(x.data(), T, n, w.data(), b.data(), 1e-6f, want.data());
    float* gy = p.g.zeros(want.size());
    p.gpu->layer_norm(p.g.up(x), T, n, p.g.up(w), p.g.up(b), 1e-6f, gy);
    EXPECT_LT(nmse(p.g.down(gy, want.size()), want), 1e-12);
  }
  // rope in place: a warp per (token, head) up to 32 pairs (T * H = 3 T items: the last block
  // partly empty), a block per item beyond.
  for (int64_t width : {32, 64, 128})
  for (RopeKind kind : {RopeKind::Interleaved, RopeKind::HalfSplit}) {
    const int64_t H = 3, off = 8, hs = off + width + 4, ts = H * hs;
    auto v = randv(size_t(T * ts), 5), cs = randv(size_t(T * width), 6);
    std::vector<float> want = v;
    p.cpu->rope(want.data(), T, H, ts, hs, off, width, cs.data(), kind);
    float* gv = p.g.up(v);
    p.gpu->rope(gv, T, H, ts, hs, off, width, p.g.up(cs), kind);
    EXPECT_LT(nmse(p.g.down(gv, want.size()), want), 1e-12) << "width " << width;
  }
  {  // add, scale, swiglu, fill, copy_rows
    auto a = randv(1000, 7), c = randv(1000, 8);
    std::vector<float> want = a;
    p.cpu->add(want.data(), c.data(), 1000);
    p.cpu->scale(want.data(), 0.37f, 1000);
    p.cpu->swiglu(want.data(), c.data(), want.data(), 1000);
    float* ga = p.g.up(a);
    float* gc = p.g.up(c);
    p.gpu->add(ga, gc, 1000);
    p.gpu->scale(ga, 0.37f, 1000);
    p.gpu->swiglu(ga, gc, ga, 1000);
    EXPECT_LT(nmse(p.g.down(ga, 1000), want), 1e-12);
    p.gpu->fill(ga, 2.5f, 1000);
    for (float f : p.g.down(ga, 1000)) ASSERT_EQ(f, 2.5f);
    // add and fill move float4s where both ends allow: 16-byte aligned or not, lengths not a
    // multiple of 4, nothing outside [off, off + m) touched.
    for (int64_t off : {0, 1, 3}) {
      const int64_t m = 997 - off;
      std::vector<float> want_add = a;
      p.cpu->add(want_add.data() + off, c.data() + off, m);
      float* g1 = p.g.up(a);
      p.gpu->add(g1 + off, p.g.up(c) + off, m);
      EXPECT_EQ(p.g.down(g1, 1000), want_add) << "add at offset " << off;
      std::vector<float> want_fill = a;
      std::fill(want_fill.begin() + off, want_fill.begin() + off + m, -1.5f);
      float* g2 = p.g.up(a);
      p.gpu->fill(g2 + off, -1.5f, m);
      EXPECT_EQ(p.g.down(g2, 1000), want_fill) << "fill at offset " << off;
    }
    std::vector<float> rows(size_t(4 * 50), 0.0f);
    p.cpu->copy_rows(rows.data(), 50, c.data() + 3, 100, 4, 30);
    float* gr = p.g.zeros(rows.size());
    p.gpu->copy_rows(gr, 50, gc + 3, 100, 4, 30);
    EXPECT_EQ(p.g.down(gr, rows.size()), rows);
  }
}

#ifdef VIREO_HAVE_CUDA
// The step's lookup and first norm in one launch (decode rows: a cluster a row) give the bits of
// the two ops in turn, on every table dtype; past the cluster's rows (T > 8) the two ops run.
TEST(CudaOps, EmbedRmsNormSameBitsAsApart) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t n = 6144;  // GLM-5's hidden size
  auto w = randv(size_t(n), 21);
  for (DType dt : {DType::BF16, DType::F8_E4M3, DType::F32}) {
    HostWeight table = make_weight(dt, 40, n, 22);
    const Weight gt = p.gpu->upload_weight(table.w);
    for (int64_t T : {1, 3, 8, 9}) {
      std::vector<int32_t> ids;
      for (int64_t t = 0; t < T; ++t) ids.push_back(int32_t((t * 17 + 5) % 40));
      int32_t* gids = p.g.up_i(ids);
      float* gw = p.g.up(w);
      float* h_apart = p.g.zeros(size_t(T * n));
      float* y_apart = p.g.zeros(size_t(T * n));
      p.gpu->embed(gt, gids, T, h_apart);
      p.gpu->rms_norm(h_apart, n, T, n, gw, 1e-5f, y_apart, n);
      std::vector<float> nan(size_t(T * n), NAN);  // poison: every output must be written
      float* h = p.g.up(nan);
      float* y = p.g.up(nan);
      cuda_set_profile(*p.gpu, true);
      p.gpu->embed_rms_norm(gt, gids, T, gw, 1e-5f, h, y);
      const std::string report = cuda_profile_report(*p.gpu, 1.0);
      cuda_set_profile(*p.gpu, false);
      EXPECT_EQ(p.g.down(h, size_t(T * n)), p.g.down(h_apart, size_t(T * n))) << dt_name(dt) << " T " << T;
      EXPECT_EQ(p.g.down(y, size_t(T * n)), p.g.down(y_apart, size_t(T * n))) << dt_name(dt) << " T " << T;
      EXPECT_EQ(report.find("embed_rms_norm") != std::string::npos, T <= 8) << dt_name(dt) << " T " << T << "\n"
                                                                            << report;
      std::vector<float> want_h(size_t(T * n)), want_y(size_t(T * n));
      p.cpu->embed_rms_norm(table.w, ids.data(), T, w.data(), 1e-5f, want_h.data(), want_y.data());
      EXPECT_EQ(p.g.down(h, size_t(T * n)), want_h) << dt_name(dt) << " T " << T;  // the lookup is exact
      EXPECT_LT(nmse(p.g.down(y, size_t(T * n)), want_y), 1e-12) << dt_name(dt) << " T " << T;
    }
  }
}

#endif

TEST(CudaOps, EmbedGatherScatter) {
  REQUIRE_CUDA();
  Pair p;
  for (DType dt : {DType::BF16, DType::F8_E4M3, DType::F32}) {
    HostWeight table = make_weight(dt, 300, 256, 9);
    std::vector<int32_t> ids = {5, 0, 299, 17, 5};
    std::vector<float> want(ids.size() * 256);
    p.cpu->embed(table.w, ids.data(), int64_t(ids.size()), want.data());
    float* gy = p.g.zeros(want.size());
    p.gpu->embed(p.gpu->upload_weight(table.w), p.g.up_i(ids), int64_t(ids.size()), gy);
    EXPECT_EQ(p.g.down(gy, want.size()), want) << dt_name(dt);
  }
  const int64_t n = 300, rows = 10, m = 6;
  auto x = randv(size_t(rows * n), 10), r = randv(size_t(m * n), 11), y = randv(size_t(rows * n), 12);
  std::vector<int32_t> index = {3, 9, 0, 3, 4, 7};  // a repeat: order of accumulation matters
  std::vector<float> s = {0.5f, -1.0f, 2.0f, 0.25f, 1.0f, 3.0f};
  std::vector<float> want_rows(size_t(m * n));
  p.cpu->gather_rows(x.data(), index.data(), m, n, want_rows.data());
  float* grows = p.g.zeros(want_rows.size());
  int32_t* gidx = p.g.up_i(index);
  p.gpu->gather_rows(p.g.up(x), gidx, m, n, grows);
  EXPECT_EQ(p.g.down(grows, want_rows.size()), want_rows);
  std::vector<float> want_y = y;
  p.cpu->scatter_add_rows(want_y.data(), index.data(), s.data(), r.data(), m, n);
  float* gy = p.g.up(y);
  p.gpu->scatter_add_rows(gy, gidx, p.g.up(s), p.g.up(r), m, n);
  EXPECT_EQ(p.g.down(gy, want_y.size()), want_y);
  {  // strictly increasing rows (an expert's token list): the parallel path, still bit-identical
    const int64_t ny = 3000, mm = 700, nn = 1000;
    std::vector<int32_t> idx;
    for (int64_t i = 0; i < ny && int64_t(idx.size()) < mm; i += 1 + (i % 5 == 0)) idx.push_back(int32_t(i));
    const int64_t mi = int64_t(idx.size());
    auto rr = randv(size_t(mi * nn), 13), yy = randv(size_t(ny * nn), 14), ss = randv(size_t(mi), 15);
    std::vector<float> want = yy;
    p.cpu->scatter_add_rows(want.data(), idx.data(), ss.data(), rr.data(), mi, nn);
    float* gyy = p.g.up(yy);
    p.gpu->scatter_add_rows(gyy, p.g.up_i(idx), p.g.up(ss), p.g.up(rr), mi, nn);
    EXPECT_EQ(p.g.down(gyy, want.size()), want);
    // Many rows with repeats: checked on the device, then accumulated in order.
    std::vector<int32_t> rep_idx(static_cast<size_t>(mi));
    for (int64_t i = 0; i < mi; ++i) rep_idx[size_t(i)] = int32_t((i * 37) % 50);
    std::vector<float> want2 = yy;
    p.cpu->scatter_add_rows(want2.data(), rep_idx.data(), ss.data(), rr.data(), mi, nn);
    float* gy2 = p.g.up(yy);
    p.gpu->scatter_add_rows(gy2, p.g.up_i(rep_idx), p.g.up(ss), p.g.up(rr), mi, nn);
    EXPECT_EQ(p.g.down(gy2, want2.size()), want2);
  }
}

namespace {
// Random sorted selections [T, stride] of causal keys, some rows with fewer than stride keys.
void random_selection(int64_t T, int64_t stride, int64_t pos0, uint32_t seed, std::vector<int32_t>& keys,
                      std::vector<int32_t>& counts) {
  std::mt19937 g(seed);
  keys.assign(size_t(T * stride), 0);
  counts.assign(size_t(T), 0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n_causal = pos0 + t + 1;
    std::vector<int32_t> all(static_cast<size_t>(n_causal));
    for (int64_t u = 0; u < n_causal; ++u) all[size_t(u)] = int32_t(u);
    std::shuffle(all.begin(), all.end(), g);
    const int64_t k = std::min<int64_t>(stride, t % 3 == 2 ? n_causal / 3 + 1 : n_causal);
    std::sort(all.begin(), all.begin() + k);
    std::copy(all.begin(), all.begin() + k, keys.begin() + t * stride);
    counts[size_t(t)] = int32_t(k);
  }
}

}  // namespace

TEST(CudaOps, MlaAttentionBothPathsWithAndWithoutSelection) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t H = 12, nope = 24, rope = 8, vd = 20, L = 64, N = 300;
  const int64_t qw = nope + rope, kvw = L + rope, hw = nope + vd;
  for (DType dt : {DType::BF16, DType::F8_E4M3, DType::F32}) {
    HostWeight kvb = make_weight(dt, H * hw, L, 21);
    Weight gkvb = p.gpu->upload_weight(kvb.w);
    auto kv = randv(size_t(N * kvw), 22);
    float* gkv = p.g.up(kv);
    for (bool absorbed : {true, false})
      for (bool selected : {false, true})
        for (int64_t T : {int64_t(1), int64_t(37)}) {
          const int64_t pos0 = N - T, stride = 100;
          auto q = randv(size_t(T * H * qw), uint32_t(23 + T));
          std::vector<int32_t> keys, counts;
          random_selection(T, stride, pos0, uint32_t(24 + T), keys, counts);
          MlaAttentionArgs a = mla_shape(T, H, nope, rope, vd, L, N, pos0, 0.17f, absorbed);
          std::vector<float> want(size_t(T * H * vd));
          MlaAttentionArgs c = a;
          c.q = q.data();
          c.kv = kv.data();
          c.kv_b = &kvb.w;
          c.out = want.data();
          if (selected) c.selection = KeySelection{keys.data(), counts.data(), stride};
          p.cpu->mla_attention(c);
          MlaAttentionArgs g = a;
          g.q = p.g.up(q);
          g.kv = gkv;
          g.kv_b = &gkvb;
          g.out = p.g.zeros(want.size());
          if (selected) g.selection = KeySelection{p.g.up_i(keys), p.g.up_i(counts), stride};
          p.gpu->mla_attention(g);
          const std::vector<float> got = p.g.down(g.out, want.size());
          const double e = nmse(got, want);
          // Reconstructed: tensor cores with the bf16 hi/lo split (kv_b through the split GEMM too).
          EXPECT_LT(e, absorbed ? 1e-10 : 1e-9) << dt_name(dt) << (absorbed ? " absorbed" : " reconstructed")
                                                << (selected ? " selected" : " causal") << " T " << T;
#ifdef VIREO_HAVE_CUDA
          if (absorbed && T > 1) {  // one row per pass (the smallest pass budget): the same bits
            cuda_set_absorbed_pass_bytes(*p.gpu, 1);
            g.out = p.g.zeros(want.size());
            p.gpu->mla_attention(g);
            cuda_set_absorbed_pass_bytes(*p.gpu, 0);
            EXPECT_EQ(p.g.down(g.out, want.size()), got) << dt_name(dt) << (selected ? " selected" : " causal");
          }
#endif
        }
  }
}

// The launch forms of a one-token product (Backend::ProductLaunch: blocks that leave half an SM,
// and the early start that skips the wait) and the queries' RoPE inside the absorption launch
// change where and when the work runs, never its values: the same bits as the plain ops.
TEST(CudaOps, LaunchFormsAndFusedRopeChangeNoBits) {
  REQUIRE_CUDA();
  Pair p;
#ifdef VIREO_HAVE_CUDA
  cuda_set_absorb_ahead(true);  // (whatever VIREO_ABSORB_AHEAD says: the staged form is compared below)
#endif
  for (DType dt : {DType::F8_E4M3, DType::BF16}) {
    HostWeight w = make_weight(dt, 8192, 2048, 31);  // gemv_rows2's shape class (q_b, the indexer's queries)
    Weight gw = p.gpu->upload_weight(w.w);
    float* x = p.g.up(randv(2048, 32));
    float* y0 = p.g.zeros(8192);
    float* y1 = p.g.zeros(8192);
    float* y2 = p.g.zeros(8192);
    p.gpu->matmul(x, 1, gw, y0);
    p.gpu->matmul_launched(x, 1, gw, y1, Backend::ProductLaunch::HalfSm);
    p.gpu->matmul_launched(x, 1, gw, y2, Backend::ProductLaunch::Early);  // (the op before writes neither x nor y2)
    const std::vector<float> want = p.g.down(y0, 8192);
    EXPECT_EQ(p.g.down(y1, 8192), want) << dt_name(dt) << " half an SM";
    EXPECT_EQ(p.g.down(y2, 8192), want) << dt_name(dt) << " early";
  }
  // GLM-5's head shapes (fewer heads); L 512 takes the 16-byte absorption kernel, L 72 the other.
  struct Shape {
    int64_t nope, rope, L;
  };
  for (Shape sh : {Shape{192, 64, 512}, Shape{24, 8, 72}})
    for (DType dt : {DType::F8_E4M3, DType::BF16})
      for (RopeKind kind : {RopeKind::Interleaved, RopeKind::HalfSplit})
        for (int64_t T : {int64_t(1), int64_t(2)}) {
          const int64_t H = 6, vd = 40, N = 50, qw = sh.nope + sh.rope, kvw = sh.L + sh.rope;
          HostWeight kvb = make_weight(dt, H * (sh.nope + vd), sh.L, 33);
          Weight gkvb = p.gpu->upload_weight(kvb.w);
          const auto q = randv(size_t(T * H * qw), 34);
          const auto cs = randv(size_t(T * sh.rope), 35);
          MlaAttentionArgs a = mla_shape(T, H, sh.nope, sh.rope, vd, sh.L, N, N - T, 0.1f, true);
          a.kv = p.g.up(randv(size_t(N * kvw), 36));
          a.kv_b = &gkvb;
          float* gcs = p.g.up(cs);
          std::vector<float> q_after[2], out[2];
          for (int fused = 0; fused < 2; ++fused) {
            float* gq = p.g.up(q);
            a.q = gq;
            a.out = p.g.zeros(size_t(T * H * vd));
            if (fused) {
              p.gpu->mla_rope_absorb_queries(gq, gcs, kind, a);
            } else {
              p.gpu->rope(gq, T, H, H * qw, qw, sh.nope, sh.rope, gcs, kind);
              p.gpu->mla_absorb_queries(a);
            }
            p.gpu->mla_attention(a);
            q_after[fused] = p.g.down(gq, q.size());
            out[fused] = p.g.down(a.out, size_t(T * H * vd));
          }
          const std::string what = std::string(dt_name(dt)) + " L " + std::to_string(sh.L) +
                                   (kind == RopeKind::Interleaved ? " interleaved" : " half") + " T " +
                                   std::to_string(T);
          EXPECT_NE(q_after[0], q) << what << ": the rope parts were not rotated";
          EXPECT_EQ(q_after[1], q_after[0]) << what;
          EXPECT_EQ(out[1], out[0]) << what;
#ifdef VIREO_HAVE_CUDA
          // FP8 W_UK staged before the wait (the default, checked taken) or read after it.
          if (dt == DType::F8_E4M3 && sh.L == 512) {
            EXPECT_GT(cuda_absorb_staged_launches(), 0) << what << ": the staged absorption never ran";
            cuda_set_absorb_ahead(false);
            const int64_t staged = cuda_absorb_staged_launches();
            float* gq = p.g.up(q);
            a.q = gq;
            a.out = p.g.zeros(size_t(T * H * vd));
            p.gpu->rope(gq, T, H, H * qw, qw, sh.nope, sh.rope, gcs, kind);
            p.gpu->mla_absorb_queries(a);
            p.gpu->mla_attention(a);
            cuda_set_absorb_ahead(true);
            EXPECT_EQ(cuda_absorb_staged_launches(), staged) << what << ": the switch did not turn it off";
            EXPECT_EQ(p.g.down(a.out, size_t(T * H * vd)), out[0]) << what << " W_UK read after the wait";
          }
#endif
        }
}

#ifdef VIREO_HAVE_CUDA
// The prefill attention kernels at GLM-5 head shapes (qk 192 + 64, v 256, kv_lora 512; fewer
// heads): a prompt from an empty cache and a chunk after cached keys, causal and under a DSA
// selection (random keys, and contiguous runs that leave whole key tiles unselected), on tensor
// cores (split) and on f32 CUDA cores (simt). Output poisoned first: every element is written.
TEST(CudaOps, PrefillAttentionGlmShapes) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t H = 3, nope = 192, rope = 64, vd = 256, L = 512, N = 520;
  const int64_t qw = nope + rope, kvw = L + rope, hw = nope + vd;
  HostWeight kvb = make_weight(DType::BF16, H * hw, L, 51);
  Weight gkvb = p.gpu->upload_weight(kvb.w);
  auto kv = randv(size_t(N * kvw), 52);
  float* gkv = p.g.up(kv);
  for (int64_t T : {N, int64_t(200)})
    for (int sel = 0; sel < 3; ++sel) {
      const int64_t pos0 = N - T, stride = 160;
      auto q = randv(size_t(T * H * qw), uint32_t(53 + T));
      std::vector<int32_t> keys, counts;
      if (sel == 1) {
        random_selection(T, stride, pos0, uint32_t(54 + T), keys, counts);
      } else if (sel == 2) {  // the first 40 keys and the last (up to) 120 before each query
        keys.assign(size_t(T * stride), 0);
        counts.assign(size_t(T), 0);
        for (int64_t t = 0; t < T; ++t) {
          const int64_t n = pos0 + t + 1;
          int32_t c = 0;
          for (int64_t u = 0; u < n && c < stride; ++u)
            if (u < 40 || u >= n - 120) keys[size_t(t * stride + c++)] = int32_t(u);
          counts[size_t(t)] = c;
        }
      }
      MlaAttentionArgs a = mla_shape(T, H, nope, rope, vd, L, N, pos0, 1.0f / std::sqrt(float(qw)), false);
      const KeySelection host_sel{keys.data(), counts.data(), stride};
      const std::vector<float> want = cpu_mla_attention(*p.cpu, a, q, kv, kvb.w, sel ? &host_sel : nullptr);
      MlaAttentionArgs g = a;
      g.q = p.g.up(q);
      g.kv = gkv;
      g.kv_b = &gkvb;
      g.out = p.g.zeros(want.size());
      if (sel) g.selection = KeySelection{p.g.up_i(keys), p.g.up_i(counts), stride};
      struct M { CudaGemmMode m; double tol; const char* name; };
      for (M m : {M{CudaGemmMode::Split, 1e-9, "tensor cores"}, M{CudaGemmMode::Simt, 1e-10, "f32"}}) {
        cuda_set_gemm_mode(*p.gpu, m.m);
        p.gpu->fill(g.out, NAN, int64_t(want.size()));
        p.gpu->mla_attention(g);
        const double e = nmse(p.g.down(g.out, want.size()), want);
        EXPECT_LT(e, m.tol) << m.name << " T " << T << " selection " << sel;
        std::printf("  prefill attention %-12s T %4lld selection %d NMSE %.3g\n", m.name, (long long)T, sel, e);
      }
      cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
    }
}
#endif

namespace {

// The indexer's selection of T queries over N keys: counts [T] and selected [T, topk].
struct Selection {
  std::vector<int32_t> selected, counts;
};

IndexerArgs indexer_shape(int64_t T, int64_t nI, int64_t d, int64_t N, int64_t pos0, int64_t topk) {
  IndexerArgs a;
  a.T = T;
  a.n_heads = nI;
  a.head_dim = d;
  a.n_keys = N;
  a.pos0 = pos0;
  a.topk = topk;
  a.scale = 1.0f / std::sqrt(float(d));
  return a;
}

Selection cpu_select(Pair& p, IndexerArgs a, const std::vector<float>& q, const std::vector<float>& w,
                     const std::vector<float>& keys) {
  Selection s{std::vector<int32_t>(size_t(a.T * a.topk), -1), std::vector<int32_t>(size_t(a.T), -1)};
  a.q = q.data();
  a.weights = w.data();
  a.keys = keys.data();
  a.selected = s.selected.data();
  a.counts = s.counts.data();
  p.cpu->indexer_select(a);
  return s;
}

// `a` with its inputs on the device.
Selection gpu_select(Pair& p, IndexerArgs a) {
  a.selected = p.g.up_i(std::vector<int32_t>(size_t(a.T * a.topk), -1));
  a.counts = p.g.zeros_i(size_t(a.T));
  p.gpu->indexer_select(a);
  return {p.g.down_i(a.selected, size_t(a.T * a.topk)), p.g.down_i(a.counts, size_t(a.T))};
}

void expect_same_selection(const Selection& want, const Selection& got, int64_t topk, const std::string& what) {
  ASSERT_EQ(got.counts, want.counts) << what;
  for (size_t t = 0; t < want.counts.size(); ++t)
    for (int64_t i = 0; i < want.counts[t]; ++i)
      ASSERT_EQ(got.selected[t * size_t(topk) + size_t(i)], want.selected[t * size_t(topk) + size_t(i)])
          << what << " t " << t << " i " << i;
}

}  // namespace

TEST(CudaOps, IndexerSelectIsIdentical) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t nI = 4, d = 32, N = 600, topk = 64;
  for (int64_t T : {int64_t(1), int64_t(9), int64_t(600)}) {
    const int64_t pos0 = N - T;
    auto q = randv(size_t(T * nI * d), uint32_t(31 + T)), w = randv(size_t(T * nI), uint32_t(32 + T), 0.5f);
    auto keys = randv(size_t(N * d), 33);
    // Ties: repeated keys give equal scores; the lower position must win.
    for (int64_t u = 0; u + 1 < N; u += 7)
      std::copy(keys.begin() + u * d, keys.begin() + (u + 1) * d, keys.begin() + (u + 1) * d);
    IndexerArgs a = indexer_shape(T, nI, d, N, pos0, topk);
    IndexerArgs g = a;
    g.q = p.g.up(q);
    g.weights = p.g.up(w);
    g.keys = p.g.up(keys);
    expect_same_selection(cpu_select(p, a, q, w, keys), gpu_select(p, g), topk, "T " + std::to_string(T));
    // The head weights' scale folded into the scores (a negative one reverses the ranking).
    a.weight_scale = g.weight_scale = -0.75f;
    expect_same_selection(cpu_select(p, a, q, w, keys), gpu_select(p, g), topk, "weight scale, T " + std::to_string(T));
  }
}

TEST(CudaOps, MoeRouteIsIdentical) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t T = 33, D = 256;
  struct Cfg { int E, G, topk_group, K; bool norm, ties; };
  // ties: x = 0 and bias in steps of 0.01 with repeats, so experts and groups tie on their scores.
  for (Cfg cfg : {Cfg{64, 8, 4, 6, true, false}, Cfg{16, 1, 1, 4, false, false}, Cfg{256, 1, 1, 8, true, false},
                  Cfg{256, 8, 4, 8, true, false}, Cfg{64, 8, 4, 6, true, true}, Cfg{256, 1, 1, 8, true, true},
                  Cfg{40, 40, 37, 33, false, false}}) {
    HostWeight gate = make_weight(DType::BF16, cfg.E, D, 41);
    auto x = randv(size_t(T * D), 42, 3.0f), bias = randv(size_t(cfg.E), 43, 0.05f);
    if (cfg.ties) {
      std::fill(x.begin(), x.end(), 0.0f);
      for (int e = 0; e < cfg.E; ++e) bias[size_t(e)] = 0.01f * float((e * 7) % 5);
    }
    RouterArgs a;
    a.n_experts = cfg.E;
    a.n_group = cfg.G;
    a.topk_group = cfg.topk_group;
    a.top_k = cfg.K;
    a.norm_topk_prob = cfg.norm;
    a.routed_scaling_factor = 2.5f;
    std::vector<int32_t> ids(size_t(T * cfg.K));
    std::vector<float> wts(ids.size());
    RouterArgs c = a;
    c.gate = &gate.w;
    c.bias = bias.data();
    p.cpu->moe_route(x.data(), T, c, ids.data(), wts.data());
    Weight ggate = p.gpu->upload_weight(gate.w);
    RouterArgs g = a;
    g.gate = &ggate;
    g.bias = p.g.up(bias);
    int32_t* gids = p.g.zeros_i(ids.size());
    float* gw = p.g.zeros(wts.size());
    p.gpu->moe_route(p.g.up(x), T, g, gids, gw);
    EXPECT_EQ(p.g.down_i(gids, ids.size()), ids) << "E " << cfg.E;
    EXPECT_LT(nmse(p.g.down(gw, wts.size()), wts), 1e-11) << "E " << cfg.E;  // expf vs std::exp: an ulp
  }
}

TEST(CudaOps, MoeGroupIsIdentical) {
  REQUIRE_CUDA();
  Pair p;
  struct Cfg { int64_t N; int K, E; bool skewed; };
  // Decode and prefill shapes, heavy duplication (few experts, or most slots on a handful), and
  // expert counts large enough that the kernel runs with fewer warps (shared-memory bound).
  for (Cfg cfg : {Cfg{1, 8, 256, false}, Cfg{33, 6, 64, false}, Cfg{100, 4, 3, false}, Cfg{4096, 8, 256, true},
                  Cfg{4096, 8, 256, false}, Cfg{1000, 8, 2048, true}, Cfg{777, 3, 4000, false}, Cfg{64, 1, 1, false},
                  Cfg{31, 2, 5, true}}) {
    std::mt19937 rng(uint32_t(cfg.N * 131 + cfg.E));
    std::uniform_int_distribution<int> pick(0, cfg.E - 1), few(0, std::min(cfg.E, 4) - 1), coin(0, 3);
    std::vector<int32_t> ids(size_t(cfg.N * cfg.K));
    for (int32_t& v : ids) v = cfg.skewed && coin(rng) != 0 ? few(rng) : pick(rng);
    std::vector<float> w = randv(ids.size(), 77);
    std::vector<int32_t> off(size_t(cfg.E + 1)), tok(ids.size());
    std::vector<float> wt(ids.size());
    p.cpu->moe_group(ids.data(), w.data(), cfg.N, cfg.K, cfg.E, off.data(), tok.data(), wt.data());
    int32_t* goff = p.g.up_i(std::vector<int32_t>(off.size(), -1));
    int32_t* gtok = p.g.up_i(std::vector<int32_t>(tok.size(), -1));
    float* gwt = p.g.up(std::vector<float>(wt.size(), -1.0f));
    p.gpu->moe_group(p.g.up_i(ids), p.g.up(w), cfg.N, cfg.K, cfg.E, goff, gtok, gwt);
    EXPECT_EQ(p.g.down_i(goff, off.size()), off) << "N " << cfg.N << " K " << cfg.K << " E " << cfg.E;
    EXPECT_EQ(p.g.down_i(gtok, tok.size()), tok) << "N " << cfg.N << " K " << cfg.K << " E " << cfg.E;
    EXPECT_EQ(p.g.down(gwt, wt.size()), wt) << "N " << cfg.N << " K " << cfg.K << " E " << cfg.E;
  }
}

// Routed experts by id (the decode path): every dtype, vector-load shapes and odd shapes
// (scalar path), one token and several, experts repeated across tokens.
TEST(CudaOps, MoeExpertsMatchesCpu) {
  REQUIRE_CUDA();
  Pair p;
  struct Cfg { int64_t D, I, N; int K, E; };
  for (DType dt : {DType::BF16, DType::F8_E4M3, DType::F32})
    // 272 x 80: both products' rows end in a 16-element piece of an FP8 scale block.
    for (Cfg cfg : {Cfg{256, 128, 1, 4, 8}, Cfg{384, 256, 3, 8, 16}, Cfg{100, 36, 2, 3, 5}, Cfg{272, 80, 2, 3, 6}})
      for (int n_shared : {0, 1}) {
      std::vector<HostWeight> hw;
      ExpertBank cb, gb;
      cb.n_shared = gb.n_shared = n_shared;
      for (int e = 0; e < cfg.E + n_shared; ++e) {
        hw.push_back(make_weight(dt, cfg.I, cfg.D, uint32_t(500 + 3 * e)));
        hw.push_back(make_weight(dt, cfg.I, cfg.D, uint32_t(501 + 3 * e)));
        hw.push_back(make_weight(dt, cfg.D, cfg.I, uint32_t(502 + 3 * e)));
      }
      for (int e = 0; e < cfg.E + n_shared; ++e) {
        cb.gate.push_back(hw[size_t(3 * e)].w);
        cb.up.push_back(hw[size_t(3 * e + 1)].w);
        cb.down.push_back(hw[size_t(3 * e + 2)].w);
        gb.gate.push_back(p.gpu->upload_weight(cb.gate.back()));
        gb.up.push_back(p.gpu->upload_weight(cb.up.back()));
        gb.down.push_back(p.gpu->upload_weight(cb.down.back()));
      }
      std::mt19937 rng(uint32_t(cfg.D + cfg.N));
      std::vector<int32_t> ids;
      for (int64_t t = 0; t < cfg.N; ++t) {
        std::vector<int32_t> all(size_t(cfg.E));
        for (int e = 0; e < cfg.E; ++e) all[size_t(e)] = e;
        std::shuffle(all.begin(), all.end(), rng);
        std::sort(all.begin(), all.begin() + cfg.K);
        ids.insert(ids.end(), all.begin(), all.begin() + cfg.K);
      }
      auto x = randv(size_t(cfg.N * cfg.D), 61, 2.0f), w = randv(ids.size(), 62);
      std::vector<float> want(size_t(cfg.N * cfg.D));
      p.cpu->moe_experts(x.data(), cfg.N, ids.data(), w.data(), cfg.K, cb, want.data());
      float* gx = p.g.up(x);
      int32_t* gids = p.g.up_i(ids);
      float* gw = p.g.up(w);
      float* gout = p.g.up(std::vector<float>(want.size(), NAN));
      p.gpu->moe_experts(gx, cfg.N, gids, gw, cfg.K, gb, gout);
      const std::vector<float> got = p.g.down(gout, want.size());
      EXPECT_LT(nmse(got, want), 1e-10) << dt_name(dt) << " D " << cfg.D << " N " << cfg.N << " shared " << n_shared;
      // The shared experts' gate | up queued ahead (the decode step's branch beside the router):
      // the same products in two launches, so the same bits; with no shared expert it queues nothing.
      // (Another input first, so that products left over in the backend's buffer cannot pass.)
      float* gout_ahead = p.g.up(std::vector<float>(want.size(), NAN));
      p.gpu->moe_experts(p.g.up(randv(x.size(), 63)), cfg.N, gids, gw, cfg.K, gb, gout_ahead);
      p.gpu->moe_shared_gate_up(gx, cfg.N, cfg.K, gb);
      p.gpu->moe_experts(gx, cfg.N, gids, gw, cfg.K, gb, gout_ahead);
      EXPECT_EQ(p.g.down(gout_ahead, want.size()), got)
          << dt_name(dt) << " shared ahead, D " << cfg.D << " N " << cfg.N;
#ifdef VIREO_HAVE_CUDA
      // x and h through L1 (FP8: the rows / slots kernels) instead of shared memory: each lane
      // sums its chunks in the same order and the slots combine in order of k, so the same bits.
      cuda_set_gemv_x_shared(*p.gpu, false);
      float* gout_l1 = p.g.up(std::vector<float>(want.size(), NAN));
      p.gpu->moe_experts(gx, cfg.N, gids, gw, cfg.K, gb, gout_l1);
      cuda_set_gemv_x_shared(*p.gpu, true);
      EXPECT_EQ(p.g.down(gout_l1, want.size()), got) << dt_name(dt) << " x via L1, D " << cfg.D << " N " << cfg.N;
      // One token's FP8 gate | up in 16-row blocks instead of the walking ones (cuda_set_moe_walk):
      // the same lane sums, so the same bits (N > 1 and the other dtypes take the blocks either way).
      cuda_set_moe_walk(false);
      float* gout_blocks = p.g.up(std::vector<float>(want.size(), NAN));
      p.gpu->moe_experts(gx, cfg.N, gids, gw, cfg.K, gb, gout_blocks);
      cuda_set_moe_walk(true);
      EXPECT_EQ(p.g.down(gout_blocks, want.size()), got) << dt_name(dt) << " unwalked, D " << cfg.D << " N " << cfg.N;
#endif
    }
}

// Decode's down products waiting per slot on counts that the gate | up blocks bump (instead of for
// the whole gate | up launch): the same bits as waiting for the launch, over several calls queued
// back to back with different inputs (a count not reset after a call, or read before the slot's
// rows are written, would let a down product read the last call's rows). Shapes where the gate |
// up takes several waves of blocks, so the down products begin during its last one, and the tiny
// test models'. NB: a first form whose down blocks read h before their wait was over passed this
// test (on an H200, also at the tiny shapes) and failed the tiny models' decode every time
// (DemoModel.*, CudaFixture.*): those, run on every GPU suite, are what guard that race.
TEST(CudaOps, MoeSlotCountsKeepTheSums) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  Pair p;
  struct Shape {
    int64_t D, I;
    int K, E;
  };
  const int kCalls = 6;
  for (Shape sh : {Shape{2048, 1024, 8, 16}, Shape{256, 32, 2, 8}})
    for (DType dt : {DType::F8_E4M3, DType::BF16})
      for (int64_t N : {int64_t(1), int64_t(3)}) {
        const int64_t D = sh.D, I = sh.I;
        const int K = sh.K, E = sh.E;
        ExpertBank gb;
        gb.n_shared = 1;
        std::vector<HostWeight> hw;
        for (int e = 0; e <= E; ++e)
          for (int m = 0; m < 3; ++m) {
            hw.push_back(m < 2 ? make_weight(dt, I, D, uint32_t(900 + 3 * e + m))
                               : make_weight(dt, D, I, uint32_t(902 + 3 * e)));
            std::vector<Weight>& g = m == 0 ? gb.gate : m == 1 ? gb.up : gb.down;
            g.push_back(p.gpu->upload_weight(hw.back().w));
          }
        // Each call routes to other experts through the same ids buffer, as a step's layers do (the
        // buffer rewritten by a copy queued between calls, as by each layer's router).
        std::mt19937 rng(uint32_t(N) + 7);
        std::vector<std::vector<int32_t>> ids(kCalls);
        for (auto& call : ids)
          for (int64_t t = 0; t < N; ++t) {
            std::vector<int32_t> all(static_cast<size_t>(E));
            for (int e = 0; e < E; ++e) all[size_t(e)] = e;
            std::shuffle(all.begin(), all.end(), rng);
            call.insert(call.end(), all.begin(), all.begin() + K);
          }
        std::vector<int32_t*> call_ids;
        for (const auto& call : ids) call_ids.push_back(p.g.up_i(call));
        std::vector<float*> xs;
        for (int c = 0; c < kCalls; ++c) xs.push_back(p.g.up(randv(size_t(N * D), uint32_t(70 + c), 2.0f)));
        int32_t* gids = p.g.up_i(ids[0]);
        float* gw = p.g.up(randv(ids[0].size(), 64));
        auto run = [&](bool counts, bool walk) {
          cuda_set_moe_slot_counts(*p.gpu, counts);
          cuda_set_moe_walk(walk);
          std::vector<float*> outs;
          for (int c = 0; c < kCalls; ++c) outs.push_back(p.g.up(std::vector<float>(size_t(N * D), NAN)));
          for (int c = 0; c < kCalls; ++c) {  // queued back to back, read after the last
            p.gpu->copy_rows(reinterpret_cast<float*>(gids), N * K, reinterpret_cast<const float*>(call_ids[size_t(c)]),
                             N * K, 1, N * K);  // the ids' bits, copied on the stream
            float* gx = xs[size_t(c)];
            if (c % 2) p.gpu->moe_shared_gate_up(gx, N, K, gb);  // the decode step's order (Rest), or All
            p.gpu->moe_experts(gx, N, gids, gw, K, gb, outs[size_t(c)]);
          }
          std::vector<std::vector<float>> got;
          for (float* o : outs) got.push_back(p.g.down(o, size_t(N * D)));
          return got;
        };
        // The gate | up in 16-row blocks, counted per slot or not, or (one token, FP8) walking, where
        // the down products wait for the whole launch whatever the counts' switch says, and walk too
        // (each of those calls launched moe_down_walk_kernel, unless VIREO_MOE_DOWN_WALK=0).
        const auto whole = run(false, false), per_slot = run(true, false);
        const int64_t down_walks = cuda_moe_down_walk_launches();
        const auto walked = run(true, true), walked_whole = run(false, true);
        const char* down_walk_env = std::getenv("VIREO_MOE_DOWN_WALK");
        if (dt == DType::F8_E4M3 && N == 1 && !(down_walk_env && std::string(down_walk_env) == "0")) {
          EXPECT_EQ(cuda_moe_down_walk_launches() - down_walks, 2 * kCalls) << "D " << D << ": the down walk not taken";
        } else {
          EXPECT_EQ(cuda_moe_down_walk_launches(), down_walks) << dt_name(dt) << " D " << D << " N " << N;
        }
        for (int c = 0; c < kCalls; ++c) {
          EXPECT_EQ(per_slot[size_t(c)], whole[size_t(c)]) << dt_name(dt) << " D " << D << " N " << N << " call " << c;
          EXPECT_EQ(walked[size_t(c)], whole[size_t(c)])
              << dt_name(dt) << " walked, D " << D << " N " << N << " call " << c;
          EXPECT_EQ(walked_whole[size_t(c)], whole[size_t(c)])
              << dt_name(dt) << " walked, no counts, D " << D << " N " << N << " call " << c;
          if (c > 0) {
            EXPECT_NE(whole[size_t(c)], whole[size_t(c - 1)]) << "inputs did not change";
          }
        }
      }
  cuda_set_moe_slot_counts(*p.gpu, true);
  cuda_set_moe_walk(true);
#endif
}

// Fused cache appends (host and run-time positions), argmax, and absorbed attention plus the
// indexer with run-time positions against the CPU with the true ones.
TEST(CudaOps, DecodeStepOpsMatchCpu) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t T = 3, L = 512, rope = 64, kvw = L + rope, d = 128, cap = 40, pos0 = 7;
  auto kva = randv(size_t(T * kvw), 70), nw = randv(size_t(L), 71), cs = randv(size_t(T * rope), 72);
  auto k = randv(size_t(T * d), 73), lw = randv(size_t(d), 74), lb = randv(size_t(d), 75);
  int32_t* gpos = p.g.up_i({int32_t(pos0)});
  for (RopeKind kind : {RopeKind::Interleaved, RopeKind::HalfSplit})
    for (bool dev_pos : {false, true}) {
      std::vector<float> want(size_t(cap * kvw), 0.0f), kwant(size_t(cap * d), 0.0f);
      p.cpu->mla_cache_append(kva.data(), T, L, rope, nw.data(), 1e-6f, cs.data(), kind, want.data(), pos0, nullptr);
      p.cpu->index_key_append(k.data(), T, d, lw.data(), lb.data(), 1e-6f, rope, cs.data(), kind, kwant.data(), pos0,
                              nullptr);
      float* g = p.g.zeros(want.size());
      float* gk = p.g.zeros(kwant.size());
      p.gpu->mla_cache_append(p.g.up(kva), T, L, rope, p.g.up(nw), 1e-6f, p.g.up(cs), kind, g, dev_pos ? 0 : pos0,
                              dev_pos ? gpos : nullptr);
      p.gpu->index_key_append(p.g.up(k), T, d, p.g.up(lw), p.g.up(lb), 1e-6f, rope, p.g.up(cs), kind, gk,
                              dev_pos ? 0 : pos0, dev_pos ? gpos : nullptr);
      EXPECT_LT(nmse(p.g.down(g, want.size()), want), 1e-12);
      EXPECT_LT(nmse(p.g.down(gk, kwant.size()), kwant), 1e-12);
    }

  std::vector<float> logits = randv(3 * 50000, 76);
  logits[123] = logits[40000] = 5.0f;  // a tie: the lower index wins
  logits[50000 + 7] = 4.0f;
  std::vector<int32_t> want_am(3);
  p.cpu->argmax_rows(logits.data(), 3, 50000, want_am.data());
  int32_t* gam = p.g.zeros_i(3);
  p.gpu->argmax_rows(p.g.up(logits), 3, 50000, gam);
  EXPECT_EQ(p.g.down_i(gam, 3), want_am);
  EXPECT_EQ(want_am[0], 123);
  // Rows split over many blocks: odd lengths (rows not 16-byte aligned), the maximum last, ties
  // inside one block and across blocks, NaN inside a row (never wins) and first (the reference's 0),
  // a row of -inf.
  for (int64_t n : {int64_t(154881), int64_t(7), int64_t(4096)}) {
    std::vector<float> lx = randv(size_t(6 * n), 83);
    lx[size_t(n - 1)] = 9.0f;                                   // row 0: the last element
    lx[size_t(n + n / 2)] = lx[size_t(n + n / 2 + 1)] = 9.0f;   // row 1: a tie of neighbours
    lx[size_t(2 * n + 1)] = lx[size_t(3 * n - 1)] = 9.0f;       // row 2: a tie far apart
    lx[size_t(3 * n + 2)] = std::nanf("");                      // row 3: NaN inside
    lx[size_t(3 * n + 3)] = 9.0f;
    lx[size_t(4 * n)] = std::nanf("");                          // row 4: NaN first
    for (int64_t i = 0; i < n; ++i) lx[size_t(5 * n + i)] = -INFINITY;  // row 5
    std::vector<int32_t> lw(6);
    p.cpu->argmax_rows(lx.data(), 6, n, lw.data());
    int32_t* lg = p.g.zeros_i(6);
    p.gpu->argmax_rows(p.g.up(lx), 6, n, lg);
    EXPECT_EQ(p.g.down_i(lg, 6), lw) << "n " << n;
    EXPECT_EQ(lw[0], n - 1);
    EXPECT_EQ(lw[4], 0);
  }

  // One decode query at position n - 1 of n cached keys; the GPU call is sized for cap keys.
  const int64_t H = 16, nope = 32, vd = 32, qw = nope + rope, hw = nope + vd, nI = 4, topk = 16;
  HostWeight kvb = make_weight(DType::BF16, H * hw, L, 77);
  Weight gkvb = p.gpu->upload_weight(kvb.w);
  auto kv = randv(size_t(cap * kvw), 78), q = randv(size_t(H * qw), 79);
  auto iq = randv(size_t(nI * d), 80), iw = randv(size_t(nI), 81), keys = randv(size_t(cap * d), 82);
  for (int64_t n : {int64_t(5), int64_t(29)}) {
    int32_t* gp = p.g.up_i({int32_t(n - 1)});
    IndexerArgs ia;
    ia.T = 1; ia.n_heads = nI; ia.head_dim = d; ia.topk = topk; ia.scale = 0.1f;
    IndexerArgs ci = ia;
    std::vector<int32_t> sel(size_t(topk), -1), cnt(1, -1);
    ci.q = iq.data(); ci.weights = iw.data(); ci.keys = keys.data(); ci.n_keys = n; ci.pos0 = n - 1;
    ci.selected = sel.data(); ci.counts = cnt.data();
    p.cpu->indexer_select(ci);
    IndexerArgs gi = ia;
    gi.q = p.g.up(iq); gi.weights = p.g.up(iw); gi.keys = p.g.up(keys); gi.n_keys = cap; gi.pos0 = cap - 1;
    gi.pos0_dev = gp;
    gi.selected = p.g.up_i(std::vector<int32_t>(size_t(topk), -1));
    gi.counts = p.g.zeros_i(1);
    p.gpu->indexer_select(gi);
    ASSERT_EQ(p.g.down_i(gi.counts, 1), cnt) << "n " << n;
    auto gsel = p.g.down_i(gi.selected, size_t(topk));
    for (int i = 0; i < cnt[0]; ++i) EXPECT_EQ(gsel[size_t(i)], sel[size_t(i)]) << "n " << n << " i " << i;

    MlaAttentionArgs a;
    a.T = 1; a.n_heads = H; a.qk_nope = nope; a.qk_rope = rope; a.v_dim = vd; a.kv_lora = L; a.scale = 0.05f;
    a.absorbed = true;
    std::vector<float> want(size_t(H * vd));
    MlaAttentionArgs c = a;
    c.q = q.data(); c.kv = kv.data(); c.kv_b = &kvb.w; c.n_keys = n; c.pos0 = n - 1; c.out = want.data();
    c.selection = KeySelection{sel.data(), cnt.data(), topk};
    p.cpu->mla_attention(c);
    MlaAttentionArgs g = a;
    g.q = p.g.up(q); g.kv = p.g.up(kv); g.kv_b = &gkvb; g.n_keys = cap; g.pos0 = cap - 1; g.pos0_dev = gp;
    g.out = p.g.up(std::vector<float>(want.size(), NAN));
    g.selection = KeySelection{gi.selected, gi.counts, topk};
    p.gpu->mla_attention(g);
    EXPECT_LT(nmse(p.g.down(g.out, want.size()), want), 1e-10) << "n " << n;
  }
}

// Several products of one input in one launch (a decode step's q_a, kv_a, indexer keys and
// weights): even row counts (two rows per warp), odd ones (one), mixed dtypes (one token: FP8 and
// BF16 rows in one launch with x shared, a launch a dtype through L1; more: one matmul each) and
// T > 1: every way equals the CPU's separate products.
TEST(CudaOps, MatmulManyMatchesCpu) {
  REQUIRE_CUDA();
  Pair p;
  struct Case { std::vector<int64_t> outs; std::vector<DType> dts; int64_t T; };
  const int64_t in = 512;
  // One token's 2784 and 2752 rows: one block of 32 warps an SM, rows dealt round-robin (x in
  // shared memory); 4800 rows: more than those blocks hold at once (blocks of 8, spread or in order).
  for (const Case& c : {Case{{2048, 576, 128, 32}, {DType::BF16, DType::BF16, DType::BF16, DType::BF16}, 1},
                        Case{{2048, 576, 128}, {DType::F8_E4M3, DType::F8_E4M3, DType::F8_E4M3}, 1},
                        Case{{4096, 576, 128}, {DType::F8_E4M3, DType::F8_E4M3, DType::F8_E4M3}, 1},
                        Case{{256, 130, 2}, {DType::F8_E4M3, DType::F8_E4M3, DType::F8_E4M3}, 1},
                        Case{{300, 77}, {DType::F32, DType::F32}, 1}, Case{{256, 32}, {DType::F8_E4M3, DType::BF16}, 1},
                        // an FP8 layer's input at 4096 cached: the bf16 head weights among FP8 rows
                        Case{{2048, 576, 128, 32}, {DType::F8_E4M3, DType::F8_E4M3, DType::F8_E4M3, DType::BF16}, 1},
                        Case{{64, 32}, {DType::BF16, DType::BF16}, 3},
                        // prefill rows: x converted once for every product (exact mode: split)
                        Case{{2048, 576, 128, 32}, {DType::BF16, DType::BF16, DType::BF16, DType::BF16}, 100},
                        Case{{256, 32}, {DType::F8_E4M3, DType::BF16}, 40}}) {
    std::vector<HostWeight> hw;
    for (size_t i = 0; i < c.outs.size(); ++i) hw.push_back(make_weight(c.dts[i], c.outs[i], in, uint32_t(90 + i)));
    auto x = randv(size_t(c.T * in), 91);
    float* gx = p.g.up(x);
    std::vector<Weight> gw;
    std::vector<float*> gy;
    for (size_t i = 0; i < hw.size(); ++i) {
      gw.push_back(p.gpu->upload_weight(hw[i].w));
      gy.push_back(p.g.up(std::vector<float>(size_t(c.T * c.outs[i]), NAN)));
    }
    std::vector<const Weight*> ws;
    for (const Weight& w : gw) ws.push_back(&w);
    p.gpu->matmul_many(gx, c.T, ws.data(), gy.data(), int(ws.size()));
#ifdef VIREO_HAVE_CUDA
    // x through L1 instead of shared memory (one token: pairs of rows a warp where the row
    // counts allow): each row's sums in the same order, the same bits.
    std::vector<float*> gy_l1;
    for (size_t i = 0; i < hw.size(); ++i) gy_l1.push_back(p.g.up(std::vector<float>(size_t(c.T * c.outs[i]), NAN)));
    cuda_set_gemv_x_shared(*p.gpu, false);
    p.gpu->matmul_many(gx, c.T, ws.data(), gy_l1.data(), int(ws.size()));
    cuda_set_gemv_x_shared(*p.gpu, true);
#endif
    for (size_t i = 0; i < hw.size(); ++i) {
      std::vector<float> want(size_t(c.T * c.outs[i]));
      cpu_matmul(x.data(), c.T, hw[i].w, want.data(), ThreadPool::global());
      const std::vector<float> got = p.g.down(gy[i], want.size());
      EXPECT_LT(nmse(got, want), 1e-9) << "weight " << i << " of " << hw.size() << " rows " << c.outs[i] << " T " << c.T;
#ifdef VIREO_HAVE_CUDA
      // (Except a BF16 weight among FP8 ones: through L1 it runs alone, several warps a row.)
      bool mixed = false;
      for (DType dt : c.dts) mixed = mixed || dt != c.dts[0];
      if (!(mixed && c.T == 1 && c.dts[i] == DType::BF16)) {
        EXPECT_EQ(p.g.down(gy_l1[i], want.size()), got) << "x via L1, weight " << i << " T " << c.T;
      }
#endif
    }
  }
}

// Weights uploaded side by side (upload_weights_adjacent: an attention layer's q_a, indexer keys
// and kv_a) run at prefill as one product over the adjacent ones, in whatever order matmul_many
// lists them; each output gets its own columns. BF16 (exact mode) and fast-fp8 with a bf16 weight
// among FP8 ones (an FP8 checkpoint's indexer keys: uploaded apart, run alone); FP8 rows that end
// in a partial 128-row block before the last weight cannot share scales and are uploaded apart.
// Past 1024 tokens each product runs alone.
TEST(CudaOps, MatmulManyJoinsAdjacentWeights) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  Pair p;
  struct Case {
    std::vector<int64_t> outs;  // upload order
    std::vector<DType> dts;
    CudaGemmMode mode;
    const char* joined;  // the profile's one product over the joined rows, or nullptr: none
  };
  const int64_t in = 512;
  const DType b16 = DType::BF16, f8 = DType::F8_E4M3;
  // 1100 tokens: past kJoinedMaxRows, one product each (the products alone fill the GPU there).
  for (const int64_t T : {int64_t(100), int64_t(1100)})
    for (const Case& c : {Case{{2048, 128, 576}, {b16, b16, b16}, CudaGemmMode::Split, "matmul bf16 2752x512"},
                          Case{{2048, 128, 576}, {f8, b16, f8}, CudaGemmMode::Fp8, "matmul fp8 2624x512"},
                          Case{{2048, 128, 576}, {f8, f8, f8}, CudaGemmMode::Fp8, "matmul fp8 2752x512"},
                          Case{{130, 256}, {f8, f8}, CudaGemmMode::Fp8, nullptr}}) {
      std::vector<HostWeight> hw;
      for (size_t i = 0; i < c.outs.size(); ++i) hw.push_back(make_weight(c.dts[i], c.outs[i], in, uint32_t(70 + i)));
      std::vector<Weight> gw;
      for (const HostWeight& h : hw) gw.push_back(h.w);
      // As the model uploads: those of the first one's dtype together, the others alone.
      std::vector<Weight*> side;
      for (Weight& w : gw)
        if (w.w.dtype == c.dts[0]) side.push_back(&w);
      p.gpu->upload_weights_adjacent(side.data(), int(side.size()));
      for (Weight& w : gw) w = p.gpu->upload_weight(w);
      const auto x = randv(size_t(T * in), 71);
      float* gx = p.g.up(x);
      // The model's order (q_a, kv_a, keys): not the upload order.
      std::vector<size_t> order(c.outs.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      if (order.size() == 3) std::swap(order[1], order[2]);
      std::vector<const Weight*> ws;
      std::vector<float*> ys, sep;
      for (size_t i : order) {
        ws.push_back(&gw[i]);
        ys.push_back(p.g.up(std::vector<float>(size_t(T * c.outs[i]), NAN)));
        sep.push_back(p.g.up(std::vector<float>(size_t(T * c.outs[i]), NAN)));
      }
      cuda_set_gemm_mode(*p.gpu, c.mode);
      cuda_set_profile(*p.gpu, true);
      p.gpu->matmul_many(gx, T, ws.data(), ys.data(), int(ws.size()));
      const std::string report = cuda_profile_report(*p.gpu, 1.0);
      cuda_set_profile(*p.gpu, false);
      for (size_t k = 0; k < ws.size(); ++k) p.gpu->matmul(gx, T, *ws[k], sep[k]);
      cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
      if (c.joined && T <= 1024) {
        EXPECT_NE(report.find(c.joined), std::string::npos) << report;
      } else {
        EXPECT_EQ(report.find("joined columns out"), std::string::npos) << report;
      }
      for (size_t k = 0; k < ws.size(); ++k) {
        const size_t i = order[k];
        std::vector<float> want(size_t(T * c.outs[i]));
        cpu_matmul(x.data(), T, hw[i].w, want.data(), ThreadPool::global());
        const std::vector<float> got = p.g.down(ys[k], want.size()), alone = p.g.down(sep[k], want.size());
        // Against the product run alone (the same operands; cuBLASLt may sum a taller matrix in
        // another order) and against the CPU at the mode's bound.
        EXPECT_LT(nmse(got, alone), 1e-12) << "weight " << i << " rows " << c.outs[i];
        EXPECT_LT(nmse(got, want), c.mode == CudaGemmMode::Fp8 ? 2e-3 : 1e-9)
            << "weight " << i << " rows " << c.outs[i];
      }
    }
#endif
}

// One expert over gathered rows: CUDA fuses the gather and the SwiGLU into the bf16 conversions
// of its tensor-core products. Against the CPU's composed ops: exact mode at the split products'
// NMSE bound, fast mode at its operands' rounding (and really different from exact); decode-sized groups
// (<= 8 rows) and FP8 experts take the composed path.
TEST(CudaOps, ExpertRowsMatchesComposedOps) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  Pair p;
  const int64_t D = 512, N = 300;
  // I = 256: FP8 experts in fast-fp8 mode take the fused e4m3 path (all three products at least
  // one 128-block each way); I = 96 keeps them on the composed one.
  for (const auto& [dt, I] : {std::pair{DType::BF16, int64_t(96)}, std::pair{DType::F8_E4M3, int64_t(96)},
                              std::pair{DType::F8_E4M3, int64_t(256)}}) {
    HostWeight gate = make_weight(dt, I, D, 71), up = make_weight(dt, I, D, 72), down = make_weight(dt, D, I, 73);
    const Weight gg = p.gpu->upload_weight(gate.w), gu = p.gpu->upload_weight(up.w), gd = p.gpu->upload_weight(down.w);
    auto x = randv(size_t(N * D), 74);
    for (int64_t m : {int64_t(5), int64_t(137), int64_t(140)}) {  // 137: rows padded to 140
      std::vector<int32_t> index(static_cast<size_t>(m));
      for (int64_t i = 0; i < m; ++i) index[size_t(i)] = int32_t((i * 7 + 3) % N);
      std::vector<float> want(size_t(m * D)), xs(size_t(m * D)), g(size_t(m * I)), u(size_t(m * I));
      p.cpu->expert_rows(x.data(), index.data(), m, gate.w, up.w, down.w, xs.data(), g.data(), u.data(), want.data());
      std::vector<float> got[3];
      for (CudaGemmMode mode : {CudaGemmMode::Split, CudaGemmMode::Bf16, CudaGemmMode::Fp8}) {
        cuda_set_gemm_mode(*p.gpu, mode);
        // gate | up in one buffer: u after g (the products run as one batch of 2, whichever
        // weight lies first in memory), then u before g (two products); the same rows either way.
        float* gu_buf = p.g.zeros(size_t(2 * m * I));
        std::vector<float> pair[2];
        for (int order = 0; order < 2; ++order) {
          float* rows = p.g.up(std::vector<float>(size_t(m * D), NAN));
          float *gb = gu_buf + (order ? m * I : 0), *ub = gu_buf + (order ? 0 : m * I);
          p.gpu->expert_rows(p.g.up(x), p.g.up_i(index), m, gg, gu, gd, p.g.zeros(size_t(m * D)), gb, ub, rows);
          pair[order] = p.g.down(rows, size_t(m * D));
        }
        const double apart = nmse(pair[0], pair[1]);
        EXPECT_LT(apart, mode == CudaGemmMode::Split ? 1e-12 : 1e-9) << "batched vs separate gate/up, mode " << int(mode);
        got[mode == CudaGemmMode::Split ? 0 : mode == CudaGemmMode::Bf16 ? 1 : 2] = pair[0];
      }
      cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
      const std::string what = std::string(dt_name(dt)) + " I " + std::to_string(I) + " m " + std::to_string(m);
      const double exact = nmse(got[0], want), fast = nmse(got[1], want), fp8 = nmse(got[2], want);
      std::printf("  %s: exact NMSE %.2e, fast NMSE %.2e, fast-fp8 NMSE %.2e\n", what.c_str(), exact, fast, fp8);
      EXPECT_LT(exact, 1e-9) << what;
      EXPECT_LT(fast, 1e-4) << what;
      // (fast-fp8 on FP8 weights may quantize activations to e4m3 per 128 columns: ~1e-3.)
      EXPECT_LT(fp8, dt == DType::BF16 ? 1e-4 : 5e-3) << what;
      if (dt == DType::BF16 && m > 8) {
        EXPECT_GT(fast, 1e-8) << what << ": fast mode did not round";
      }
    }
  }
#endif
}

#ifdef VIREO_HAVE_CUDA
// A run of experts for the experts_add tests: job j has weights of spec[j]'s dtype (gate, up
// [I, D], down [D, I]) on the host and uploaded, and a strictly increasing list of about spec[j]'s
// m tokens of N (overlapping between jobs, so a token is in several), all lists one index array.
struct ExpertRun {
  std::vector<HostWeight> hw;
  std::vector<Weight> gw;
  std::vector<int32_t> index;
  std::vector<Backend::ExpertJob> cpu_jobs, gpu_jobs;
  // blocky: weights with a power of two per 128 x 128 block (make_weight).
  ExpertRun(Backend& gpu, int64_t D, int64_t I, int64_t N, const std::vector<std::pair<DType, int64_t>>& spec,
            uint32_t seed, bool blocky = false) {
    hw.reserve(3 * spec.size());
    for (size_t j = 0; j < spec.size(); ++j) {
      for (int k = 0; k < 3; ++k)
        hw.push_back(make_weight(spec[j].first, k == 2 ? D : I, k == 2 ? I : D, uint32_t(seed + 3 * j + size_t(k)),
                                 0.1f, blocky));
      const int64_t at = int64_t(index.size());
      for (int64_t i = 0; i < spec[j].second; ++i) index.push_back(int32_t((i * 13 + int64_t(j) * 7) % N));
      std::sort(index.begin() + at, index.end());
      index.erase(std::unique(index.begin() + at, index.end()), index.end());
      cpu_jobs.push_back({&hw[3 * j].w, &hw[3 * j + 1].w, &hw[3 * j + 2].w, at, int64_t(index.size()) - at});
    }
    for (HostWeight& h : hw) gw.push_back(gpu.upload_weight(h.w));
    for (size_t j = 0; j < spec.size(); ++j)
      gpu_jobs.push_back({&gw[3 * j], &gw[3 * j + 1], &gw[3 * j + 2], cpu_jobs[j].at, cpu_jobs[j].m});
  }
  // Random inputs from seeds seed, seed + 1, seed + 2 (x [N, D], a scale per index entry, out0
  // [N, D]) and the CPU's experts_add of them into a copy of out0: what the tests compare with.
  struct Reference {
    std::vector<float> x, scale, out0, want;
  };
  // blocky_x: x's (row, 128-column block)s scaled by their own powers of two (1/8 .. 8), so that
  // activation scales differ too.
  Reference cpu_reference(Backend& cpu, int64_t N, int64_t D, int64_t I, uint32_t seed, bool blocky_x = false) const {
    Reference r{randv(size_t(N * D), seed), randv(index.size(), seed + 1), randv(size_t(N * D), seed + 2), {}};
    if (blocky_x)
      for (int64_t t = 0; t < N; ++t)
        for (int64_t c = 0; c < D; ++c) r.x[size_t(t * D + c)] *= std::ldexp(1.0f, int((t + c / 128) % 7) - 3);
    r.want = r.out0;
    std::vector<float> xs(size_t(N * D)), g(size_t(N * I)), u(size_t(N * I)), y(size_t(N * D));
    cpu.experts_add(r.x.data(), index.data(), r.scale.data(), cpu_jobs.data(), int(cpu_jobs.size()), xs.data(),
                    g.data(), u.data(), y.data(), r.want.data());
    return r;
  }
  // The last job made dense (a shared expert: every one of the N rows, unscaled).
  void last_dense(int64_t N) {
    for (auto* jobs : {&cpu_jobs, &gpu_jobs}) {
      jobs->back().dense = true;
      jobs->back().at = 0;
      jobs->back().m = N;
    }
  }
};

// A run's inputs uploaded once (x, scale and index from the reference), then experts_add into a
// fresh copy of out0 per call, with the grouped products on or off, in chunks of chunk_rows (0:
// the default), tiles by TMA or not, profiled: `path` (a profile row name) must appear exactly
// when expect_path.
struct GroupedCall {
  Pair& p;
  const ExpertRun& er;
  const ExpertRun::Reference& ref;
  float *x, *scale, *xs, *g, *u, *y;
  int32_t* index;
  GroupedCall(Pair& pair, const ExpertRun& run, const ExpertRun::Reference& r, int64_t N, int64_t D, int64_t I)
      : p(pair), er(run), ref(r) {
    x = p.g.up(ref.x);
    scale = p.g.up(ref.scale);
    index = p.g.up_i(er.index);
    xs = p.g.zeros(size_t(N * D));
    g = p.g.zeros(size_t(2 * N * I));
    u = g + N * I;
    y = p.g.zeros(size_t(N * D));
  }
  std::vector<float> operator()(bool grouped, int64_t chunk_rows, bool tma, const char* path, bool expect_path) {
    cuda_set_grouped_experts(*p.gpu, grouped, chunk_rows);
    cuda_set_grouped_tma(*p.gpu, tma);
    float* out = p.g.up(ref.out0);
    cuda_set_profile(*p.gpu, true);
    p.gpu->experts_add(x, index, scale, er.gpu_jobs.data(), int(er.gpu_jobs.size()), xs, g, u, y, out);
    const std::string report = cuda_profile_report(*p.gpu, 1.0);
    cuda_set_profile(*p.gpu, false);
    EXPECT_EQ(report.find(path) != std::string::npos, expect_path) << report;
    return p.g.down(out, ref.out0.size());
  }
};
#endif

// A run of experts added into one output: CUDA computes the jobs concurrently on side streams
// and adds them in job order on its own stream, so the result equals job-by-job calls bit for bit
// (including a token routed to several experts: the order of its additions is what is checked),
// and the CPU's composed ops within the products' bound. BF16 and FP8 experts, 1 to 300 rows.
TEST(CudaOps, ExpertsAddConcurrentEqualsSerial) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  Pair p;
  // I = 128: FP8 experts take the FP8 x FP8 path in fast-fp8 (both dims >= 128), where a lane's
  // down product writes its padded height in place (m = 9, 137) but the serial run copies m rows.
  const int64_t D = 256, I = 128, N = 300;
  const ExpertRun er(*p.gpu, D, I, N,
                     {{DType::BF16, 137},
                      {DType::BF16, 3},
                      {DType::F8_E4M3, 40},
                      {DType::BF16, 300},
                      {DType::BF16, 20},
                      {DType::F8_E4M3, 9},
                      {DType::BF16, 64},
                      {DType::F8_E4M3, 137}},
                     200);
  const std::vector<int32_t>& index = er.index;
  const std::vector<Backend::ExpertJob>& gpu_jobs = er.gpu_jobs;
  const ExpertRun::Reference ref = er.cpu_reference(*p.cpu, N, D, I, 301);
  const std::vector<float>&x = ref.x, &scale = ref.scale, &out0 = ref.out0, &want = ref.want;
  for (CudaGemmMode mode : {CudaGemmMode::Split, CudaGemmMode::Bf16, CudaGemmMode::Fp8}) {
    cuda_set_gemm_mode(*p.gpu, mode);
    float *gx = p.g.up(x), *gs = p.g.up(scale);
    int32_t* gi = p.g.up_i(index);
    // gate | up in one buffer as the model passes them (the backend pairs the two products).
    float *gxs = p.g.zeros(size_t(N * D)), *gg = p.g.zeros(size_t(2 * N * I)), *gu = gg + N * I;
    float* gy = p.g.zeros(size_t(N * D));
    float* serial = p.g.up(out0);
    for (const Backend::ExpertJob& j : gpu_jobs) p.gpu->experts_add(gx, gi, gs, &j, 1, gxs, gg, gu, gy, serial);
    float* concurrent = p.g.up(out0);
    for (int rep = 0; rep < 2; ++rep) {  // the second run reuses the lanes and their buffers
      if (rep) p.g.be.copy_from_host(concurrent, out0.data(), out0.size());
      p.gpu->experts_add(gx, gi, gs, gpu_jobs.data(), int(gpu_jobs.size()), gxs, gg, gu, gy, concurrent);
      EXPECT_EQ(p.g.down(concurrent, out0.size()), p.g.down(serial, out0.size())) << "mode " << int(mode);
    }
    const double e = nmse(p.g.down(concurrent, out0.size()), want);
    std::printf("  experts_add mode %d: NMSE %.2e against the CPU\n", int(mode), e);
    EXPECT_LT(e, mode == CudaGemmMode::Split ? 1e-9 : 5e-3);
  }
  cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
#endif
}

// The fast modes' grouped expert products (cuda_grouped.h): every BF16 expert of a run in one
// launch a product, SwiGLU in the gate | up epilogue, the additions in job order by one launch.
// Against the CPU and the side lanes (cuBLASLt) within the bf16 operands' bound; run to run, and
// in chunks (a run split at job boundaries, a job larger than a chunk alone) against one chunk,
// bit for bit (each output element is the same dot product wherever its row falls in a tile).
// Rows 1 to 600 (partial tiles of 128, a warpgroup's 64 rows empty, several tiles), a token in
// several jobs, K of 2 to 32 k-steps (fewer than the ring's loads ahead), more tiles than SMs.
TEST(CudaOps, GroupedExpertsMatchLanesAndCpu) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  Pair p;
  struct Shape {
    int64_t D, I;
  };
  for (const Shape sh : {Shape{256, 128}, Shape{2048, 1024}}) {
    const int64_t D = sh.D, I = sh.I, N = 600;
    std::vector<std::pair<DType, int64_t>> spec;
    for (int64_t m : {137, 3, 1, 600, 20, 129, 64, 255, 400, 300, 0}) spec.push_back({DType::BF16, m});
    ExpertRun er(*p.gpu, D, I, N, spec, 400);
    er.last_dense(N);  // and a shared expert last
    const ExpertRun::Reference ref = er.cpu_reference(*p.cpu, N, D, I, 501);
    const std::vector<float>& want = ref.want;
    GroupedCall call(p, er, ref, N, D, I);
    auto run = [&](bool grouped, int64_t chunk_rows, bool tma = true) {
      return call(grouped, chunk_rows, tma, "grouped experts: down", grouped);
    };
    for (CudaGemmMode mode : {CudaGemmMode::Bf16, CudaGemmMode::Fp8}) {
      cuda_set_gemm_mode(*p.gpu, mode);
      const std::string what =
          "D " + std::to_string(D) + " I " + std::to_string(I) + " mode " + std::to_string(int(mode));
      const std::vector<float> lanes = run(false, 0), grouped = run(true, 0);
      EXPECT_EQ(run(true, 0), grouped) << what << ": run to run";
      EXPECT_EQ(run(true, 700), grouped) << what << ": in chunks of at most 700 rows";
      EXPECT_EQ(run(true, 1), grouped) << what << ": a job a chunk";
      EXPECT_EQ(run(true, 0, false), grouped) << what << ": tiles loaded by cp.async instead of TMA";
      EXPECT_EQ(run(true, 700, false), grouped) << what << ": cp.async, in chunks";
      // A tile a block, and every TMA product walking its tiles with 3 blocks (tma_grid): one
      // ring across a block's tiles, the same sums.
      for (int walk : {0, 1}) {
        cuda_set_grouped_walk(walk, walk ? 3 : 0);
        EXPECT_EQ(run(true, 0), grouped) << what << ": walk " << walk;
        EXPECT_EQ(run(true, 700), grouped) << what << ": walk " << walk << ", in chunks";
      }
      cuda_set_grouped_walk(-1, 0);
      const double to_cpu = nmse(grouped, want), to_lanes = nmse(grouped, lanes);
      std::printf("  %s: grouped NMSE %.2e against the CPU, %.2e against the lanes (lanes %.2e)\n", what.c_str(),
                  to_cpu, to_lanes, nmse(lanes, want));
      EXPECT_LT(to_cpu, 1e-4) << what;
      EXPECT_LT(to_lanes, 1e-4) << what;
      EXPECT_GT(to_cpu, 1e-9) << what << ": no bf16 rounding seen (did the products run in f32?)";
    }
    cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
    cuda_set_grouped_experts(*p.gpu, true);
    cuda_set_grouped_tma(*p.gpu, true);
  }
#endif
}

// FP8 experts in fast-fp8 as grouped products (e4m3 MMA, block scales applied per k-block):
// against the side lanes (cuBLASLt's block-scaled GEMMs on the same quantized operands) and the
// CPU's f32 products. Weights and x carry a different power of two per scale block, so a scale
// read from the wrong block, row or job moves the result by far more than the e4m3 rounding.
// The same bits run to run and in any chunking; without TMA the grouped path declines (lanes).
TEST(CudaOps, GroupedFp8ExpertsMatchLanesAndCpu) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  Pair p;
  struct Shape {
    int64_t D, I;
  };
  for (const Shape sh : {Shape{256, 128}, Shape{1024, 512}}) {
    const int64_t D = sh.D, I = sh.I, N = 600;
    std::vector<std::pair<DType, int64_t>> spec;
    for (int64_t m : {137, 30, 12, 600, 20, 129, 64, 255, 400, 300, 0}) spec.push_back({DType::F8_E4M3, m});
    ExpertRun er(*p.gpu, D, I, N, spec, 700, true);
    er.last_dense(N);
    const ExpertRun::Reference ref = er.cpu_reference(*p.cpu, N, D, I, 801, true);
    cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Fp8);
    GroupedCall call(p, er, ref, N, D, I);
    auto run = [&](bool grouped, int64_t chunk_rows, bool tma, bool expect_grouped) {
      return call(grouped, chunk_rows, tma, "grouped experts: down (fp8)", expect_grouped);
    };
    const std::string what = "D " + std::to_string(D) + " I " + std::to_string(I);
    const std::vector<float> lanes = run(false, 0, true, false), grouped = run(true, 0, true, true);
    EXPECT_EQ(run(true, 0, true, true), grouped) << what << ": run to run";
    EXPECT_EQ(run(true, 700, true, true), grouped) << what << ": in chunks of at most 700 rows";
    EXPECT_EQ(run(true, 1, true, true), grouped) << what << ": a job a chunk";
    // Both tile forms, whichever the rows' fill picks: the same sums in the same order. Token
    // columns take 1 to 128 tokens a tile (N 16 .. 128, token boxes of 32, 64, 128 rows): the
    // jobs' rows here leave 1 to 127 in a job's last tile.
    for (int form : {1, 2}) {
      cuda_set_grouped_fp8_form(*p.gpu, form);
      EXPECT_EQ(run(true, 0, true, true), grouped) << what << ": form " << form;
      EXPECT_EQ(run(true, 1, true, true), grouped) << what << ": form " << form << ", a job a chunk";
    }
    // Row tiles a tile a block, and walking with 3 blocks (the ring's phases carried across tiles).
    cuda_set_grouped_fp8_form(*p.gpu, 1);
    for (int walk : {0, 1}) {
      cuda_set_grouped_walk(walk, walk ? 3 : 0);
      EXPECT_EQ(run(true, 0, true, true), grouped) << what << ": row tiles, walk " << walk;
      EXPECT_EQ(run(true, 1, true, true), grouped) << what << ": row tiles, walk " << walk << ", a job a chunk";
    }
    cuda_set_grouped_walk(-1, 0);
    cuda_set_grouped_fp8_form(*p.gpu, 0);
    EXPECT_EQ(run(true, 0, false, false), lanes) << what << ": without TMA, the lanes";
    const double to_cpu = nmse(grouped, ref.want), to_lanes = nmse(grouped, lanes), lanes_cpu = nmse(lanes, ref.want);
    std::printf("  %s: grouped NMSE %.2e against the CPU, %.2e against the lanes (lanes %.2e)\n", what.c_str(), to_cpu,
                to_lanes, lanes_cpu);
    EXPECT_GT(lanes_cpu, 1e-7) << what << ": no e4m3 rounding seen on the lanes";
    EXPECT_LT(to_cpu, 1.25 * lanes_cpu) << what;
    EXPECT_LT(to_lanes, 0.25 * lanes_cpu) << what << ": further from the lanes than the e4m3 rounding explains";
    cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
    cuda_set_grouped_experts(*p.gpu, true);
    cuda_set_grouped_tma(*p.gpu, true);
  }
#endif
}

// The grouped products at GLM-5's expert shapes (D 6144, I 2048: 48 and 16 k-blocks, the ring
// wrapping many times), BF16 and FP8, ops launched back to back as the model runs them (no
// profile between them), run many times: the same bits every time, and the side lanes' values.
// 32 rows an expert leave a tile's second warpgroup without rows; that case once hung one run in
// four (a warp lagging a whole ring lap behind its warpgroup's release: see release() in
// cuda_grouped.cu), so a hang here fails the test by its timeout. Weights are random bytes (the
// quantizing test helpers take minutes at these shapes).
TEST(CudaOps, GroupedExpertsGlmShapesRepeat) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  Pair p;
  const int64_t D = 6144, I = 2048;
  auto random_weight = [&](DType dt, int64_t out, int64_t in, uint32_t seed) {
    HostWeight h;
    h.bytes.resize(size_t(out * in) * dtype_size(dt));
    uint32_t st = seed;
    for (size_t i = 0; i < h.bytes.size(); ++i) {
      st = st * 1664525u + 1013904223u;
      // e4m3: no NaN codes (0x7F, 0xFF); bf16: the high byte keeps |w| < 2^-3 or so
      h.bytes[i] = dt == DType::F8_E4M3 ? uint8_t(((st >> 24) & 0x7E) | ((st >> 16) & 0x80))
                   : i % 2              ? uint8_t(0x3C | ((st >> 16) & 0x80) | ((st >> 24) & 0x1))
                                        : uint8_t(st >> 24);
    }
    if (dt == DType::F8_E4M3) {
      const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
      h.scales.resize(size_t(so * si));
      for (size_t i = 0; i < h.scales.size(); ++i) h.scales[i] = 1e-3f * float(1 + (i * 7) % 5);
      h.w.scale_inv = Tensor(h.scales.data(), DType::F32, {so, si});
    }
    h.w.w = Tensor(h.bytes.data(), dt, {out, in});
    return h;
  };
  for (DType dt : {DType::F8_E4M3, DType::BF16}) {
    const HostWeight hg = random_weight(dt, I, D, 1), hu = random_weight(dt, I, D, 2), hd = random_weight(dt, D, I, 3);
    const Weight wg = p.gpu->upload_weight(hg.w), wu = p.gpu->upload_weight(hu.w), wd = p.gpu->upload_weight(hd.w);
    cuda_set_gemm_mode(*p.gpu, dt == DType::F8_E4M3 ? CudaGemmMode::Fp8 : CudaGemmMode::Bf16);
    struct Case {
      int64_t N, rows;  // tokens; rows of each of the 16 routed jobs (all share one expert's weights)
      int repeats;
    };
    for (const Case cs : {Case{64, 32, 16}, Case{512, 256, 4}}) {
      const int64_t N = cs.N;
      std::vector<int32_t> index;
      std::vector<Backend::ExpertJob> jobs;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t at = int64_t(index.size());
        for (int64_t i = 0; i < cs.rows; ++i) index.push_back(int32_t((i * 13 + j * 7) % N));
        std::sort(index.begin() + at, index.end());
        index.erase(std::unique(index.begin() + at, index.end()), index.end());
        jobs.push_back({&wg, &wu, &wd, at, int64_t(index.size()) - at});
      }
      jobs.push_back({&wg, &wu, &wd, 0, N, true});
      float *gx = p.g.up(randv(size_t(N * D), 901)), *gs = p.g.up(randv(index.size(), 902));
      int32_t* gi = p.g.up_i(index);
      float *gxs = p.g.zeros(size_t(N * D)), *gg = p.g.zeros(size_t(2 * N * I)), *gu = gg + N * I;
      float *gy = p.g.zeros(size_t(N * D)), *out = p.g.zeros(size_t(N * D));
      auto run = [&](bool grouped) {
        cuda_set_grouped_experts(*p.gpu, grouped, 0);
        p.gpu->fill(out, 0.0f, N * D);
        p.gpu->experts_add(gx, gi, gs, jobs.data(), int(jobs.size()), gxs, gg, gu, gy, out);
        return p.g.down(out, size_t(N * D));
      };
      const std::string what = std::string(dtype_name(dt)) + " N " + std::to_string(N);
      const std::vector<float> lanes = run(false), grouped = run(true);
      const double to_lanes = nmse(grouped, lanes);
      std::printf("  %s: grouped NMSE %.2e against the lanes\n", what.c_str(), to_lanes);
      EXPECT_LT(to_lanes, dt == DType::F8_E4M3 ? 1e-6 : 1e-4) << what;
      for (int r = 0; r < cs.repeats; ++r) EXPECT_EQ(run(true), grouped) << what << ": run " << r;
    }
  }
  cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
  cuda_set_grouped_experts(*p.gpu, true);
#endif
}

#ifdef VIREO_HAVE_CUDA
namespace {
// A decode attention case at GLM-5 head shapes (qk 192 + 64, v 256, kv_lora 512) over the cache
// rows kv / gkv: T queries after pos0 = N - T cached keys, a random selection of at most `stride`
// keys a query unless dense. want: the CPU's output; g: the GPU's arguments (output zeroed);
// gpos: pos0 in device memory, for run-time positions.
struct GlmDecodeCase {
  std::vector<float> want;
  MlaAttentionArgs g;
  int32_t* gpos = nullptr;
  // g with host positions, or with run-time ones as a recorded step has them: the position read
  // from the device, the launch bound 100 keys past the real count.
  MlaAttentionArgs at(bool run_time) const {
    MlaAttentionArgs a = g;
    if (run_time) {
      a.pos0_dev = gpos;
      a.pos0 = g.n_keys + 100 - g.T;
      a.n_keys = g.n_keys + 100;
    }
    return a;
  }
};
GlmDecodeCase glm_decode_case(Pair& p, int64_t T, int64_t H, int64_t N, int64_t stride, bool dense, uint32_t q_seed,
                              uint32_t sel_seed, const std::vector<float>& kv, float* gkv, const HostWeight& kvb,
                              const Weight& gkvb, int64_t vd = 256) {
  const int64_t nope = 192, rope = 64, L = 512, qw = nope + rope, pos0 = N - T;
  auto q = randv(size_t(T * H * qw), q_seed);
  std::vector<int32_t> keys, counts;
  random_selection(T, stride, pos0, sel_seed, keys, counts);
  const MlaAttentionArgs a = mla_shape(T, H, nope, rope, vd, L, N, pos0, 1.0f / std::sqrt(float(qw)), true);
  const KeySelection host_sel{keys.data(), counts.data(), stride};
  GlmDecodeCase c;
  c.want = cpu_mla_attention(*p.cpu, a, q, kv, kvb.w, dense ? nullptr : &host_sel);
  c.g = a;
  c.g.q = p.g.up(q);
  c.g.kv = gkv;
  c.g.kv_b = &gkvb;
  c.g.out = p.g.zeros(c.want.size());
  if (!dense) c.g.selection = KeySelection{p.g.up_i(keys), p.g.up_i(counts), stride};
  c.gpos = p.g.up_i({int32_t(pos0)});
  return c;
}
}  // namespace

// The absorbed decode attention at GLM-5 head shapes (qk 192 + 64, v 256, kv_lora 512) on 2048
// selected keys of 4200 and (64 heads, BF16) on all 4200 (more key tiles than the scores kernel
// has blocks, so each loops over several), with host and run-time positions, on the fast kernels (all heads per
// block: 64 heads, and 80 = a partial group of 32 and of 64) and the reference ones, BF16 and FP8
// W_UV; output poisoned first, so every element is written.
TEST(CudaOps, DecodeAttentionGlmShapesFastAndReference) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t nope = 192, rope = 64, vd = 256, L = 512, N = 4200, stride = 2048;
  const int64_t kvw = L + rope, hw = nope + vd;
  auto kv = randv(size_t(N * kvw), 90);
  float* gkv = p.g.up(kv);
  for (int64_t H : {int64_t(64), int64_t(80)})
    for (DType dt : {DType::BF16, DType::F8_E4M3}) {
      if (H == 80 && dt == DType::F8_E4M3) continue;
      HostWeight kvb = make_weight(dt, H * hw, L, uint32_t(91 + H));
      Weight gkvb = p.gpu->upload_weight(kvb.w);
      for (int64_t T : {int64_t(1), int64_t(3)})
        for (bool dense : {false, true}) {
          if (dense && (H != 64 || dt != DType::BF16)) continue;
          const GlmDecodeCase c =
              glm_decode_case(p, T, H, N, stride, dense, uint32_t(92 + T), uint32_t(93 + T), kv, gkv, kvb, gkvb);
          const std::vector<float>& want = c.want;
          for (bool fast : {true, false})
            for (bool dev_pos : {false, true}) {
              cuda_set_fast_decode(*p.gpu, fast, true, true);
              MlaAttentionArgs gg = c.at(dev_pos);
              p.gpu->fill(gg.out, NAN, int64_t(want.size()));
              p.gpu->mla_attention(gg);
              const double e = nmse(p.g.down(gg.out, want.size()), want);
              EXPECT_LT(e, 1e-10) << "H " << H << " " << dt_name(dt) << " T " << T << (fast ? " fast" : " reference")
                                  << (dev_pos ? " run-time pos" : "") << (dense ? " dense" : "");
              std::printf("  decode attention H %lld %-8s T %lld %-9s %s %s NMSE %.3g\n", (long long)H, dt_name(dt),
                          (long long)T, fast ? "fast" : "reference", dev_pos ? "run-time" : "host    ",
                          dense ? "dense " : "select", e);
            }
          cuda_set_fast_decode(*p.gpu, true, true, true);
        }
    }
}

// The fast modes' long-context decode attention: its scores and p x latent on bf16 tensor cores
// (the queries, the cache rows and the softmax's weights rounded once, f32 sums). Against the CPU
// at the fast modes' tolerance, and above the f32 kernels' error (so the rounding, and with it the
// tensor-core path, really ran); exact mode keeps the f32 kernels. GLM-5 shapes, 2048 selected of
// 4200 keys, 64 heads and 80 (a partial head group), 1 and 3 rows, host and run-time positions.
TEST(CudaOps, DecodeAttentionFastModesOnTensorCores) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t nope = 192, rope = 64, vd = 256, L = 512, N = 4200, stride = 2048;
  const int64_t kvw = L + rope, hw = nope + vd;
  auto kv = randv(size_t(N * kvw), 490);
  float* gkv = p.g.up(kv);
  for (int64_t H : {int64_t(64), int64_t(80)}) {
    HostWeight kvb = make_weight(DType::BF16, H * hw, L, uint32_t(491 + H));
    Weight gkvb = p.gpu->upload_weight(kvb.w);
    for (int64_t T : {int64_t(1), int64_t(3)}) {
      const GlmDecodeCase c =
          glm_decode_case(p, T, H, N, stride, false, uint32_t(492 + T), uint32_t(493 + T), kv, gkv, kvb, gkvb);
      for (bool dev_pos : {false, true}) {
        MlaAttentionArgs g = c.at(dev_pos);
        double err[3] = {};
        const CudaGemmMode modes[3] = {CudaGemmMode::Split, CudaGemmMode::Bf16, CudaGemmMode::Fp8};
        for (int m = 0; m < 3; ++m) {
          cuda_set_gemm_mode(*p.gpu, modes[m]);
          p.gpu->fill(g.out, NAN, int64_t(c.want.size()));
          p.gpu->mla_attention(g);
          err[m] = nmse(p.g.down(g.out, c.want.size()), c.want);
        }
        cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
        const std::string what =
            "H " + std::to_string(H) + " T " + std::to_string(T) + (dev_pos ? " run-time" : " host");
        EXPECT_LT(err[0], 1e-10) << what << " exact";
        for (int m = 1; m < 3; ++m) {
          EXPECT_LT(err[m], 1e-4) << what << " fast mode " << m;
          EXPECT_GT(err[m], 100 * err[0]) << what << " fast mode " << m << ": not rounded (the f32 kernels ran?)";
        }
        std::printf("  decode attention %-16s NMSE exact %.3g, fast %.3g, fast-fp8 %.3g\n", what.c_str(), err[0],
                    err[1], err[2]);
      }
    }
  }
}

// The fast modes' long-context attention with its scores, softmax and p x latent in one kernel and
// split pairs reduced in clusters (cuda_set_fused_decode_attention). Against the CPU at the fast
// modes' tolerance and near the two-kernel form (the same roundings over other splits), its bits
// not theirs (so the fused kernel ran), every output written (poisoned first). GLM-5 shapes, FP8
// W_UV, up to 2048 selected of 4200 keys (the third row a third of them: partial and empty splits
// and pairs), 64 heads and 72 (a partial group of 16), 1 and 3 rows, host and run-time positions;
// and a selection of at most 1950 (31 splits: a pair with no second block's keys at all).
TEST(CudaOps, DecodeAttentionFusedTcNearTwoKernels) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t nope = 192, rope = 64, vd = 256, L = 512, N = 4200;
  const int64_t kvw = L + rope, hw = nope + vd;
  auto kv = randv(size_t(N * kvw), 590);
  float* gkv = p.g.up(kv);
  const std::pair<int64_t, int64_t> heads_keys[] = {{64, 2048}, {72, 2048}, {64, 1950}};
  for (const auto& [H, stride] : heads_keys) {
    HostWeight kvb = make_weight(DType::F8_E4M3, H * hw, L, uint32_t(591 + H));
    Weight gkvb = p.gpu->upload_weight(kvb.w);
    for (int64_t T : {int64_t(1), int64_t(3)}) {
      const GlmDecodeCase c =
          glm_decode_case(p, T, H, N, stride, false, uint32_t(592 + T), uint32_t(593 + T), kv, gkv, kvb, gkvb);
      for (bool dev_pos : {false, true}) {
        MlaAttentionArgs g = c.at(dev_pos);
        cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Bf16);
        std::vector<float> out[2];
        double err[2] = {};
        for (int fused = 0; fused < 2; ++fused) {
          cuda_set_fused_decode_attention(fused == 1);
          p.gpu->fill(g.out, NAN, int64_t(c.want.size()));
          p.gpu->mla_attention(g);
          out[fused] = p.g.down(g.out, c.want.size());
          err[fused] = nmse(out[fused], c.want);
        }
        cuda_set_fused_decode_attention(true);
        cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
        const std::string what = "H " + std::to_string(H) + " keys " + std::to_string(stride) + " T " +
                                 std::to_string(T) + (dev_pos ? " run-time" : " host");
        EXPECT_LT(err[0], 1e-4) << what << " two kernels";
        EXPECT_LT(err[1], 1e-4) << what << " fused";
        EXPECT_LT(nmse(out[1], out[0]), 1e-4) << what;
        EXPECT_NE(out[1], out[0]) << what << ": the same bits (the fused kernel did not run?)";
        std::printf("  decode attention %-26s NMSE two kernels %.3g, fused %.3g\n", what.c_str(), err[0], err[1]);
      }
    }
  }
}

// The decode attention straight after the indexer's top-k on the device, in one stream of
// programmatic launches, as a decode step runs them (the other attention tests upload their
// selection): every kernel that reads the selection must do so after its wait. The selection
// buffer holds a wrong but valid selection (every key 0) before each run, so a read that came too
// early gives wrong output, not a fault. GLM-5 attention shapes, 2048 of 3000 keys, FP8 W_UV,
// host and run-time positions.
TEST(CudaOps, DecodeAttentionReadsTheSelectionJustMade) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t nope = 192, rope = 64, vd = 256, L = 512, H = 64, N = 3000, topk = 2048, nI = 4, d = 32;
  const int64_t kvw = L + rope, hw = nope + vd, qw = nope + rope;
  auto kv = randv(size_t(N * kvw), 390);
  HostWeight kvb = make_weight(DType::F8_E4M3, H * hw, L, 391);
  Weight gkvb = p.gpu->upload_weight(kvb.w);
  auto keys = randv(size_t(N * d), 392);
  for (int64_t T : {int64_t(1), int64_t(3)}) {
    const int64_t pos0 = N - T;
    auto iq = randv(size_t(T * nI * d), uint32_t(393 + T)), iw = randv(size_t(T * nI), uint32_t(394 + T), 0.5f);
    auto q = randv(size_t(T * H * qw), uint32_t(395 + T));
    const IndexerArgs ia = indexer_shape(T, nI, d, N, pos0, topk);
    const Selection sel = cpu_select(p, ia, iq, iw, keys);
    const MlaAttentionArgs a = mla_shape(T, H, nope, rope, vd, L, N, pos0, 1.0f / std::sqrt(float(qw)), true);
    const KeySelection host_sel{sel.selected.data(), sel.counts.data(), topk};
    const std::vector<float> want = cpu_mla_attention(*p.cpu, a, q, kv, kvb.w, &host_sel);
    IndexerArgs gi = ia;
    gi.q = p.g.up(iq);
    gi.weights = p.g.up(iw);
    gi.keys = p.g.up(keys);
    gi.selected = p.g.zeros_i(size_t(T * topk));
    gi.counts = p.g.zeros_i(size_t(T));
    MlaAttentionArgs g = a;
    g.q = p.g.up(q);
    g.kv = p.g.up(kv);
    g.kv_b = &gkvb;
    g.out = p.g.zeros(want.size());
    g.selection = KeySelection{gi.selected, gi.counts, topk};
    int32_t* gpos = p.g.up_i({int32_t(pos0)});
    for (bool dev_pos : {false, true}) {
      IndexerArgs gg = gi;
      MlaAttentionArgs ga = g;
      if (dev_pos) {  // as a recorded step: a bound above the real length
        gg.pos0_dev = ga.pos0_dev = gpos;
        gg.pos0 = ga.pos0 = N + 64 - T;
        gg.n_keys = ga.n_keys = N + 64;
      }
      const std::vector<int32_t> zeros(size_t(T * topk), 0);
      const std::vector<int32_t> full = std::vector<int32_t>(size_t(T), int32_t(topk));
      p.gpu->copy_from_host_i32(gi.selected, zeros.data(), zeros.size());
      p.gpu->copy_from_host_i32(gi.counts, full.data(), full.size());
      p.gpu->fill(ga.out, NAN, int64_t(want.size()));
      p.gpu->indexer_select(gg);
      p.gpu->mla_attention(ga);
      const double e = nmse(p.g.down(ga.out, want.size()), want);
      EXPECT_LT(e, 1e-10) << "T " << T << (dev_pos ? " run-time pos" : " host pos");
      expect_same_selection(sel, {p.g.down_i(gi.selected, size_t(T * topk)), p.g.down_i(gi.counts, size_t(T))}, topk,
                            "T " + std::to_string(T));
    }
  }
}

// Short contexts at GLM-5 head shapes: key lists of at most 256 take the one-kernel scores + o_lat
// path (splits of 32 keys, 4 heads a block), longer bounds the two long-context kernels. Lengths
// around the split edges, a head count that leaves a partial head group, causal and selected keys,
// host positions and a recorded step's run-time ones under bounds on both sides of 256.
TEST(CudaOps, DecodeAttentionShortContextsFast) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t nope = 192, rope = 64, vd = 256, L = 512, cap = 400;
  const int64_t kvw = L + rope, hw = nope + vd;
  auto kv = randv(size_t(cap * kvw), 190);
  float* gkv = p.g.up(kv);
  for (int64_t H : {int64_t(64), int64_t(6)})
    for (DType dt : {DType::BF16, DType::F8_E4M3}) {
      HostWeight kvb = make_weight(dt, H * hw, L, uint32_t(191 + H));
      Weight gkvb = p.gpu->upload_weight(kvb.w);
      for (int64_t N : {int64_t(1), int64_t(2), int64_t(32), int64_t(33), int64_t(100), int64_t(256)})
        for (int64_t T : {int64_t(1), int64_t(2)}) {
          if (N < T) continue;
          for (bool dense : {true, false}) {
            const GlmDecodeCase c =
                glm_decode_case(p, T, H, N, 64, dense, uint32_t(192 + N + T), uint32_t(193 + N), kv, gkv, kvb, gkvb);
            const std::vector<float>& want = c.want;
            const MlaAttentionArgs& g = c.g;
            int32_t* gpos = c.gpos;
            for (int64_t bound : {int64_t(0), int64_t(256), cap}) {  // 0: host positions
              if (bound > 0 && bound < N) continue;
              MlaAttentionArgs gg = g;
              if (bound > 0) {
                gg.pos0_dev = gpos;
                gg.pos0 = bound - T;
                gg.n_keys = bound;
              }
              gg.out = p.g.zeros(want.size());
              p.gpu->fill(gg.out, NAN, int64_t(want.size()));
              p.gpu->mla_attention(gg);
              const double e = nmse(p.g.down(gg.out, want.size()), want);
              EXPECT_LT(e, 1e-10) << "H " << H << " " << dt_name(dt) << " N " << N << " T " << T << " bound " << bound
                                  << (dense ? " dense" : " selected");
            }
          }
        }
    }
}

// Value widths that are not a multiple of the merge block's W_UV rows (128 at BF16 and FP8): the
// last block's rows past vd are loaded clamped and never written, so each head's output is exactly
// its vd values (the output is poisoned first, and a write past a head's rows would land in the
// next head's). Short (one kernel) and long (three) paths, selected keys.
TEST(CudaOps, DecodeAttentionValueWidthsPastTheMergeBlock) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t nope = 192, rope = 64, L = 512, cap = 700, H = 6;
  auto kv = randv(size_t(cap * (L + rope)), 290);
  float* gkv = p.g.up(kv);
  for (int64_t vd : {int64_t(200), int64_t(64)})
    for (DType dt : {DType::BF16, DType::F8_E4M3}) {
      HostWeight kvb = make_weight(dt, H * (nope + vd), L, uint32_t(291 + vd));
      Weight gkvb = p.gpu->upload_weight(kvb.w);
      for (int64_t N : {int64_t(100), cap}) {
        const GlmDecodeCase c =
            glm_decode_case(p, 1, H, N, 512, false, uint32_t(292 + N), uint32_t(293 + N), kv, gkv, kvb, gkvb, vd);
        MlaAttentionArgs g = c.g;
        p.gpu->fill(g.out, NAN, int64_t(c.want.size()));
        p.gpu->mla_attention(g);
        const double e = nmse(p.g.down(g.out, c.want.size()), c.want);
        EXPECT_LT(e, 1e-10) << "vd " << vd << " " << dt_name(dt) << " N " << N;
      }
    }
}

// The indexer's top-k on long rows (the register top-k holds 4, 8 or 16 keys a thread; 20000
// keys take the reference kernel), with runs of equal scores (repeated keys) and rows of only 3
// distinct scores, so the threshold falls inside a run of ~N/3 ties, and rows of distinct scores
// (where the radix passes stop early): the selection must
// equal the CPU's (ties to the lower position), with host and run-time positions, fast and reference.
TEST(CudaOps, IndexerSelectLongRowsIsIdentical) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t nI = 4, d = 32, topk = 2048;
  // (Fast top-k: keys a thread in registers under the bound, on one block 4 up to 4096, 8, 16 at
  // 12000; past 16384 keys on a cluster of 8 blocks, each a slice of the row in registers: 4 keys a
  // thread at N = 20000 and 32700, 8 at N = 50000, 16 at N = 70000, 32 at the bounds of 3N + 64;
  // past 262144 (4N + 64 at N = 70000) the streaming kernel.)
  for (int64_t N : {int64_t(3000), int64_t(4096), int64_t(5000), int64_t(12000), int64_t(20000), int64_t(32700),
                    int64_t(50000), int64_t(70000)})
    for (int ties = 0; ties < 3; ++ties) {  // 2: none (the radix passes usually stop after two)
      const int64_t T = 2, pos0 = N - T;
      auto q = randv(size_t(T * nI * d), uint32_t(41 + N)), w = randv(size_t(T * nI), uint32_t(42 + N), 0.5f);
      auto keys = randv(size_t(N * d), uint32_t(43 + N));
      if (ties == 0) {  // runs of 5 equal keys
        for (int64_t u = 0; u + 1 < N; ++u)
          if (u % 5 != 4) std::copy(keys.begin() + u * d, keys.begin() + (u + 1) * d, keys.begin() + (u + 1) * d);
      } else if (ties == 1) {  // 3 distinct keys (u % 3): ~N/3 equal scores each, so the threshold falls inside a run
        for (int64_t u = 3; u < N; ++u)
          std::copy(keys.begin() + (u % 3) * d, keys.begin() + (u % 3 + 1) * d, keys.begin() + u * d);
      }
      const IndexerArgs a = indexer_shape(T, nI, d, N, pos0, topk);
      const Selection want = cpu_select(p, a, q, w, keys);
      std::vector<float> kbound(keys);
      kbound.resize(size_t((4 * N + 64) * d), 0.0f);
      IndexerArgs g = a;
      g.q = p.g.up(q);
      g.weights = p.g.up(w);
      g.keys = p.g.up(kbound);
      int32_t* gpos = p.g.up_i({int32_t(pos0)});
      for (bool fast : {true, false})
        for (int64_t bound :
             {int64_t(0), N + 64, 3 * N + 64, 4 * N + 64}) {      // 0: host positions; else a recorded step's
          cuda_set_fast_decode(*p.gpu, true, fast, fast);         // bound, the row far shorter in the second
          IndexerArgs gg = g;
          if (bound > 0) {
            gg.pos0_dev = gpos;
            gg.pos0 = bound - T;
            gg.n_keys = bound;
          }
          expect_same_selection(want, gpu_select(p, gg), topk,
                                "N " + std::to_string(N) + " ties " + std::to_string(ties) +
                                    (fast ? " fast" : " reference") + " bound " + std::to_string(bound));
        }
      cuda_set_fast_decode(*p.gpu, true, true, true);
    }
}
#endif

#ifdef VIREO_HAVE_CUDA
// --math fast: prefill indexer scores on tensor cores with q and k rounded to bf16. The selection
// may differ from the exact one only at near-ties: every key chosen by one side and not the other
// must score within 1% of the row's largest score magnitude of the exact top-k threshold, and such swaps
// stay rare. Decode rows (T <= 8) keep the exact kernel, so those selections stay identical.
TEST(CudaOps, IndexerFastMathDiffersOnlyAtNearTies) {
  REQUIRE_CUDA();
  Pair p;
  cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Bf16);
  struct Shape { int64_t nI, d, T, N, topk; };
  // Prefill rows (indexer_scores_bf16) and decode rows (indexer_scores_decode_tc, also under run-time
  // positions as a recorded step gives them: the same bits as host positions).
  for (const Shape& sh : {Shape{32, 128, 700, 700, 256}, Shape{4, 32, 300, 1000, 64}, Shape{32, 128, 4, 900, 256},
                          Shape{32, 128, 1, 4096, 2048}, Shape{20, 48, 3, 333, 64}}) {
    const int64_t pos0 = sh.N - sh.T;
    auto q = randv(size_t(sh.T * sh.nI * sh.d), uint32_t(51 + sh.d)), w = randv(size_t(sh.T * sh.nI), 52, 0.5f);
    auto keys = randv(size_t(sh.N * sh.d), 53);
    const IndexerArgs a = indexer_shape(sh.T, sh.nI, sh.d, sh.N, pos0, sh.topk);
    const Selection want = cpu_select(p, a, q, w, keys);
    IndexerArgs g = a;
    g.q = p.g.up(q);
    g.weights = p.g.up(w);
    g.keys = p.g.up(keys);
    const Selection got = gpu_select(p, g);
    const std::string what = "nI " + std::to_string(sh.nI) + " T " + std::to_string(sh.T);
    if (sh.T <= 8) {
      IndexerArgs r = g;  // the recorded step's form: bounds on the host, the position on the device
      r.pos0_dev = p.g.up_i({int32_t(pos0)});
      r.n_keys = sh.N + 64;
      r.pos0 = r.n_keys - sh.T;
      std::vector<float> kpad(keys);
      kpad.resize(size_t(r.n_keys * sh.d), 1e3f);  // keys past the causal ones: never scored
      r.keys = p.g.up(kpad);
      expect_same_selection(got, gpu_select(p, r), sh.topk, what + " run-time positions");
    }
    ASSERT_EQ(got.counts, want.counts) << what;
    int64_t swaps = 0, selected = 0;
    for (int64_t t = 0; t < sh.T; ++t) {
      const int64_t n = pos0 + t + 1, c = want.counts[size_t(t)];
      selected += c;
      if (n <= sh.topk) {  // every causal key, in order
        for (int64_t i = 0; i < c; ++i) EXPECT_EQ(got.selected[size_t(t * sh.topk + i)], i) << what;
        continue;
      }
      std::vector<double> score(static_cast<size_t>(n));
      for (int64_t u = 0; u < n; ++u) {
        double s = 0;
        for (int64_t h = 0; h < sh.nI; ++h) {
          double dot = 0;
          for (int64_t x = 0; x < sh.d; ++x)
            dot += double(q[size_t((t * sh.nI + h) * sh.d + x)]) * keys[size_t(u * sh.d + x)];
          s += double(w[size_t(t * sh.nI + h)]) * std::max(dot * a.scale, 0.0);
        }
        score[size_t(u)] = s;
      }
      std::vector<double> sorted(score);
      std::nth_element(sorted.begin(), sorted.begin() + (c - 1), sorted.end(), std::greater<double>());
      const double threshold = sorted[size_t(c - 1)];
      double top = 0;  // the row's largest score magnitude: the scale of the rounding
      for (double v : score) top = std::max(top, std::fabs(v));
      std::vector<char> in_want(static_cast<size_t>(n), 0), in_got(static_cast<size_t>(n), 0);
      for (int64_t i = 0; i < c; ++i) {
        in_want[size_t(want.selected[size_t(t * sh.topk + i)])] = 1;
        const int32_t u = got.selected[size_t(t * sh.topk + i)];
        ASSERT_TRUE(u >= 0 && u < n) << what << " row " << t << " selected " << u;
        in_got[size_t(u)] = 1;
      }
      for (int64_t u = 0; u < n; ++u)
        if (in_want[size_t(u)] != in_got[size_t(u)]) {
          ++swaps;
          EXPECT_LE(std::fabs(score[size_t(u)] - threshold), 0.01 * top)
              << what << " row " << t << " key " << u << ": not a near-tie";
        }
    }
    std::printf("  %s: %lld of %lld selected keys differ from the exact selection (near-ties)\n", what.c_str(),
                (long long)swaps / 2, (long long)selected);
    EXPECT_LE(swaps, selected / 50) << what;
  }
  cuda_set_gemm_mode(*p.gpu, CudaGemmMode::Split);
}
#endif

// A streaming store's bank changes between steps: entries repointed at other weights (experts
// moved to other device slots) must be what the next launch reads, even with several launches
// queued and nothing read back in between (the table is patched from a pinned mirror on the
// stream). FP8 and BF16, the shared expert in the bank.
TEST(CudaOps, MoeExpertsSeesBankEntriesChangedBetweenCalls) {
  REQUIRE_CUDA();
  Pair p;
  const int64_t D = 256, I = 128, N = 2;
  const int K = 2, E = 6, kSources = 10, kRounds = 5;
  for (DType dt : {DType::BF16, DType::F8_E4M3}) {
    std::vector<HostWeight> hw;  // kSources experts' gate, up, down
    std::vector<Weight> gw;
    for (int i = 0; i < 3 * kSources; ++i) {
      const bool down = i % 3 == 2;
      hw.push_back(make_weight(dt, down ? D : I, down ? I : D, uint32_t(900 + i)));
    }
    for (const HostWeight& h : hw) gw.push_back(p.gpu->upload_weight(h.w));
    ExpertBank cb, gb;
    cb.n_shared = gb.n_shared = 1;
    for (ExpertBank* b : {&cb, &gb}) {
      b->gate.resize(E + 1);
      b->up.resize(E + 1);
      b->down.resize(E + 1);
    }
    auto point = [&](int e, int src) {  // bank entry e := source expert src
      for (int m = 0; m < 3; ++m) {
        std::vector<Weight>& c = m == 0 ? cb.gate : m == 1 ? cb.up : cb.down;
        std::vector<Weight>& g = m == 0 ? gb.gate : m == 1 ? gb.up : gb.down;
        c[size_t(e)] = hw[size_t(3 * src + m)].w;
        g[size_t(e)] = gw[size_t(3 * src + m)];
      }
    };
    for (int e = 0; e <= E; ++e) point(e, e);
    const std::vector<int32_t> ids = {1, 4, 0, 4};
    auto x = randv(size_t(N * D), 63, 2.0f), w = randv(ids.size(), 64);
    int32_t* gids = p.g.up_i(ids);
    float* gx = p.g.up(x);
    float* gw8 = p.g.up(w);
    std::vector<std::vector<float>> want(kRounds, std::vector<float>(size_t(N * D)));
    std::vector<float*> gout(kRounds);
    for (int r = 0; r < kRounds; ++r) {
      if (r > 0) {  // experts 1 and 4 move; in round 3 the shared expert and expert 0 too
        point(1, (E + r) % kSources);
        point(4, (2 * r + 3) % kSources);
        if (r == 3) {
          point(0, 9);
          point(E, 8);
        }
      }
      p.cpu->moe_experts(x.data(), N, ids.data(), w.data(), K, cb, want[size_t(r)].data());
      gout[size_t(r)] = p.g.up(std::vector<float>(size_t(N * D), NAN));
      p.gpu->moe_experts(gx, N, gids, gw8, K, gb, gout[size_t(r)]);  // queued, not read yet
    }
    for (int r = 0; r < kRounds; ++r) {
      EXPECT_LT(nmse(p.g.down(gout[size_t(r)], size_t(N * D)), want[size_t(r)]), 1e-10)
          << dtype_name(dt) << " round " << r;
      if (r > 0) {
        EXPECT_GT(nmse(want[size_t(r)], want[size_t(r - 1)]), 1e-3) << "round " << r << " changed nothing";
      }
    }
  }
}

// The listing kernel-costs.sh reads: kernels launched into the recorded decode step are named
// again, marked, apart from those of prefill (launched outside any recording).
TEST(CudaOps, SkipKernelsListingMarksTheRecordedStep) {
  REQUIRE_CUDA();
  vireo::test::TempDir tmp("skiplist");
  const std::string cmd = "VIREO_SKIP_KERNELS=none " + std::string(VIREO_BIN) + " bench -m " +
                          std::string(VIREO_FIXTURES_DIR) + "/glm_dsa_full_f32 --device cuda --prompt 4 --decode 4 >" +
                          (tmp / "out") + " 2>" + (tmp / "err");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << vireo::test::read_file(tmp / "err");
  std::istringstream err(vireo::test::read_file(tmp / "err"));
  std::set<std::string> recorded, outside;
  for (std::string line; std::getline(err, line);) {
    if (line.rfind("VIREO_SKIP_KERNELS: launching ", 0) != 0) continue;
    const std::string name = line.substr(30, line.find(' ', 30) - 30);
    const bool marked = line.size() > 20 && line.compare(line.size() - 20, 20, " in a recorded graph") == 0;
    (marked ? recorded : outside).insert(name);
  }
  EXPECT_GT(recorded.size(), 5u) << vireo::test::read_file(tmp / "err");
  EXPECT_GT(outside.size(), 5u);  // prefill's launches, unmarked
  EXPECT_NE(vireo::test::read_file(tmp / "out").find("decode"), std::string::npos);
}

// VIREO_SKIP_KERNELS' names (a timing switch: the launches it drops are the kernels named here).
// Runs without a GPU: it is the name test alone.
TEST(CudaOps, SkipKernelsNamesKernelsAsTheSourceDoes) {
#ifndef VIREO_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  // What cudaFuncGetName gives: nested in the anonymous namespace, a template, a plain function.
  EXPECT_EQ(cuda_kernel_name("_ZN5vireo4cuda12_GLOBAL__N_117gemv_rows2_kernelILi3ELb1ELi16EEEvPKfNS0_4DevWEPfi"),
            "gemv_rows2_kernel");
  EXPECT_EQ(cuda_kernel_name("_ZN5vireo12_GLOBAL__N_111rope_kernelEPflllllPKfii"), "rope_kernel");
  EXPECT_EQ(cuda_kernel_name("_ZN5vireo4cuda12_GLOBAL__N_119add_rms_norm_kernelEPfPKflS4_fS2_"), "add_rms_norm_kernel");
  // As an H200's runtime gave them (the anonymous namespace named after its file).
  EXPECT_EQ(cuda_kernel_name("_ZN5vireo48_GLOBAL__N__ec0edd6b_15_cuda_backend_cu_e09bab8111rope_kernelEPfllllllPKfii"),
            "rope_kernel");
  EXPECT_EQ(
      cuda_kernel_name("_ZN5vireo4cuda47_GLOBAL__N__28eb2a4a_14_cuda_decode_cu_c627bef518moe_gate_up_kernelILi3ELb1E"
                       "Lb1ELi16EEEvPKflliiiiiPKiPKNS0_9DevExpertEPf"),
      "moe_gate_up_kernel");
  EXPECT_EQ(cuda_kernel_name("_Z10fill_floatPffl"), "fill_float");
  EXPECT_EQ(cuda_kernel_name("not_mangled"), "not_mangled");
  EXPECT_EQ(cuda_kernel_name("_ZN5vir"), "_ZN5vir");  // a length past the end: unchanged
  EXPECT_TRUE(cuda_kernel_listed("rope_kernel", "rope_kernel"));
  EXPECT_TRUE(cuda_kernel_listed("gemv_rows2_kernel", "absorb_q_vec_kernel,gemv_rows2_kernel"));
  EXPECT_TRUE(cuda_kernel_listed("rope_kernel", "x,,rope_kernel"));            // empty entries are ignored
  EXPECT_FALSE(cuda_kernel_listed("add_rms_norm_kernel", "rms_norm_kernel"));  // whole names only
  EXPECT_FALSE(cuda_kernel_listed("rms_norm_kernel", "rms_norm"));
  EXPECT_FALSE(cuda_kernel_listed("rope_kernel", ""));
  EXPECT_FALSE(cuda_kernel_listed("rope_kernel", ",,"));
  EXPECT_FALSE(cuda_kernel_listed("", ",,"));
#endif
}
