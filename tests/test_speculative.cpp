// Speculative sampling's pieces (runtime/speculative.h): the dense distribution a sampler draws
// from, and the keep-or-redraw verdict, whose tokens must follow the target distribution p
// whatever the draft distribution q is.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/sampler.h"
#include "runtime/speculative.h"

using namespace vireo;

namespace {

SampleRowArgs warp(float temperature, int top_k = 0, float top_p = 1.0f, float min_p = 0.0f) {
  SampleRowArgs a;
  a.temperature = temperature;
  a.top_k = top_k;
  a.top_p = top_p;
  a.min_p = min_p;
  return a;
}

double total_variation(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += std::fabs(a[i] - b[i]);
  return s / 2;
}

// A uniform stream independent of the code under test (Sampler's, seeded).
SamplingParams seeded(uint64_t seed) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = seed;
  return p;
}

struct Uniforms {
  explicit Uniforms(uint64_t seed) : s(seeded(seed)) {}
  double operator()() { return s.next_uniform(); }
  Sampler s;
};

}  // namespace

// warped_distribution gives what sample_row draws: over 60000 uniforms, every token's share of
// the draws is its probability, and no token outside the distribution's support is drawn; and
// sample_warp + sample_draw (the drafts' draw) is sample_row's token.
TEST(Speculative, WarpedDistributionIsWhatSampleRowDraws) {
  std::vector<float> logits(40);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = float(std::sin(double(i) * 1.7) * 2.5);
  logits[7] = logits[3];  // a tie: candidate order by id
  SampleWorkspace ws;
  for (const SampleRowArgs& base :
       {warp(1.0f), warp(0.7f, 5), warp(1.3f, 0, 0.8f), warp(1.0f, 0, 1.0f, 0.2f), warp(0.0f), warp(0.9f, 1)}) {
    std::vector<double> p;
    warped_distribution(logits.data(), int64_t(logits.size()), base, ws, p);
    double sum = 0;
    for (double v : p) sum += v;
    EXPECT_NEAR(sum, 1.0, 1e-6);
    const int n = 60000;
    std::vector<double> drawn(logits.size(), 0.0);
    Uniforms u(7);
    for (int i = 0; i < n; ++i) {
      SampleRowArgs a = base;
      a.uniform = u();
      const int32_t t = sample_row(logits.data(), int64_t(logits.size()), a, ws);
      EXPECT_GT(p[size_t(t)], 0.0) << "token " << t << " drawn outside the distribution";
      EXPECT_EQ(sample_draw(sample_warp(logits.data(), int64_t(logits.size()), a, ws), a.uniform, ws), t);
      drawn[size_t(t)] += 1.0 / n;
    }
    // 60000 draws: a share's standard deviation is at most 0.002.
    for (size_t x = 0; x < p.size(); ++x)
      EXPECT_NEAR(drawn[x], p[x], 0.009) << "token " << x << " at temperature " << base.temperature << ", top-k "
                                         << base.top_k << ", top-p " << base.top_p << ", min-p " << base.min_p;
  }
}

// The verdict's tokens follow p, and the draft is kept at the rate sum_x min(p(x), q(x)), for
// drafts from a q near p, far from it, with a support p lacks, equal to it, and one-hot (greedy).
TEST(Speculative, KeptOrRedrawnTokensFollowTheTarget) {
  const int64_t V = 8;
  std::vector<float> lp(V), lq(V);
  for (int64_t i = 0; i < V; ++i) {
    lp[size_t(i)] = float(std::cos(double(i) * 0.9) * 2.0);
    lq[size_t(i)] = float(std::cos(double(i) * 0.9 + 0.8) * 2.0);
  }
  struct Case {
    const char* name;
    SampleRowArgs p, q;
    bool q_outside_p = false;  // q draws tokens p cannot
  };
  const std::vector<Case> cases = {
      {"temperature 1", warp(1.0f), warp(1.0f)},
      {"top-k 3", warp(1.0f, 3), warp(1.0f, 3)},
      {"top-k 2 for p, 4 for q", warp(1.0f, 2), warp(1.0f, 4), true},
      {"top-p 0.9, min-p 0.05", warp(0.8f, 0, 0.9f, 0.05f), warp(0.8f, 0, 0.9f, 0.05f), true},
      {"greedy (one-hot p and q, apart)", warp(0.0f), warp(0.0f), true},
  };
  SampleWorkspace ws;
  for (const Case& c : cases) {
    std::vector<double> p, q;
    warped_distribution(lp.data(), V, c.p, ws, p);
    warped_distribution(lq.data(), V, c.q, ws, q);
    double overlap = 0;
    for (int64_t x = 0; x < V; ++x) overlap += std::min(p[size_t(x)], q[size_t(x)]);
    // The cases only test something if keeping every draft would give q, not p.
    EXPECT_GT(total_variation(p, q), 0.2) << c.name;
    bool outside = false;
    for (int64_t x = 0; x < V; ++x) outside |= q[size_t(x)] > 0 && p[size_t(x)] == 0;
    EXPECT_EQ(outside, c.q_outside_p) << c.name;
    const int n = 100000;
    std::vector<double> got(size_t(V), 0.0);
    double kept = 0;
    Uniforms u(11);
    for (int i = 0; i < n; ++i) {
      SampleRowArgs a = c.q;
      a.uniform = u();
      const int32_t draft = sample_row(lq.data(), V, a, ws);
      const double u_keep = u(), u_redraw = u();
      const DraftVerdict v = verify_draft(p, q, draft, u_keep, u_redraw);
      if (v.kept) {
        EXPECT_EQ(v.token, draft);
        kept += 1.0 / n;
      }
      got[size_t(v.token)] += 1.0 / n;
    }
    std::printf("  %s: TV(p, q) %.3f, kept %.4f (sum min(p, q) %.4f), TV(tokens, p) %.4f\n", c.name,
                total_variation(p, q), kept, overlap, total_variation(got, p));
    // 100000 verdicts: a share's standard deviation is at most 0.0016.
    for (int64_t x = 0; x < V; ++x) EXPECT_NEAR(got[size_t(x)], p[size_t(x)], 0.007) << c.name << ", token " << x;
    EXPECT_NEAR(kept, overlap, 0.007) << c.name;
  }
  // q equal to p: every draft kept.
  std::vector<double> p;
  warped_distribution(lp.data(), V, warp(1.0f), ws, p);
  Uniforms u(3);
  for (int i = 0; i < 1000; ++i) {
    SampleRowArgs a = warp(1.0f);
    a.uniform = u();
    const int32_t draft = sample_row(lp.data(), V, a, ws);
    EXPECT_TRUE(verify_draft(p, p, draft, u(), u()).kept);
  }
}

TEST(Speculative, MisuseFailsWithAMessage) {
  const std::vector<double> p{0.5, 0.5, 0.0}, q{0.0, 0.5, 0.5};
  auto expect_fail = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one with '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_fail([&] { verify_draft(p, {0.5, 0.5}, 1, 0.1, 0.1); }, "verify_draft: p has 3 entries, q 2");
  expect_fail([&] { verify_draft(p, q, 0, 0.1, 0.1); }, "verify_draft: draft 0 is not a token q can draw");
  expect_fail([&] { verify_draft(p, q, 3, 0.1, 0.1); }, "verify_draft: draft 3 is not a token q can draw");
  expect_fail([&] { verify_draft(p, q, 1, 1.0, 0.1); }, "uniforms must be in [0, 1), got 1 and 0.1");
  // A draft p cannot draw is never kept; the redraw comes from max(0, p - q): token 0 only.
  for (double u : {0.0, 0.3, 0.999}) {
    const DraftVerdict v = verify_draft(p, q, 2, u, u);
    EXPECT_FALSE(v.kept);
    EXPECT_EQ(v.token, 0);
  }
}
