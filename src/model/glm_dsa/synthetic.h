#pragma once
// Synthetic GLM-5-shaped models: the real layer shapes with random weights, built in memory, so
// speed can be measured with no checkpoint on disk.
#include <memory>
#include <string>

#include "io/safetensors.h"
#include "model/glm_dsa/config.h"

namespace vireo {

// The GLM-5 configuration (spec §1) cut to `layers` MoE layers of `experts` routed experts
// (num_experts_per_tok = min(8, experts)).
GlmDsaConfig glm5_synthetic_config(int layers, int experts);

// Random weights for every tensor the graph binds. dtype: BF16, or F8_E4M3 (128x128 block
// scales; embeddings, norms, router and indexer weights_proj in BF16 as in GLM-5-FP8).
std::unique_ptr<Checkpoint> make_synthetic_checkpoint(const GlmDsaConfig& c, DType dtype, uint64_t seed = 1);

// Parses "bf16" / "fp8" (the --dtype flag).
DType parse_weight_dtype_flag(const std::string& s);

}  // namespace vireo
