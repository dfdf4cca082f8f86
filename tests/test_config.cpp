// config.json parsing rules (spec §1).
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "model/glm_dsa/config.h"
#include "test_helpers.h"

using namespace vireo;

namespace {

std::string base_config(const std::string& extra, const std::string& model_type = "glm_moe_dsa") {
  return R"({"model_type": ")" + model_type + R"(", "vocab_size": 100, "hidden_size": 32,
    "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 6,
    "num_attention_heads": 2, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "index_topk": 4, "index_n_heads": 2, "index_head_dim": 8,
    "head_dim": 4, "eos_token_id": 7)" + extra + "}";
}

std::string error_of(const std::string& cfg, const std::string& gen = "") {
  try {
    parse_glm_dsa_config(cfg, gen, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Config, Glm52ScheduleFreq4Offset3Over78Layers) {
  std::vector<bool> full = indexer_schedule(78, 4, 3);
  std::vector<int> layers;
  for (int i = 0; i < 78; ++i)
    if (full[size_t(i)]) layers.push_back(i);
  ASSERT_EQ(layers.size(), 21u);
  std::vector<int> expect = {0, 1, 2};
  for (int i = 6; i <= 74; i += 4) expect.push_back(i);
  EXPECT_EQ(layers, expect);
}

TEST(Config, DefaultScheduleIsAllFull) {
  GlmDsaConfig c = parse_glm_dsa_config(base_config(""), "", "config.json");
  EXPECT_EQ(c.n_full_indexer_layers(), 6);
}

TEST(Config, IndexerTypesWinOverPatternAndFreq) {
  GlmDsaConfig c = parse_glm_dsa_config(
      base_config(R"(, "indexer_types": ["full","shared","full","shared","shared","full"],
                     "index_topk_pattern": "FFFFFF", "index_topk_freq": 4)"), "", "config.json");
  EXPECT_EQ(c.indexer_full, (std::vector<bool>{true, false, true, false, false, true}));
  c = parse_glm_dsa_config(base_config(R"(, "index_topk_pattern": "FSSFSS", "index_topk_freq": 4)"), "", "c");
  EXPECT_EQ(c.indexer_full, (std::vector<bool>{true, false, false, true, false, false}));
  c = parse_glm_dsa_config(base_config(R"(, "index_topk_freq": 2, "index_skip_topk_offset": 1)"), "", "c");
  EXPECT_EQ(c.indexer_full, (std::vector<bool>{true, false, true, false, true, false}));
}

TEST(Config, MlpLayerTypesWinOverFirstKDense) {
  GlmDsaConfig c = parse_glm_dsa_config(base_config(R"(, "first_k_dense_replace": 2)"), "", "c");
  EXPECT_EQ(c.layer_dense, (std::vector<bool>{true, true, false, false, false, false}));
  c = parse_glm_dsa_config(
      base_config(R"(, "first_k_dense_replace": 2, "mlp_layer_types": ["sparse","dense","sparse","dense","sparse","sparse"])"),
      "", "c");
  EXPECT_EQ(c.layer_dense, (std::vector<bool>{false, true, false, true, false, false}));
}

TEST(Config, RopeTopLevelAndRopeParameters) {
  GlmDsaConfig c = parse_glm_dsa_config(base_config(R"(, "rope_theta": 8000000.0)"), "", "c");
  EXPECT_EQ(c.rope.theta, 8e6);
  EXPECT_FALSE(c.rope.yarn);
  c = parse_glm_dsa_config(base_config(R"(, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
      "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
      "mscale": 1.0, "mscale_all_dim": 1.0})", "deepseek_v32"), "", "c");
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_EQ(c.rope.factor, 40);
  EXPECT_DOUBLE_EQ(c.rope.attention_factor, 1.0);  // mscale / mscale_all_dim
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.attention_scale(), m * m / std::sqrt(12.0), 1e-12);
  // Old style: rope_scaling with "type".
  c = parse_glm_dsa_config(base_config(R"(, "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4,
      "original_max_position_embeddings": 64})", "deepseek_v32"), "", "c");
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_NEAR(c.rope.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-12);  // no mscales given
  EXPECT_NEAR(c.attention_scale(), 1 / std::sqrt(12.0), 1e-12);            // no mscale_all_dim
}

TEST(Config, HeadDimIsNotTheRotaryWidth) {
  GlmDsaConfig c = parse_glm_dsa_config(base_config(R"(, "head_dim": 99)"), "", "c");
  EXPECT_EQ(c.qk_rope_dim, 4);
  EXPECT_EQ(c.qk_head_dim(), 12);
}

TEST(Config, QLoraNullMeansPlainQProj) {
  std::string cfg = base_config("", "deepseek_v3");
  cfg.replace(cfg.find("\"q_lora_rank\": 24"), 17, "\"q_lora_rank\": null");
  GlmDsaConfig c = parse_glm_dsa_config(cfg, "", "c");
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_FALSE(c.has_indexer);
}

TEST(Config, EosIsUnionWithGenerationConfig) {
  GlmDsaConfig c = parse_glm_dsa_config(base_config(""), R"({"eos_token_id": [3, 7, 9]})", "c");
  EXPECT_EQ(c.eos_ids, (std::set<int64_t>{3, 7, 9}));
}

TEST(Config, FamilyRopeStyles) {
  EXPECT_EQ(parse_glm_dsa_config(base_config(""), "", "c").indexer_rope_style, RopeStyle::Interleaved);
  EXPECT_EQ(parse_glm_dsa_config(base_config("", "deepseek_v32"), "", "c").indexer_rope_style, RopeStyle::HalfSplit);
  // DeepSeek-V3.2 has no shared layers even if a schedule is written.
  EXPECT_EQ(parse_glm_dsa_config(base_config(R"(, "index_topk_freq": 2)", "deepseek_v32"), "", "c").n_full_indexer_layers(), 6);
}

TEST(Config, ErrorsNameTheField) {
  EXPECT_NE(error_of(base_config("", "llama")).find("unknown model_type 'llama'"), std::string::npos);
  EXPECT_NE(error_of("{\"model_type\": ").find("malformed JSON"), std::string::npos);
  EXPECT_NE(error_of(base_config(R"(, "index_topk_pattern": "FSX")")).find("index_topk_pattern"), std::string::npos);
  EXPECT_NE(error_of(base_config(R"(, "indexer_types": ["shared","full","full","full","full","full"])")).find("layer 0"),
            std::string::npos);
  std::string cfg = base_config("");
  cfg.replace(cfg.find("\"hidden_size\": 32"), 17, "\"hidden_size\": \"x\"");
  EXPECT_NE(error_of(cfg).find("hidden_size must be an integer"), std::string::npos);
  EXPECT_NE(error_of(base_config(R"(, "n_group": 3)")).find("n_group"), std::string::npos);
  EXPECT_NE(error_of(base_config(R"(, "rope_parameters": {"rope_type": "longrope"})")).find("longrope"), std::string::npos);
  // A number past double's range is a parse failure of its own kind in nlohmann (out_of_range, not
  // parse_error): still the file's named error. (A 100x fuzz campaign found "1e800" escaping.)
  EXPECT_NE(error_of(base_config(R"(, "rope_theta": 1e800)")).find("config.json: malformed JSON: number overflow"),
            std::string::npos);
  EXPECT_NE(error_of(base_config(""), R"({"eos_token_id": 1e800})").find("generation_config.json: malformed JSON"),
            std::string::npos);
}

TEST(Config, FuzzedConfigsFailCleanly) {
  const std::string good = base_config(R"(, "index_topk_freq": 2, "mlp_layer_types": ["dense","sparse","sparse","sparse","sparse","sparse"])");
  uint64_t s = vireo::test::fuzz_seed(12345);
  auto rnd = [&]() { s = s * 6364136223846793005ull + 1442695040888963407ull; return uint32_t(s >> 33); };
  const char alphabet[] = "{}[]\",:0123456789-.eE truefalsnul";
  for (int it = 0; it < vireo::test::fuzz_iterations(3000); ++it) {
    std::string t = good;
    int edits = 1 + int(rnd() % 4);
    for (int k = 0; k < edits; ++k) {
      size_t pos = rnd() % t.size();
      switch (rnd() % 3) {
        case 0: t[pos] = alphabet[rnd() % (sizeof(alphabet) - 1)]; break;
        case 1: t.erase(pos, 1 + rnd() % 8); break;
        default: t.insert(pos, 1, alphabet[rnd() % (sizeof(alphabet) - 1)]); break;
      }
    }
    try {
      parse_glm_dsa_config(t, "", "config.json");
    } catch (const Error&) {
    }
  }
}
