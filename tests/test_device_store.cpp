// Experts streamed to device slots (DeviceExpertStore) under a GPU budget.
//
// Without a GPU the store runs over the host TransferLink (make_host_transfer_link): "device"
// memory is host memory and every copy is deferred until its ticket is waited for, so a missing
// wait leaves the previous expert's bytes in the slot and the outputs change. That checks the
// store's policy, counters and ordering on the CPU backend: equality with resident execution at
// 1-2 slots per layer, from a pinned host copy and from a staging ring. The GPU column of the
// memory plan is arithmetic and is checked here too. The CUDA suites (gated by REQUIRE_CUDA) run
// the same equality on the CUDA backend against resident CUDA runs, and check the plan against
// the device memory really allocated.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <regex>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/transfer_link.h"
#include "cuda_test_util.h"
#include "expert_test_util.h"
#include "fixture_util.h"
#include "experts/device_store.h"
#include "experts/memory_plan.h"
#include "io/json_file.h"
#include "model/glm_dsa/model.h"
#include "runtime/generate.h"
#include "test_helpers.h"

using namespace vireo;
using vireo::test::batched_decode_logits;
using vireo::test::decode_logits;
using vireo::test::greedy;
using vireo::test::max_row_rel_l2;
using vireo::test::mean_row_rel_l2;
using vireo::test::payload_bytes;
using vireo::test::prefill_logits;

namespace {

const std::string kFixtures = VIREO_FIXTURES_DIR;

struct Mode {
  int per_layer;          // device slots per MoE layer
  int64_t staging;        // 0: pinned host copy; N: host tier of N slots fed from disk
  bool prefetch = false;  // next-layer guesses copied ahead of need
};
std::string mode_name(const Mode& m) {
  return std::to_string(m.per_layer) + " slots per layer, " +
         (m.staging ? "host tier of " + std::to_string(m.staging) : std::string("host copy")) +
         (m.prefetch ? ", prefetch" : "");
}
const Mode kModes[] = {{1, 0}, {2, 0}, {1, 1}, {2, 3}, {1, 1000}, {2, 0, true}, {2, 3, true}};

std::unique_ptr<Checkpoint> in_memory_copy(const Checkpoint& ck) {
  auto m = Checkpoint::in_memory("copy of " + ck.dir());
  for (const auto& [name, t] : ck.tensors()) std::memcpy(m->add_tensor(name, t->dtype, t->shape), t->data, t->nbytes);
  return m;
}

std::unique_ptr<GlmDsaModel> load_device(const std::string& dir, Backend& be, std::shared_ptr<TransferLink> link,
                                         const Mode& mode, bool in_memory = false) {
  GlmDsaConfig c = load_glm_dsa_config(dir);
  auto ck = Checkpoint::open(dir);
  if (in_memory) ck = in_memory_copy(*ck);
  ExpertStoreOptions o;
  o.slots = int64_t(mode.per_layer) * int64_t(expert_store_params(c).moe_layers.size());
  o.staging = mode.staging;
  o.prefetch = mode.prefetch;
  o.read_chunk = 4096;  // several reads per expert
  auto store = std::make_unique<DeviceExpertStore>(*ck, expert_store_params(c), o, std::move(link));
  return GlmDsaModel::create(std::move(c), std::move(ck), be, std::move(store));
}

bool same_bytes(const ExpertWeights& a, const ExpertWeights& b) {
  for (auto [x, y] : {std::pair{&a.gate, &b.gate}, {&a.up, &b.up}, {&a.down, &b.down}}) {
    if (x->w.nbytes() != y->w.nbytes() || std::memcmp(x->w.data, y->w.data, x->w.nbytes()) != 0) return false;
    if (x->scale_inv.nbytes() != y->scale_inv.nbytes() ||
        (x->scale_inv.nbytes() && std::memcmp(x->scale_inv.data, y->scale_inv.data, x->scale_inv.nbytes()) != 0))
      return false;
  }
  return true;
}

}  // namespace

TEST(DeviceStore, CountersAreExact) {
  const std::string dir = kFixtures + "/glm_dsa_full_f32";
  GlmDsaConfig c = load_glm_dsa_config(dir);
  auto ck = Checkpoint::open(dir);
  ExpertStoreParams p = expert_store_params(c);  // MoE layers 1, 2, 3; 8 experts, top 2
  // staging 2: a ring (every device miss read from disk); 24: a host tier holding all 3 x 8
  // experts (a device miss on an expert read before is a copy, not a read).
  for (int64_t staging : {int64_t(0), int64_t(2), int64_t(24)}) {
    SCOPED_TRACE(staging ? "host tier of " + std::to_string(staging) : std::string("host copy"));
    ExpertStoreOptions o;
    o.slots = 4;
    o.layer_floor = 1;
    o.staging = staging;
    DeviceExpertStore s(*ck, p, o, make_host_transfer_link());
    EXPECT_EQ(s.max_experts_per_prepare(), 2u);
    EXPECT_EQ(s.resident_bytes(), 4 * s.slot_bytes());
    EXPECT_EQ(s.pinned_bytes(), (staging ? uint64_t(staging) : 3 * 8) * s.host_slot_bytes());
    EXPECT_EQ(s.slot_bytes() % 256, 0u);
    const uint64_t e = payload_bytes(*ck, 1, 0), moved = e;  // one copy per tensor
    ASSERT_GT(e, 0u);
    struct Step { int layer; std::vector<int> experts; int misses; };
    const std::vector<Step> script = {
        {1, {0, 1}, 2},  // cold
        {1, {0, 1}, 0},  // both resident
        {2, {3, 4}, 2},  // pool now full: 1:{0,1} 2:{3,4}
        {3, {5}, 1},     // evicts the LRU slot not protected by a floor: (1,0)
        {1, {1}, 0},
        {1, {0}, 1},     // was evicted
    };
    uint64_t misses = 0, requests = 0, disk_before = 0;
    for (size_t i = 0; i < script.size(); ++i) {
      s.prepare(script[i].layer, script[i].experts);
      misses += uint64_t(script[i].misses);
      requests += script[i].experts.size();
      const ExpertStoreStats st = s.stats();
      EXPECT_EQ(st.misses, misses) << "step " << i;
      EXPECT_EQ(st.requests, requests) << "step " << i;
      EXPECT_EQ(st.hits, requests - misses) << "step " << i;
      EXPECT_EQ(st.bytes_read, misses * e) << "step " << i;
      EXPECT_EQ(st.bytes_to_device, misses * moved) << "step " << i;
      // The last step's miss, (1, 0), was read at step 0: still in a 24-slot host tier, long
      // gone from a 2-buffer ring.
      const bool host_hit = staging == 24 && i + 1 == script.size();
      EXPECT_EQ(st.host_hits, host_hit ? 1u : 0u) << "step " << i;
      if (staging) {
        EXPECT_GE(st.bytes_transferred, st.bytes_read - st.host_hits * e) << "step " << i;
        if (script[i].misses && !host_hit) {
          EXPECT_GT(st.bytes_transferred, disk_before) << "step " << i;
        } else {
          EXPECT_EQ(st.bytes_transferred, disk_before) << "step " << i;  // no disk read
        }
      } else {
        EXPECT_EQ(st.bytes_transferred, 0u) << "step " << i;  // no disk reads after startup
      }
      disk_before = st.bytes_transferred;
    }
    EXPECT_EQ(s.slot_of(2, 3), -1);
    EXPECT_GE(s.slot_of(2, 4), 0);
    EXPECT_GE(s.slot_of(3, 5), 0);
    s.reset_stats();
    EXPECT_EQ(s.stats().requests, 0u);
    EXPECT_THROW(s.prepare(1, {0, 1, 2}), Error);
  }
}

TEST(DeviceStore, SlotsHoldTheCheckpointBytesOnlyAfterAwait) {
  // The host link performs a copy only when it is waited for: before await(i) the slot still
  // holds what was there (the test would catch a forward pass that skipped the wait).
  const std::string dir = kFixtures + "/glm_dsa_fp8";
  GlmDsaConfig c = load_glm_dsa_config(dir);
  auto ck = Checkpoint::open(dir);
  ResidentExpertStore r(*ck, expert_store_params(c));
  for (int64_t staging : {int64_t(0), int64_t(1)}) {
    SCOPED_TRACE(staging ? "staging ring" : "host copy");
    ExpertStoreOptions o;
    o.slots = 2 * int64_t(expert_store_params(c).moe_layers.size());
    o.staging = staging;
    o.read_chunk = 4096;
    DeviceExpertStore s(*ck, expert_store_params(c), o, make_host_transfer_link());
    bool saw_stale = false;
    for (int l : expert_store_params(c).moe_layers)
      for (int e = 0; e < c.n_routed_experts; ++e) {
        const ExpertWeights* a = s.prepare_async(l, {e})[0];
        const ExpertWeights* b = r.prepare(l, {e})[0];
        if (!s.ready(0)) saw_stale |= !same_bytes(*a, *b);
        s.await(0);
        EXPECT_TRUE(same_bytes(*a, *b)) << "layer " << l << " expert " << e;
        EXPECT_TRUE(s.ready(0));
      }
    EXPECT_TRUE(saw_stale);
  }
}

class DeviceStoreFixture : public ::testing::TestWithParam<std::string> {};

// Rows of logits [rows, V]: the same argmax per row, and within f32 rounding of each other.
static void expect_same_choices(const std::vector<float>& got, const std::vector<float>& want, int64_t V) {
  ASSERT_EQ(got.size(), want.size());
  for (int64_t r = 0; r < int64_t(got.size()) / V; ++r) {
    const float* g = got.data() + r * V;
    const float* w = want.data() + r * V;
    EXPECT_EQ(std::max_element(g, g + V) - g, std::max_element(w, w + V) - w) << "row " << r;
    EXPECT_LE(max_row_rel_l2(g, w, 1, V), 1e-5) << "row " << r;
  }
}

// Decode as the CUDA backend runs it (experts by id, moe_experts), here on the CPU backend with
// the host link: a layer whose experts are all in slots runs them from the streamed bank, one
// with copies in flight runs the grouped path. Single-row steps equal the resident run's (which
// runs experts by id from the store's bank) bit for bit: one-row products are the same
// computation either way. Two-row steps: the grouped path's products over 2 rows and its separate
// shared expert round differently, so the same greedy choice per row, logits within 1e-5.
TEST_P(DeviceStoreFixture, DecodeByIdEqualsResident) {
  const std::string dir = kFixtures + "/" + GetParam();
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "fixture " << GetParam() << " not present";
  auto prompt = read_json_file(dir + "/expected.json")["greedy_prompt"].get<std::vector<int32_t>>();
  auto be = make_cpu_backend(8);
  auto resident = GlmDsaModel::load(dir, *be);
  const auto want_logits = decode_logits(*resident, *be, prompt, 12);
  const auto want_tokens = greedy(*resident, *be, prompt, 12);
  const auto want_batched = batched_decode_logits(*resident, *be, prompt, 6);
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode_name(mode));
    auto m = load_device(dir, *be, make_host_transfer_link(), mode);
    EXPECT_EQ(decode_logits(*m, *be, prompt, 12), want_logits);
    EXPECT_EQ(greedy(*m, *be, prompt, 12), want_tokens);
    expect_same_choices(batched_decode_logits(*m, *be, prompt, 6), want_batched, m->config().vocab_size);
  }
}

TEST_P(DeviceStoreFixture, EqualsResidentTokenForToken) {
  const std::string dir = kFixtures + "/" + GetParam();
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "fixture " << GetParam() << " not present";
  Json expected = read_json_file(dir + "/expected.json");
  auto ids = expected["tokens"].get<std::vector<int32_t>>();
  auto prompt = expected["greedy_prompt"].get<std::vector<int32_t>>();
  auto be = make_cpu_backend();
  auto resident = GlmDsaModel::load(dir, *be);
  const auto want_logits = prefill_logits(*resident, *be, ids);
  const auto want_tokens = greedy(*resident, *be, prompt, 24);
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode_name(mode));
    auto m = load_device(dir, *be, make_host_transfer_link(), mode);
    EXPECT_EQ(prefill_logits(*m, *be, ids), want_logits);  // bit for bit: same sums, same order
    EXPECT_EQ(greedy(*m, *be, prompt, 24), want_tokens);
    const ExpertStoreStats st = m->experts().stats();
    EXPECT_GT(st.misses, 0u);
    EXPECT_GT(st.bytes_to_device, 0u);
    // One device slot per layer evicts experts that come back: a host tier holding every expert
    // serves those without a second disk read; a pinned copy or a small ring never counts one.
    if (mode.staging >= 1000 && mode.per_layer == 1) {
      EXPECT_GT(st.host_hits, 0u);
    }
    if (mode.staging == 0) {
      EXPECT_EQ(st.host_hits, 0u);
    }
    if (mode.prefetch) {  // guesses were made, scored and (some) copied ahead
      EXPECT_GT(st.predicted, 0u);
      EXPECT_GT(st.predicted_actual, 0u);
      EXPECT_LE(st.predicted_correct, std::min(st.predicted, st.predicted_actual));
      EXPECT_GT(st.prefetch_reads, 0u);
      EXPECT_LE(st.prefetch_used, st.prefetch_reads);
    } else {
      EXPECT_EQ(st.predicted + st.prefetch_reads, 0u);
    }
  }
  // An in-memory checkpoint (as `vireo bench --synthetic`): packed slots, copied not read.
  auto m = load_device(dir, *be, make_host_transfer_link(), {1, 0}, true);
  EXPECT_EQ(prefill_logits(*m, *be, ids), want_logits);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeviceStoreFixture,
                         ::testing::Values("glm_dsa_full_f32", "glm_dsa_shared_f32", "glm_dsa_bf16", "glm_dsa_fp8",
                                           "dsv32_f32"));

// --- the memory plan's GPU column --------------------------------------------------------------

namespace {

MemoryPlanInputs gpu_inputs() {
  MemoryPlanInputs in;
  in.dense_bytes = uint64_t(2) << 30;
  in.expert_bytes = uint64_t(37) << 20;
  in.slot_bytes = uint64_t(38) << 20;
  in.n_moe_layers = 4;
  in.n_experts = 64;
  in.top_k = 8;
  in.cache_bytes = uint64_t(100) << 20;
  in.scratch_bytes = uint64_t(50) << 20;
  in.context = 4096;
  in.gpu_budget = uint64_t(8) << 30;
  return in;
}

}  // namespace

TEST(MemoryPlan, GpuColumnArithmetic) {
  MemoryPlanInputs in = gpu_inputs();
  MemoryPlan p = make_memory_plan(in);
  ASSERT_TRUE(p.gpu);
  const uint64_t reserve = (uint64_t(640) << 20) + in.gpu_budget / 50;
  EXPECT_EQ(p.g.reserve, reserve);
  const uint64_t fixed = in.dense_bytes + in.cache_bytes + in.scratch_bytes + reserve;
  EXPECT_EQ(p.g.slots, int64_t((in.gpu_budget - fixed) / in.slot_bytes));
  EXPECT_EQ(p.g.pool_bytes, uint64_t(p.g.slots) * in.slot_bytes);
  in.device_slot_bytes = in.slot_bytes - (uint64_t(1) << 20);  // device slots sized apart
  EXPECT_EQ(make_memory_plan(in).g.slots, int64_t((in.gpu_budget - fixed) / in.device_slot_bytes));
  EXPECT_EQ(make_memory_plan(in).g.pinned_bytes, 256 * in.slot_bytes);
  in.device_slot_bytes = 0;
  EXPECT_EQ(p.g.total, fixed + p.g.pool_bytes);
  EXPECT_LE(p.g.total, in.gpu_budget);
  EXPECT_TRUE(p.g.fits);
  {  // The backend's op buffers come out of the pool, and raise the minimum by as much.
    MemoryPlanInputs ob = in;
    ob.backend_bytes = uint64_t(300) << 20;
    const MemoryPlan q = make_memory_plan(ob);
    EXPECT_EQ(q.g.slots, int64_t((in.gpu_budget - fixed - ob.backend_bytes) / in.slot_bytes));
    EXPECT_EQ(q.g.total, fixed + ob.backend_bytes + q.g.pool_bytes);
    EXPECT_NEAR(double(q.g.minimum - p.g.minimum), double(ob.backend_bytes) / 0.98, 2.0);
    EXPECT_TRUE(std::regex_search(q.table(), std::regex("op buffers +- +300\\.00 MiB"))) << q.table();
  }
  // No RAM budget, nothing known about RAM: a pinned copy of every expert.
  EXPECT_TRUE(p.g.host_copy);
  EXPECT_EQ(p.g.pinned_bytes, 256 * in.slot_bytes);
  // The minimum runs exactly top_k slots.
  in.gpu_budget = p.g.minimum;
  MemoryPlan q = make_memory_plan(in);
  EXPECT_TRUE(q.g.fits);
  EXPECT_GE(q.g.slots, 8);
  in.gpu_budget = p.g.minimum - (uint64_t(40) << 20);
  EXPECT_FALSE(make_memory_plan(in).g.fits);
  // Never more slots than experts.
  in.gpu_budget = uint64_t(64) << 30;
  EXPECT_EQ(make_memory_plan(in).g.slots, 256);
}

// The memory plan's op buffers count a resident bank's prefill run buffers (once left out: ~0.67 GB
// at GLM-5's shapes) by CudaBufferSizes::bank_run_bytes: bf16 x and SwiGLU rows, f32 down rows,
// 6 D + 2 I bytes a row, for up to a chunk of rows, none for decode steps.
// (CudaDeviceStore.FastPrefillBankRunMatchesForwardGrouping checks the real buffers against it.)
TEST(MemoryPlan, GpuBankRunBound) {
  const int64_t D = 6144, I = 2048, per_token = 9, E = 256, per_row = 6 * D + 2 * I;
  const int64_t chunk = CudaBufferSizes::kGroupedRows;
  for (int64_t T : {int64_t(2048), int64_t(4096)}) {  // more rows than a chunk: the bound of smaller steps
    EXPECT_GE(CudaBufferSizes::bank_run_bytes(T, per_token, D, I, E), chunk * per_row) << T;
    EXPECT_LT(CudaBufferSizes::bank_run_bytes(T, per_token, D, I, E), chunk * per_row * 11 / 10) << T;
  }
  // 100 tokens, 900 rows: buffers of at most round_up(2 x 900 + 1024, 1024) = 3072 rows.
  EXPECT_GE(CudaBufferSizes::bank_run_bytes(100, per_token, D, I, E), 3072 * per_row);
  EXPECT_LT(CudaBufferSizes::bank_run_bytes(100, per_token, D, I, E), 4096 * per_row);
  EXPECT_EQ(CudaBufferSizes::bank_run_bytes(8, per_token, D, I, E), 0) << "decode steps run the experts by id";
}

TEST(MemoryPlan, GpuHostSideIsACopyOrAHostTier) {
  MemoryPlanInputs in = gpu_inputs();
  const uint64_t all = 256 * in.slot_bytes;  // 9.5 GiB
  in.host_available = uint64_t(64) << 30;
  EXPECT_TRUE(make_memory_plan(in).g.host_copy);
  in.host_available = uint64_t(8) << 30;  // less than the experts: a host tier fed from disk
  MemoryPlan p = make_memory_plan(in);
  EXPECT_FALSE(p.g.host_copy);
  // As many host slots as 90% of what is available holds besides the spine and the reserve.
  const uint64_t ram = in.host_available / 10 * 9;
  EXPECT_GT(p.g.staging, 2 * in.top_k);
  EXPECT_LT(p.g.staging, 256);
  EXPECT_EQ(p.g.pinned_bytes, uint64_t(p.g.staging) * in.slot_bytes);
  EXPECT_LE(p.g.host_total, ram);
  EXPECT_GT(p.g.host_total + in.slot_bytes, ram);  // one slot more would not fit
  EXPECT_NE(p.table().find("host tier of " + std::to_string(p.g.staging) + " pinned slots"), std::string::npos)
      << p.table();
  // Nothing known about RAM and no budget: a pinned copy (the caller checks what it can pin).
  in.host_available = 0;
  EXPECT_TRUE(make_memory_plan(in).g.host_copy);
  in.host_available = uint64_t(8) << 30;
  // A RAM budget decides instead of what is available.
  in.budget = in.dense_bytes + all + (uint64_t(1) << 30);
  EXPECT_TRUE(make_memory_plan(in).g.host_copy);
  in.budget = in.dense_bytes + (uint64_t(400) << 20);  // room for a few host slots only
  p = make_memory_plan(in);
  EXPECT_FALSE(p.g.host_copy);
  EXPECT_GE(p.g.staging, 1);
  EXPECT_LT(p.g.staging, 16);
  EXPECT_LE(p.g.host_total, in.budget);
  EXPECT_GT(p.g.host_total + in.slot_bytes, in.budget);
  EXPECT_TRUE(p.g.fits);
  in.budget = in.dense_bytes;  // not even one buffer
  EXPECT_FALSE(make_memory_plan(in).g.fits);
  // In-memory checkpoints cannot stream from disk: always a host copy.
  in.in_memory = true;
  EXPECT_TRUE(make_memory_plan(in).g.host_copy);
  // The table has both columns.
  const std::string t = make_memory_plan(gpu_inputs()).table();
  EXPECT_NE(t.find("RAM          GPU"), std::string::npos) << t;
  EXPECT_TRUE(std::regex_search(t, std::regex("expert pool +9\\.50 GiB +[0-9.]+ GiB  GPU: [0-9]+ slots"))) << t;
  EXPECT_NE(t.find("minimum budget"), std::string::npos);
}

namespace {

// A tiny GLM-5-structured checkpoint on disk (4 layers x 64 experts of 768 KiB).
struct TinyCheckpoint {
  test::TempDir dir{"device_ck"};
  TinyCheckpoint() {
    auto r = test::run_vireo("synth --out " + dir.str() + " --arch tiny --layers 4 --experts 64 --quiet");
    if (r.exit_code != 0) ADD_FAILURE() << r.err;
  }
};
TinyCheckpoint& tiny() {
  static TinyCheckpoint ck;
  return ck;
}

// "  expert pool   12.00 MiB   140.00 MiB  GPU: ..." -> (RAM bytes, GPU bytes); "-" is 0.
[[maybe_unused]] std::pair<double, double> gpu_row(const std::string& table, const std::string& row) {
  auto bytes = [](const std::string& v, const std::string& u) {
    if (v == "-") return 0.0;
    const double mult = u == "B" ? 1 : u == "KiB" ? 1024.0 : u == "MiB" ? 1048576.0 : 1073741824.0;
    return std::stod(v) * mult;
  };
  std::smatch m;
  std::regex re("  " + row + " +(-|[0-9.]+) ?(B|KiB|MiB|GiB)? +(-|[0-9.]+) ?(B|KiB|MiB|GiB)?");
  if (!std::regex_search(table, m, re)) {
    ADD_FAILURE() << "no row " << row << " in\n" << table;
    return {0, 0};
  }
  return {bytes(m[1], m[2]), bytes(m[3], m[4])};
}

}  // namespace

TEST(MemoryPlan, GpuPlanCommandAndRefusal) {
  const std::string dir = tiny().dir.str();
  auto r = test::run_vireo("plan --model " + dir + " --gpu-budget 1280M --context 1024");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("memory plan: GPU budget 1.25 GiB"), std::string::npos) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("GPU: ([0-9]+) slots"))) << r.out;
  EXPECT_EQ(std::stoll(m[1]), 256);  // 1.25 GiB holds every expert of this tiny model
  // The backend's op buffers have their row: 4 expert lanes' 32 MiB workspaces at least.
  EXPECT_GE(gpu_row(r.out, "op buffers").second, 128.0 * 1048576) << r.out;
  // Below the minimum: the table, then one line naming the flag.
  r = test::run_vireo("plan --model " + dir + " --gpu-budget 500M");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("minimum budget"), std::string::npos) << r.out;
  std::regex err_line("^vireo: error: --gpu-budget 500.00 MiB is below the minimum of [0-9.]+ MiB for [^\n]*\n$");
  EXPECT_TRUE(std::regex_search(r.err, err_line)) << r.err;
  // A RAM budget too small for a staging buffer besides the resident weights.
  r = test::run_vireo("plan --model " + dir + " --gpu-budget 1G --memory-budget 1M");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("vireo: error: --memory-budget 1.00 MiB leaves no room for a pinned staging buffer"),
            std::string::npos) << r.err;
  // The flag belongs to the CUDA device.
  r = test::run_vireo("run -m " + dir + " --prompt-ids 1,2 -n 1 --gpu-budget 1G");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "vireo: error: --gpu-budget needs --device cuda\n");
  r = test::run_vireo("plan --model " + dir + " --gpu-budget 1x");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "vireo: error: --gpu-budget: '1x' is not a size (expected bytes or a number with K, M, G or T, e.g. 8G)\n");
}

// --- on the GPU -------------------------------------------------------------------------------

class CudaDeviceStoreFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaDeviceStoreFixture, EqualsResidentCudaTokenForToken) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  const std::string dir = kFixtures + "/" + GetParam();
  Json expected = read_json_file(dir + "/expected.json");
  auto ids = expected["tokens"].get<std::vector<int32_t>>();
  auto prompt = expected["greedy_prompt"].get<std::vector<int32_t>>();
  auto be = make_cuda_backend();
  auto resident = GlmDsaModel::load(dir, *be);
  const auto want_logits = prefill_logits(*resident, *be, ids);
  const auto want_tokens = greedy(*resident, *be, prompt, 24);
  const auto want_batched = batched_decode_logits(*resident, *be, prompt, 6);
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode_name(mode));
    auto m = load_device(dir, *be, make_cuda_transfer_link(*be), mode);
    EXPECT_EQ(prefill_logits(*m, *be, ids), want_logits);  // bit for bit
    EXPECT_EQ(greedy(*m, *be, prompt, 24), want_tokens);
    // Where the store holds a step's top_k experts at once, decode runs them in the fused
    // launches and replays recorded pieces between the stages (else the grouped path).
    const size_t K = size_t(m->config().experts_per_token);
    if (!mode.prefetch && m->experts().max_experts_per_prepare() >= K) {
      EXPECT_GT(m->recorded_steps_run(), 0);
    } else {
      EXPECT_EQ(m->recorded_steps_run(), 0);
    }
    // Two rows per step (recorded too where the store holds 2 x top_k experts): the same greedy
    // choice per row as resident, logits within f32 rounding (the grouped path, taken while
    // copies are in flight, sums each product in another order than the fused launches).
    const int64_t before = m->recorded_steps_run();
    expect_same_choices(batched_decode_logits(*m, *be, prompt, 6), want_batched, m->config().vocab_size);
    if (!mode.prefetch && m->experts().max_experts_per_prepare() >= 2 * K) {
      EXPECT_GT(m->recorded_steps_run(), before);
    }
    const ExpertStoreStats st = m->experts().stats();
    EXPECT_GT(st.misses, 0u);
    EXPECT_GT(st.bytes_to_device, 0u);
  }
  auto m = load_device(dir, *be, make_cuda_transfer_link(*be), {1, 0}, true);
  EXPECT_EQ(prefill_logits(*m, *be, ids), want_logits);
#endif
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaDeviceStoreFixture,
                         ::testing::Values("glm_dsa_full_f32", "glm_dsa_shared_f32", "glm_dsa_bf16", "glm_dsa_fp8",
                                           "dsv32_f32"));

// The fast modes' grouped expert products inside the model: the tiny GLM-5-shaped checkpoint (D
// 512, I 256, 64 experts, 8 a token: ~25 rows an expert at 200 tokens) resident, and streamed
// through 2 device slots a layer (runs of 2 experts, cut by misses), against the CPU and against
// the side lanes (the fast path the grouped one replaces). Fast math rounds activations to bf16,
// and this random model's routing and DSA selections flip at near-ties under any change of
// rounding: session 12 measured a worst row of 0.22 relative L2 for the lanes themselves against
// the CPU, in the first 64 rows. So a flipped row is tolerated as the lanes' own error is: the mean
// row error of the grouped path may not exceed the lanes' by more than half. A wrong expert, weight
// or routing scale would move every row, by O(1).
TEST(CudaDeviceStore, FastPrefillGroupedExpertsMatchLanes) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  const std::string dir = tiny().dir.str();
  std::vector<int32_t> ids(200);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i * 7 % 1000);
  auto cpu = make_cpu_backend();
  auto ref_model = GlmDsaModel::load(dir, *cpu);
  const int64_t V = ref_model->config().vocab_size;
  const int64_t rows = std::min<int64_t>(int64_t(ids.size()), ref_model->config().index_topk);
  const std::vector<float> want = prefill_logits(*ref_model, *cpu, ids);
  auto be = make_cuda_backend();
  cuda_set_gemm_mode(*be, CudaGemmMode::Bf16);
  auto resident = GlmDsaModel::load(dir, *be);
  cuda_set_grouped_experts(*be, false);
  const std::vector<float> lanes = prefill_logits(*resident, *be, ids);
  cuda_set_grouped_experts(*be, true);
  auto grouped = [&](GlmDsaModel& m) {
    cuda_set_profile(*be, true);
    std::vector<float> out = prefill_logits(m, *be, ids);
    const std::string report = cuda_profile_report(*be, 1.0);
    cuda_set_profile(*be, false);
    EXPECT_NE(report.find("grouped experts: down"), std::string::npos) << report;
    return out;
  };
  const std::vector<float> got = grouped(*resident);
  auto streamed = load_device(dir, *be, make_cuda_transfer_link(*be), {2, 0});
  const std::vector<float> got_streamed = grouped(*streamed);
  auto mean = [&](const std::vector<float>& a, const std::vector<float>& b) {
    return mean_row_rel_l2(a.data(), b.data(), rows, V);
  };
  auto worst = [&](const std::vector<float>& a, const std::vector<float>& b) {
    return max_row_rel_l2(a.data(), b.data(), rows, V);
  };
  std::printf(
      "first %lld rows, mean / max row rel L2: lanes vs CPU %.2e / %.2e, grouped vs CPU %.2e / %.2e, "
      "grouped vs lanes %.2e / %.2e, grouped with 2 slots a layer vs CPU %.2e / %.2e\n",
      (long long)rows, mean(lanes, want), worst(lanes, want), mean(got, want), worst(got, want), mean(got, lanes),
      worst(got, lanes), mean(got_streamed, want), worst(got_streamed, want));
  const double allowed = 1.5 * mean(lanes, want) + 1e-3;
  EXPECT_LE(mean(got, want), allowed);
  EXPECT_LE(mean(got_streamed, want), allowed);
  EXPECT_LE(mean(got, lanes), allowed);
  EXPECT_GT(worst(got, lanes), 0.0) << "the two paths gave the same bits: was the grouped one taken?";
  cuda_set_gemm_mode(*be, CudaGemmMode::Split);
#endif
}

// A resident bank's experts at prefill as one grouped run whose tables are made on the device
// from moe_group's counts (nothing read back) against the forward's grouping (the row counts read
// back, the tables made on the host): the same jobs in the same order, so the same bits. BF16
// and FP8 checkpoints in their fast modes; 600 tokens first (~75 rows an expert of 64, some past
// one 128-row tile; the run buffers made for rows that are no multiple of their 1024-row steps),
// then 200 (~25: the buffers hold stale rows past the run), then 1500 (the buffers grown, the
// bank's tables made again for them).
TEST(CudaDeviceStore, FastPrefillBankRunMatchesForwardGrouping) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  test::TempDir fp8_dir{"device_ck_fp8"};
  auto r = test::run_vireo("synth --out " + fp8_dir.str() + " --arch tiny --layers 2 --experts 64 --dtype fp8 --quiet");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto be = make_cuda_backend();
  for (const auto& [dir, mode] :
       {std::pair{tiny().dir.str(), CudaGemmMode::Bf16}, std::pair{fp8_dir.str(), CudaGemmMode::Fp8}}) {
    SCOPED_TRACE(dir);
    cuda_set_gemm_mode(*be, mode);
    auto m = GlmDsaModel::load(dir, *be);
    for (size_t n : {size_t(600), size_t(200), size_t(1500)}) {
      std::vector<int32_t> ids(n);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i * 7 % 1000);
      auto run = [&](bool bank) {
        cuda_set_bank_grouped(*be, bank);
        cuda_set_profile(*be, true);
        std::vector<float> out = prefill_logits(*m, *be, ids);
        const std::string report = cuda_profile_report(*be, 1.0);
        cuda_set_profile(*be, false);
        EXPECT_NE(report.find("grouped experts: down"), std::string::npos) << report;
        EXPECT_EQ(report.find("tiles on the device") != std::string::npos, bank) << report;
        return out;
      };
      const std::vector<float> forward = run(false), bank = run(true);
      EXPECT_EQ(bank, forward) << n << " tokens";
      // Every grouped product walking its tiles with 5 blocks: a walk ends at the device-made
      // table's first padding entry (job -1), not at the grid's size.
      cuda_set_grouped_walk(1, 5);
      EXPECT_EQ(run(true), forward) << n << " tokens, walking";
      cuda_set_grouped_walk(-1, 0);
    }
    // The run's buffers, grown over the three lengths, within the memory plan's bound for the
    // longest (the first model only: the second's may still hold buffers the first grew).
    if (mode == CudaGemmMode::Bf16) {
      EXPECT_GT(cuda_bank_run_buffer_bytes(*be), 0u);
      const GlmDsaConfig& c = m->config();
      EXPECT_LE(int64_t(cuda_bank_run_buffer_bytes(*be)),
                CudaBufferSizes::bank_run_bytes(1500, c.experts_per_token + (c.n_shared_experts > 0 ? 1 : 0),
                                                c.hidden_size, c.moe_intermediate_size, c.n_routed_experts));
    }
  }
  cuda_set_bank_grouped(*be, true);
  cuda_set_gemm_mode(*be, CudaGemmMode::Split);
#endif
}

TEST(CudaDeviceStore, PlanMatchesDeviceAllocationsWithin5Percent) {
  REQUIRE_CUDA();
#ifdef VIREO_HAVE_CUDA
  const std::string dir = tiny().dir.str();
  const int64_t context = 2048;
  // A budget whose pool holds about half of the experts (the tiny model's spine is small).
  const int64_t step = 128;
  auto r = test::run_vireo("plan --model " + dir + " --gpu-budget 900M --context " + std::to_string(context) +
                           " --prefill-chunk " + std::to_string(step));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::printf("%s", r.out.c_str());
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("GPU: ([0-9]+) slots"))) << r.out;
  const int64_t slots = std::stoll(m[1]);
  ASSERT_GT(slots, 8);
  ASSERT_LT(slots, 256);
  auto be = make_cuda_backend();
  std::vector<int32_t> ids(static_cast<size_t>(context));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i * 7 % 200);
  {  // warm-up, freed again: kernels loaded (lazily, into device memory) before the baseline
    auto warm = GlmDsaModel::load(dir, *be);
    MlaCache cache(*be, warm->cache_shape(), 1, 2 * step + 1);
    std::vector<float> logits(size_t(warm->config().vocab_size));
    warm->forward(ids.data(), step, cache, 0, logits.data(), false, AttentionPath::Reconstructed);
    warm->forward(ids.data() + step, step, cache, 0, logits.data(), false, AttentionPath::Absorbed);
    warm->forward(ids.data(), 1, cache, 0, logits.data());
  }
  cuda_synchronize(*be);
  const uint64_t used0 = cuda_device_memory_used(), weights0 = cuda_weight_bytes(*be);
  GlmDsaConfig c = load_glm_dsa_config(dir);
  auto ck = Checkpoint::open(dir);
  ExpertStoreOptions o;
  o.slots = slots;
  auto store = std::make_unique<DeviceExpertStore>(*ck, expert_store_params(c), o, make_cuda_transfer_link(*be));
  const DeviceExpertStore* st = store.get();
  auto model = GlmDsaModel::create(std::move(c), std::move(ck), *be, std::move(store));
  MlaCache cache(*be, model->cache_shape(), 1, context);
  std::vector<float> logits(size_t(model->config().vocab_size));
  // The steps the plan is sized for, at their largest: chunks of `step` tokens filling the
  // context on the reconstructed path (the last one expands all `context` keys through kv_b and
  // scores them in the indexer), then the last chunk again on the absorbed path (as Auto picks
  // for a chunk appended to a long cache), whose per-op buffers persist beside the first ones.
  for (int64_t at = 0; at < context; at += step)
    model->forward(ids.data() + at, step, cache, 0, logits.data(), false, AttentionPath::Reconstructed);
  cache.trim(0, context - step);
  model->forward(ids.data() + context - step, step, cache, 0, logits.data(), false, AttentionPath::Absorbed);
  cuda_synchronize(*be);
  const double used = double(cuda_device_memory_used() - used0);
  auto near = [](double plan, double real) { return std::abs(plan - real) <= 0.05 * real; };
  const double dense = gpu_row(r.out, "resident weights").second, pool = gpu_row(r.out, "expert pool").second;
  const double mla = gpu_row(r.out, "MLA cache").second, scratch = gpu_row(r.out, "scratch").second;
  const double weights = double(cuda_weight_bytes(*be) - weights0);
  std::printf("plan: dense %.0f pool %.0f cache %.0f scratch %.0f (sum %.0f); real: weights %.0f pool %zu cache %zu, "
              "device memory used %.0f\n",
              dense, pool, mla, scratch, dense + pool + mla + scratch, weights, st->resident_bytes(),
              cache.bytes_allocated(), used);
  EXPECT_TRUE(near(dense, weights));
  EXPECT_TRUE(near(pool, double(st->resident_bytes())));
  EXPECT_TRUE(near(mla, double(cache.bytes_allocated())));
  // Everything the process added on the device (weights, pool, cache, scratch, per-op buffers,
  // allocator rounding) against the plan's rows without the reserve.
  EXPECT_TRUE(near(dense + pool + mla + scratch, used));
#endif
}
