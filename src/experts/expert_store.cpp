#include "experts/expert_store.h"

namespace vireo {

Weight bind_weight(const Checkpoint& ck, const std::string& prefix, int64_t out, int64_t in) {
  const std::string name = prefix + ".weight";
  const TensorInfo& t = ck.require(name, {out, in});
  Weight w;
  w.w = t.view();
  switch (t.dtype) {
    case DType::F32: case DType::BF16: case DType::F16: break;
    case DType::F8_E4M3: {
      const int64_t so = (out + 127) / 128, si = (in + 127) / 128;
      const TensorInfo& s = ck.require(prefix + ".weight_scale_inv", {so, si});
      if (s.dtype != DType::F32 && s.dtype != DType::BF16)
        fail(ck.dir(), ": tensor ", prefix, ".weight_scale_inv has dtype ", dtype_name(s.dtype), ", expected F32");
      if (s.dtype != DType::F32)
        fail(ck.dir(), ": tensor ", prefix, ".weight_scale_inv is BF16; only F32 block scales are supported");
      w.scale_inv = s.view();
      break;
    }
    default:
      fail(ck.dir(), ": tensor ", name, " has dtype ", dtype_name(t.dtype), " (expected F32, BF16, F16 or F8_E4M3)");
  }
  return w;
}

ResidentExpertStore::ResidentExpertStore(const Checkpoint& ck, const std::vector<bool>& moe_layers, int n_experts,
                                         int64_t hidden, int64_t inter, const std::string& layer_prefix) {
  experts_.resize(moe_layers.size());
  for (size_t l = 0; l < moe_layers.size(); ++l) {
    if (!moe_layers[l]) continue;
    for (int e = 0; e < n_experts; ++e) {
      const std::string p = layer_prefix + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".";
      ExpertWeights x;
      x.gate = bind_weight(ck, p + "gate_proj", inter, hidden);
      x.up = bind_weight(ck, p + "up_proj", inter, hidden);
      x.down = bind_weight(ck, p + "down_proj", hidden, inter);
      bytes_ += x.nbytes();
      experts_[l].push_back(x);
    }
  }
}

std::vector<const ExpertWeights*> ResidentExpertStore::prepare(int layer, const std::vector<int>& experts) {
  std::vector<const ExpertWeights*> out;
  out.reserve(experts.size());
  for (int e : experts) out.push_back(&experts_[size_t(layer)][size_t(e)]);
  return out;
}

}  // namespace vireo
