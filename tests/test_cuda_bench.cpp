// Micro-benchmarks of one decode layer's ops at GLM-5 shapes on the CUDA backend: the absorbed
// attention (absorb_q + the decode kernels) and the DSA indexer (scores + top-k), at 4096 cached
// tokens and at a short context, fast and reference kernels (cuda_set_fast_decode); the layer's
// products at 1-8 rows (DecodeProducts); its experts by id (DecodeExperts).
// Each op is recorded into a CUDA graph 50 times, as a decode step replays it (run-time positions),
// and the replay timed. Skipped unless VIREO_CUDA_BENCH=1: it measures, it checks nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/dtype.h"
#include "cuda_test_util.h"
#include "backend_test_util.h"

using namespace vireo;

#ifdef VIREO_HAVE_CUDA
namespace {

std::vector<float> rnd(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(g) * scale;
  return v;
}

// Median microseconds per op call: the op recorded `reps` times into one graph, replayed.
double time_recorded(Backend& be, const std::function<void()>& op, int reps = 50, int replays = 11) {
  op();  // eager: scratch allocations, kernel attributes
  cuda_synchronize(be);
  be.begin_recording();
  for (int i = 0; i < reps; ++i) op();
  std::unique_ptr<RecordedOps> rec = be.end_recording();
  // ~100 ms of replays first: the clocks ramp up from idle before anything is timed.
  for (auto t0 = std::chrono::steady_clock::now();
       std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(100);) {
    rec->replay();
    cuda_synchronize(be);
  }
  std::vector<double> us;
  for (int r = 0; r < replays; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    rec->replay();
    cuda_synchronize(be);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

TEST(CudaBench, DecodeAttentionAndIndexer) {
  REQUIRE_CUDA();
  const char* env = std::getenv("VIREO_CUDA_BENCH");
  if (!env) GTEST_SKIP() << "set VIREO_CUDA_BENCH=1 to run";
  // VIREO_CUDA_BENCH=once: each op launched once per configuration, eagerly (for ncu).
  const bool once = std::string(env) == "once";
  std::unique_ptr<Backend> be = make_cuda_backend();
  const int64_t H = 64, nope = 192, rope = 64, vd = 256, L = 512, qw = nope + rope, kvw = L + rope, hw = nope + vd;
  const int64_t nI = 32, d = 128, topk = 2048, cap = 4352;
  std::vector<std::shared_ptr<float>> keep;
  std::vector<std::shared_ptr<int32_t>> keep_i;
  auto up = [&](const std::vector<float>& h) {
    auto b = be->alloc_f32(h.size());
    be->copy_from_host(b.get(), h.data(), h.size());
    keep.push_back(b);
    return b.get();
  };
  auto up_i = [&](const std::vector<int32_t>& h) {
    auto b = be->alloc_i32(h.size());
    be->copy_from_host_i32(b.get(), h.data(), h.size());
    keep_i.push_back(b);
    return b.get();
  };
  std::vector<float> wv = rnd(size_t(H * hw * L), 1, 0.05f);
  std::vector<uint16_t> wb(wv.size());
  for (size_t i = 0; i < wv.size(); ++i) wb[i] = f32_to_bf16(wv[i]);
  Weight host_kvb;
  host_kvb.w = Tensor(wb.data(), DType::BF16, {H * hw, L});
  Weight kvb = be->upload_weight(host_kvb);
  float* kv = up(rnd(size_t(cap * kvw), 2));
  float* q = up(rnd(size_t(H * qw), 3));
  float* out = up(std::vector<float>(size_t(H * vd), 0.0f));
  float* iq = up(rnd(size_t(nI * d), 4));
  float* iw = up(rnd(size_t(nI), 5, 0.2f));
  float* ikeys = up(rnd(size_t(cap * d), 6));
  int32_t* sel = up_i(std::vector<int32_t>(size_t(topk), 0));
  int32_t* cnt = up_i({0});

  struct Cfg { bool attn, scores, topk; const char* name; };
  const Cfg cfgs[] = {{false, false, false, "reference"},
                      {true, true, true, "fast"},
                      {false, true, false, "fast scores only"},
                      {false, false, true, "fast top-k only"}};
  for (int64_t pos : {int64_t(4096), int64_t(100)}) {
    int32_t* gpos = up_i({int32_t(pos)});
    IndexerArgs ia;
    ia.q = iq;
    ia.weights = iw;
    ia.keys = ikeys;
    ia.T = 1;
    ia.n_heads = nI;
    ia.head_dim = d;
    ia.pos0 = cap - 1;  // the bound, as a recorded step
    ia.n_keys = cap;
    ia.pos0_dev = gpos;
    ia.topk = topk;
    ia.scale = 1.0f / std::sqrt(float(d));
    ia.selected = sel;
    ia.counts = cnt;
    MlaAttentionArgs ma;
    ma.q = q;
    ma.T = 1;
    ma.n_heads = H;
    ma.qk_nope = nope;
    ma.qk_rope = rope;
    ma.v_dim = vd;
    ma.kv_lora = L;
    ma.kv = kv;
    ma.pos0 = cap - 1;
    ma.n_keys = cap;
    ma.pos0_dev = gpos;
    ma.kv_b = &kvb;
    ma.scale = 1.0f / std::sqrt(float(qw));
    ma.selection = KeySelection{sel, cnt, topk};
    ma.absorbed = true;
    ma.out = out;
    for (const Cfg& c : cfgs) {
      cuda_set_fast_decode(*be, c.attn, c.scores, c.topk);
      if (once) {
        be->indexer_select(ia);
        be->mla_attention(ma);
        cuda_synchronize(*be);
        continue;
      }
      const double ti = time_recorded(*be, [&] { be->indexer_select(ia); });
      const double ta = time_recorded(*be, [&] { be->mla_attention(ma); });
      std::printf("[bench] context %5lld  %-17s indexer_select %7.2f us   mla_attention absorbed %7.2f us\n",
                  (long long)pos, c.name, ti, ta);
    }
  }
  cuda_set_fast_decode(*be, true, true, true);
}
// Decode products at GLM-5 shapes, 1 to 8 tokens, in GB/s of weight bytes: FP8 weights with the
// f32-math GEMVs (--math exact) and with the e4m3-activation kernels (--math fast-fp8,
// cuda_q8_gemv.h), BF16 weights in exact and fast mode (the latter's 2-8 rows on cuBLASLt from
// VIREO_BF16_LT_DECODE's row count; a quarter of the lm_head's vocabulary for its shape); x from
// the shared-memory copy (default) or, with VIREO_GEMV_XS=0 in the environment, through L1.
TEST(CudaBench, DecodeProducts) {
  REQUIRE_CUDA();
  if (!std::getenv("VIREO_CUDA_BENCH")) GTEST_SKIP() << "set VIREO_CUDA_BENCH=1 to run";
  std::unique_ptr<Backend> be = make_cuda_backend();
  struct Shape {
    const char* name;
    int64_t out, in;
  };
  for (DType dt : {DType::F8_E4M3, DType::BF16})
    for (Shape sh : {Shape{"o_proj", 6144, 16384}, Shape{"q_b", 16384, 2048}, Shape{"gate|up", 4096, 6144},
                     Shape{"down", 6144, 2048}, Shape{"vocab/4", 38720, 6144}}) {
      const vireo::test::HostWeight hw = vireo::test::make_weight(dt, sh.out, sh.in, 7);
      const Weight w = be->upload_weight(hw.w);
      auto x = be->alloc_f32(size_t(8 * sh.in));
      auto y = be->alloc_f32(size_t(8 * sh.out));
      const std::vector<float> xh = rnd(size_t(8 * sh.in), 9);
      be->copy_from_host(x.get(), xh.data(), xh.size());
      const bool fp8 = dt == DType::F8_E4M3;
      for (int64_t T : {1, 2, 4, 8}) {
        double us[2] = {0, 0};
        for (int k = 0; k < 2; ++k) {
          cuda_set_gemm_mode(*be, k == 0 ? CudaGemmMode::Split : fp8 ? CudaGemmMode::Fp8 : CudaGemmMode::Bf16);
          us[k] = time_recorded(*be, [&] { be->matmul(x.get(), T, w, y.get()); });
        }
        cuda_set_gemm_mode(*be, CudaGemmMode::Split);
        const double gb = double(sh.out * sh.in) * (fp8 ? 1 : 2) / 1e3;
        std::printf("  %-4s %-8s %5lldx%-5lld T %lld: exact %7.1f us %6.0f GB/s", fp8 ? "fp8" : "bf16", sh.name,
                    (long long)sh.out, (long long)sh.in, (long long)T, us[0], gb / us[0]);
        std::printf(", %s %7.1f us %6.0f GB/s\n", fp8 ? "e4m3" : "fast", us[1], gb / us[1]);
      }
    }
}

// One decode layer's routed and shared experts at GLM-5 shapes (6144 x 2048, 8 of 16 routed
// experts and 1 shared a token): `moe_experts` (gate | up of every slot, then the down products
// summed), at 1 and 8 tokens. Skipped unless VIREO_CUDA_BENCH=1: it measures, it checks nothing.
TEST(CudaBench, DecodeExperts) {
  REQUIRE_CUDA();
  if (!std::getenv("VIREO_CUDA_BENCH")) GTEST_SKIP() << "set VIREO_CUDA_BENCH=1 to run";
  std::unique_ptr<Backend> be = make_cuda_backend();
  const int64_t D = 6144, I = 2048;
  const int E = 16, K = 8;
  for (DType dt : {DType::F8_E4M3, DType::BF16}) {
    const bool fp8 = dt == DType::F8_E4M3;
    // One random matrix of each shape, uploaded once per expert: distinct device copies, as a
    // checkpoint's experts are, without generating 51 matrices on the host.
    const vireo::test::HostWeight gate = vireo::test::make_weight(dt, I, D, 3),
                                  up = vireo::test::make_weight(dt, I, D, 4),
                                  down = vireo::test::make_weight(dt, D, I, 5);
    ExpertBank bank;
    bank.n_shared = 1;
    for (int e = 0; e < E + 1; ++e) {
      bank.gate.push_back(be->upload_weight(gate.w));
      bank.up.push_back(be->upload_weight(up.w));
      bank.down.push_back(be->upload_weight(down.w));
    }
    for (int64_t T : {1, 8}) {
      std::mt19937 rng{static_cast<uint32_t>(T)};
      std::vector<int32_t> ids;
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int32_t> all(static_cast<size_t>(E));
        for (int e = 0; e < E; ++e) all[size_t(e)] = e;
        std::shuffle(all.begin(), all.end(), rng);
        std::sort(all.begin(), all.begin() + K);
        ids.insert(ids.end(), all.begin(), all.begin() + K);
      }
      auto x = be->alloc_f32(size_t(T * D));
      auto out = be->alloc_f32(size_t(T * D));
      auto gids = be->alloc_i32(ids.size());
      auto wts = be->alloc_f32(ids.size());
      const std::vector<float> xh = rnd(size_t(T * D), 9), wh = rnd(ids.size(), 10);
      be->copy_from_host(x.get(), xh.data(), xh.size());
      be->copy_from_host(wts.get(), wh.data(), wh.size());
      be->copy_from_host_i32(gids.get(), ids.data(), ids.size());
      const double us =
          time_recorded(*be, [&] { be->moe_experts(x.get(), T, gids.get(), wts.get(), K, bank, out.get()); });
      // Weight bytes read: each token's distinct experts (at 8 tokens, the union of their ids).
      std::vector<int32_t> used(ids);
      std::sort(used.begin(), used.end());
      used.erase(std::unique(used.begin(), used.end()), used.end());
      const double gb = double(used.size() + 1) * 3.0 * double(D * I) * (fp8 ? 1 : 2) / 1e3;
      std::printf("  %-4s experts T %lld: %7.1f us, %zu+1 experts, %6.0f GB/s\n", fp8 ? "fp8" : "bf16", (long long)T,
                  us, used.size(), gb / us);
    }
  }
}
#endif
