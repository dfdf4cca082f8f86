// The forward pass against Hugging Face transformers on tiny checkpoints (tests/fixtures, made by
// tools/make_fixtures.py). Each fixture holds teacher-forced logits from one full transformers
// forward and a greedy continuation from model.generate.
//
// Tolerances. Every fixture's expected outputs were computed by transformers in float32 on the
// weights exactly as stored (BF16 and FP8 fixtures: on the dequantized values), so vireo's f32
// math differs from the oracle only by summation order: relative L2 error <= 1e-4 for every
// dtype. The FP8 fixture also carries the logits of the unquantized f32 model: that gap is the
// format's own error, stated and bounded in FP8QuantizationErrorIsBounded.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "backend/backend.h"
#include "io/json_file.h"
#include "io/npy.h"
#include "model/glm_dsa/model.h"
#include "runtime/generate.h"

using namespace vireo;

namespace {

const std::string kFixtures = VIREO_FIXTURES_DIR;

struct Fixture {
  std::string dir;
  Json expected;
  NpyArray logits;
};

Fixture load_fixture(const std::string& name) {
  Fixture f;
  f.dir = kFixtures + "/" + name;
  f.expected = read_json_file(f.dir + "/expected.json");
  f.logits = read_npy_f32(f.dir + "/logits.npy");
  return f;
}

std::vector<int32_t> ids_of(const Json& j) { return j.get<std::vector<int32_t>>(); }

// Worst relative L2 error over rows (positions).
double max_row_rel_l2(const float* got, const float* want, int64_t T, int64_t V) {
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    double num = 0, den = 0;
    for (int64_t v = 0; v < V; ++v) {
      double d = double(got[t * V + v]) - want[t * V + v];
      num += d * d;
      den += double(want[t * V + v]) * want[t * V + v];
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

std::vector<float> run_logits(GlmDsaModel& m, Backend& be, const std::vector<int32_t>& ids, bool decode) {
  const int64_t T = int64_t(ids.size()), V = m.config().vocab_size;
  MlaCache cache(be, m.cache_shape(), 1, T);
  std::vector<float> out(static_cast<size_t>(T * V));
  if (!decode) {
    m.forward(ids.data(), T, cache, 0, out.data(), true, AttentionPath::Reconstructed);
  } else {
    for (int64_t t = 0; t < T; ++t)
      m.forward(&ids[size_t(t)], 1, cache, 0, out.data() + t * V, false, AttentionPath::Absorbed);
  }
  return out;
}

class ModelFixture : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(ModelFixture, PrefillLogitsMatchTransformers) {
  Fixture f = load_fixture(GetParam());
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  auto ids = ids_of(f.expected["tokens"]);
  ASSERT_EQ(f.logits.shape[0], int64_t(ids.size()));
  ASSERT_EQ(f.logits.shape[1], m->config().vocab_size);
  auto got = run_logits(*m, *be, ids, false);
  EXPECT_LE(max_row_rel_l2(got.data(), f.logits.data.data(), f.logits.shape[0], f.logits.shape[1]), 1e-4);
}

TEST_P(ModelFixture, DecodeLogitsMatchTransformersAndPrefill) {
  Fixture f = load_fixture(GetParam());
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  auto ids = ids_of(f.expected["tokens"]);
  auto decode = run_logits(*m, *be, ids, true);
  auto prefill = run_logits(*m, *be, ids, false);
  const int64_t T = f.logits.shape[0], V = f.logits.shape[1];
  EXPECT_LE(max_row_rel_l2(decode.data(), f.logits.data.data(), T, V), 1e-4);
  EXPECT_LE(max_row_rel_l2(decode.data(), prefill.data(), T, V), 1e-4);
}

TEST_P(ModelFixture, GreedyContinuationIsIdentical) {
  Fixture f = load_fixture(GetParam());
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  auto prompt = ids_of(f.expected["greedy_prompt"]);
  auto want = ids_of(f.expected["greedy_new"]);
  ASSERT_GE(want.size(), 32u);
  MlaCache cache(*be, m->cache_shape(), 1, int64_t(prompt.size() + want.size()));
  GenerateOptions opt;
  opt.max_new_tokens = int64_t(want.size());
  GenerateResult r = generate(*m, cache, 0, prompt, opt);
  EXPECT_EQ(r.tokens, want);
  EXPECT_FALSE(r.stopped_at_eos);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ModelFixture,
                         ::testing::Values("glm_dsa_full_f32", "glm_dsa_shared_f32", "dsv32_f32", "dsv3_f32",
                                           "glm_dsa_bf16", "glm_dsa_fp8"));

TEST(ModelFixtures, Fp8QuantizationErrorIsBounded) {
  // E4M3 keeps 3 mantissa bits: each weight's relative rounding error is at most 2^-4, and about
  // 2^-4 / sqrt(3) ~ 3.6% RMS for uniformly spread values. Errors of independent weights average
  // in dot products but compound across layers; the whole-model logits' relative error against
  // the unquantized f32 model must stay well under one weight's worst case (2^-4 = 6.25%).
  Fixture f = load_fixture("glm_dsa_fp8");
  NpyArray ref = read_npy_f32(f.dir + "/logits_f32ref.npy");
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  auto got = run_logits(*m, *be, ids_of(f.expected["tokens"]), false);
  const double err = max_row_rel_l2(got.data(), ref.data.data(), ref.shape[0], ref.shape[1]);
  EXPECT_LE(err, 0.0625);
  EXPECT_GT(err, 1e-4);  // the weights really are quantized
}

TEST(ModelFixtures, SelectionReallyDropsKeys) {
  // The fixtures' sequences are longer than index_topk, so DSA must change the result: running
  // the same model with index_topk raised to the sequence length (dense attention) must give
  // different logits.
  Fixture f = load_fixture("glm_dsa_full_f32");
  auto ids = ids_of(f.expected["tokens"]);
  auto be = make_cpu_backend();
  GlmDsaConfig c = load_glm_dsa_config(f.dir);
  ASSERT_LT(c.index_topk * 3, int(ids.size()));
  c.index_topk = int(ids.size());
  auto dense = GlmDsaModel::create(c, Checkpoint::open(f.dir), *be);
  auto got = run_logits(*dense, *be, ids, false);
  EXPECT_GT(max_row_rel_l2(got.data(), f.logits.data.data(), f.logits.shape[0], f.logits.shape[1]), 1e-3);
}

TEST(ModelFixtures, GenerationStopsAtEos) {
  Fixture f = load_fixture("glm_dsa_full_f32");
  auto prompt = ids_of(f.expected["greedy_prompt"]);
  auto want = ids_of(f.expected["greedy_new"]);
  auto be = make_cpu_backend();
  GlmDsaConfig c = load_glm_dsa_config(f.dir);
  c.eos_ids.insert(want[5]);  // the 6th greedy token becomes an end-of-sequence id
  auto m = GlmDsaModel::create(c, Checkpoint::open(f.dir), *be);
  MlaCache cache(*be, m->cache_shape(), 1, int64_t(prompt.size() + want.size()));
  GenerateOptions opt;
  opt.max_new_tokens = int64_t(want.size());
  GenerateResult r = generate(*m, cache, 0, prompt, opt);
  EXPECT_TRUE(r.stopped_at_eos);
  size_t first = size_t(std::find(want.begin(), want.end(), want[5]) - want.begin());
  EXPECT_EQ(r.tokens, std::vector<int32_t>(want.begin(), want.begin() + long(first) + 1));
}

TEST(ModelFixtures, CacheTrimRollsBack) {
  // Decoding, trimming the cache back and decoding other tokens gives the same logits as never
  // having decoded the first ones (speculative decoding's rollback).
  Fixture f = load_fixture("glm_dsa_shared_f32");
  auto ids = ids_of(f.expected["tokens"]);
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  const int64_t V = m->config().vocab_size, P = int64_t(ids.size()) - 8;
  MlaCache cache(*be, m->cache_shape(), 2, int64_t(ids.size()) + 4);
  std::vector<float> a(static_cast<size_t>(V)), b(static_cast<size_t>(V));
  m->forward(ids.data(), P, cache, 0, a.data());
  std::vector<int32_t> junk = {ids[3], ids[1], ids[4], ids[1]};
  m->forward(junk.data(), 4, cache, 0, a.data());
  cache.trim(0, P);
  m->forward(&ids[size_t(P)], 8, cache, 0, a.data());
  m->forward(ids.data(), int64_t(ids.size()), cache, 1, b.data());  // row 1: straight through
  EXPECT_LE(max_row_rel_l2(a.data(), b.data(), 1, V), 1e-5);
  EXPECT_LE(max_row_rel_l2(b.data(), f.logits.data.data() + (ids.size() - 1) * size_t(V), 1, V), 1e-4);
}
