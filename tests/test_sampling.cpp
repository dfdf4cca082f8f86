// The sampling reference (backend/sampling.h) and Backend::sample_rows: the portable exp against
// std::exp, the levels and their searches against plain double loops, the whole draw against a
// double-precision oracle (an inverse-CDF grid of uniforms gives each token's mass exactly), the
// CPU backend against Sampler, the CUDA backend against the CPU token for token, and generation
// (generate, the scheduler, `vireo run`) on the backend path against the host path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/sampling.h"
#include "core/error.h"
#include "core/portable_math.h"
#include "cuda_test_util.h"
#include "io/json_file.h"
#include "model/glm_dsa/model.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "runtime/scheduler.h"
#include "test_helpers.h"

using namespace vireo;

namespace {

const std::string kFixture = std::string(VIREO_FIXTURES_DIR) + "/glm_dsa_full_f32";
const std::string kDemo = std::string(VIREO_SOURCE_DIR) + "/models/vireo-demo";

// The distance from `got` to the exact value `want` in units of the float spacing at `want`.
double ulps(float got, double want) {
  const double a = std::fabs(want);
  const double spacing = a < 0x1p-126 ? 0x1p-149 : std::ldexp(1.0, std::ilogb(a) - 23);
  return std::fabs(double(got) - want) / spacing;
}

// Straightforward double-precision sampling distribution: P(token) after temperature, top-k,
// top-p and min-p. `margin` gets the smallest distance of a cutoff decision from its threshold
// (a reference in float may decide such a near tie the other way).
std::vector<double> oracle(const std::vector<float>& l, double T, int top_k, double top_p, double min_p,
                           double* margin) {
  const int64_t V = int64_t(l.size());
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)]; });
  int64_t n = top_k > 0 && top_k < V ? top_k : V;
  std::vector<double> p(static_cast<size_t>(n));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += p[size_t(i)] = std::exp((double(l[size_t(order[size_t(i)])]) - l[size_t(order[0])]) / T);
  for (double& x : p) x /= sum;
  *margin = 1;
  if (top_p < 1) {
    double cum = 0;
    for (int64_t i = 0; i < n; ++i) {
      cum += p[size_t(i)];
      *margin = std::min(*margin, std::fabs(cum - top_p));
      if (cum >= top_p) {
        n = i + 1;
        break;
      }
    }
  }
  if (min_p > 0) {
    int64_t keep = 1;
    while (keep < n && p[size_t(keep)] >= min_p * p[0]) ++keep;
    for (int64_t i = 1; i < n; ++i) *margin = std::min(*margin, std::fabs(p[size_t(i)] - min_p * p[0]));
    n = keep;
  }
  double kept = 0;
  for (int64_t i = 0; i < n; ++i) kept += p[size_t(i)];
  std::vector<double> out(static_cast<size_t>(V), 0.0);
  for (int64_t i = 0; i < n; ++i) out[size_t(order[size_t(i)])] = p[size_t(i)] / kept;
  return out;
}

std::vector<float> normal_logits(int64_t n, uint32_t seed, float scale) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(g);
  return v;
}

SampleRowArgs row_args(float t, int k, float p, float m, double u) {
  SampleRowArgs a;
  a.temperature = t;
  a.top_k = k;
  a.top_p = p;
  a.min_p = m;
  a.uniform = u;
  return a;
}

}  // namespace

TEST(PortableMath, ExpIsWithinOneUlpOfTheTrueValue) {
  // Every 97th float from -104 to 89 (about 15 million), plus the special values.
  double worst = 0;
  float worst_at = 0;
  auto check = [&](float x) {
    const float got = pm::exp(x);
    const double want = std::exp(double(x));
    if (want > double(std::numeric_limits<float>::max())) {
      EXPECT_TRUE(std::isinf(got)) << x;
      return;
    }
    const double e = ulps(got, want);
    if (e > worst) {
      worst = e;
      worst_at = x;
    }
  };
  for (uint32_t b = pm::float_bits(-104.0f); b > 0x80000000u; b -= 97) check(pm::bits_float(b));
  for (uint32_t b = 0; b < pm::float_bits(89.0f); b += 97) check(pm::bits_float(b));
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, 88.72f, -87.3f, -100.0f, -103.9f, 1e-30f, -1e-30f}) check(x);
  std::printf("  portable exp: worst error %.3f ulp at x = %a\n", worst, worst_at);
  EXPECT_LE(worst, 1.0);
  EXPECT_EQ(pm::exp(0.0f), 1.0f);
  EXPECT_EQ(pm::exp(-INFINITY), 0.0f);
  EXPECT_EQ(pm::exp(-200.0f), 0.0f);
  EXPECT_TRUE(std::isinf(pm::exp(100.0f)));
  EXPECT_TRUE(std::isnan(pm::exp(NAN)));
}

TEST(SamplingReference, LevelsSumAndSearchLikePlainLoops) {
  std::mt19937 g(5);
  std::uniform_real_distribution<float> d(0.0f, 1.0f);
  for (int64_t n : {1, 2, 31, 32, 33, 1024, 1025, 40000}) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = d(g);
    const SumLevels L = sum_levels(n);
    EXPECT_EQ(L.size[L.count], 1);
    std::vector<double> sums(static_cast<size_t>(L.doubles));
    for (int l = 1; l <= L.count; ++l)
      for (int64_t j = 0; j < L.size[l]; ++j) sums[size_t(L.offset[l] + j)] = level_block_sum(v.data(), sums.data(), L, l, j);
    std::vector<double> prefix(static_cast<size_t>(n));  // sequential long double, the exact-enough truth
    long double c = 0;
    for (int64_t i = 0; i < n; ++i) prefix[size_t(i)] = double(c += v[size_t(i)]);
    const double total = sums[size_t(L.offset[L.count])];
    EXPECT_NEAR(total, prefix.back(), 1e-12 * prefix.back()) << n;
    for (int q = 0; q < 200; ++q) {
      const double t = double(d(g)) * total;
      const int64_t want = std::upper_bound(prefix.begin(), prefix.end(), t) - prefix.begin();  // first > t
      const int64_t got = level_search(v.data(), sums.data(), L, t, true);
      // Only a threshold within rounding of a prefix sum may land one index off.
      const bool near = (want < n && std::fabs(prefix[size_t(want)] - t) < 1e-9) ||
                        (want > 0 && std::fabs(prefix[size_t(want - 1)] - t) < 1e-9);
      if (!near) {
        EXPECT_EQ(got, std::min(want, n - 1)) << "n " << n << " threshold " << t;
      }
    }
    EXPECT_EQ(level_search(v.data(), sums.data(), L, 2 * total, false), n - 1);  // never reached
    EXPECT_EQ(level_search(v.data(), sums.data(), L, 0.0, false), 0);
  }
}

TEST(SamplingReference, CandidateOrderIsDescendingLogitThenId) {
  SampleWorkspace ws;
  for (int64_t V : {int64_t(5), int64_t(100), int64_t(5000), int64_t(154880)}) {
    std::vector<std::vector<float>> rows;
    rows.push_back(normal_logits(V, uint32_t(V), 3.0f));
    std::vector<float> ties = normal_logits(V, uint32_t(V) + 1, 2.0f);
    for (size_t i = 0; i < ties.size(); ++i) ties[i] = i % 5 == 0 ? (i % 2 ? -0.0f : 0.0f) : std::round(ties[i] * 4) / 4;
    ties[0] = INFINITY;
    ties[size_t(V - 1)] = -INFINITY;
    rows.push_back(ties);
    rows.push_back(std::vector<float>(static_cast<size_t>(V), -1.5f));
    for (const auto& l : rows) {
      std::vector<int32_t> want(static_cast<size_t>(V));
      std::iota(want.begin(), want.end(), 0);
      std::stable_sort(want.begin(), want.end(), [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)]; });
      for (int64_t n : {int64_t(1), int64_t(2), int64_t(7), V / 16, V / 16 + 1, V}) {
        if (n < 1 || n > V) continue;
        sample_candidate_order(l.data(), V, n, ws);
        ASSERT_EQ(ws.ids, std::vector<int32_t>(want.begin(), want.begin() + n)) << "vocab " << V << " n " << n;
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(ws.order_keys[size_t(i)], sample_order_key(l[size_t(want[size_t(i)])]));
      }
    }
  }
}

// sample_warp restated the plain way: candidates by a stable sort, each weight from its gathered
// logit with the portable build's exp, each level entry by level_block_sum. The library sorts by
// radix or a bounded selection, reads the logits back from their sort keys, runs the weights with
// FMA instructions where the CPU has them and sums level 1 eight blocks at a time: all of that
// must leave every bit of the probabilities, the level sums, the cutoffs and the mass as here.
TEST(SamplingReference, WarpIsTheStraightforwardComputationBitForBit) {
  SampleWorkspace ws;
  int checked = 0;
  for (int64_t V : {int64_t(3), int64_t(300), int64_t(5000), int64_t(154880)}) {
    std::vector<std::vector<float>> rows = {normal_logits(V, uint32_t(V) + 7, 3.0f)};
    std::vector<float> ties = normal_logits(V, uint32_t(V) + 8, 2.0f);
    for (size_t i = 0; i < ties.size(); ++i)
      ties[i] = i % 5 == 0 ? (i % 2 ? -0.0f : 0.0f) : std::round(ties[i] * 4) / 4;
    ties[size_t(V - 1)] = -INFINITY;
    rows.push_back(ties);
    std::vector<float> wide = normal_logits(V, uint32_t(V) + 9, 40.0f);  // many weights underflow to 0
    wide[0] = 0.0f;
    rows.push_back(wide);
    for (const auto& l : rows)
      for (const SampleRowArgs& a : {row_args(0.8f, 0, 1, 0, 0), row_args(1.0f, 40, 1, 0, 0),
                                     row_args(0.6f, 0, 0.9f, 0, 0), row_args(1.3f, 0, 1, 0.05f, 0),
                                     row_args(0.7f, int(V / 16), 0.95f, 0.01f, 0), row_args(1e-30f, 0, 1, 0, 0)}) {
        std::vector<int32_t> ids(static_cast<size_t>(V));
        std::iota(ids.begin(), ids.end(), 0);
        std::stable_sort(ids.begin(), ids.end(), [&](int32_t x, int32_t y) {
          return sample_order_key(l[size_t(x)]) < sample_order_key(l[size_t(y)]);
        });
        const int64_t n = sample_candidates(a, V);
        const float inv_t = pm::div(1.0f, a.temperature), x0 = l[size_t(ids[0])];
        std::vector<float> prob(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) prob[size_t(i)] = sample_weight(l[size_t(ids[size_t(i)])], x0, inv_t);
        SumLevels L = sum_levels(n);
        std::vector<double> sums(static_cast<size_t>(L.doubles));
        auto build = [&] {
          for (int lv = 1; lv <= L.count; ++lv)
            for (int64_t j = 0; j < L.size[lv]; ++j)
              sums[size_t(L.offset[lv] + j)] = level_block_sum(prob.data(), sums.data(), L, lv, j);
        };
        build();
        const double total = sums[size_t(L.offset[L.count])];
        for (float& x : prob) x = pm::to_float(pm::div(double(x), total));
        build();
        int64_t keep = a.top_p < 1.0f ? level_search(prob.data(), sums.data(), L, double(a.top_p), false) + 1 : n;
        if (a.min_p > 0.0f)
          for (int64_t i = 1; i < keep; ++i)
            if (prob[size_t(i)] < pm::mul(a.min_p, prob[0])) {
              keep = i;
              break;
            }
        if (keep != n) {
          L = resize_levels(L, keep);
          build();
        }

        const WarpedCandidates w = sample_warp(l.data(), V, a, ws);
        const std::string what = "vocab " + std::to_string(V) + " T " + std::to_string(a.temperature) + " top_k " +
                                 std::to_string(a.top_k) + " top_p " + std::to_string(a.top_p);
        ASSERT_EQ(w.keep, keep) << what;
        ASSERT_EQ(ws.ids, std::vector<int32_t>(ids.begin(), ids.begin() + n)) << what;
        ASSERT_EQ(std::memcmp(ws.prob.data(), prob.data(), size_t(n) * sizeof(float)), 0) << what;
        for (int lv = 1; lv <= L.count; ++lv)
          for (int64_t j = 0; j < L.size[lv]; ++j)
            ASSERT_EQ(ws.sums[size_t(L.offset[lv] + j)], sums[size_t(L.offset[lv] + j)])
                << what << " level " << lv << " entry " << j;
        ASSERT_EQ(w.mass, sums[size_t(L.offset[L.count])]) << what;
        // The portable weights (no FMA instructions) and the dispatched ones: the same bits.
        std::vector<float> plain(static_cast<size_t>(n)), fast(static_cast<size_t>(n));
        sample_candidate_weights(ws.order_keys.data(), n, inv_t, plain.data(), false);
        sample_candidate_weights(ws.order_keys.data(), n, inv_t, fast.data(), true);
        ASSERT_EQ(std::memcmp(plain.data(), fast.data(), size_t(n) * sizeof(float)), 0) << what;
        ++checked;
      }
  }
  EXPECT_EQ(checked, 4 * 3 * 6);
}

TEST(SamplingReference, DrawsFollowTheDoubleOracle) {
  // Uniforms on a grid (j + 1/2) / N: the draw is an inverse CDF, so each token is drawn
  // N * P(token) times within 1 (each cutoff and its mass rounded, far below 1/N).
  const int N = 4000;
  int checked = 0;
  SampleWorkspace ws;
  for (uint32_t seed : {1u, 2u}) {
    const std::vector<float> l = normal_logits(300, seed, 2.0f);
    for (float T : {0.5f, 1.0f, 2.0f})
      for (int k : {0, 1, 5, 50})
        for (float tp : {1.0f, 0.9f, 0.5f})
          for (float mp : {0.0f, 0.05f, 0.2f}) {
            double margin = 1;
            const std::vector<double> want = oracle(l, T, k, tp, mp, &margin);
            if (margin < 1e-5) continue;  // a cutoff within float rounding of its threshold
            std::vector<int> count(l.size(), 0);
            for (int j = 0; j < N; ++j) ++count[size_t(sample_row(l.data(), 300, row_args(T, k, tp, mp, (j + 0.5) / N), ws))];
            for (size_t i = 0; i < l.size(); ++i)
              ASSERT_NEAR(double(count[i]) / N, want[i], 1.01 / N)
                  << "token " << i << " T " << T << " top_k " << k << " top_p " << tp << " min_p " << mp;
            ++checked;
          }
  }
  EXPECT_GE(checked, 150);  // of 216: few cases sit on a cutoff
}

TEST(SamplingReference, TiesEdgesAndGreedy) {
  SampleWorkspace ws;
  // Exact ties (and -0 == +0) are ordered by id: top-k 2 keeps ids 1 and 3 of the three 2.0s.
  const std::vector<float> l = {0.0f, 2.0f, -1.0f, 2.0f, 2.0f, -0.0f};
  EXPECT_EQ(sample_row(l.data(), 6, row_args(0.0f, 0, 1, 0, 0.5), ws), 1);
  EXPECT_EQ(sample_row(l.data(), 6, row_args(1.0f, 1, 1, 0, 0.99), ws), 1);
  std::map<int32_t, int> seen;
  for (int j = 0; j < 100; ++j) seen[sample_row(l.data(), 6, row_args(1.0f, 2, 1, 0, j / 100.0), ws)]++;
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1], 50);
  EXPECT_EQ(seen[3], 50);
  // Uniform 0 draws the first candidate; the largest uniform below 1 the last kept one.
  const std::vector<float> m = {1.0f, 3.0f, 2.0f, -INFINITY, 0.5f};
  EXPECT_EQ(sample_row(m.data(), 5, row_args(1.0f, 0, 1, 0, 0.0), ws), 1);
  EXPECT_EQ(sample_row(m.data(), 5, row_args(1.0f, 0, 1, 0, 1.0 - 0x1p-53), ws), 4);  // -inf never drawn
  EXPECT_EQ(sample_row(m.data(), 5, row_args(1.0f, 3, 1, 0, 1.0 - 0x1p-53), ws), 0);
  // top_p tiny keeps the best alone.
  EXPECT_EQ(sample_row(m.data(), 5, row_args(1.0f, 0, 1e-6f, 0, 1.0 - 0x1p-53), ws), 1);
}

// Penalties (SamplingParams): the arithmetic on a row, stated case by case.
TEST(Penalties, ApplyIsTheStatedArithmetic) {
  SamplingParams p;
  p.repetition_penalty = 1.25f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = -0.25f;
  const std::vector<float> row = {2.0f, -2.0f, 0.0f, 3.0f, -1.0f, 4.0f};
  std::vector<uint8_t> in_context = {1, 1, 1, 1, 0, 0};  // 0..3: prompt or generated
  std::vector<int32_t> generated = {0, 2, 0, 1, 0, 0};   // 1 twice, 3 once
  std::vector<float> x = row;
  adjust_logits(p, x.data(), in_context, generated, {0, 1, 2, 3});
  EXPECT_EQ(x[0], 2.0f / 1.25f);                         // in the prompt: divided (> 0)
  EXPECT_EQ(x[1], -2.0f * 1.25f - 0.5f * 2.0f + 0.25f);  // multiplied (< 0), counted twice, present
  EXPECT_EQ(x[2], 0.0f);                                 // 0 stays 0
  EXPECT_EQ(x[3], 3.0f / 1.25f - 0.5f + 0.25f);
  EXPECT_EQ(x[4], -1.0f);  // untouched
  EXPECT_EQ(x[5], 4.0f);
  p.repetition_penalty = 0.5f;  // below 1: repeated tokens favoured
  x = row;
  adjust_logits(p, x.data(), in_context, generated, {0, 1, 2, 3});
  EXPECT_EQ(x[0], 4.0f);
  EXPECT_EQ(x[1], -1.0f - 1.0f + 0.25f);
  p.logit_bias = {{1, 3.0f}, {4, -100.0f}};  // the biases first: token 1's logit turns positive
  x = row;
  adjust_logits(p, x.data(), in_context, generated, {0, 1, 2, 3});
  EXPECT_EQ(x[1], (-2.0f + 3.0f) / 0.5f - 1.0f + 0.25f);
  EXPECT_EQ(x[4], -101.0f);
  EXPECT_EQ(x[5], 4.0f);
  SamplingParams m;  // min_tokens: the EOS ids out while fewer were drawn, last of all
  m.min_tokens = 2;
  m.eos_ids = {5};
  m.logit_bias = {{5, 50.0f}};
  for (int64_t drawn : {0, 1, 2}) {
    x = row;
    adjust_logits(m, x.data(), in_context, generated, {}, drawn);
    EXPECT_EQ(x[5], drawn < 2 ? -INFINITY : 54.0f) << drawn;
    EXPECT_EQ(x[4], -1.0f);
  }
}

// allowed_token_ids: every other logit -inf, before the biases; the sampler then draws only the
// allowed ids, greedy or not.
TEST(Penalties, AllowedIdsMaskEveryOtherToken) {
  const std::vector<float> row = {2.0f, -2.0f, 0.0f, 3.0f, -1.0f, 4.0f};
  std::vector<uint8_t> in_context(row.size(), 0);
  std::vector<int32_t> generated(row.size(), 0);
  SamplingParams p;
  p.allowed_ids = {1, 4};
  p.logit_bias = {{4, 2.0f}, {5, 100.0f}};
  std::vector<float> x = row;
  adjust_logits(p, x.data(), in_context, generated, {});
  EXPECT_EQ(x, (std::vector<float>{-INFINITY, -2.0f, -INFINITY, -INFINITY, 1.0f, -INFINITY}));
  Sampler greedy(p);
  EXPECT_EQ(greedy.sample(row.data(), int64_t(row.size())), 4);  // 5 would win unmasked, 3 without the bias
  p.temperature = 1.0f;
  p.logit_bias.clear();
  for (uint64_t seed = 0; seed < 50; ++seed) {
    p.seed = seed;
    Sampler s(p);
    const int32_t t = s.sample(row.data(), int64_t(row.size()));
    EXPECT_TRUE(t == 1 || t == 4) << t;
  }
  p.allowed_ids = {6};
  Sampler outside(p);
  try {
    outside.sample(row.data(), int64_t(row.size()));
    FAIL() << "an allowed id past the vocabulary was drawn from";
  } catch (const vireo::Error& e) {
    EXPECT_NE(std::string(e.what()).find("allowed_token_ids"), std::string::npos) << e.what();
  }
}

// bad_words: a word's last token is banned where the tokens drawn so far end with the rest of it;
// the sampler keeps what it drew, so greedy walks around a word it would otherwise write.
TEST(Penalties, BadWordsBanTheirLastTokenAfterTheirPrefix) {
  const std::vector<float> row = {2.0f, -2.0f, 0.0f, 3.0f, -1.0f, 4.0f};
  std::vector<uint8_t> in_context(row.size(), 0);
  std::vector<int32_t> generated(row.size(), 0);
  SamplingParams p;
  p.bad_words = {{4}, {3, 5}, {1, 3, 0}};
  auto banned = [&](const std::vector<int32_t>& drawn) {
    std::vector<float> x = row;
    adjust_logits(p, x.data(), in_context, generated, {}, int64_t(drawn.size()), drawn);
    std::vector<int32_t> out;
    for (int32_t i = 0; i < int32_t(x.size()); ++i)
      if (x[size_t(i)] == -INFINITY) out.push_back(i);
      else EXPECT_EQ(x[size_t(i)], row[size_t(i)]) << i;
    return out;
  };
  EXPECT_EQ(banned({}), (std::vector<int32_t>{4}));  // a one-token word always; longer ones need their prefix
  EXPECT_EQ(banned({0, 3}), (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(banned({1, 3}), (std::vector<int32_t>{0, 4, 5}));
  EXPECT_EQ(banned({3, 1}), (std::vector<int32_t>{4}));  // the prefix must end what was drawn
  p.bad_words = {{4}, {5, 5}};
  Sampler s(p);  // greedy: 5, then 3 (5 after 5 is banned), then 5 again
  std::vector<int32_t> picks;
  for (int i = 0; i < 4; ++i) picks.push_back(s.sample(row.data(), int64_t(row.size())));
  EXPECT_EQ(picks, (std::vector<int32_t>{5, 3, 5, 3}));
}

// Sampler keeps the penalties' history itself: the prompt, then each token it picks.
TEST(Penalties, SamplerCountsThePromptAndItsOwnPicks) {
  const std::vector<float> row = {3.0f, 2.5f, 2.0f, 0.5f, -1.0f};
  auto picks = [&](SamplingParams p, const std::vector<int32_t>& prompt, int n) {
    Sampler s(p);
    s.set_prompt(prompt);
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) out.push_back(s.sample(row.data(), int64_t(row.size())));
    return out;
  };
  SamplingParams f;
  f.frequency_penalty = 0.6f;  // 3.0 | 2.5 | 3.0 - 0.6 = 2.4 over 2.0 | 2.0 over 1.9 and 1.8
  EXPECT_EQ(picks(f, {}, 4), (std::vector<int32_t>{0, 1, 0, 2}));
  EXPECT_EQ(picks(f, {0, 0, 0}, 2), (std::vector<int32_t>{0, 1}));  // the prompt is not counted
  SamplingParams r;
  r.repetition_penalty = 2.0f;  // 0 in the prompt: 1.5; then 2.5 -> 1.25, 2.0 -> 1.0; no compounding
  EXPECT_EQ(picks(r, {0}, 4), (std::vector<int32_t>{1, 2, 0, 0}));
  SamplingParams none;
  EXPECT_EQ(picks(none, {0}, 3), (std::vector<int32_t>{0, 0, 0}));
  SamplingParams banned;
  banned.logit_bias = {{0, -100.0f}, {3, 1.75f}};  // 0 banned; 3: 0.5 + 1.75 = 2.25 after 2.5
  EXPECT_EQ(picks(banned, {}, 2), (std::vector<int32_t>{1, 1}));
  banned.frequency_penalty = 0.5f;  // 1: 2.5, then 2.0 under 3's 2.25
  EXPECT_EQ(picks(banned, {}, 2), (std::vector<int32_t>{1, 3}));
  // Sampled: the draw of sample_row on the penalized row, with the stream's uniforms in order.
  SamplingParams t;
  t.temperature = 0.9f;
  t.seed = 5;
  t.presence_penalty = 1.5f;
  t.repetition_penalty = 1.1f;
  Sampler with(t), plain([&] {
    SamplingParams q = t;
    q.presence_penalty = 0.0f;
    q.repetition_penalty = 1.0f;
    return q;
  }());
  const std::vector<float> wide = normal_logits(300, 4, 2.0f);
  with.set_prompt({7, 8});
  std::vector<uint8_t> ctx(300, 0);
  std::vector<int32_t> gen(300, 0), touched = {7, 8};
  ctx[7] = ctx[8] = 1;
  std::set<int32_t> distinct;
  for (int i = 0; i < 60; ++i) {
    std::vector<float> x = wide;
    adjust_logits(t, x.data(), ctx, gen, touched);
    const int32_t want = plain.sample(x.data(), 300);
    ASSERT_EQ(with.sample(wide.data(), 300), want) << "step " << i;
    if (!ctx[size_t(want)]) touched.push_back(want);
    ctx[size_t(want)] = 1;
    ++gen[size_t(want)];
    distinct.insert(want);
  }
  EXPECT_GT(distinct.size(), 30u);  // the presence penalty spreads the picks
  // Bad values are refused by name.
  for (auto [field, set] :
       std::vector<std::pair<std::string, std::function<void(SamplingParams&)>>>{{"repetition_penalty",
                                                                                  [](SamplingParams& q) {
                                                                                    q.repetition_penalty = 0.0f;
                                                                                  }},
                                                                                 {"frequency_penalty",
                                                                                  [](SamplingParams& q) {
                                                                                    q.frequency_penalty = 2.5f;
                                                                                  }},
                                                                                 {"presence_penalty",
                                                                                  [](SamplingParams& q) {
                                                                                    q.presence_penalty = NAN;
                                                                                  }},
                                                                                 {"logit_bias: the bias of token 3",
                                                                                  [](SamplingParams& q) {
                                                                                    q.logit_bias = {{3, 101.0f}};
                                                                                  }},
                                                                                 {"logit_bias: token id -1",
                                                                                  [](SamplingParams& q) {
                                                                                    q.logit_bias = {{-1, 1.0f}};
                                                                                  }}}) {
    SamplingParams q;
    set(q);
    try {
      Sampler bad(q);
      ADD_FAILURE() << field << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(field, 0), 0u) << e.what();
    }
  }
}

// generate() with penalties (its host path) on an f32 fixture whose indexer selects (index_topk 12
// of up to 60 keys): transformers' greedy tokens (tests/fixtures/penalties.json), the prompt whole
// or in chunks, and the cache left as the backend path leaves it.
TEST(Penalties, GenerateMatchesTransformersOnTheF32Fixture) {
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(kFixture, *be);
  const Json golden = read_json_file(std::string(VIREO_FIXTURES_DIR) + "/penalties.json");
  int checked = 0;
  for (const Json& c : golden["cases"]) {
    if (c["model"].get<std::string>() != "glm_dsa_full_f32") continue;
    const auto prompt = c["prompt"].get<std::vector<int32_t>>();
    const auto want = c["new"].get<std::vector<int32_t>>();
    GenerateOptions opt;
    opt.max_new_tokens = int64_t(want.size());
    opt.stop_at_eos = false;
    opt.sampling.repetition_penalty = c["repetition_penalty"].get<float>();
    opt.sampling.frequency_penalty = c["frequency_penalty"].get<float>();
    opt.sampling.presence_penalty = c["presence_penalty"].get<float>();
    for (int64_t chunk : {int64_t(0), int64_t(7)}) {
      opt.prefill_chunk = chunk;
      MlaCache cache(*be, m->cache_shape(), 1, int64_t(prompt.size() + want.size()));
      EXPECT_EQ(generate(*m, cache, 0, prompt, opt).tokens, want)
          << "repetition " << opt.sampling.repetition_penalty << " frequency " << opt.sampling.frequency_penalty
          << " presence " << opt.sampling.presence_penalty << " chunk " << chunk;
      EXPECT_EQ(cache.length(0), int64_t(prompt.size() + want.size()) - 1);
    }
    ++checked;
  }
  EXPECT_EQ(checked, 4);
}

// logit_bias through generate(): -100 on the token greedy decoding picks first makes the first
// token the runner-up of the prompt's logits; +100 on a token makes every pick that token.
TEST(Penalties, LogitBiasBansAndFavoursTokens) {
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(kFixture, *be);
  const Json e = read_json_file(kFixture + "/expected.json");
  const auto prompt = e["greedy_prompt"].get<std::vector<int32_t>>();
  const auto plain = e["greedy_new"].get<std::vector<int32_t>>();
  const int64_t V = m->config().vocab_size;
  std::vector<float> logits(static_cast<size_t>(V));
  MlaCache c0(*be, m->cache_shape(), 1, int64_t(prompt.size()));
  m->forward(prompt.data(), int64_t(prompt.size()), c0, 0, logits.data());
  ASSERT_EQ(argmax(logits.data(), V), plain[0]);
  logits[size_t(plain[0])] -= 100.0f;
  GenerateOptions opt;
  opt.max_new_tokens = 6;
  opt.stop_at_eos = false;
  opt.sampling.logit_bias = {{plain[0], -100.0f}};
  MlaCache c1(*be, m->cache_shape(), 1, int64_t(prompt.size()) + 6);
  const auto banned = generate(*m, c1, 0, prompt, opt).tokens;
  EXPECT_EQ(banned[0], argmax(logits.data(), V));
  EXPECT_EQ(std::count(banned.begin(), banned.end(), plain[0]), 0);
  opt.sampling.logit_bias = {{77, 100.0f}};
  MlaCache c2(*be, m->cache_shape(), 1, int64_t(prompt.size()) + 6);
  EXPECT_EQ(generate(*m, c2, 0, prompt, opt).tokens, std::vector<int32_t>(6, 77));
  opt.sampling.logit_bias = {{int32_t(V), 1.0f}};
  MlaCache c3(*be, m->cache_shape(), 1, int64_t(prompt.size()) + 6);
  try {
    generate(*m, c3, 0, prompt, opt);
    ADD_FAILURE() << "a token id past the vocabulary accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("logit_bias: token id 256 is outside the vocabulary"), std::string::npos)
        << err.what();
  }
}

TEST(SamplingReference, CpuBackendEqualsSamplerRowByRow) {
  auto be = make_cpu_backend();
  const int64_t V = 5000, R = 6;
  std::vector<float> x = normal_logits(R * V, 9, 3.0f);
  for (int64_t i = 0; i < V; i += 7) x[size_t(V + i)] = 1.0f;  // row 1: many exact ties
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_k = 0;
  p.top_p = 0.9f;
  p.min_p = 0.02f;
  p.seed = 3;
  for (int top_k : {0, 40}) {
    p.top_k = top_k;
    Sampler host(p), dev(p);
    for (int step = 0; step < 20; ++step) {
      std::vector<SampleRowArgs> args;
      for (int64_t r = 0; r < R; ++r) args.push_back(dev.next_row_args());
      std::vector<int32_t> got(static_cast<size_t>(R));
      be->sample_rows(x.data(), R, V, args.data(), got.data());
      for (int64_t r = 0; r < R; ++r) EXPECT_EQ(got[size_t(r)], host.sample(x.data() + r * V, V)) << "row " << r;
    }
  }
  SampleRowArgs bad = row_args(1.0f, 0, 0.0f, 0, 0.5);
  int32_t out = 0;
  try {
    be->sample_rows(x.data(), 1, V, &bad, &out);
    ADD_FAILURE() << "top_p 0 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("top_p"), std::string::npos) << e.what();
  }
  bad = row_args(1.0f, 0, 1.0f, 0, 1.0);
  EXPECT_THROW(be->sample_rows(x.data(), 1, V, &bad, &out), Error);
}

// Generation on the backend path (the token chosen by sample_rows) equals the host path: the
// logits of every step copied back and drawn by Sampler::sample.
TEST(SamplingReference, GenerateOnTheBackendEqualsTheHostPath) {
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(kFixture, *be);
  const Json e = read_json_file(kFixture + "/expected.json");
  const auto prompt = e["greedy_prompt"].get<std::vector<int32_t>>();
  const int64_t n = 24, V = m->config().vocab_size;
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_p = 0.9f;
  p.seed = 1;
  MlaCache c1(*be, m->cache_shape(), 1, int64_t(prompt.size()) + n);
  GenerateOptions opt;
  opt.max_new_tokens = n;
  opt.sampling = p;
  opt.stop_at_eos = false;
  const GenerateResult got = generate(*m, c1, 0, prompt, opt);

  MlaCache c2(*be, m->cache_shape(), 1, int64_t(prompt.size()) + n);
  Sampler s(p);
  std::vector<float> logits(static_cast<size_t>(V));
  std::vector<int32_t> want;
  m->forward(prompt.data(), int64_t(prompt.size()), c2, 0, logits.data());
  for (int64_t i = 0; i < n; ++i) {
    want.push_back(s.sample(logits.data(), V));
    if (i + 1 < n) m->forward(&want.back(), 1, c2, 0, logits.data(), false, AttentionPath::Absorbed);
  }
  EXPECT_EQ(got.tokens, want);
  EXPECT_GT(std::set<int32_t>(want.begin(), want.end()).size(), 3u);  // really sampled
}

// The scheduler samples on the backend for requests without logprobs and on the host for those
// with: the same seed gives the same tokens either way, in a batch with other requests.
TEST(SamplingReference, SchedulerBackendAndHostSamplingAgree) {
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(kFixture, *be);
  const Json e = read_json_file(kFixture + "/expected.json");
  const auto toks = e["tokens"].get<std::vector<int32_t>>();
  SchedulerOptions o;
  o.max_batch = 4;
  o.context = 128;
  o.prefill_chunk = 8;  // the 20-token prompts span three steps
  o.start_thread = false;
  Scheduler sch(*m, *be, o);
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (int i = 0; i < 4; ++i) {
    SchedRequest r;
    r.prompt.assign(toks.begin() + i % 2, toks.begin() + 20 + i % 2);
    r.max_tokens = 16;
    r.stop_at_eos = false;
    r.sampling.temperature = 0.9f;
    r.sampling.top_k = 50;
    r.sampling.seed = 11;
    r.logprobs = i >= 2;  // requests 2 and 3 are requests 0 and 1 drawn on the host
    hs.push_back(sch.submit(r));
  }
  while (sch.step()) {}
  std::vector<std::vector<int32_t>> ids(4);
  for (int i = 0; i < 4; ++i) {
    SchedEvent ev;
    while (hs[size_t(i)]->next(ev, std::chrono::milliseconds(0)))
      if (ev.kind == SchedEvent::Kind::Token) ids[size_t(i)].push_back(ev.token);
    EXPECT_EQ(ids[size_t(i)].size(), 16u);
  }
  EXPECT_EQ(ids[0], ids[2]);
  EXPECT_EQ(ids[1], ids[3]);
  EXPECT_GT(std::set<int32_t>(ids[0].begin(), ids[0].end()).size(), 3u);
}

// --- the CUDA backend --------------------------------------------------------------------

#ifdef VIREO_HAVE_CUDA
namespace {

// Rows that stress the order and the sums: random, exact ties, one very peaked, all equal
// (flat), -inf entries.
std::vector<std::vector<float>> test_rows(int64_t V, uint32_t seed) {
  std::vector<std::vector<float>> rows;
  rows.push_back(normal_logits(V, seed, 3.0f));
  std::vector<float> ties = normal_logits(V, seed + 1, 2.0f);
  for (float& x : ties) x = std::round(x * 4.0f) / 4.0f;  // few distinct values, many ties
  rows.push_back(ties);
  std::vector<float> peaked = normal_logits(V, seed + 2, 1.0f);
  peaked[size_t(V / 3)] = 40.0f;
  rows.push_back(peaked);
  rows.push_back(std::vector<float>(size_t(V), 0.5f));
  std::vector<float> holes = normal_logits(V, seed + 3, 1.5f);
  for (int64_t i = 1; i < V; i += 3) holes[size_t(i)] = -INFINITY;
  rows.push_back(holes);
  return rows;
}

}  // namespace
#endif

TEST(CudaOps, SampleRowsMatchesCpu) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  auto cpu = make_cpu_backend();
  auto gpu = make_cuda_backend();
  std::mt19937_64 g(17);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  int64_t cases = 0, mismatches = 0;
  for (int64_t V : {int64_t(1), int64_t(2), int64_t(7), int64_t(33), int64_t(1000), int64_t(1025), int64_t(154880)}) {
    const auto rows = test_rows(V, uint32_t(V));
    // Every (row, parameters, uniform) case as one row of a batch.
    std::vector<float> x;
    std::vector<SampleRowArgs> args;
    auto flush = [&] {
      if (args.empty()) return;
      const int64_t R = int64_t(args.size());
      std::vector<int32_t> want(static_cast<size_t>(R)), got(static_cast<size_t>(R));
      cpu->sample_rows(x.data(), R, V, args.data(), want.data());
      auto dx = gpu->alloc_f32(x.size());
      auto dout = gpu->alloc_i32(size_t(R));
      gpu->copy_from_host(dx.get(), x.data(), x.size());
      gpu->sample_rows(dx.get(), R, V, args.data(), dout.get());
      gpu->copy_to_host_i32(got.data(), dout.get(), size_t(R));
      for (int64_t r = 0; r < R; ++r) {
        ++cases;
        if (got[size_t(r)] != want[size_t(r)]) {
          ++mismatches;
          const SampleRowArgs& a = args[size_t(r)];
          ADD_FAILURE() << "vocab " << V << ": cpu " << want[size_t(r)] << " cuda " << got[size_t(r)] << " (T "
                        << a.temperature << " top_k " << a.top_k << " top_p " << a.top_p << " min_p " << a.min_p
                        << " u " << a.uniform << ")";
        }
      }
      x.clear();
      args.clear();
    };
    const bool big = V > 50000;
    for (size_t ri = 0; ri < rows.size(); ++ri)
      for (float T : big ? std::vector<float>{0.7f, 1.3f} : std::vector<float>{0.0f, 0.3f, 0.7f, 1.0f, 1.5f})
        for (int k : {0, 1, 5, 50, 4096})
          for (float tp : {1.0f, 0.9f, 0.5f, 1e-6f})
            for (float mp : {0.0f, 0.05f}) {
              std::vector<double> us = {0.0, 1.0 - 0x1p-53, ud(g)};
              if (!big) us.push_back(ud(g));
              for (double u : us) {
                x.insert(x.end(), rows[ri].begin(), rows[ri].end());
                args.push_back(row_args(T, k, tp, mp, u));
                if (int64_t(args.size()) * V >= (int64_t(1) << 24)) flush();
              }
            }
    flush();
  }
  std::printf("  sample_rows: %lld cases, %lld mismatches\n", (long long)cases, (long long)mismatches);
  EXPECT_GT(cases, 10000);
#endif
}

// `vireo run` with sampling draws the same tokens on the GPU as on the CPU (the logits of the two
// backends differ in their last bits; the tokens must not).
TEST(CudaOps, RunSamplesTheSameTokensAsTheCpu) {
  REQUIRE_CUDA();
  for (const std::string& model : {kFixture, kDemo}) {
    const std::string args =
        "run --model " + model + " --prompt-ids 1,2,3,4,5,6,7,8 -n 32 --ignore-eos --temp 0.7 --top-p 0.9 --seed 1";
    const test::RunResult cpu = test::run_vireo(args + " --device cpu");
    const test::RunResult gpu = test::run_vireo(args + " --device cuda");
    ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
    ASSERT_EQ(gpu.exit_code, 0) << gpu.err;
    EXPECT_EQ(gpu.out, cpu.out) << model;
    std::printf("  %s: %s", model.c_str(), cpu.out.c_str());
  }
}
