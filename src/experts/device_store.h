#pragma once
// DeviceExpertStore: routed experts in a fixed pool of device slots (one device allocation of
// slots x slot_bytes) under a GPU memory budget; misses are copied host -> device on the
// TransferLink's own stream, and the compute stream waits only for the expert it is about to use.
//
// Device slots use a packed layout (every tensor 256-byte aligned, as the GPU kernels' vector
// loads need) whatever the host side's layout is; a miss is one copy per tensor, all on one
// stream, its ticket the last one's.
//
// Where the host bytes come from:
//   host copy (staging == 0): every expert, read once at startup into pinned host memory (disk
//       checkpoints with the ExpertReader, in-memory ones by memcpy); a miss is one copy.
//   host tier (staging > 0, disk checkpoints): `staging` pinned host slots, for models whose
//       experts do not fit in host RAM. A miss whose expert is still in a host slot is one copy
//       (a host-tier hit); otherwise it is read from disk into the least recently used free host
//       slot on the reader's threads, then copied to its device slot. With few host slots this
//       is a staging ring; with most of RAM it keeps the experts read last, so only misses of
//       both tiers go to disk.
//
// Slot policy and pinning are the SlotPool's, as in the host StreamingExpertStore: LRU over one
// global pool with a per-layer floor; what a prepare returns stays pinned until the next one; a
// slot whose bytes are still being read from disk is busy. Before a copy overwrites a slot whose
// previous expert may still be read by queued kernels, the link orders the copy after them.
//
// Threading: the forward pass calls everything, stats() included, on one thread (every call into
// the link happens there); the reader's threads only mark staging reads done under the mutex.
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/transfer_link.h"
#include "experts/expert_layout.h"
#include "experts/expert_reader.h"
#include "experts/expert_store.h"
#include "experts/slot_pool.h"

namespace vireo {

class DeviceExpertStore final : public ExpertStore {
 public:
  // In-memory checkpoints need staging == 0.
  DeviceExpertStore(const Checkpoint& ck, const ExpertStoreParams& p, const ExpertStoreOptions& o,
                    std::shared_ptr<TransferLink> link);
  ~DeviceExpertStore() override;

  std::vector<const ExpertWeights*> prepare(int layer, const std::vector<int>& experts) override;
  std::vector<const ExpertWeights*> prepare_async(int layer, const std::vector<int>& experts) override;
  void await(size_t i) override;
  bool ready(size_t i) override;
  // Starts the copies of the guessed experts of `layer` that are not in slots yet (into free
  // slots or `layer`'s own least recently used ones), so they overlap the compute before it.
  void prefetch(int layer, const std::vector<int>& experts) override;
  bool wants_prefetch() const override { return opts_.prefetch; }
  size_t max_experts_per_prepare() const override { return size_t(pool_.max_per_prepare()); }
  // Device bytes of the slot pool.
  size_t resident_bytes() const override { return arena_bytes_; }
  ExpertStoreStats stats() const override;
  void reset_stats() override;

  int64_t slots() const { return pool_.size(); }
  int layer_floor() const { return pool_.floor(); }
  uint64_t slot_bytes() const { return dev_layout_.slot_bytes(); }        // one device slot
  uint64_t host_slot_bytes() const { return layout_.slot_bytes(); }      // one expert in pinned memory
  bool host_copy() const { return staging_.empty(); }
  int64_t staging_buffers() const { return int64_t(staging_.size()); }
  uint64_t pinned_bytes() const { return pinned_bytes_; }
  const ExpertLayout& layout() const { return layout_; }
  int64_t slot_of(int layer, int expert) const { return pool_.find(layer, expert); }
  // Pinned host-to-device bandwidth in GB/s, measured now by the link.
  double measure_link_gbs(size_t bytes = size_t(1) << 30) { return link_.measure_gbs(bytes); }

 private:
  struct Staging {
    int64_t slot = -1;               // device slot being filled, or -1
    bool reading = false, read_done = false;
    std::string error;
    TransferLink::Ticket ticket = 0; // last copy out of this buffer (reuse after it lands)
    int layer = -1, expert = -1;     // whose bytes it holds (or is reading); -1: none
    bool valid = false;              // the read finished without error: the bytes can be copied
    uint64_t last_use = 0;
  };
  void fill_host_copy(const Checkpoint& ck);
  int64_t claim(int layer, int expert);
  // Before the first copy into a slot that held an expert: order the copies after the compute
  // queued so far (kernels may still read the old expert). Once per prepare/prefetch.
  void order_reuse(int64_t slot, bool& ordered);
  void start_miss(int64_t slot, int layer, int expert);
  // Queues the copies of one expert's tensors from its host image to its device slot.
  TransferLink::Ticket copy_expert(int64_t slot, const char* src);
  int64_t take_staging();
  // The host slot holding (layer, expert)'s bytes, or -1; and its index in host_slot_of_.
  size_t host_key(int layer, int expert) const;
  void forget_host_slot(int64_t b);
  int64_t free_staging();  // a staging buffer free now, or -1
  // Issues the copies of staging reads that have finished (forward thread).
  void pump();
  void wait_for_a_read();
  char* host_image(int layer, int expert) const;

  ExpertStoreOptions opts_;
  std::shared_ptr<TransferLink> link_holder_;
  TransferLink& link_;
  ExpertLayout layout_;      // host side: the checkpoint's extents (or packed, in memory)
  ExpertLayout dev_layout_;  // device slots: packed
  SlotPool pool_;
  std::vector<int> moe_index_;          // [layer] -> index among MoE layers, or -1
  std::shared_ptr<char> arena_;         // device slots
  size_t arena_bytes_ = 0;
  std::shared_ptr<char> pinned_;        // host copy, or the staging buffers
  uint64_t pinned_bytes_ = 0;
  std::vector<ExpertWeights> weights_;  // [slot] device views
  std::vector<TransferLink::Ticket> ticket_;  // [slot] the copy that filled it
  std::vector<int64_t> staging_of_;     // [slot] staging buffer being read for it, or -1
  std::vector<std::string> errors_;     // [slot] read error
  std::vector<Staging> staging_;
  std::vector<int64_t> host_slot_of_;   // [moe layer index x n_experts + expert] -> host slot, or -1
  uint64_t host_clock_ = 0;             // LRU clock of the host slots
  std::vector<int64_t> current_;        // slots of the last prepare, in its order
  PredictionLog predictions_;
  mutable std::mutex mu_;               // staging_[*].read_done / error, disk_*
  std::condition_variable cv_;
  ExpertStoreStats stats_;              // forward thread only
  uint64_t disk_bytes_ = 0;             // staging reads: bytes moved, seconds in read calls
  double disk_seconds_ = 0;
  double link_stall_base_ = 0;
  std::unique_ptr<ExpertReader> reader_;  // staging only; destroyed first (see the destructor)
};

}  // namespace vireo
