#pragma once
// The GLM-DSA weights, bound by name from a checkpoint with every shape checked. Matrices stay
// in their stored dtype (views into the mapped files); only 1-D norm vectors and biases are
// copied to f32 (a few KB per layer).
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "io/safetensors.h"
#include "model/glm_dsa/config.h"

namespace vireo {

struct AttentionWeights {
  Weight q_a_proj;                 // [q_lora, hidden]            (q_lora_rank > 0)
  std::vector<float> q_a_norm;     // [q_lora]
  Weight q_b_proj;                 // [H * (nope + rope), q_lora]
  Weight q_proj;                   // [H * (nope + rope), hidden] (q_lora_rank == 0)
  Weight kv_a_proj;                // [kv_lora + rope, hidden]
  std::vector<float> kv_a_norm;    // [kv_lora]
  Weight kv_b_proj;                // [H * (nope + v), kv_lora]
  Weight o_proj;                   // [hidden, H * v]
  // DSA indexer, on layers that run their own ("full").
  bool has_indexer = false;
  Weight idx_wq_b;                 // [n_idx * d, q_lora]
  Weight idx_wk;                   // [d, hidden]
  std::vector<float> idx_k_norm_w, idx_k_norm_b;  // [d] LayerNorm
  Weight idx_weights_proj;         // [n_idx, hidden]
};

struct MlpWeights {
  Weight gate, up;  // [inter, hidden]
  Weight down;      // [hidden, inter]
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;  // [hidden]
  AttentionWeights attn;
  bool dense = true;
  MlpWeights mlp;               // dense layers
  Weight router;                // [n_experts, hidden]              (MoE layers)
  std::vector<float> router_bias;  // [n_experts] e_score_correction_bias
  bool has_shared = false;
  MlpWeights shared;            // [n_shared * moe_inter, hidden]   (MoE layers)
};

// The MTP layer's own tensors around its decoder layer (layers[num_layers]): it reads the main
// model's embedding and lm_head.
struct MtpWeights {
  std::vector<float> enorm, hnorm;  // [hidden]: the next token's embedding, the main model's hidden state
  Weight eh_proj;                   // [hidden, 2 hidden]: [enorm(embed) ; hnorm(h)] -> hidden
  std::vector<float> head_norm;     // [hidden] shared_head.norm, before the main lm_head
};

struct GlmDsaWeights {
  Weight embed;                  // [vocab, hidden]
  std::vector<float> final_norm; // [hidden]
  Weight lm_head;                // [vocab, hidden]
  std::vector<LayerWeights> layers;  // [num_layers + mtp_layers]
  MtpWeights mtp;                    // bound where c.mtp_layers > 0
  size_t dense_bytes = 0;            // every bound tensor of the main model except routed experts
  size_t mtp_bytes = 0;              // the MTP layer's, except its routed experts
};

// Binds the main stack (layers 0 .. num_layers-1) and, where c.mtp_layers > 0, the MTP layer
// (model.layers.{num_layers}.*). Tensors the graph does not use (an unbound MTP layer, rotary
// caches) are ignored.
GlmDsaWeights bind_glm_dsa_weights(const Checkpoint& ck, const GlmDsaConfig& c);

// A 1-D tensor of length n as f32 (F32, BF16 or F16 storage).
std::vector<float> load_vector(const Checkpoint& ck, const std::string& name, int64_t n);

}  // namespace vireo
