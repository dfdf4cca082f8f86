#include "model/glm_dsa/weights.h"

#include <cstring>

#include "experts/expert_store.h"

namespace vireo {

std::vector<float> load_vector(const Checkpoint& ck, const std::string& name, int64_t n) {
  const TensorInfo& t = ck.require(name, {n});
  std::vector<float> out(static_cast<size_t>(n));
  // Element by element through memcpy: safetensors does not align a tensor's data to its element
  // size (a header of odd length, or an odd-length 2-byte tensor before a 4-byte one), and a
  // misaligned float or uint16_t load is undefined behaviour (UBSan flagged it here).
  const auto* bytes = static_cast<const unsigned char*>(t.data);
  for (int64_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case DType::F32: std::memcpy(&out[size_t(i)], bytes + 4 * i, 4); break;
      case DType::BF16:
      case DType::F16: {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        out[size_t(i)] = t.dtype == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        break;
      }
      default: fail(ck.dir(), ": tensor ", name, " has dtype ", dtype_name(t.dtype), " (expected F32, BF16 or F16)");
    }
  }
  return out;
}

namespace {

MlpWeights bind_mlp(const Checkpoint& ck, const std::string& p, int64_t hidden, int64_t inter, size_t& bytes) {
  MlpWeights m;
  m.gate = bind_weight(ck, p + "gate_proj", inter, hidden);
  m.up = bind_weight(ck, p + "up_proj", inter, hidden);
  m.down = bind_weight(ck, p + "down_proj", hidden, inter);
  bytes += m.gate.nbytes() + m.up.nbytes() + m.down.nbytes();
  return m;
}

}  // namespace

GlmDsaWeights bind_glm_dsa_weights(const Checkpoint& ck, const GlmDsaConfig& c) {
  GlmDsaWeights w;
  const int64_t D = c.hidden_size, H = c.n_heads;
  size_t* counted = &w.dense_bytes;  // where bound bytes are counted: the main model's, then the MTP layer's
  auto bind = [&](const std::string& name, int64_t out, int64_t in) {
    Weight x = bind_weight(ck, name, out, in);
    *counted += x.nbytes();
    return x;
  };
  auto vec = [&](const std::string& name, int64_t n) {
    *counted += ck.find(name) ? ck.find(name)->nbytes : 0;
    return load_vector(ck, name, n);
  };
  w.embed = bind("model.embed_tokens", c.vocab_size, D);
  w.final_norm = vec("model.norm.weight", D);
  if (ck.has("lm_head.weight")) w.lm_head = bind("lm_head", c.vocab_size, D);
  else if (c.tie_word_embeddings) w.lm_head = w.embed;
  else fail(ck.dir(), ": missing tensor lm_head.weight (expected shape [", c.vocab_size, ", ", D, "])");

  for (int l = 0; l < c.bound_layers(); ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    if (l == c.num_layers) {
      counted = &w.mtp_bytes;
      w.mtp.enorm = vec(p + "enorm.weight", D);
      w.mtp.hnorm = vec(p + "hnorm.weight", D);
      w.mtp.eh_proj = bind(p + "eh_proj", D, 2 * D);
      w.mtp.head_norm = vec(p + "shared_head.norm.weight", D);
    }
    LayerWeights L;
    L.attn_norm = vec(p + "input_layernorm.weight", D);
    L.ffn_norm = vec(p + "post_attention_layernorm.weight", D);
    AttentionWeights& a = L.attn;
    const std::string ap = p + "self_attn.";
    if (c.q_lora_rank > 0) {
      a.q_a_proj = bind(ap + "q_a_proj", c.q_lora_rank, D);
      a.q_a_norm = vec(ap + "q_a_layernorm.weight", c.q_lora_rank);
      a.q_b_proj = bind(ap + "q_b_proj", H * c.qk_head_dim(), c.q_lora_rank);
    } else {
      a.q_proj = bind(ap + "q_proj", H * c.qk_head_dim(), D);
    }
    a.kv_a_proj = bind(ap + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_dim, D);
    a.kv_a_norm = vec(ap + "kv_a_layernorm.weight", c.kv_lora_rank);
    a.kv_b_proj = bind(ap + "kv_b_proj", H * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank);
    a.o_proj = bind(ap + "o_proj", D, H * c.v_head_dim);
    if (c.has_indexer && c.indexer_full[size_t(l)]) {
      const std::string ip = ap + "indexer.";
      a.has_indexer = true;
      a.idx_wq_b = bind(ip + "wq_b", int64_t(c.index_n_heads) * c.index_head_dim, c.q_lora_rank);
      a.idx_wk = bind(ip + "wk", c.index_head_dim, D);
      a.idx_k_norm_w = vec(ip + "k_norm.weight", c.index_head_dim);
      a.idx_k_norm_b = vec(ip + "k_norm.bias", c.index_head_dim);
      a.idx_weights_proj = bind(ip + "weights_proj", c.index_n_heads, D);
    }
    L.dense = c.layer_dense[size_t(l)];
    if (L.dense) {
      L.mlp = bind_mlp(ck, p + "mlp.", D, c.intermediate_size, *counted);
    } else {
      L.router = bind(p + "mlp.gate", c.n_routed_experts, D);
      L.router_bias = vec(p + "mlp.gate.e_score_correction_bias", c.n_routed_experts);
      if (c.n_shared_experts > 0) {
        L.has_shared = true;
        L.shared = bind_mlp(ck, p + "mlp.shared_experts.", D, c.moe_intermediate_size * c.n_shared_experts, *counted);
      }
    }
    w.layers.push_back(std::move(L));
  }
  return w;
}

}  // namespace vireo
