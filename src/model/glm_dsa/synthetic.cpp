#include "model/glm_dsa/synthetic.h"

#include <cmath>

#include "core/thread_pool.h"

namespace vireo {

GlmDsaConfig glm5_synthetic_config(int layers, int experts) {
  if (layers < 1) fail("--layers must be at least 1, got ", layers);
  if (experts < 1 || experts > 256) fail("--experts must be in [1, 256], got ", experts);
  GlmDsaConfig c;
  c.model_type = "glm_moe_dsa";
  c.vocab_size = 154880;
  c.hidden_size = 6144;
  c.intermediate_size = 12288;
  c.moe_intermediate_size = 2048;
  c.num_layers = layers;
  c.n_heads = 64;
  c.q_lora_rank = 2048;
  c.kv_lora_rank = 512;
  c.qk_nope_dim = 192;
  c.qk_rope_dim = 64;
  c.v_head_dim = 256;
  c.n_routed_experts = experts;
  c.n_shared_experts = 1;
  c.experts_per_token = std::min(8, experts);
  c.routed_scaling_factor = 2.5;
  c.rms_norm_eps = 1e-5;
  c.max_position_embeddings = 202752;
  c.has_indexer = true;
  c.index_topk = 2048;
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.indexer_full.assign(size_t(layers), true);
  c.layer_dense.assign(size_t(layers), false);
  c.rope.theta = 1e6;
  c.eos_ids = {154820};
  return c;
}

DType parse_weight_dtype_flag(const std::string& s) {
  if (s == "bf16") return DType::BF16;
  if (s == "fp8") return DType::F8_E4M3;
  fail("--dtype must be bf16 or fp8, got '", s, "'");
}

namespace {

struct Filler {
  Checkpoint& ck;
  uint64_t seed;
  size_t count = 0;

  // Uniform values in [-a, a) from a counter-based hash: independent of thread partitioning.
  static float value(uint64_t key, float a) {
    uint64_t z = key * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * a;
  }

  void fill(void* data, DType dt, size_t n, float a) {
    const uint64_t base = (seed << 40) ^ (uint64_t(++count) << 48);
    ThreadPool::global().parallel_for(int64_t(n), [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        float v = value(base + uint64_t(i), a);
        switch (dt) {
          case DType::F32: static_cast<float*>(data)[i] = v; break;
          case DType::BF16: static_cast<uint16_t*>(data)[i] = uint16_t(bits_from_f32(v) >> 16); break;
          case DType::F8_E4M3: {
            // A random finite code with |value| <= 448 (exponent field < 15 avoids NaN).
            uint8_t code = uint8_t(bits_from_f32(v) >> 13);
            if ((code & 0x78) == 0x78) code &= 0xf7;
            static_cast<uint8_t*>(data)[i] = code;
            break;
          }
          default: break;
        }
      }
    }, 4096);
  }

  void matrix(const std::string& name, int64_t out, int64_t in, DType dt) {
    const float a = 1.0f / std::sqrt(float(in));
    void* w = ck.add_tensor(name + ".weight", dt, {out, in});
    fill(w, dt, size_t(out * in), a);
    if (dt == DType::F8_E4M3) {
      const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
      float* s = static_cast<float*>(ck.add_tensor(name + ".weight_scale_inv", DType::F32, {so, si}));
      for (int64_t i = 0; i < so * si; ++i) s[i] = a / 448.0f;
    }
  }

  void vector(const std::string& name, int64_t n, float v) {
    float* p = static_cast<float*>(ck.add_tensor(name, DType::F32, {n}));
    for (int64_t i = 0; i < n; ++i) p[i] = v;
  }
};

}  // namespace

std::unique_ptr<Checkpoint> make_synthetic_checkpoint(const GlmDsaConfig& c, DType dt, uint64_t seed) {
  if (dt != DType::BF16 && dt != DType::F8_E4M3) fail("synthetic weights must be BF16 or F8_E4M3");
  auto ck = Checkpoint::in_memory("synthetic:glm5");
  Filler f{*ck, seed};
  const int64_t D = c.hidden_size, H = c.n_heads;
  f.matrix("model.embed_tokens", c.vocab_size, D, DType::BF16);
  f.matrix("lm_head", c.vocab_size, D, DType::BF16);
  f.vector("model.norm.weight", D, 1.0f);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string a = p + "self_attn.";
    f.vector(p + "input_layernorm.weight", D, 1.0f);
    f.vector(p + "post_attention_layernorm.weight", D, 1.0f);
    f.matrix(a + "q_a_proj", c.q_lora_rank, D, dt);
    f.vector(a + "q_a_layernorm.weight", c.q_lora_rank, 1.0f);
    f.matrix(a + "q_b_proj", H * c.qk_head_dim(), c.q_lora_rank, dt);
    f.matrix(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_dim, D, dt);
    f.vector(a + "kv_a_layernorm.weight", c.kv_lora_rank, 1.0f);
    f.matrix(a + "kv_b_proj", H * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank, dt);
    f.matrix(a + "o_proj", D, H * c.v_head_dim, dt);
    if (c.indexer_full[size_t(l)]) {
      f.matrix(a + "indexer.wq_b", int64_t(c.index_n_heads) * c.index_head_dim, c.q_lora_rank, dt);
      f.matrix(a + "indexer.wk", c.index_head_dim, D, dt);
      f.vector(a + "indexer.k_norm.weight", c.index_head_dim, 1.0f);
      f.vector(a + "indexer.k_norm.bias", c.index_head_dim, 0.0f);
      f.matrix(a + "indexer.weights_proj", c.index_n_heads, D, DType::BF16);
    }
    if (c.layer_dense[size_t(l)]) {
      f.matrix(p + "mlp.gate_proj", c.intermediate_size, D, dt);
      f.matrix(p + "mlp.up_proj", c.intermediate_size, D, dt);
      f.matrix(p + "mlp.down_proj", D, c.intermediate_size, dt);
      continue;
    }
    f.matrix(p + "mlp.gate", c.n_routed_experts, D, DType::BF16);
    f.vector(p + "mlp.gate.e_score_correction_bias", c.n_routed_experts, 0.0f);
    for (int e = 0; e < c.n_routed_experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      f.matrix(x + "gate_proj", c.moe_intermediate_size, D, dt);
      f.matrix(x + "up_proj", c.moe_intermediate_size, D, dt);
      f.matrix(x + "down_proj", D, c.moe_intermediate_size, dt);
    }
    const int64_t si = c.moe_intermediate_size * c.n_shared_experts;
    f.matrix(p + "mlp.shared_experts.gate_proj", si, D, dt);
    f.matrix(p + "mlp.shared_experts.up_proj", si, D, dt);
    f.matrix(p + "mlp.shared_experts.down_proj", D, si, dt);
  }
  return ck;
}

}  // namespace vireo
