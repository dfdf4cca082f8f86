#pragma once
// The expert store: the seam between the forward pass and where routed experts' weights live.
// The forward pass asks for (layer, expert) and gets a Weight triple; whether the bytes are
// resident, mapped, or streamed into a slot is the store's business. `ResidentExpertStore` binds
// every expert straight from the mapped checkpoint.
#include <cstdint>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "io/safetensors.h"

namespace vireo {

struct ExpertWeights {
  Weight gate;  // [moe_intermediate, hidden]
  Weight up;    // [moe_intermediate, hidden]
  Weight down;  // [hidden, moe_intermediate]
  size_t nbytes() const { return gate.nbytes() + up.nbytes() + down.nbytes(); }
};

struct ExpertStoreStats {
  uint64_t requests = 0, hits = 0, misses = 0, bytes_read = 0;
  double stall_seconds = 0;
};

class ExpertStore {
 public:
  virtual ~ExpertStore() = default;
  // The experts `experts` of MoE layer `layer` are about to run: make them available. Returns
  // them in the same order; valid until the next prepare() call.
  virtual std::vector<const ExpertWeights*> prepare(int layer, const std::vector<int>& experts) = 0;
  virtual size_t resident_bytes() const = 0;
  virtual ExpertStoreStats stats() const { return {}; }
};

// Binds a linear layer's weight `prefix + ".weight"` (and, for F8_E4M3, its weight_scale_inv
// [ceil(out/128), ceil(in/128)]) from the checkpoint, checking shape and dtype.
Weight bind_weight(const Checkpoint& ck, const std::string& prefix, int64_t out, int64_t in);

class ResidentExpertStore final : public ExpertStore {
 public:
  // layers: for each model layer, true if it is an MoE layer (its experts are bound).
  ResidentExpertStore(const Checkpoint& ck, const std::vector<bool>& moe_layers, int n_experts, int64_t hidden,
                      int64_t moe_intermediate, const std::string& layer_prefix = "model.layers.");
  std::vector<const ExpertWeights*> prepare(int layer, const std::vector<int>& experts) override;
  size_t resident_bytes() const override { return bytes_; }

 private:
  std::vector<std::vector<ExpertWeights>> experts_;  // [layer][expert]
  size_t bytes_ = 0;
};

}  // namespace vireo
