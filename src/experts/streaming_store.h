#pragma once
// StreamingExpertStore: routed experts live in a fixed pool of slots (one anonymous mapping of
// slots x slot_bytes, allocated once); a miss reads the expert's extents from the checkpoint
// files into a slot on the reader's threads. Never touches the checkpoint's mapping for expert
// bytes, so the page cache and RSS hold only the pool.
//
// Threading: the forward pass calls prepare/await/prefetch on one thread; reads complete on the
// reader's threads, which only flip a slot from busy to ready under the store's mutex.
//
// Slot ownership: every slot handed out by a prepare is pinned until the next prepare, so a
// prepare never evicts what it (or the previous one) returned; slots being read are busy and
// never evicted. max_experts_per_prepare() = slots - (moe_layers - 1) x floor is what one
// prepare can always get; the model runs larger unions in chunks of that size.
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "experts/expert_layout.h"
#include "experts/expert_reader.h"
#include "experts/expert_store.h"
#include "experts/slot_pool.h"

namespace vireo {

class StreamingExpertStore final : public ExpertStore {
 public:
  StreamingExpertStore(const Checkpoint& ck, const ExpertStoreParams& p, const ExpertStoreOptions& o);
  ~StreamingExpertStore() override;

  std::vector<const ExpertWeights*> prepare(int layer, const std::vector<int>& experts) override;
  std::vector<const ExpertWeights*> prepare_async(int layer, const std::vector<int>& experts) override;
  void await(size_t i) override;
  bool ready(size_t i) override;
  size_t max_experts_per_prepare() const override { return size_t(pool_.max_per_prepare()); }
  void prefetch(int layer, const std::vector<int>& experts) override;
  bool wants_prefetch() const override { return opts_.prefetch; }
  size_t resident_bytes() const override { return arena_bytes_; }
  ExpertStoreStats stats() const override;
  void reset_stats() override;

  int64_t slots() const { return pool_.size(); }
  int layer_floor() const { return pool_.floor(); }
  uint64_t slot_bytes() const { return layout_.slot_bytes(); }
  bool direct_io() const { return reader_->direct(); }
  const ExpertLayout& layout() const { return layout_; }
  // The slot holding (layer, expert), or -1 (tests).
  int64_t slot_of(int layer, int expert) const;

  // Disk read bandwidth in GB/s as the streaming path sees it: `n` distinct random experts read
  // with the same threads and chunking into temporary buffers (not the pool), `batch` at a time.
  double measure_read_gbs(int n, int batch = 8, uint64_t seed = 1);

 private:
  int64_t claim(int layer, int expert, std::unique_lock<std::mutex>& lock);
  void start_read(int64_t slot, int layer, int expert, bool urgent);

  ExpertStoreOptions opts_;
  ExpertLayout layout_;
  SlotPool pool_;
  char* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  std::vector<ExpertWeights> weights_;  // [slot]
  std::vector<std::string> errors_;     // [slot] read error, if any
  std::vector<int64_t> current_;        // slots of the last prepare, in its order
  PredictionLog predictions_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  ExpertStoreStats stats_;
  // Last member: destroyed first, so its threads stop before the state their callbacks touch.
  std::unique_ptr<ExpertReader> reader_;
};

}  // namespace vireo
