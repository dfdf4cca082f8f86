// Expert streaming: the slot pool's policy, exact counters, equality with resident execution on
// the fixtures at 1-2 slots per layer, the memory plan against real allocations, refusal below
// the minimum budget, and RSS under budget for a checkpoint whose experts exceed it.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "backend/backend.h"
#include "expert_test_util.h"
#include "experts/expert_layout.h"
#include "experts/memory_plan.h"
#include "experts/slot_pool.h"
#include "experts/streaming_store.h"
#include "io/json_file.h"
#include "model/glm_dsa/model.h"
#include "runtime/generate.h"
#include "test_helpers.h"

using namespace vireo;
using vireo::test::greedy;
using vireo::test::payload_bytes;
using vireo::test::prefill_logits;

namespace {

const std::string kFixtures = VIREO_FIXTURES_DIR;


std::unique_ptr<GlmDsaModel> load(const std::string& dir, Backend& be, int64_t slots, bool prefetch = false,
                                  DirectIo direct = DirectIo::Auto) {
  GlmDsaConfig c = load_glm_dsa_config(dir);
  auto ck = Checkpoint::open(dir);
  ExpertStoreOptions o;
  o.slots = slots;
  o.prefetch = prefetch;
  o.direct = direct;
  auto store = make_expert_store(*ck, expert_store_params(c), o);
  return GlmDsaModel::create(std::move(c), std::move(ck), be, std::move(store));
}

}  // namespace

// The default floor keeps room for one token's experts in any prepare, and never exceeds top_k.
TEST(SlotPool, AutoFloorLeavesRoomForTopK) {
  for (int layers : {1, 3, 75})
    for (int top_k : {1, 2, 8})
      for (int64_t slots = top_k; slots <= int64_t(top_k) * layers * 3; slots += std::max(1, layers / 4)) {
        const int f = SlotPool::auto_floor(slots, layers, top_k);
        EXPECT_GE(f, 0);
        EXPECT_LE(f, top_k);
        EXPECT_GE(SlotPool(slots, layers, layers, 256, f).max_per_prepare(), top_k)
            << slots << " slots, " << layers << " layers, top_k " << top_k;
      }
  EXPECT_EQ(SlotPool::auto_floor(8 + 75 * 8, 75, 8), 8);  // a full floor once every layer fits top_k
  EXPECT_EQ(SlotPool::auto_floor(8 + 75 * 3, 75, 8), 3);
}

TEST(SlotPool, LruWithPerLayerFloor) {
  // 4 slots, layers 0..1 both MoE, floor 1.
  SlotPool p(4, 2, 2, 8, 1);
  EXPECT_EQ(p.max_per_prepare(), 3);
  EXPECT_EQ(p.claim(0, 0), 0);
  EXPECT_EQ(p.claim(0, 1), 1);
  EXPECT_EQ(p.claim(1, 0), 2);
  EXPECT_EQ(p.claim(1, 1), 3);
  // Full. Layer 0 wants a third expert: the LRU slot is (0,0), its own: taken.
  bool ev = false;
  EXPECT_EQ(p.claim(0, 2, &ev), 0);
  EXPECT_TRUE(ev);
  EXPECT_EQ(p.find(0, 0), -1);
  // Layer 0 again: LRU is now (0,1) [slot 1]; touch it so (1,0) [slot 2] is the oldest.
  p.touch(1);
  EXPECT_EQ(p.claim(0, 3), 2);  // took (1,0): layer 1 had 2 > floor
  EXPECT_EQ(p.resident(1), 1);
  // Layer 1 is at its floor: layer 0 can no longer take its last slot even though it is oldest.
  p.touch(0);
  p.touch(1);
  p.touch(2);
  EXPECT_EQ(p.claim(0, 4), 0);  // own LRU slot, not (1,1)
  EXPECT_EQ(p.find(1, 1), 3);
  // Pinned and busy slots are never taken.
  p.pin(0);
  p.pin(1);
  p.set_busy(2, true);
  EXPECT_EQ(p.claim(0, 5), -1);
  p.unpin_all();
  p.set_busy(2, false);
  EXPECT_GE(p.claim(0, 5), 0);
  // Prefetch claims (own layer only) never take another layer's slot.
  SlotPool q(2, 2, 2, 4, 0);
  q.claim(0, 0);
  q.claim(0, 1);
  EXPECT_EQ(q.claim(1, 0, nullptr, true), -1);
  EXPECT_GE(q.claim(1, 0, nullptr, false), 0);
}

TEST(StreamingStore, CountersAreExact) {
  const std::string dir = kFixtures + "/glm_dsa_full_f32";
  GlmDsaConfig c = load_glm_dsa_config(dir);
  auto ck = Checkpoint::open(dir);
  ExpertStoreParams p = expert_store_params(c);  // MoE layers 1, 2, 3; 8 experts, top 2
  ExpertStoreOptions o;
  o.slots = 4;
  o.layer_floor = 1;
  StreamingExpertStore s(*ck, p, o);
  EXPECT_EQ(s.max_experts_per_prepare(), 2u);
  const uint64_t e = payload_bytes(*ck, 1, 0);
  ASSERT_GT(e, 0u);
  // Scripted: (layer, experts) -> expected new misses.
  struct Step { int layer; std::vector<int> experts; int misses; };
  const std::vector<Step> script = {
      {1, {0, 1}, 2},  // cold
      {1, {0, 1}, 0},  // both resident
      {2, {3, 4}, 2},  // pool now full: 1:{0,1} 2:{3,4}
      {3, {5}, 1},     // evicts the LRU unprotected slot: (1,0) (layer 1 keeps its floor of 1)
      {1, {1}, 0},     // still there
      {1, {0}, 1},     // was evicted
  };
  uint64_t misses = 0, requests = 0;
  for (size_t i = 0; i < script.size(); ++i) {
    s.prepare(script[i].layer, script[i].experts);
    misses += uint64_t(script[i].misses);
    requests += script[i].experts.size();
    const ExpertStoreStats st = s.stats();
    EXPECT_EQ(st.misses, misses) << "step " << i;
    EXPECT_EQ(st.requests, requests) << "step " << i;
    EXPECT_EQ(st.hits, requests - misses) << "step " << i;
    EXPECT_EQ(st.bytes_read, misses * e) << "step " << i;
    EXPECT_GE(st.bytes_transferred, st.bytes_read);
  }
  // After step 5 (1,0) came back by evicting the LRU slot not protected: layer 2 held 2 slots
  // ((2,3) oldest), layer 3 holds 1 = floor. So (2,3) is gone and (2,4) remains.
  EXPECT_EQ(s.slot_of(2, 3), -1);
  EXPECT_GE(s.slot_of(2, 4), 0);
  EXPECT_GE(s.slot_of(3, 5), 0);
  s.reset_stats();
  EXPECT_EQ(s.stats().requests, 0u);
  // A prepare larger than one prepare can hold is an internal error (the model chunks).
  EXPECT_THROW(s.prepare(1, {0, 1, 2}), Error);
}

TEST(StreamingStore, WeightsEqualTheCheckpoint) {
  const std::string dir = kFixtures + "/glm_dsa_full_f32";
  GlmDsaConfig c = load_glm_dsa_config(dir);
  auto ck = Checkpoint::open(dir);
  ExpertStoreOptions o;
  o.slots = 2;
  o.read_chunk = 4096;  // many chunks per expert, on several threads
  StreamingExpertStore s(*ck, expert_store_params(c), o);
  ResidentExpertStore r(*ck, expert_store_params(c));
  for (int l : {1, 2, 3})
    for (int e = 0; e < c.n_routed_experts; ++e) {
      const ExpertWeights* a = s.prepare(l, {e})[0];
      const ExpertWeights* b = r.prepare(l, {e})[0];
      for (auto [x, y] : {std::pair{&a->gate, &b->gate}, {&a->up, &b->up}, {&a->down, &b->down}}) {
        ASSERT_EQ(x->w.nbytes(), y->w.nbytes());
        EXPECT_EQ(std::memcmp(x->w.data, y->w.data, x->w.nbytes()), 0) << "layer " << l << " expert " << e;
      }
    }
}

class StreamingFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(StreamingFixture, EqualsResidentTokenForToken) {
  const std::string dir = kFixtures + "/" + GetParam();
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "fixture " << GetParam() << " not present";
  Json expected = read_json_file(dir + "/expected.json");
  auto ids = expected["tokens"].get<std::vector<int32_t>>();
  auto prompt = expected["greedy_prompt"].get<std::vector<int32_t>>();
  auto be = make_cpu_backend();
  auto resident = load(dir, *be, 0);
  const auto want_logits = prefill_logits(*resident, *be, ids);
  const auto want_tokens = greedy(*resident, *be, prompt, 24);
  const int n_moe = int(expert_store_params(resident->config()).moe_layers.size());
  for (int per_layer : {1, 2})
    for (bool prefetch : {false, true}) {
      SCOPED_TRACE("slots per layer " + std::to_string(per_layer) + (prefetch ? ", prefetch" : ""));
      auto m = load(dir, *be, int64_t(per_layer) * n_moe, prefetch);
      EXPECT_EQ(prefill_logits(*m, *be, ids), want_logits);  // bit for bit: same sums, same order
      EXPECT_EQ(greedy(*m, *be, prompt, 24), want_tokens);
      EXPECT_GT(m->experts().stats().misses, 0u);
      auto* s = dynamic_cast<StreamingExpertStore*>(&m->experts());
      ASSERT_NE(s, nullptr);
      EXPECT_EQ(m->experts().resident_bytes(), size_t(per_layer * n_moe) * s->slot_bytes());
    }
  auto buffered = load(dir, *be, n_moe, false, DirectIo::Off);
  EXPECT_EQ(prefill_logits(*buffered, *be, ids), want_logits);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, StreamingFixture,
                         ::testing::Values("glm_dsa_full_f32", "glm_dsa_shared_f32", "glm_dsa_bf16", "glm_dsa_fp8",
                                           "dsv32_f32"));

TEST(MemoryPlan, ParsesSizes) {
  EXPECT_EQ(parse_byte_size("8G", "x"), uint64_t(8) << 30);
  EXPECT_EQ(parse_byte_size("512M", "x"), uint64_t(512) << 20);
  EXPECT_EQ(parse_byte_size("1.5GiB", "x"), uint64_t(3) << 29);
  EXPECT_EQ(parse_byte_size("4096", "x"), 4096u);
  EXPECT_THROW(parse_byte_size("8Q", "--memory-budget"), Error);
  EXPECT_THROW(parse_byte_size("", "--memory-budget"), Error);
}

namespace {

// A tiny GLM-5-structured checkpoint on disk whose experts (4 layers x 64 x 768 KiB = 192 MiB)
// exceed the budgets below.
struct TinyCheckpoint {
  test::TempDir dir{"experts_ck"};
  TinyCheckpoint() {
    auto r = test::run_vireo("synth --out " + dir.str() + " --arch tiny --layers 4 --experts 64 --quiet");
    if (r.exit_code != 0) ADD_FAILURE() << r.err;
  }
};

TinyCheckpoint& tiny() {
  static TinyCheckpoint ck;
  return ck;
}

}  // namespace

// The minimum budget is tight: it runs a pool of top_k slots, and 1 MiB less (far under a slot)
// does not. (The 2% reserve grows with the budget; counting it twice overstated the minimum.)
TEST(MemoryPlan, MinimumBudgetIsTight) {
  MemoryPlanInputs in;
  in.dense_bytes = uint64_t(3) << 30;
  in.expert_bytes = uint64_t(37) << 20;
  in.slot_bytes = uint64_t(38) << 20;
  in.n_moe_layers = 75;
  in.n_experts = 256;
  in.top_k = 8;
  in.cache_bytes = uint64_t(200) << 20;
  in.scratch_bytes = uint64_t(60) << 20;
  in.budget = uint64_t(32) << 30;
  const uint64_t minimum = make_memory_plan(in).minimum;
  in.budget = minimum;
  const MemoryPlan at = make_memory_plan(in);
  EXPECT_TRUE(at.fits);
  EXPECT_GE(at.slots, in.top_k);
  EXPECT_EQ(at.minimum, minimum);  // the same minimum whatever budget it is computed at
  in.budget = minimum - (uint64_t(1) << 20);
  EXPECT_FALSE(make_memory_plan(in).fits);
}

TEST(MemoryPlan, MatchesRealAllocationWithin5Percent) {
  const std::string dir = tiny().dir.str();
  const int64_t context = 2048;
  auto r = test::run_vireo("plan --model " + dir + " --memory-budget 100M --context " + std::to_string(context));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("expert pool +[0-9.]+ [KMG]iB +([0-9]+) slots")));
  const int64_t slots = std::stoll(m[1]);
  ASSERT_GT(slots, 8);
  auto be = make_cpu_backend();
  auto model = load(dir, *be, slots);
  MlaCache cache(*be, model->cache_shape(), 1, context);
  auto near = [](double plan, double real) { return std::abs(plan - real) <= 0.05 * real; };
  EXPECT_TRUE(near(test::table_bytes(r.out, "resident weights"), double(model->weights().dense_bytes)));
  EXPECT_TRUE(near(test::table_bytes(r.out, "expert pool"), double(model->experts().resident_bytes())));
  EXPECT_TRUE(near(test::table_bytes(r.out, "MLA cache"), double(cache.bytes_allocated())));
  // The pool really is a fraction of the experts.
  const double all_experts = 4.0 * 64 * double(payload_bytes(model->checkpoint(), 0, 0));
  EXPECT_LT(double(model->experts().resident_bytes()), 0.5 * all_experts);
}

TEST(MemoryPlan, BudgetBelowMinimumIsRefusedWithOneLineAndTheTable) {
  const std::string dir = tiny().dir.str();
  auto r = test::run_vireo("run -m " + dir + " --prompt-ids 1,2,3 -n 2 --memory-budget 20M");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("memory plan: budget 20.00 MiB"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("minimum budget"), std::string::npos);
  std::regex err_line("(^|\n)vireo: error: --memory-budget 20.00 MiB is below the minimum of [0-9.]+ MiB[^\n]*\n$");
  EXPECT_TRUE(std::regex_search(r.err, err_line)) << r.err;
  EXPECT_EQ(r.out, "");
}

TEST(MemoryPlan, RssStaysUnderBudgetWhileExpertsExceedIt) {
  // The experts (192 MiB) do not fit in the budget; a child process decodes with streaming and
  // reports its peak RSS (VmHWM): weights, pool, cache, scratch and everything else must fit.
  const std::string dir = tiny().dir.str();
  const uint64_t budget = uint64_t(96) << 20;
  auto resident = test::run_vireo("run -m " + dir + " --prompt-ids 5,6,7,8 -n 12 --ignore-eos");
  ASSERT_EQ(resident.exit_code, 0) << resident.err;
  for (const char* direct : {"auto", "off"}) {
    SCOPED_TRACE(direct);
    auto r = test::run_vireo("run -m " + dir + " --prompt-ids 5,6,7,8 -n 12 --ignore-eos --stats --memory-budget 96M "
                             "--direct-io " + direct);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, resident.out);  // token for token
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.err, m, std::regex("peak RSS: ([0-9]+) bytes \\(([0-9]+) before loading"))) << r.err;
    // What the run added on top of the program itself (its code and shared libraries, which
    // include CUDA's when built with it) must fit the budget.
    const uint64_t rss = std::stoull(m[1]) - std::stoull(m[2]);
    EXPECT_LE(rss, budget);
    ASSERT_TRUE(std::regex_search(r.err, m, std::regex("experts total: requests [0-9]+, hits [0-9]+ \\([0-9.]+%\\), misses ([0-9]+)")));
    EXPECT_GT(std::stoull(m[1]), 0u);
    ASSERT_TRUE(std::regex_search(r.err, m, std::regex("experts total: .*read ([0-9.]+) GB")));
    EXPECT_GT(std::stod(m[1]) * 1e9, 0.1 * double(budget));  // it really streamed
  }
}

// The plan's scratch is sized for the step the command runs: it grows with the context (the
// attention's buffers over every key: kv_b's expansion, the latents) and with the step's tokens,
// and the table says which step it planned for.
TEST(MemoryPlan, ScratchGrowsWithContextAndStep) {
  const std::string dir = tiny().dir.str();
  auto scratch = [&](const std::string& flags) {
    auto r = test::run_vireo("plan --model " + dir + " --memory-budget 100M " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return test::table_bytes(r.out, "scratch");
  };
  const double base = scratch("--context 1024 --prefill-chunk 128");
  EXPECT_GT(scratch("--context 4096 --prefill-chunk 128"), base);
  EXPECT_GT(scratch("--context 1024 --prefill-chunk 512"), base);
  // A chunk beyond the context is a step of the context.
  EXPECT_EQ(scratch("--context 1024 --prefill-chunk 4096"), scratch("--context 1024 --prefill-chunk 1024"));
  // The tiny model: 4 heads x (32 + 32) f32 of kv_b's expansion and a 64-wide latent per key.
  const double per_key = 4 * 64 * 4 + 64 * 4;
  EXPECT_GE(scratch("--context 4096 --prefill-chunk 128") - base, 0.99 * per_key * 3072);
  auto r = test::run_vireo("plan --model " + dir + " --memory-budget 100M --context 1024 --prefill-chunk 128");
  EXPECT_NE(r.out.find("activations of one step of 128 tokens over up to 1024 keys"), std::string::npos) << r.out;
  r = test::run_vireo("plan --model " + dir + " --memory-budget 100M --context 64");
  EXPECT_NE(r.out.find("one step of 64 tokens"), std::string::npos) << r.out;  // default 512, capped
}

// Under a budget `run` feeds a prompt longer than its chunk (the default 512, or --prefill-chunk)
// in chunks, with the tokens of the resident one-step run; a chunk of 0 (the whole prompt,
// unplanned) or below is refused with one line naming the flag.
TEST(MemoryPlan, RunChunksTheLongPromptUnderABudget) {
  const std::string dir = tiny().dir.str();
  std::string ids;
  for (int i = 0; i < 600; ++i) ids += (i ? "," : "") + std::to_string((i * 37 + 11) % 1000);
  const std::string run = "run -m " + dir + " --prompt-ids " + ids + " -n 6 --ignore-eos";
  auto resident = test::run_vireo(run);
  ASSERT_EQ(resident.exit_code, 0) << resident.err;
  for (const char* chunk : {"", " --prefill-chunk 64", " --prefill-chunk 599"}) {
    SCOPED_TRACE(chunk);
    auto r = test::run_vireo(run + " --memory-budget 96M" + std::string(chunk));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, resident.out);  // token for token
  }
  auto zero = test::run_vireo(run + " --memory-budget 96M --prefill-chunk 0");
  EXPECT_EQ(zero.exit_code, 1);
  EXPECT_EQ(zero.err,
            "vireo: error: --prefill-chunk 0 (the whole prompt in one step) cannot be planned under --memory-budget: "
            "give a chunk of at least 1 token\n");
  EXPECT_EQ(zero.out, "");
  for (const char* budget : {" --memory-budget 96M", ""}) {
    auto neg = test::run_vireo(run + budget + " --prefill-chunk=-3");
    EXPECT_EQ(neg.exit_code, 1);
    EXPECT_EQ(neg.err, "vireo: error: --prefill-chunk: -3 is negative (expected a token count, or 0 for the whole "
                       "prompt)\n");
  }
  // Without a budget 0 is the whole prompt, as without the flag.
  auto whole = test::run_vireo(run + " --prefill-chunk 0");
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  EXPECT_EQ(whole.out, resident.out);
}
