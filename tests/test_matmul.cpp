// cpu_matmul against the f64 reference for every weight dtype and kernel family, odd shapes and
// batch sizes; thread-count invariance; FP8 decoding of every code through the vector kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/matmul.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

using namespace vireo;

namespace {

// Owns the bytes behind a Weight.
struct TestWeight {
  std::vector<uint8_t> bytes;
  std::vector<float> scale;
  Weight w;
};

TestWeight make_weight(DType dt, int64_t out, int64_t in, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  TestWeight tw;
  tw.bytes.resize(size_t(out * in) * dtype_size(dt) + 1);
  for (int64_t i = 0; i < out * in; ++i) {
    const float v = u(rng);
    switch (dt) {
      case DType::F32: std::memcpy(&tw.bytes[i * 4], &v, 4); break;
      case DType::BF16: { uint16_t h = f32_to_bf16(v); std::memcpy(&tw.bytes[i * 2], &h, 2); break; }
      case DType::F16: { uint16_t h = f32_to_f16(v); std::memcpy(&tw.bytes[i * 2], &h, 2); break; }
      case DType::F8_E4M3: {
        // Any code but NaN, so subnormals and extremes are covered.
        uint8_t c;
        do c = uint8_t(rng()); while ((c & 0x7f) == 0x7f);
        tw.bytes[i] = c;
        break;
      }
      default: break;
    }
  }
  tw.w.w = Tensor(tw.bytes.data(), dt, {out, in});
  if (dt == DType::F8_E4M3) {
    const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
    tw.scale.resize(so * si);
    for (auto& s : tw.scale) s = std::ldexp(0.5f + 0.5f * (u(rng) + 1.0f), int(rng() % 9) - 12);
    tw.w.scale_inv = Tensor(tw.scale.data(), DType::F32, {so, si});
  }
  return tw;
}

std::vector<float> random_x(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = g(rng);
  return x;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<MatmulIsa> supported_isas() {
  std::vector<MatmulIsa> v;
  for (MatmulIsa isa : {MatmulIsa::Scalar, MatmulIsa::Avx2, MatmulIsa::Avx512})
    if (cpu_matmul_isa_supported(isa)) v.push_back(isa);
  return v;
}

// Restores automatic kernel selection when a test ends.
struct IsaGuard {
  ~IsaGuard() { cpu_matmul_set_isa(MatmulIsa::Auto); }
};

const DType kDtypes[] = {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3};

}  // namespace

TEST(Matmul, AutoPicksASupportedIsa) {
  EXPECT_NE(cpu_matmul_isa(), MatmulIsa::Auto);
  EXPECT_TRUE(cpu_matmul_isa_supported(cpu_matmul_isa()));
  std::printf("matmul kernels: %s\n", matmul_isa_name(cpu_matmul_isa()));
}

TEST(Matmul, MatchesReferenceEveryIsaDtypeShape) {
  IsaGuard guard;
  ThreadPool pool(2);
  // {out, in}: tails in rows (not multiples of the row block), columns (not multiples of the
  // vector width or of the 128-column FP8 block), and degenerate sizes.
  const int64_t shapes[][2] = {{300, 200}, {200, 300}, {129, 257}, {257, 129}, {1, 5},
                               {5, 1},     {64, 128},  {130, 1000}, {17, 31}};
  for (MatmulIsa isa : supported_isas()) {
    cpu_matmul_set_isa(isa);
    for (DType dt : kDtypes) {
      for (const auto& s : shapes) {
        const int64_t out = s[0], in = s[1];
        TestWeight tw = make_weight(dt, out, in, uint32_t(out * 131 + in));
        for (int64_t T : {1, 2, 3, 4, 5, 7, 16, 33}) {
          std::vector<float> x = random_x(T * in, uint32_t(T + 7 * in));
          std::vector<float> y(T * out, NAN), ref(T * out);
          cpu_matmul(x.data(), T, tw.w, y.data(), pool);
          cpu_matmul_reference(x.data(), T, tw.w, ref.data());
          ASSERT_LE(rel_l2(y, ref), 1e-5)
              << matmul_isa_name(isa) << " " << dtype_name(dt) << " out=" << out << " in=" << in
              << " T=" << T;
        }
      }
    }
  }
}

TEST(Matmul, LargerShapesMatchReference) {
  IsaGuard guard;
  ThreadPool pool(2);
  for (MatmulIsa isa : supported_isas()) {
    if (isa == MatmulIsa::Scalar) continue;
    cpu_matmul_set_isa(isa);
    for (DType dt : kDtypes) {
      TestWeight tw = make_weight(dt, 200, 1100, 5);  // several prefill column tiles and row tiles
      for (int64_t T : {1, 4, 9, 64}) {
        std::vector<float> x = random_x(T * 1100, uint32_t(T));
        std::vector<float> y(T * 200), ref(T * 200);
        cpu_matmul(x.data(), T, tw.w, y.data(), pool);
        cpu_matmul_reference(x.data(), T, tw.w, ref.data());
        ASSERT_LE(rel_l2(y, ref), 1e-5) << matmul_isa_name(isa) << " " << dtype_name(dt) << " T=" << T;
      }
    }
  }
}

TEST(Matmul, BitIdenticalAcrossThreadCounts) {
  IsaGuard guard;
  ThreadPool p1(1), p2(2), p3(3);
  for (MatmulIsa isa : supported_isas()) {
    cpu_matmul_set_isa(isa);
    for (DType dt : kDtypes) {
      TestWeight tw = make_weight(dt, 301, 520, 11);
      for (int64_t T : {1, 2, 3, 6, 16}) {
        std::vector<float> x = random_x(T * 520, 3);
        std::vector<float> y1(T * 301), y2(T * 301), y3(T * 301);
        cpu_matmul(x.data(), T, tw.w, y1.data(), p1);
        cpu_matmul(x.data(), T, tw.w, y2.data(), p2);
        cpu_matmul(x.data(), T, tw.w, y3.data(), p3);
        ASSERT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * 4), 0)
            << matmul_isa_name(isa) << " " << dtype_name(dt) << " T=" << T;
        ASSERT_EQ(std::memcmp(y1.data(), y3.data(), y1.size() * 4), 0)
            << matmul_isa_name(isa) << " " << dtype_name(dt) << " T=" << T;
      }
    }
  }
}

// Each row of a product has the bits a T = 1 call on that row gives, whatever T is: a speculative
// verification step's rows equal decode steps', and a batch of sequences (a server's step, the
// rows routed to one expert) computes each sequence's rows as it would alone. T = 2, 3 run the
// direct kernel, T >= 4 the packed one on AVX-512; `in` 1100 leaves a partial 512-column chunk,
// 128-column FP8 block and 32-column step.
TEST(Matmul, RowsEqualSingleRowCallsAtAnyT) {
  IsaGuard guard;
  ThreadPool pool(2);
  for (MatmulIsa isa : supported_isas()) {
    cpu_matmul_set_isa(isa);
    for (DType dt : kDtypes) {
      for (int64_t in : {700, 1100}) {
        TestWeight tw = make_weight(dt, 150, in, 17);
        for (int64_t T : {2, 3, 4, 7, 9}) {
          std::vector<float> x = random_x(T * in, 23);
          std::vector<float> y(T * 150), y1(150);
          cpu_matmul(x.data(), T, tw.w, y.data(), pool);
          for (int64_t t = 0; t < T; ++t) {
            cpu_matmul(x.data() + t * in, 1, tw.w, y1.data(), pool);
            ASSERT_EQ(std::memcmp(y.data() + t * 150, y1.data(), 150 * 4), 0)
                << matmul_isa_name(isa) << " " << dtype_name(dt) << " in=" << in << " T=" << T << " t=" << t;
          }
        }
      }
    }
  }
}

// Every finite e4m3 code, decoded by the vector path (bit tricks + F16C, 2^8 folded into the
// scale), must equal the scalar decoder exactly. Row c holds code c at column `col`, zeros
// elsewhere; x is the unit vector on `col`, so y[c] is exactly the decoded value.
TEST(Matmul, Fp8AllCodesThroughKernels) {
  IsaGuard guard;
  ThreadPool pool(2);
  const int64_t in = 300;
  for (MatmulIsa isa : supported_isas()) {
    cpu_matmul_set_isa(isa);
    for (int64_t col : {0, 5, 129, 299}) {  // aligned, inside, second block, masked tail
      std::vector<uint8_t> w(256 * in, 0);
      for (int c = 0; c < 256; ++c) w[c * in + col] = uint8_t(c);
      std::vector<float> scale(2 * 3, 1.0f);
      Weight wt{Tensor(w.data(), DType::F8_E4M3, {256, in}), Tensor(scale.data(), DType::F32, {2, 3})};
      for (int64_t T : {1, 3, 8}) {
        std::vector<float> x(T * in, 0.0f);
        for (int64_t t = 0; t < T; ++t) x[t * in + col] = 1.0f;
        std::vector<float> y(T * 256);
        cpu_matmul(x.data(), T, wt, y.data(), pool);
        for (int64_t t = 0; t < T; ++t)
          for (int c = 0; c < 256; ++c) {
            if ((c & 0x7f) == 0x7f) continue;  // NaN codes
            ASSERT_EQ(y[t * 256 + c], fp8_e4m3_to_f32(uint8_t(c)))
                << matmul_isa_name(isa) << " code " << c << " col " << col << " T=" << T;
          }
      }
    }
  }
}

TEST(Matmul, RejectsBadWeights) {
  ThreadPool pool(1);
  std::vector<uint8_t> w(4 * 4);
  float x[4] = {}, y[4];
  Weight no_scale{Tensor(w.data(), DType::F8_E4M3, {4, 4}), Tensor()};
  EXPECT_THROW(cpu_matmul(x, 1, no_scale, y, pool), Error);
  Weight ints{Tensor(w.data(), DType::I32, {2, 2}), Tensor()};
  EXPECT_THROW(cpu_matmul(x, 1, ints, y, pool), Error);
}
