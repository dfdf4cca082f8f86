#pragma once
// The GLM-DSA family's configuration (glm_moe_dsa, deepseek_v32, deepseek_v3), parsed from a
// checkpoint's config.json (+ generation_config.json for EOS ids) by the rules of spec §1.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace vireo {

enum class RopeStyle : uint8_t {
  Interleaved,  // pairs (x[2i], x[2i+1]); output written as [rotated evens | rotated odds]
  HalfSplit,    // NeoX: pairs (x[i], x[i + r/2])
};

struct RopeConfig {
  double theta = 10000.0;
  bool yarn = false;           // rope_type "yarn" (else "default")
  double factor = 1.0;
  double original_max_position = 4096;
  double beta_fast = 32, beta_slow = 1;
  double mscale = 0, mscale_all_dim = 0;  // 0 = absent
  double attention_factor = 1.0;          // cos/sin multiplier (YaRN)
  bool truncate = true;
};

struct GlmDsaConfig {
  std::string model_type;  // glm_moe_dsa | deepseek_v32 | deepseek_v3
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense layers' SwiGLU width
  int64_t moe_intermediate_size = 0;  // each routed expert's width
  int num_layers = 0;                 // main stack (the MTP layer is layer num_layers)
  int num_nextn_predict_layers = 0;
  // MTP layers bound (enable_mtp): 0, or 1 = the checkpoint's first next-token-prediction layer,
  // bound as layer num_layers (its own full indexer; MoE where the model has routed experts).
  int mtp_layers = 0;
  int n_heads = 0;
  int64_t q_lora_rank = 0;  // 0: plain q_proj (config value null)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;
  int n_routed_experts = 0, n_shared_experts = 0, experts_per_token = 0;
  int n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  // DSA indexer (absent for deepseek_v3).
  bool has_indexer = false;
  int index_topk = 0, index_n_heads = 0;
  int64_t index_head_dim = 0;
  // [num_layers + mtp_layers]: true = own indexer, false = reuse previous full
  std::vector<bool> indexer_full;
  std::vector<bool> layer_dense;  // [num_layers + mtp_layers]: true = dense SwiGLU, false = MoE
  RopeConfig rope;
  RopeStyle mla_rope_style = RopeStyle::Interleaved;
  RopeStyle indexer_rope_style = RopeStyle::Interleaved;
  std::set<int64_t> eos_ids;  // union of config.json and generation_config.json

  int64_t qk_head_dim() const { return qk_nope_dim + qk_rope_dim; }
  int64_t kv_cache_dim() const { return kv_lora_rank + qk_rope_dim; }  // [latent | k_rope]
  double attention_scale() const;  // sigma: qk_head_dim^-1/2, times mscale^2 under YaRN
  int n_full_indexer_layers() const;
  int bound_layers() const { return num_layers + mtp_layers; }  // the main stack and the MTP layer
};

// Binds the model's MTP layer too (speculative decoding's drafter; spec: the demo model card): fails,
// naming `source`, when the config declares none (num_nextn_predict_layers 0). Call before the
// expert store and the model are built from `c`. Idempotent.
void enable_mtp(GlmDsaConfig& c, const std::string& source);

// Parses <dir>/config.json and, if present, <dir>/generation_config.json.
GlmDsaConfig load_glm_dsa_config(const std::string& dir);
// The parsing rules without the file system (tests): `config` and optional `generation_config`
// JSON texts; `source` names the file in errors.
GlmDsaConfig parse_glm_dsa_config(const std::string& config_json, const std::string& generation_json,
                                  const std::string& source);

// Indexer schedule rule of spec §1 (no indexer_types / index_topk_pattern given).
std::vector<bool> indexer_schedule(int num_layers, int freq, int offset);

}  // namespace vireo
