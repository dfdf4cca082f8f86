#pragma once
// GlmDsaModel: the forward pass of the GLM-DSA family (spec §3), written once against Backend.
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cache/mla_cache.h"
#include "experts/expert_store.h"
#include "io/safetensors.h"
#include "model/glm_dsa/config.h"
#include "model/glm_dsa/weights.h"

namespace vireo {

enum class AttentionPath : uint8_t {
  Auto,           // reconstructed for T > 1, absorbed for T == 1
  Reconstructed,  // expand latents through kv_b (prefill)
  Absorbed,       // attend over latents directly (decode)
};

class GlmDsaModel {
 public:
  // Loads config, maps the checkpoint and binds the weights. `experts` may be null: then every
  // routed expert is bound resident from the checkpoint.
  static std::unique_ptr<GlmDsaModel> load(const std::string& dir, Backend& backend,
                                           std::unique_ptr<ExpertStore> experts = nullptr);

  // Builds a model over an already opened checkpoint (e.g. an in-memory synthetic one).
  static std::unique_ptr<GlmDsaModel> create(GlmDsaConfig config, std::unique_ptr<Checkpoint> ck, Backend& backend,
                                             std::unique_ptr<ExpertStore> experts = nullptr);

  const GlmDsaConfig& config() const { return config_; }
  const GlmDsaWeights& weights() const { return weights_; }
  const Checkpoint& checkpoint() const { return *checkpoint_; }
  ExpertStore& experts() { return *experts_; }
  Backend& backend() { return backend_; }
  MlaCacheShape cache_shape() const;

  // Runs tokens[0..T) at positions cache.length(row) .. +T through the model, appending their
  // entries to cache row `row`. Writes logits for every token ([T, vocab]) when all_logits, else
  // for the last token only ([1, vocab]); `logits` is host memory.
  void forward(const int32_t* tokens, int64_t T, MlaCache& cache, int row, float* logits,
               bool all_logits = false, AttentionPath path = AttentionPath::Auto);

  // Bytes the forward pass reads per decoded token: the dense spine's matrices that every token
  // uses plus experts_per_token routed experts per MoE layer (embedding: one row).
  size_t active_weight_bytes_per_token();

 private:
  GlmDsaModel(GlmDsaConfig config, std::unique_ptr<Checkpoint> ck, Backend& backend);
  void rope_table(int64_t pos0, int64_t T, float* cos_sin) const;  // [T, rope/2, 2]
  void attention(int layer, float* xn, int64_t T, MlaCache& cache, int row, int64_t pos0, AttentionPath path,
                 float* out);
  void moe(int layer, const float* xn, int64_t T, float* out);
  void mlp(const MlpWeights& w, const float* x, int64_t T, float* out);
  float* scratch(int slot, size_t n);

  GlmDsaConfig config_;
  std::unique_ptr<Checkpoint> checkpoint_;
  Backend& backend_;
  GlmDsaWeights weights_;
  std::unique_ptr<ExpertStore> experts_;
  std::vector<float> inv_freq_;  // [rope/2]
  // DSA selection of the most recent full-indexer layer, reused by shared layers.
  std::vector<int32_t> selected_, selected_count_;
  std::vector<std::shared_ptr<float>> scratch_;
  std::vector<size_t> scratch_size_;
};

}  // namespace vireo
