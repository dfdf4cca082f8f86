#include "experts/expert_store.h"

#include <algorithm>

#include "experts/streaming_store.h"

namespace vireo {

ExpertStoreStats ExpertStoreStats::operator-(const ExpertStoreStats& o) const {
  ExpertStoreStats d;
  d.requests = requests - o.requests;
  d.hits = hits - o.hits;
  d.misses = misses - o.misses;
  d.bytes_read = bytes_read - o.bytes_read;
  d.bytes_transferred = bytes_transferred - o.bytes_transferred;
  d.evictions = evictions - o.evictions;
  d.bytes_to_device = bytes_to_device - o.bytes_to_device;
  d.host_hits = host_hits - o.host_hits;
  d.prefetch_reads = prefetch_reads - o.prefetch_reads;
  d.prefetch_used = prefetch_used - o.prefetch_used;
  d.predicted = predicted - o.predicted;
  d.predicted_correct = predicted_correct - o.predicted_correct;
  d.predicted_actual = predicted_actual - o.predicted_actual;
  d.stall_seconds = stall_seconds - o.stall_seconds;
  d.read_seconds = read_seconds - o.read_seconds;
  return d;
}

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

ResidentExpertStore::ResidentExpertStore(const Checkpoint& ck, const ExpertStoreParams& p) {
  experts_.resize(size_t(p.n_layers));
  for (int l : p.moe_layers) {
    for (int e = 0; e < p.n_experts; ++e) {
      const std::string x = p.layer_prefix + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".";
      ExpertWeights w;
      w.gate = bind_weight(ck, x + "gate_proj", p.moe_intermediate, p.hidden);
      w.up = bind_weight(ck, x + "up_proj", p.moe_intermediate, p.hidden);
      w.down = bind_weight(ck, x + "down_proj", p.hidden, p.moe_intermediate);
      bytes_ += w.nbytes();
      experts_[size_t(l)].push_back(w);
    }
  }
}

std::vector<const ExpertWeights*> ResidentExpertStore::prepare(int layer, const std::vector<int>& experts) {
  std::vector<const ExpertWeights*> out;
  out.reserve(experts.size());
  for (int e : experts) out.push_back(&experts_[size_t(layer)][size_t(e)]);
  return out;
}

std::unique_ptr<ExpertStore> make_expert_store(const Checkpoint& ck, const ExpertStoreParams& p,
                                               const ExpertStoreOptions& o) {
  if (o.slots <= 0) return std::make_unique<ResidentExpertStore>(ck, p);
  return std::make_unique<StreamingExpertStore>(ck, p, o);
}

void ResidentExpertStore::upload(Backend& backend) {
  banks_.assign(experts_.size(), ExpertBank{});
  for (size_t l = 0; l < experts_.size(); ++l)
    for (ExpertWeights& e : experts_[l]) {
      e.gate = backend.upload_weight(e.gate);
      e.up = backend.upload_weight(e.up);
      e.down = backend.upload_weight(e.down);
      banks_[l].gate.push_back(e.gate);
      banks_[l].up.push_back(e.up);
      banks_[l].down.push_back(e.down);
    }
}

const std::vector<int>& PredictionLog::guess(int layer, std::vector<int> experts, ExpertStoreStats& s) {
  std::sort(experts.begin(), experts.end());
  experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
  s.predicted += experts.size();
  guess_[size_t(layer)] = std::move(experts);
  return guess_[size_t(layer)];
}

void PredictionLog::score(int layer, const std::vector<int>& experts, ExpertStoreStats& s) {
  if (last_layer_ >= 0 && last_layer_ != layer) guess_[size_t(last_layer_)].clear();
  last_layer_ = layer;
  const std::vector<int>& g = guess_[size_t(layer)];
  if (g.empty()) return;
  s.predicted_actual += experts.size();
  for (int e : experts) s.predicted_correct += std::binary_search(g.begin(), g.end(), e);
}

}  // namespace vireo
