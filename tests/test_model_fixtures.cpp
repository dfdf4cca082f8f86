// The forward pass against Hugging Face transformers on tiny checkpoints (tests/fixtures, made by
// tools/make_fixtures.py). Each fixture holds teacher-forced logits from one full transformers
// forward and a greedy continuation from model.generate.
//
// Tolerances. Every fixture's expected outputs were computed by transformers in float32 on the
// weights exactly as stored (BF16 and FP8 fixtures: on the dequantized values), so vireo's f32
// math differs from the oracle only by summation order: relative L2 error <= 1e-4 for every
// dtype. What the formats themselves cost is stated per product in
// QuantizedMatmulErrorIsWithinFormatBound. (The FP8 fixture also carries the unquantized model's
// logits, logits_f32ref.npy: on these tiny random models, sharpened to peaked distributions, the
// quantization drift compounds to O(1) relative error over three layers, so it bounds nothing.)
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>

#include "backend/backend.h"
#include "backend/sampling.h"
#include "core/thread_pool.h"
#include "io/json_file.h"
#include "io/npy.h"
#include "model/glm_dsa/model.h"
#include "runtime/generate.h"
#include "fixture_util.h"

using namespace vireo;
using vireo::test::max_row_rel_l2;
using vireo::test::run_logits;

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

// What the storage formats themselves cost, stated per matrix product (the fixtures above compare
// against the oracle on the dequantized values, so they measure vireo, not the format).
// Round-to-nearest with m mantissa bits has relative error <= 2^-(m+1) per weight: BF16 (m = 7)
// 2^-8, E4M3 (m = 3) 2^-4 (block scaling keeps every block's values in the normal range, except
// the smallest, whose absolute error is bounded by the subnormal step). Errors of independent
// weights partly cancel in a dot product, so the product's relative L2 error must stay under the
// per-weight bound, and above a small fraction of it (the weights really are rounded).
TEST(ModelFixtures, QuantizedMatmulErrorIsWithinFormatBound) {
  const int64_t out = 300, in = 520, T = 4;  // partial 128-blocks in both directions
  std::vector<float> w(static_cast<size_t>(out * in)), x(static_cast<size_t>(T * in));
  uint64_t s = 5;
  auto uni = [&]() { s = s * 6364136223846793005ull + 1442695040888963407ull; return float(s >> 40) / 16777216.0f * 2 - 1; };
  for (float& v : w) v = uni() * 0.05f;
  for (float& v : x) v = uni();
  Weight wf;
  wf.w = Tensor(w.data(), DType::F32, {out, in});
  std::vector<float> ref(static_cast<size_t>(T * out)), got(ref.size());
  cpu_matmul_reference(x.data(), T, wf, ref.data());
  auto rel = [&]() {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      num += double(got[i] - ref[i]) * (got[i] - ref[i]);
      den += double(ref[i]) * ref[i];
    }
    return std::sqrt(num / den);
  };
  // BF16
  std::vector<uint16_t> wb(w.size());
  for (size_t i = 0; i < w.size(); ++i) wb[i] = f32_to_bf16(w[i]);
  Weight b;
  b.w = Tensor(wb.data(), DType::BF16, {out, in});
  cpu_matmul(x.data(), T, b, got.data(), ThreadPool::global());
  EXPECT_LT(rel(), std::ldexp(1.0, -8));
  EXPECT_GT(rel(), std::ldexp(1.0, -8) / 20);
  // FP8 E4M3 with 128x128 block scales, scale = block amax / 448 as GLM-5-FP8.
  const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
  std::vector<float> scale(static_cast<size_t>(so * si), 0.0f);
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j) {
      float& m = scale[size_t((i / 128) * si + j / 128)];
      m = std::max(m, std::fabs(w[size_t(i * in + j)]) / 448.0f);
    }
  std::vector<uint8_t> wq(w.size());
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j)
      wq[size_t(i * in + j)] = f32_to_fp8_e4m3(w[size_t(i * in + j)] / scale[size_t((i / 128) * si + j / 128)]);
  Weight q;
  q.w = Tensor(wq.data(), DType::F8_E4M3, {out, in});
  q.scale_inv = Tensor(scale.data(), DType::F32, {so, si});
  cpu_matmul(x.data(), T, q, got.data(), ThreadPool::global());
  EXPECT_LT(rel(), std::ldexp(1.0, -4));
  EXPECT_GT(rel(), std::ldexp(1.0, -4) / 20);
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
  // One step at a time, and greedy chunks of 3 and 8 steps (the stop falls inside a chunk).
  for (int chunk : {1, 3, 8}) {
    MlaCache cache(*be, m->cache_shape(), 1, int64_t(prompt.size() + want.size()));
    GenerateOptions opt;
    opt.max_new_tokens = int64_t(want.size());
    opt.decode_steps = chunk;
    GenerateResult r = generate(*m, cache, 0, prompt, opt);
    EXPECT_TRUE(r.stopped_at_eos) << "chunk " << chunk;
    size_t first = size_t(std::find(want.begin(), want.end(), want[5]) - want.begin());
    EXPECT_EQ(r.tokens, std::vector<int32_t>(want.begin(), want.begin() + long(first) + 1)) << "chunk " << chunk;
    // The steps queued past the stop are dropped: the cache holds the prompt and every token but
    // the last, as one step at a time leaves it.
    EXPECT_EQ(cache.length(0), int64_t(prompt.size() + r.tokens.size()) - 1) << "chunk " << chunk;
    EXPECT_EQ(m->queued_steps(), 0);
  }
}

TEST(ModelFixtures, GenerationStoppedByTheCallerLeavesTheCacheAsOneStepAtATime) {
  Fixture f = load_fixture("glm_dsa_shared_f32");
  auto prompt = ids_of(f.expected["greedy_prompt"]);
  auto want = ids_of(f.expected["greedy_new"]);
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  for (int64_t stop : {1, 2, 7})
    for (int chunk : {1, 4}) {
      MlaCache cache(*be, m->cache_shape(), 1, int64_t(prompt.size() + want.size()));
      GenerateOptions opt;
      opt.max_new_tokens = int64_t(want.size());
      opt.decode_steps = chunk;
      int64_t seen = 0;
      GenerateResult r = generate(*m, cache, 0, prompt, opt, [&](int32_t) { return ++seen < stop; });
      EXPECT_EQ(r.tokens, std::vector<int32_t>(want.begin(), want.begin() + stop));
      EXPECT_EQ(cache.length(0), int64_t(prompt.size()) + stop - 1) << "stopped after " << stop;
      // The cache goes on from there as if it had never run ahead: the next step's logits.
      std::vector<float> lg(static_cast<size_t>(m->config().vocab_size));
      m->forward(&r.tokens.back(), 1, cache, 0, lg.data());
      const int32_t next = int32_t(std::max_element(lg.begin(), lg.end()) - lg.begin());
      EXPECT_EQ(next, want[size_t(stop)]) << "stopped after " << stop;
    }
}

TEST(ModelFixtures, QueuedStepsEqualOneStepAtATime) {
  Fixture f = load_fixture("glm_dsa_full_f32");
  auto prompt = ids_of(f.expected["greedy_prompt"]);
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  for (int depth : {1, 3, Backend::kMaxQueuedReads}) {
    const vireo::test::QueuedAndSingle r = vireo::test::queued_and_single_steps(*m, *be, prompt, depth, 20);
    EXPECT_EQ(r.queued, r.single) << "depth " << depth;
    EXPECT_EQ(r.queued_length, r.single_length) << "depth " << depth;
  }
  // Chunks of steps (each step on the pick of the one before, the picks read back together):
  // the same picks, the last chunk shorter where 19 steps do not divide.
  for (int chunk : {2, 3, 8})
    for (int depth : {1, 2}) {
      const vireo::test::QueuedAndSingle r = vireo::test::queued_and_single_steps(*m, *be, prompt, depth, 20, chunk);
      EXPECT_EQ(r.queued, r.single) << "chunk " << chunk << " depth " << depth;
      EXPECT_EQ(r.queued_length, r.single_length) << "chunk " << chunk << " depth " << depth;
    }
  // Misuse fails with a message, not a wrong token.
  MlaCache cache(*be, m->cache_shape(), 2, 64);
  EXPECT_THROW(m->take_step(), Error);
  const int32_t t = m->forward_next(prompt.data(), 4, cache, 0, nullptr);
  EXPECT_THROW(m->queue_step(nullptr, cache, 1), Error);  // row 1 has no pick to feed
  // A chunk: greedy only, 1 to kMaxQueuedRead steps, within the cache's capacity; a refused
  // chunk leaves the row as it was.
  const SampleRowArgs sampled{};
  const int64_t len = cache.length(0);
  EXPECT_THROW(m->queue_step(&t, cache, 0, &sampled, 2), Error);
  EXPECT_THROW(m->queue_step(&t, cache, 0, nullptr, 0), Error);
  EXPECT_THROW(m->queue_step(&t, cache, 0, nullptr, int(Backend::kMaxQueuedRead) + 1), Error);
  EXPECT_THROW(m->queue_step(&t, cache, 0, nullptr, int(64 - len) + 1), Error);  // context full
  EXPECT_EQ(cache.length(0), len);
  EXPECT_EQ(m->queued_steps(), 0);
  for (int i = 0; i < Backend::kMaxQueuedReads; ++i) m->queue_step(i == 0 ? &t : nullptr, cache, 0, nullptr, 1 + i % 2);
  EXPECT_EQ(m->queued_steps(), Backend::kMaxQueuedReads * 3 / 2);
  EXPECT_THROW(m->queue_step(nullptr, cache, 0), Error);
  while (m->queued_steps() > 0) m->take_step();
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

TEST(ModelFixtures, RopeTableGrownInPiecesEqualsOneMadeWhole) {
  // The model keeps the rope table of every position seen so far and grows it when a step goes
  // past its end. Keys cached before a growth and queries after it must see the positions they
  // would have with the table made at once: a chunk crossing position 4096 (the first growth's
  // end) in a fresh model against one whose table already covered 8192 positions. RoPE is
  // relative, so rows shifted alike would not show: the two chunks straddle the boundary.
  Fixture f = load_fixture("glm_dsa_full_f32");
  auto ids = ids_of(f.expected["tokens"]);
  ASSERT_GE(ids.size(), 10u);
  auto be = make_cpu_backend();
  const int64_t V = GlmDsaModel::load(f.dir, *be)->config().vocab_size, start = 4090;
  auto run = [&](bool whole_first) {
    auto m = GlmDsaModel::load(f.dir, *be);
    MlaCache cache(*be, m->cache_shape(), 2, 8200);
    std::vector<float> lg(static_cast<size_t>(6 * V));
    if (whole_first) {  // a step at position 8000 makes positions [0, 8192) in one piece
      cache.set_length(1, 8000);
      m->forward(ids.data(), 1, cache, 1, lg.data());
    }
    cache.set_length(0, start);
    m->forward(ids.data(), 4, cache, 0, lg.data());            // positions 4090..4093
    m->forward(ids.data() + 4, 6, cache, 0, lg.data(), true);  // 4094..4099: past 4096
    return lg;
  };
  const std::vector<float> pieces = run(false), whole = run(true);
  for (size_t i = 0; i < pieces.size(); ++i) ASSERT_EQ(pieces[i], whole[i]) << "logit " << i;
}

TEST(ModelFixtures, RopeTableStaysWithinTheCacheCapacity) {
  // The table grows by at least half its size, but never past the capacity of the cache a step
  // runs on (what the memory plan counts for it); a longer cache grows it again, and the rows
  // made in those pieces are a table made whole's.
  Fixture f = load_fixture("glm_dsa_full_f32");
  auto ids = ids_of(f.expected["tokens"]);
  ASSERT_GE(ids.size(), 10u);
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  const int64_t V = m->config().vocab_size;
  std::vector<float> lg(static_cast<size_t>(6 * V)), whole(static_cast<size_t>(V));
  MlaCache small(*be, m->cache_shape(), 1, 4100);
  small.set_length(0, 4090);
  m->forward(ids.data(), 4, small, 0, lg.data());  // positions 4090..4093: the first 4096
  EXPECT_EQ(m->rope_table_positions(), 4096);
  m->forward(ids.data() + 4, 6, small, 0, lg.data());  // 4094..4099: half again would be 6144
  EXPECT_EQ(m->rope_table_positions(), 4100);
  MlaCache big(*be, m->cache_shape(), 1, 9000);
  big.set_length(0, 8000);
  m->forward(ids.data(), 1, big, 0, lg.data());
  EXPECT_EQ(m->rope_table_positions(), 8192);
  auto fresh = GlmDsaModel::load(f.dir, *be);
  MlaCache big2(*be, fresh->cache_shape(), 1, 9000);
  big2.set_length(0, 8000);
  fresh->forward(ids.data(), 1, big2, 0, whole.data());
  for (int64_t i = 0; i < V; ++i) ASSERT_EQ(lg[size_t(i)], whole[size_t(i)]) << "logit " << i;
}

TEST(ModelFixtures, BatchedStepsEqualSingleSequenceRuns) {
  // Three sequences of different lengths join at different steps, mixing prefill chunks and
  // single-token decodes in one batch; every logit row equals running that sequence alone.
  Fixture f = load_fixture("glm_dsa_shared_f32");
  auto ids = ids_of(f.expected["tokens"]);
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  const int64_t V = m->config().vocab_size;
  // steps[s] = list of (row, begin, end) chunks of `ids` (each row reads its own slice of ids).
  struct Chunk { int row; int64_t b, e; };
  const std::vector<std::vector<Chunk>> steps = {
      {{0, 0, 20}, {1, 5, 15}},
      {{0, 20, 21}, {1, 15, 40}, {2, 10, 13}},
      {{0, 21, 22}, {1, 40, 41}, {2, 13, 30}},
      {{0, 22, 23}, {2, 30, 31}},
  };
  MlaCache batched(*be, m->cache_shape(), 3, 64);
  MlaCache alone(*be, m->cache_shape(), 3, 64);
  for (const auto& step : steps) {
    std::vector<std::vector<float>> out(step.size(), std::vector<float>(static_cast<size_t>(64 * V)));
    std::vector<BatchItem> items;
    for (size_t i = 0; i < step.size(); ++i) {
      BatchItem it;
      it.row = step[i].row;
      it.tokens = &ids[size_t(step[i].b)];
      it.T = step[i].e - step[i].b;
      it.logits = out[i].data();
      it.all_logits = true;
      items.push_back(it);
    }
    m->forward_batch(items, batched);
    for (size_t i = 0; i < step.size(); ++i) {
      std::vector<float> ref(static_cast<size_t>(items[i].T * V));
      m->forward(items[i].tokens, items[i].T, alone, items[i].row, ref.data(), true);
      EXPECT_LE(max_row_rel_l2(out[i].data(), ref.data(), items[i].T, V), 1e-5) << "row " << items[i].row;
    }
  }
  EXPECT_EQ(batched.length(1), 41 - 5);
  EXPECT_EQ(batched.length(2), 31 - 10);
}

TEST(ModelFixtures, BatchedPicksEqualEachItemsOwn) {
  // One step's picks: greedy and sampled items, two with a pick per row, one wanting only logits
  // and one wanting nothing, each pick equal to what the item picks in a step of its own.
  Fixture f = load_fixture("glm_dsa_shared_f32");
  auto ids = ids_of(f.expected["tokens"]);
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  const int64_t V = m->config().vocab_size;
  SampleRowArgs hot;
  hot.temperature = 1.5f;
  hot.top_k = 50;
  hot.uniform = 0.61;
  std::vector<SampleRowArgs> hot_rows(3, hot);
  hot_rows[1].uniform = 0.07;
  hot_rows[2].uniform = 0.93;
  struct Item {
    int64_t b, T;
    bool all, greedy, sampled, logits;
  };
  const Item spec[] = {{0, 1, false, true, false, false}, {5, 3, true, false, true, false},
                       {9, 2, false, false, false, true}, {14, 2, false, false, false, false},
                       {20, 3, true, true, false, false}, {30, 1, false, false, true, false}};
  const size_t n = std::size(spec);
  auto items_of = [&](std::vector<std::vector<int32_t>>& picks, std::vector<std::vector<float>>& logits) {
    std::vector<BatchItem> items(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t rows = spec[i].all ? spec[i].T : 1;
      picks[i].assign(size_t(rows), -1);
      logits[i].assign(size_t(rows * V), 0.0f);
      BatchItem& it = items[i];
      it.row = int(i);
      it.tokens = &ids[size_t(spec[i].b)];
      it.T = spec[i].T;
      it.all_logits = spec[i].all;
      if (spec[i].greedy || spec[i].sampled) it.token = picks[i].data();
      if (spec[i].sampled) it.sample = hot_rows.data();
      if (spec[i].logits) it.logits = logits[i].data();
    }
    return items;
  };
  std::vector<std::vector<int32_t>> together(n), alone(n);
  std::vector<std::vector<float>> lt(n), la(n);
  std::vector<BatchItem> batch = items_of(together, lt), single = items_of(alone, la);
  MlaCache cb(*be, m->cache_shape(), int(n), 16), ca(*be, m->cache_shape(), int(n), 16);
  m->reset_host_times();
  const auto t0 = std::chrono::steady_clock::now();
  m->forward_batch(batch, cb);
  for (size_t i = 0; i < n; ++i) m->forward_batch({single[i]}, ca);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The bench's split of the host's time: every step counted, its parts within the calls' time
  // (no interval counted twice), the CPU's work (its ops run in the launch) in the launch part.
  const GlmDsaModel::HostTimes ht = m->host_times();
  EXPECT_EQ(ht.steps, int64_t(n + 1));
  EXPECT_LE(ht.before_launch_s + ht.launch_s + ht.after_launch_s, wall);
  EXPECT_GT(ht.launch_s, 0.0);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(together[i], alone[i]) << "item " << i;
    if (spec[i].greedy || spec[i].sampled) {
      for (int32_t t : together[i]) {
        EXPECT_TRUE(t >= 0 && t < V) << "item " << i;
      }
    }
    if (spec[i].logits) {
      EXPECT_LE(max_row_rel_l2(lt[i].data(), la[i].data(), 1, V), 1e-5) << "item " << i;
    }
  }
  // The draws differ from the argmax somewhere (so a greedy pick in their place would show above).
  std::vector<int32_t> greedy(3, -1);
  BatchItem g = single[1];
  g.sample = nullptr;
  g.token = greedy.data();
  g.row = 1;
  MlaCache cg(*be, m->cache_shape(), int(n), 16);
  m->forward_batch({g}, cg);
  EXPECT_NE(together[1], greedy);

  // The same step holding at most 2 rows of logits (set_logit_rows: a server's bound): lm_head
  // runs in 5 slices, items 1 and 4 split across two; the same picks and logits, a buffer of 2
  // rows, and item 4's 3 rows handed to rows_out as the slices come (rows 0-1, then row 2).
  auto m2 = GlmDsaModel::load(f.dir, *be);
  m2->set_logit_rows(2);
  std::vector<std::vector<int32_t>> sliced(n);
  std::vector<std::vector<float>> ls(n);
  std::vector<BatchItem> batch2 = items_of(sliced, ls);
  std::vector<int64_t> firsts;
  std::vector<float> handed;
  batch2[4].rows_out = [&](int64_t first, int64_t rows, const float* x) {
    firsts.push_back(first);
    handed.insert(handed.end(), x, x + rows * V);
  };
  MlaCache c2(*be, m2->cache_shape(), int(n), 16);
  m2->forward_batch(batch2, c2);
  EXPECT_EQ(m2->logit_buffer_rows(), 2);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(sliced[i], together[i]) << "item " << i;
    if (spec[i].logits) {
      EXPECT_LE(max_row_rel_l2(ls[i].data(), lt[i].data(), 1, V), 1e-5) << "item " << i;
    }
  }
  std::vector<float> want4(size_t(3 * V));
  BatchItem r4 = single[4];
  r4.logits = want4.data();
  MlaCache c4(*be, m->cache_shape(), int(n), 16);
  m->forward_batch({r4}, c4);
  EXPECT_EQ(firsts, (std::vector<int64_t>{0, 2}));
  ASSERT_EQ(handed.size(), want4.size());
  EXPECT_LE(max_row_rel_l2(handed.data(), want4.data(), 3, V), 1e-5);
  BatchItem both = batch2[4];
  both.logits = want4.data();
  EXPECT_THROW(m2->forward_batch({both}, c4), Error);  // rows_out or logits, not both
}

TEST(ModelFixtures, AutoPathPicksTheCheaperAttention) {
  // From an empty cache the reconstructed path is cheaper for a multi-token prompt; a short chunk
  // after a long cache (a chat turn, a server's chunked prefill) is cheaper absorbed, because
  // the cached keys are not re-expanded through kv_b. Decode is always absorbed.
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(kFixtures + "/glm_dsa_full_f32", *be);
  EXPECT_EQ(m->choose_path(48, 0), AttentionPath::Reconstructed);
  EXPECT_EQ(m->choose_path(1, 0), AttentionPath::Absorbed);
  EXPECT_EQ(m->choose_path(1, 40), AttentionPath::Absorbed);
  EXPECT_EQ(m->choose_path(4, 2000), AttentionPath::Absorbed);
  // And Auto computes what both explicit paths compute.
  Fixture f = load_fixture("glm_dsa_full_f32");
  auto ids = ids_of(f.expected["tokens"]);
  const int64_t V = m->config().vocab_size, P = int64_t(ids.size()) - 4;
  MlaCache a(*be, m->cache_shape(), 1, int64_t(ids.size())), b(*be, m->cache_shape(), 1, int64_t(ids.size()));
  std::vector<float> la(static_cast<size_t>(4 * V)), lb(la.size());
  m->forward(ids.data(), P, a, 0, la.data());
  m->forward(ids.data(), P, b, 0, lb.data());
  m->forward(&ids[size_t(P)], 4, a, 0, la.data(), true, AttentionPath::Auto);
  m->forward(&ids[size_t(P)], 4, b, 0, lb.data(), true, AttentionPath::Reconstructed);
  EXPECT_LE(max_row_rel_l2(la.data(), lb.data(), 4, V), 1e-5);
  EXPECT_LE(max_row_rel_l2(la.data(), f.logits.data.data() + P * V, 4, V), 1e-4);
}

// A prompt fed in chunks (GenerateOptions::prefill_chunk, as run and chat do under a memory
// budget) chooses the same tokens as one prefill step: greedy on every fixture at chunk sizes
// that split the prompt evenly, unevenly and not at all, and sampled with the same seed (the
// chunks before the last take no draw from the sampler).
TEST(Generate, ChunkedPrefillGivesTheSameTokens) {
  for (const std::string name : {"glm_dsa_full_f32", "glm_dsa_shared_f32", "dsv32_f32", "dsv3_f32", "glm_dsa_fp8"}) {
    SCOPED_TRACE(name);
    Fixture f = load_fixture(name);
    auto be = make_cpu_backend();
    auto m = GlmDsaModel::load(f.dir, *be);
    auto prompt = ids_of(f.expected["greedy_prompt"]);
    auto want = ids_of(f.expected["greedy_new"]);
    const int64_t P = int64_t(prompt.size()), n = 12;
    ASSERT_GT(P, 4);
    for (bool sampled : {false, true}) {
      GenerateOptions opt;
      opt.max_new_tokens = n;
      opt.stop_at_eos = false;
      if (sampled) {
        opt.sampling.temperature = 0.8f;
        opt.sampling.seed = 7;
      }
      MlaCache c0(*be, m->cache_shape(), 1, P + n);
      const std::vector<int32_t> one_step = generate(*m, c0, 0, prompt, opt).tokens;
      if (!sampled) {
        EXPECT_EQ(one_step, std::vector<int32_t>(want.begin(), want.begin() + n));
      }
      for (int64_t chunk : {int64_t(1), int64_t(3), P / 2, P - 1, P, P + 5}) {
        MlaCache c(*be, m->cache_shape(), 1, P + n);
        opt.prefill_chunk = chunk;
        GenerateResult r = generate(*m, c, 0, prompt, opt);
        EXPECT_EQ(r.tokens, one_step) << "chunk " << chunk << (sampled ? " sampled" : " greedy");
        EXPECT_EQ(r.prompt_tokens, P);
        EXPECT_EQ(c.length(0), P + n - 1);  // the last token is chosen, not yet fed
      }
      opt.prefill_chunk = 0;
    }
  }
  Fixture f = load_fixture("glm_dsa_full_f32");
  auto be = make_cpu_backend();
  auto m = GlmDsaModel::load(f.dir, *be);
  MlaCache c(*be, m->cache_shape(), 1, 16);
  GenerateOptions opt;
  opt.max_new_tokens = 2;
  opt.prefill_chunk = -1;
  EXPECT_THROW(generate(*m, c, 0, {1, 2, 3}, opt), Error);
  EXPECT_EQ(c.length(0), 0);
}
