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
    StreamingFlags sf;
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
  add_streaming_flags(app, o->sf);
  return [o]() {
    using clock = std::chrono::steady_clock;
    if (o->model.empty() && o->synthetic.empty()) fail("bench needs --model DIR or --synthetic glm5");
    ThreadPool& pool = ThreadPool::global();
    auto backend = make_cpu_backend();
    std::unique_ptr<GlmDsaModel> model;
    LoadedModel lm;
    auto t0 = clock::now();
    if (!o->synthetic.empty()) {
      GlmDsaConfig c = glm5_synthetic_config(o->layers, o->experts);
      std::fprintf(stderr, "building synthetic glm5: %d layers x %d experts, %s weights...\n", o->layers,
                   o->experts, o->dtype.c_str());
      auto ck = make_synthetic_checkpoint(c, parse_weight_dtype_flag(o->dtype));
      model = GlmDsaModel::create(std::move(c), std::move(ck), *backend);
    } else {
      lm = load_model(o->model, *backend, o->sf, o->prompt + o->decode);
      model = std::move(lm.model);
    }
    std::fprintf(stderr, "loaded in %.1f s; measuring memory bandwidth...\n",
                 std::chrono::duration<double>(clock::now() - t0).count());
    const double bw = measure_memory_bandwidth_gbs(pool);
    // Streaming: the disk link as the store's reader sees it, measured in this run.
    double link_gbs = 0;
    if (lm.streaming) link_gbs = lm.streaming->measure_read_gbs(48, 8);
    const GlmDsaConfig& c = model->config();
    std::vector<int32_t> ids(size_t(o->prompt + o->decode));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7919 + 13) % size_t(c.vocab_size));
    MlaCache cache(*backend, model->cache_shape(), 1, o->prompt + o->decode);
    std::vector<float> logits(size_t(c.vocab_size));
    const double active = double(model->active_weight_bytes_per_token());
    model->experts().reset_stats();
    auto t1 = clock::now();
    model->forward(ids.data(), o->prompt, cache, 0, logits.data(), false, AttentionPath::Reconstructed);
    auto t2 = clock::now();
    const ExpertStoreStats after_prefill = model->experts().stats();
    for (int64_t i = 0; i < o->decode; ++i)
      model->forward(&ids[size_t(o->prompt + i)], 1, cache, 0, logits.data(), false, AttentionPath::Absorbed);
    auto t3 = clock::now();
    const double prefill_s = std::chrono::duration<double>(t2 - t1).count();
    const double decode_s = std::chrono::duration<double>(t3 - t2).count();
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
    if (lm.streaming) {
      const ExpertStoreStats d = model->experts().stats() - after_prefill;
      const double hit = d.hit_rate();
      const double expert_bytes = double(lm.streaming->layout().expert_bytes());
      const double per_token = double(c.experts_per_token) * double(lm.plan.in.n_moe_layers) * expert_bytes;
      const double bound_tps = link_gbs * 1e9 / std::max((1.0 - hit) * per_token, 1.0);
      std::printf("expert pool        %lld slots of %.1f MB (%.1f%% of experts), floor %d, %s reads, prefetch %s\n",
                  (long long)lm.streaming->slots(), double(lm.streaming->slot_bytes()) / 1e6,
                  100.0 * double(lm.streaming->slots()) / double(lm.plan.total_experts()), lm.streaming->layer_floor(),
                  lm.streaming->direct_io() ? "O_DIRECT" : "buffered+DONTNEED", o->sf.prefetch.c_str());
      std::printf("disk read          %.2f GB/s (measured now, %d threads)\n", link_gbs, o->sf.io_threads);
      std::printf("decode experts     %s\n", stats_line(d).c_str());
      std::printf("decode read        %.2f GB/s achieved (%.3f GB per token)\n",
                  double(d.bytes_transferred) / 1e9 / decode_s, double(d.bytes_transferred) / 1e9 / double(o->decode));
      std::printf("bound              (1 - %.3f) x %.3f GB / %.2f GB/s = %.3f s/token: %.3f tok/s; achieved %.0f%% of bound\n",
                  hit, per_token / 1e9, link_gbs, 1.0 / bound_tps, bound_tps, 100.0 * dec_tps / bound_tps);
      std::printf("peak RSS           %.3f GB (budget %s)\n", double(peak_rss_bytes()) / 1e9, o->sf.budget.c_str());
    }
    return 0;
  };
}

}  // namespace vireo::cli
