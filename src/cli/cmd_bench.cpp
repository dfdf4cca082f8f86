// `vireo bench`: prefill and decode speed, with achieved weight bandwidth beside the machine's
// measured memory bandwidth (the decode bound).
#include <chrono>
#include <cstdio>
#include <memory>

#include "backend/cpu/membw.h"
#include "cli/commands.h"
#include "core/thread_pool.h"
#include "model/glm_dsa/model.h"
#include "model/glm_dsa/synthetic.h"

namespace vireo::cli {

Action add_bench(CLI::App& app) {
  struct Opts {
    std::string model, synthetic, dtype = "bf16";
    int layers = 2, experts = 16;
    int64_t prompt = 64, decode = 16;
  };
  auto o = std::make_shared<Opts>();
  auto* m = app.add_option("--model,-m", o->model, "Model directory");
  app.add_option("--synthetic", o->synthetic, "Random weights with real shapes instead of a checkpoint")
      ->check(CLI::IsMember({"glm5"}))
      ->excludes(m);
  app.add_option("--layers", o->layers, "Synthetic: MoE layers")->check(CLI::Range(1, 200));
  app.add_option("--experts", o->experts, "Synthetic: routed experts per layer")->check(CLI::Range(1, 256));
  app.add_option("--dtype", o->dtype, "Synthetic: weight dtype")->check(CLI::IsMember({"bf16", "fp8"}));
  app.add_option("--prompt", o->prompt, "Prefill length in tokens")->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  app.add_option("--decode", o->decode, "Decode steps to time")->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  return [o]() {
    using clock = std::chrono::steady_clock;
    if (o->model.empty() && o->synthetic.empty()) fail("bench needs --model DIR or --synthetic glm5");
    ThreadPool& pool = ThreadPool::global();
    auto backend = make_cpu_backend();
    std::unique_ptr<GlmDsaModel> model;
    auto t0 = clock::now();
    if (!o->synthetic.empty()) {
      GlmDsaConfig c = glm5_synthetic_config(o->layers, o->experts);
      std::fprintf(stderr, "building synthetic glm5: %d layers x %d experts, %s weights...\n", o->layers,
                   o->experts, o->dtype.c_str());
      auto ck = make_synthetic_checkpoint(c, parse_weight_dtype_flag(o->dtype));
      model = GlmDsaModel::create(std::move(c), std::move(ck), *backend);
    } else {
      model = GlmDsaModel::load(o->model, *backend);
    }
    std::fprintf(stderr, "loaded in %.1f s; measuring memory bandwidth...\n",
                 std::chrono::duration<double>(clock::now() - t0).count());
    const double bw = measure_memory_bandwidth_gbs(pool);
    const GlmDsaConfig& c = model->config();
    std::vector<int32_t> ids(size_t(o->prompt + o->decode));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7919 + 13) % size_t(c.vocab_size));
    MlaCache cache(*backend, model->cache_shape(), 1, o->prompt + o->decode);
    std::vector<float> logits(size_t(c.vocab_size));
    auto t1 = clock::now();
    model->forward(ids.data(), o->prompt, cache, 0, logits.data(), false, AttentionPath::Reconstructed);
    auto t2 = clock::now();
    for (int64_t i = 0; i < o->decode; ++i)
      model->forward(&ids[size_t(o->prompt + i)], 1, cache, 0, logits.data(), false, AttentionPath::Absorbed);
    auto t3 = clock::now();
    const double prefill_s = std::chrono::duration<double>(t2 - t1).count();
    const double decode_s = std::chrono::duration<double>(t3 - t2).count();
    const double active = double(model->active_weight_bytes_per_token());
    const double dec_tps = double(o->decode) / decode_s;
    const double dec_gbs = active * dec_tps / 1e9;
    std::printf("model              %s\n", o->synthetic.empty() ? o->model.c_str()
                : ("synthetic glm5, " + std::to_string(o->layers) + " layers x " + std::to_string(o->experts) +
                   " experts, " + o->dtype).c_str());
    std::printf("threads            %d\n", pool.size());
    std::printf("memory bandwidth   %.1f GB/s (read, measured now)\n", bw);
    std::printf("active weights     %.3f GB per decoded token\n", active / 1e9);
    std::printf("prefill            %lld tokens in %.3f s: %.1f tok/s\n", (long long)o->prompt, prefill_s,
                double(o->prompt) / prefill_s);
    std::printf("decode             %lld tokens in %.3f s: %.2f tok/s, %.1f GB/s of weights = %.0f%% of bandwidth\n",
                (long long)o->decode, decode_s, dec_tps, dec_gbs, 100.0 * dec_gbs / bw);
    return 0;
  };
}

}  // namespace vireo::cli
