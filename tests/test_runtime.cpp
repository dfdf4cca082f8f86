// Sampler and cache behaviour.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "backend/backend.h"
#include "cache/mla_cache.h"
#include "core/error.h"
#include "runtime/sampler.h"

using namespace vireo;

TEST(Sampler, GreedyTiesPickLowestId) {
  std::vector<float> l = {0.1f, 2.0f, -1.0f, 2.0f};
  Sampler s({});
  EXPECT_EQ(s.sample(l.data(), 4), 1);
}

TEST(Sampler, TopK1IsGreedyAtAnyTemperature) {
  std::vector<float> l = {0.1f, 0.5f, 0.4f, 0.45f};
  SamplingParams p;
  p.temperature = 5.0f;
  p.top_k = 1;
  Sampler s(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(s.sample(l.data(), 4), 1);
}

TEST(Sampler, SeedDeterminesTheStream) {
  std::vector<float> l(50);
  for (int i = 0; i < 50; ++i) l[size_t(i)] = std::sin(float(i));
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  Sampler a(p), b(p);
  p.seed = 43;
  Sampler c(p);
  int differ = 0;
  for (int i = 0; i < 100; ++i) {
    int x = a.sample(l.data(), 50), y = b.sample(l.data(), 50), z = c.sample(l.data(), 50);
    EXPECT_EQ(x, y);
    differ += x != z;
  }
  EXPECT_GT(differ, 10);
}

TEST(Sampler, FrequenciesFollowSoftmaxAndTruncation) {
  // logits log(0.5), log(0.3), log(0.2): temperature 1 samples in those proportions.
  std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 7;
  Sampler s(p);
  std::map<int, int> n;
  for (int i = 0; i < 20000; ++i) n[s.sample(l.data(), 3)]++;
  EXPECT_NEAR(n[0] / 20000.0, 0.5, 0.02);
  EXPECT_NEAR(n[2] / 20000.0, 0.2, 0.02);
  p.top_p = 0.75f;  // keeps {0.5, 0.3}
  Sampler tp(p);
  for (int i = 0; i < 2000; ++i) EXPECT_NE(tp.sample(l.data(), 3), 2);
  p.top_p = 1.0f;
  p.min_p = 0.5f;  // keeps tokens with p >= 0.25: {0.5, 0.3}
  Sampler mp(p);
  for (int i = 0; i < 2000; ++i) EXPECT_NE(mp.sample(l.data(), 3), 2);
}

TEST(Sampler, RejectsBadParameters) {
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_THROW(Sampler{p}, Error);
  p = {};
  p.temperature = -1;
  EXPECT_THROW(Sampler{p}, Error);
}

TEST(MlaCache, ExactBytesAndTrim) {
  auto be = make_cpu_backend();
  MlaCacheShape s;
  s.n_layers = 3;
  s.kv_dim = 576;
  s.index_dim = 128;
  s.has_index = {true, false, true};
  MlaCache c(*be, s, 2, 100);
  EXPECT_EQ(MlaCache::bytes_per_token(s), (3 * 576 + 2 * 128) * 4u);
  EXPECT_EQ(c.bytes_allocated(), 2u * 100u * MlaCache::bytes_per_token(s));
  EXPECT_EQ(c.index_keys(1, 0), nullptr);
  c.set_length(0, 10);
  c.set_length(1, 4);
  EXPECT_EQ(c.bytes_in_use(), 14u * MlaCache::bytes_per_token(s));
  c.trim(0, 6);
  EXPECT_EQ(c.length(0), 6);
  EXPECT_THROW(c.trim(0, 7), Error);
  EXPECT_THROW(c.set_length(1, 101), Error);
  // Rows do not overlap.
  EXPECT_EQ(c.kv(2, 1) - c.kv(2, 0), 100 * 576);
}
