#pragma once
// The expert store: the seam between the forward pass and where routed experts' weights live.
// The forward pass asks for (layer, expert) and gets a Weight triple; whether the bytes are
// resident, mapped, or streamed into a slot is the store's business.
//
// Two stores: `ResidentExpertStore` binds every expert straight from the mapped checkpoint;
// `StreamingExpertStore` (streaming_store.h) keeps a fixed pool of slots sized from a memory
// budget and reads misses from the checkpoint files. `make_expert_store` picks one from options.
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/matmul.h"
#include "io/safetensors.h"

namespace vireo {

struct ExpertWeights {
  Weight gate;  // [moe_intermediate, hidden]
  Weight up;    // [moe_intermediate, hidden]
  Weight down;  // [hidden, moe_intermediate]
  size_t nbytes() const { return gate.nbytes() + up.nbytes() + down.nbytes(); }
};

// Exact counters since construction or the last reset_stats(). A request is one (layer, expert)
// of a prepare(); it is a hit when no read had to be issued for it (resident, or already on its
// way from a prefetch), else a miss.
struct ExpertStoreStats {
  uint64_t requests = 0, hits = 0, misses = 0;
  uint64_t bytes_read = 0;         // payload bytes of experts read (misses and prefetches)
  uint64_t bytes_transferred = 0;  // bytes the reads really moved (block-aligned extents)
  uint64_t evictions = 0;
  uint64_t bytes_to_device = 0;    // device stores: bytes copied host -> device
  uint64_t host_hits = 0;          // device stores fed from disk: misses whose bytes were still in
                                   // the pinned host tier (copied, not read again)
  uint64_t prefetch_reads = 0;     // experts read ahead of need
  uint64_t prefetch_used = 0;      // ... and later requested before being evicted
  // Next-layer predictor: experts predicted, predicted and then requested, requested where a
  // prediction existed. precision = correct / predicted, recall = correct / actual.
  uint64_t predicted = 0, predicted_correct = 0, predicted_actual = 0;
  double stall_seconds = 0;        // time prepare()/await() spent waiting for reads or slots
                                   // (device stores: plus the time the compute stream waited
                                   // for copies)
  double read_seconds = 0;         // summed wall time of the read calls (over all I/O threads)

  double hit_rate() const { return requests ? double(hits) / double(requests) : 0.0; }
  ExpertStoreStats operator-(const ExpertStoreStats& o) const;
};

// The next-layer predictor's bookkeeping, shared by the streaming stores: a guess for `layer` is
// scored (precision/recall counters) against every prepare of that layer, then dropped when the
// forward pass moves on to another layer.
class PredictionLog {
 public:
  explicit PredictionLog(int n_layers) : guess_(size_t(n_layers)) {}
  // Records a guess for `layer`; returns it sorted, without repeats.
  const std::vector<int>& guess(int layer, std::vector<int> experts, ExpertStoreStats& s);
  void score(int layer, const std::vector<int>& experts, ExpertStoreStats& s);

 private:
  std::vector<std::vector<int>> guess_;  // [layer] last guess not yet scored
  int last_layer_ = -1;
};

class ExpertStore {
 public:
  virtual ~ExpertStore() = default;
  // The experts `experts` of MoE layer `layer` are about to run: make them available. Returns
  // them in the same order, ready; valid until the next prepare/prepare_async call.
  virtual std::vector<const ExpertWeights*> prepare(int layer, const std::vector<int>& experts) = 0;
  // As prepare(), but may return before the bytes have arrived: call await(i) before touching
  // the i-th returned expert. Lets the caller compute on expert i while later ones still load.
  virtual std::vector<const ExpertWeights*> prepare_async(int layer, const std::vector<int>& experts) {
    return prepare(layer, experts);
  }
  virtual void await(size_t i) {}
  // True when the i-th expert of the last prepare_async is already in memory: await(i) will not
  // wait. The forward pass runs those first, while the others are still on their way.
  virtual bool ready(size_t i) { return true; }
  // The most experts one prepare() can hold at once; a larger union must be asked for in chunks.
  virtual size_t max_experts_per_prepare() const { return std::numeric_limits<size_t>::max(); }
  // A hint: layer `layer` will probably ask for `experts` soon. Stores that stream start reads.
  virtual void prefetch(int layer, const std::vector<int>& experts) {}
  // True when prefetch() does something: the forward pass skips computing predictions otherwise.
  virtual bool wants_prefetch() const { return false; }
  // Bytes of expert weights this store holds in memory (resident: all; streaming: the pool).
  virtual size_t resident_bytes() const = 0;
  virtual ExpertStoreStats stats() const { return {}; }
  // Called once at load: a store whose experts stay put hands them to the backend now (a GPU
  // backend uploads them), so no decode step pays for a first use. Streaming stores keep their
  // slots in host memory and do nothing here.
  virtual void upload(Backend& backend) {}
  virtual void reset_stats() {}
  // Every expert of MoE layer `layer`, resident in backend memory after upload(): the forward
  // pass may then run them by id on the backend (no host round trip, so a decode step can be
  // recorded as a graph). Null for stores that stream.
  virtual const ExpertBank* bank(int layer) const { return nullptr; }
};

// Binds a linear layer's weight `prefix + ".weight"` (and, for F8_E4M3, its weight_scale_inv
// [ceil(out/128), ceil(in/128)]) from the checkpoint, checking shape and dtype.
Weight bind_weight(const Checkpoint& ck, const std::string& prefix, int64_t out, int64_t in);

// Where a model's routed experts are, in plain terms (src/experts does not know model configs):
// tensors `{layer_prefix}{L}.mlp.experts.{E}.{gate,up,down}_proj.weight` for L in moe_layers.
struct ExpertStoreParams {
  int n_layers = 0;             // model layers (indices run 0 .. n_layers-1)
  std::vector<int> moe_layers;  // layers with routed experts
  int n_experts = 0;            // routed experts per MoE layer
  int top_k = 0;                // experts per token
  int64_t hidden = 0, moe_intermediate = 0;
  std::string layer_prefix = "model.layers.";
};

enum class DirectIo { Auto, On, Off };

struct ExpertStoreOptions {
  // Routed-expert slots in the pool; 0 keeps every expert resident (no streaming).
  int64_t slots = 0;
  // Slots each MoE layer keeps against eviction by other layers; -1 picks
  // min(top_k, (slots - top_k) / n_moe_layers).
  int layer_floor = -1;
  // O_DIRECT reads (Auto: where the file system allows it, else buffered reads followed by
  // posix_fadvise(DONTNEED) so the page cache does not hold the model either way).
  DirectIo direct = DirectIo::Auto;
  int io_threads = 4;                  // reads in flight at once
  size_t read_chunk = size_t(8) << 20; // bytes per read call (a multiple of 4096)
  bool prefetch = false;               // act on prefetch() hints
  // Device stores (device_store.h): 0 keeps a pinned host copy of every expert; N > 0 reads
  // misses from disk through N pinned staging buffers instead.
  int64_t staging = 0;
};

class ResidentExpertStore final : public ExpertStore {
 public:
  ResidentExpertStore(const Checkpoint& ck, const ExpertStoreParams& p);
  std::vector<const ExpertWeights*> prepare(int layer, const std::vector<int>& experts) override;
  size_t resident_bytes() const override { return bytes_; }
  void upload(Backend& backend) override;
  const ExpertBank* bank(int layer) const override {
    return size_t(layer) < banks_.size() && !banks_[size_t(layer)].gate.empty() ? &banks_[size_t(layer)] : nullptr;
  }

 private:
  std::vector<std::vector<ExpertWeights>> experts_;  // [layer][expert]
  std::vector<ExpertBank> banks_;                    // [layer], filled by upload()
  size_t bytes_ = 0;
};

// Resident when options.slots == 0, else streaming with options.slots slots.
std::unique_ptr<ExpertStore> make_expert_store(const Checkpoint& ck, const ExpertStoreParams& p,
                                               const ExpertStoreOptions& o);

}  // namespace vireo
