// `vireo info`: what a checkpoint holds and what a token costs.
#include <cstdio>
#include <map>
#include <memory>

#include "backend/cuda/cuda_backend.h"
#include "cli/commands.h"
#include "model/glm_dsa/model.h"

namespace vireo::cli {

namespace {
std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) { b /= 1000; ++u; }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", b, units[u]);
  return buf;
}
std::string human_count(double n) {
  const char* units[] = {"", "K", "M", "B", "T"};
  int u = 0;
  while (n >= 1000 && u < 4) { n /= 1000; ++u; }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f%s" : "%.0f%s", n, units[u]);
  return buf;
}
// The layer index of "model.layers.N.*", or -1.
int layer_of(const std::string& name) {
  const std::string p = "model.layers.";
  if (name.compare(0, p.size(), p) != 0) return -1;
  return std::atoi(name.c_str() + p.size());
}
}  // namespace

Action add_info(CLI::App& app) {
  auto dir = std::make_shared<std::string>();
  auto device = std::make_shared<std::string>("cpu");
  auto math = std::make_shared<std::string>("exact");
  app.add_option("--model,-m", *dir, "Model directory")->required();
  add_device_flag(app, *device, *math);
  return [dir, device, math]() {
    auto backend = make_cli_backend(*device, *math);
    auto model = GlmDsaModel::load(*dir, *backend);
    const GlmDsaConfig& c = model->config();
    std::printf("model            %s\n", dir->c_str());
    std::printf("architecture     %s: %d layers, hidden %lld, %d heads, vocab %lld\n", c.model_type.c_str(),
                c.num_layers, (long long)c.hidden_size, c.n_heads, (long long)c.vocab_size);
    std::printf("attention        MLA: q_lora %lld, kv_lora %lld, qk_nope %lld, qk_rope %lld, v_head %lld; rope theta %g%s\n",
                (long long)c.q_lora_rank, (long long)c.kv_lora_rank, (long long)c.qk_nope_dim,
                (long long)c.qk_rope_dim, (long long)c.v_head_dim, c.rope.theta,
                c.rope.yarn ? " (YaRN)" : "");
    if (c.has_indexer)
      std::printf("DSA indexer      top-k %d, %d heads x %lld; %d full + %d shared layers\n", c.index_topk,
                  c.index_n_heads, (long long)c.index_head_dim, c.n_full_indexer_layers(),
                  c.num_layers - c.n_full_indexer_layers());
    std::printf("MoE              %d routed experts (%d per token, %d groups / top %d), %d shared, expert width %lld\n",
                c.n_routed_experts, c.experts_per_token, c.n_group, c.topk_group, c.n_shared_experts,
                (long long)c.moe_intermediate_size);
    struct Tally { double params = 0, bytes = 0; };
    std::map<std::string, Tally> main_by_dtype, mtp_by_dtype;
    Tally main_total, mtp_total;
    for (const auto& [name, t] : model->checkpoint().tensors()) {
      double n = 1;
      for (int64_t d : t->shape) n *= double(d);
      const bool mtp = layer_of(name) >= c.num_layers;
      auto& m = (mtp ? mtp_by_dtype : main_by_dtype)[dtype_name(t->dtype)];
      m.params += n;
      m.bytes += double(t->nbytes);
      (mtp ? mtp_total : main_total).params += n;
      (mtp ? mtp_total : main_total).bytes += double(t->nbytes);
    }
    std::printf("parameters       %s in %s (main stack)", human_count(main_total.params).c_str(),
                human_bytes(main_total.bytes).c_str());
    if (mtp_total.params > 0)
      std::printf("; MTP layer %s in %s (run --mtp drafts with it)", human_count(mtp_total.params).c_str(),
                  human_bytes(mtp_total.bytes).c_str());
    std::printf("\n");
    for (const auto& [dt, t] : main_by_dtype)
      std::printf("  %-8s       %s params, %s\n", dt.c_str(), human_count(t.params).c_str(), human_bytes(t.bytes).c_str());
    std::printf("routed experts   %s resident\n", human_bytes(double(model->experts().resident_bytes())).c_str());
    std::printf("active per token %s of weights read per decoded token\n",
                human_bytes(double(model->active_weight_bytes_per_token())).c_str());
    std::printf("MLA cache        %zu bytes per token (f32 entries)\n", MlaCache::bytes_per_token(model->cache_shape()));
    std::printf("EOS ids         ");
    for (int64_t e : c.eos_ids) std::printf(" %lld", (long long)e);
    std::printf("\nlayer schedule   (D dense / M MoE, F full indexer / S shared / - none)\n");
    for (int l = 0; l < c.num_layers; ++l) {
      char idx = !c.has_indexer ? '-' : (c.indexer_full[size_t(l)] ? 'F' : 'S');
      std::printf("  layer %3d  %c%c\n", l, c.layer_dense[size_t(l)] ? 'D' : 'M', idx);
    }
    return 0;
  };
}

}  // namespace vireo::cli
