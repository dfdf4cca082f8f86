#include "model/glm_dsa/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "io/json_file.h"

namespace vireo {

namespace {

struct Reader {
  const Json& j;
  const std::string& src;

  bool has(const char* k) const { return j.contains(k) && !j[k].is_null(); }
  int64_t integer(const char* k) const {
    if (!j.contains(k)) fail(src, ": missing field ", k, " (expected an integer)");
    if (!j[k].is_number_integer()) fail(src, ": field ", k, " must be an integer, found ", j[k].dump());
    return j[k].get<int64_t>();
  }
  int64_t positive(const char* k) const {
    int64_t v = integer(k);
    if (v <= 0) fail(src, ": field ", k, " must be positive, found ", v);
    return v;
  }
  int64_t integer_or(const char* k, int64_t def) const { return has(k) ? integer(k) : def; }
  double number_or(const char* k, double def) const {
    if (!has(k)) return def;
    if (!j[k].is_number()) fail(src, ": field ", k, " must be a number, found ", j[k].dump());
    return j[k].get<double>();
  }
  bool boolean_or(const char* k, bool def) const {
    if (!has(k)) return def;
    if (!j[k].is_boolean()) fail(src, ": field ", k, " must be true or false, found ", j[k].dump());
    return j[k].get<bool>();
  }
};

void add_eos(const Json& v, std::set<int64_t>& out, const std::string& src) {
  if (v.is_null()) return;
  if (v.is_number_integer()) { out.insert(v.get<int64_t>()); return; }
  if (v.is_array()) {
    for (const Json& e : v) {
      if (!e.is_number_integer()) fail(src, ": field eos_token_id must hold integers, found ", e.dump());
      out.insert(e.get<int64_t>());
    }
    return;
  }
  fail(src, ": field eos_token_id must be an integer or a list of integers, found ", v.dump());
}

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

void parse_rope(const Json& j, const std::string& src, RopeConfig& rope, int64_t max_pos) {
  // transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; older configs write
  // rope_theta at the top level and rope_scaling {type|rope_type, factor, ...}.
  Json params = Json::object();
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) params = j["rope_parameters"];
  else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) params = j["rope_scaling"];
  Reader top{j, src};
  Reader p{params, src};
  rope.theta = p.has("rope_theta") ? p.number_or("rope_theta", 0) : top.number_or("rope_theta", 10000.0);
  std::string type = "default";
  if (params.contains("rope_type") && params["rope_type"].is_string()) type = params["rope_type"];
  else if (params.contains("type") && params["type"].is_string()) type = params["type"];
  if (type == "default") return;
  if (type != "yarn") fail(src, ": rope type '", type, "' is not supported (expected default or yarn)");
  rope.yarn = true;
  rope.factor = p.number_or("factor", 0);
  if (!p.has("original_max_position_embeddings"))
    fail(src, ": yarn rope needs original_max_position_embeddings");
  rope.original_max_position = p.number_or("original_max_position_embeddings", 0);
  if (rope.factor == 0) rope.factor = double(max_pos) / rope.original_max_position;
  rope.beta_fast = p.number_or("beta_fast", 0);
  if (rope.beta_fast == 0) rope.beta_fast = 32;
  rope.beta_slow = p.number_or("beta_slow", 0);
  if (rope.beta_slow == 0) rope.beta_slow = 1;
  rope.mscale = p.number_or("mscale", 0);
  rope.mscale_all_dim = p.number_or("mscale_all_dim", 0);
  rope.truncate = p.boolean_or("truncate", true);
  // As transformers' _compute_yarn_parameters: an explicit attention_factor wins; else the ratio
  // of the two mscales when both are given; else mscale(factor).
  if (p.has("attention_factor")) rope.attention_factor = p.number_or("attention_factor", 1.0);
  else if (rope.mscale != 0 && rope.mscale_all_dim != 0)
    rope.attention_factor = yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim);
  else rope.attention_factor = yarn_get_mscale(rope.factor, 1.0);
}

std::vector<bool> parse_layer_list(const Json& v, int n, const char* field, const char* a, const char* b,
                                   const std::string& src) {
  if (!v.is_array() || int(v.size()) != n)
    fail(src, ": field ", field, " must be a list of ", n, " strings (one per layer)");
  std::vector<bool> out;
  for (const Json& e : v) {
    if (e.is_string() && e.get<std::string>() == a) out.push_back(true);
    else if (e.is_string() && e.get<std::string>() == b) out.push_back(false);
    else fail(src, ": field ", field, " has entry ", e.dump(), " (expected \"", a, "\" or \"", b, "\")");
  }
  return out;
}

}  // namespace

std::vector<bool> indexer_schedule(int num_layers, int freq, int offset) {
  freq = std::max(freq, 1);
  std::vector<bool> full(static_cast<size_t>(num_layers), false);
  for (int i = 0; i < num_layers; ++i) full[size_t(i)] = std::max(i - offset + 1, 0) % freq == 0;
  return full;
}

double GlmDsaConfig::attention_scale() const {
  double s = 1.0 / std::sqrt(double(qk_head_dim()));
  if (rope.yarn && rope.mscale_all_dim != 0) {
    double m = yarn_get_mscale(rope.factor, rope.mscale_all_dim);
    s *= m * m;
  }
  return s;
}

int GlmDsaConfig::n_full_indexer_layers() const {  // of the main stack
  return has_indexer ? int(std::count(indexer_full.begin(), indexer_full.begin() + num_layers, true)) : 0;
}

void enable_mtp(GlmDsaConfig& c, const std::string& source) {
  if (c.mtp_layers > 0) return;
  if (c.num_nextn_predict_layers < 1)
    fail(source, ": the model has no MTP layer (num_nextn_predict_layers is 0), so it cannot draft tokens");
  c.mtp_layers = 1;
  c.indexer_full.resize(size_t(c.num_layers), true);
  c.layer_dense.resize(size_t(c.num_layers), true);
  // DeepSeek-V3 / GLM-5's next-token-prediction layer: a full decoder layer with its own indexer
  // and the routed experts of a MoE layer.
  c.indexer_full.push_back(c.has_indexer);
  c.layer_dense.push_back(c.n_routed_experts == 0);
}

GlmDsaConfig parse_glm_dsa_config(const std::string& config_text, const std::string& generation_text,
                                  const std::string& src) {
  Json j;
  try {
    j = Json::parse(config_text);
  } catch (const Json::exception& e) {  // (parse_error, or out_of_range for a number past double's range)
    std::string what = e.what();
    auto pos = what.find("] ");
    fail(src, ": malformed JSON: ", pos == std::string::npos ? what : what.substr(pos + 2));
  }
  if (!j.is_object()) fail(src, ": expected a JSON object");
  Reader r{j, src};
  GlmDsaConfig c;
  if (!j.contains("model_type") || !j["model_type"].is_string()) fail(src, ": missing field model_type");
  c.model_type = j["model_type"];
  if (c.model_type != "glm_moe_dsa" && c.model_type != "deepseek_v32" && c.model_type != "deepseek_v3")
    fail(src, ": unknown model_type '", c.model_type, "' (expected glm_moe_dsa, deepseek_v32 or deepseek_v3)");
  c.vocab_size = r.positive("vocab_size");
  c.hidden_size = r.positive("hidden_size");
  c.intermediate_size = r.positive("intermediate_size");
  c.moe_intermediate_size = r.positive("moe_intermediate_size");
  c.num_layers = int(r.positive("num_hidden_layers"));
  c.num_nextn_predict_layers = int(r.integer_or("num_nextn_predict_layers", 0));
  c.n_heads = int(r.positive("num_attention_heads"));
  if (r.has("num_key_value_heads") && r.integer("num_key_value_heads") != c.n_heads)
    fail(src, ": field num_key_value_heads must equal num_attention_heads for MLA");
  c.q_lora_rank = r.has("q_lora_rank") ? r.positive("q_lora_rank") : 0;
  c.kv_lora_rank = r.positive("kv_lora_rank");
  c.qk_nope_dim = r.positive("qk_nope_head_dim");
  // `head_dim` in these configs is not the attention head size; the rotary width is qk_rope_head_dim.
  c.qk_rope_dim = r.positive("qk_rope_head_dim");
  if (c.qk_rope_dim % 2) fail(src, ": field qk_rope_head_dim must be even, found ", c.qk_rope_dim);
  c.v_head_dim = r.positive("v_head_dim");
  c.n_routed_experts = int(r.positive("n_routed_experts"));
  c.n_shared_experts = int(r.integer_or("n_shared_experts", 0));
  c.experts_per_token = int(r.positive("num_experts_per_tok"));
  c.n_group = int(r.integer_or("n_group", 1));
  c.topk_group = int(r.integer_or("topk_group", 1));
  if (c.n_group < 1 || c.n_routed_experts % c.n_group)
    fail(src, ": field n_group (", c.n_group, ") must divide n_routed_experts (", c.n_routed_experts, ")");
  if (c.topk_group < 1 || c.topk_group > c.n_group)
    fail(src, ": field topk_group (", c.topk_group, ") must be in [1, n_group]");
  if (c.experts_per_token > c.n_routed_experts) fail(src, ": field num_experts_per_tok exceeds n_routed_experts");
  if (c.experts_per_token > c.topk_group * (c.n_routed_experts / c.n_group))
    fail(src, ": field num_experts_per_tok exceeds the experts in topk_group groups");
  c.norm_topk_prob = r.boolean_or("norm_topk_prob", true);
  c.routed_scaling_factor = r.number_or("routed_scaling_factor", 1.0);
  c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
  c.max_position_embeddings = r.integer_or("max_position_embeddings", 4096);
  if (r.has("hidden_act") && j["hidden_act"] != "silu")
    fail(src, ": field hidden_act must be \"silu\", found ", j["hidden_act"].dump());
  if (r.boolean_or("attention_bias", false)) fail(src, ": field attention_bias = true is not supported");
  if (r.boolean_or("mlp_bias", false)) fail(src, ": field mlp_bias = true is not supported");
  parse_rope(j, src, c.rope, c.max_position_embeddings);

  c.has_indexer = c.model_type != "deepseek_v3";
  if (c.model_type == "deepseek_v3") {
    c.mla_rope_style = r.boolean_or("rope_interleave", true) ? RopeStyle::Interleaved : RopeStyle::HalfSplit;
  } else {
    c.mla_rope_style = RopeStyle::Interleaved;
    c.indexer_rope_style = c.model_type == "glm_moe_dsa" ? RopeStyle::Interleaved : RopeStyle::HalfSplit;
  }
  if (c.has_indexer) {
    if (c.q_lora_rank == 0) fail(src, ": field q_lora_rank must be set: the DSA indexer reads the q latent");
    c.index_topk = int(r.positive("index_topk"));
    c.index_n_heads = int(r.positive("index_n_heads"));
    c.index_head_dim = r.positive("index_head_dim");
    if (c.index_head_dim < c.qk_rope_dim)
      fail(src, ": field index_head_dim (", c.index_head_dim, ") must be at least qk_rope_head_dim");
    // Only glm_moe_dsa has shared indexer layers; DeepSeek-V3.2 runs the indexer everywhere.
    if (c.model_type == "glm_moe_dsa" && r.has("indexer_types")) {
      c.indexer_full = parse_layer_list(j["indexer_types"], c.num_layers, "indexer_types", "full", "shared", src);
    } else if (c.model_type == "glm_moe_dsa" && r.has("index_topk_pattern")) {
      const Json& p = j["index_topk_pattern"];
      if (p.is_string()) {
        std::string s = p;
        if (int(s.size()) != c.num_layers)
          fail(src, ": field index_topk_pattern must have ", c.num_layers, " characters, found ", s.size());
        for (char ch : s) {
          if (ch != 'F' && ch != 'S') fail(src, ": field index_topk_pattern has '", ch, "' (expected F or S)");
          c.indexer_full.push_back(ch == 'F');
        }
      } else {
        c.indexer_full = parse_layer_list(p, c.num_layers, "index_topk_pattern", "full", "shared", src);
      }
    } else if (c.model_type == "glm_moe_dsa") {
      c.indexer_full = indexer_schedule(c.num_layers, int(r.integer_or("index_topk_freq", 1)),
                                        int(r.integer_or("index_skip_topk_offset", 2)));
    } else {
      c.indexer_full.assign(size_t(c.num_layers), true);
    }
    if (!c.indexer_full[0]) fail(src, ": layer 0 must run a full indexer (a shared layer reuses an earlier one)");
  }
  if (r.has("mlp_layer_types")) {
    c.layer_dense = parse_layer_list(j["mlp_layer_types"], c.num_layers, "mlp_layer_types", "dense", "sparse", src);
  } else {
    int k = int(r.integer_or("first_k_dense_replace", 0));
    for (int i = 0; i < c.num_layers; ++i) c.layer_dense.push_back(i < k);
  }
  if (j.contains("eos_token_id")) add_eos(j["eos_token_id"], c.eos_ids, src);
  if (!generation_text.empty()) {
    Json g;
    try {
      g = Json::parse(generation_text);
    } catch (const Json::exception&) {
      fail("generation_config.json: malformed JSON");
    }
    if (g.is_object() && g.contains("eos_token_id")) add_eos(g["eos_token_id"], c.eos_ids, "generation_config.json");
  }
  return c;
}

GlmDsaConfig load_glm_dsa_config(const std::string& dir) {
  auto slurp = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  const std::string cfg = dir + "/config.json";
  if (!file_exists(cfg)) fail(dir, ": no config.json (not a model directory?)");
  std::string gen;
  if (file_exists(dir + "/generation_config.json")) gen = slurp(dir + "/generation_config.json");
  return parse_glm_dsa_config(slurp(cfg), gen, cfg);
}

}  // namespace vireo
