#pragma once
// Where each routed expert's bytes sit in the checkpoint files, and where they go in a slot.
// An expert is 3 tensors (6 with FP8 block scales); tensors that lie close together in one file
// are merged into one extent, and every extent is widened to 4096-byte boundaries so it can be
// read with O_DIRECT in a few large calls. All experts of a model get slots of one size: the
// largest expert's extents, each starting 4096-aligned in the slot.
#include <cstdint>
#include <string>
#include <vector>

#include "experts/expert_store.h"

namespace vireo {

constexpr size_t kIoAlign = 4096;
constexpr size_t kPackAlign = 256;

struct ExpertExtent {
  int file = 0;             // index into ExpertLayout::files
  uint64_t file_offset = 0; // aligned down to kIoAlign
  uint64_t length = 0;      // aligned up to kIoAlign (may run past the end of the file)
  uint64_t slot_offset = 0; // where it lands in the slot (kIoAlign-aligned)
};

// One tensor of an expert: the bytes at slot_offset in the slot, viewed as `view` describes
// (view.data is null; add the slot base).
struct ExpertPiece {
  Tensor view;
  uint64_t slot_offset = 0;
  const void* src = nullptr;  // packed layouts: the tensor's bytes in memory
};

struct ExpertRecord {
  std::vector<ExpertExtent> extents;
  ExpertPiece pieces[6];  // gate.w, gate.scale, up.w, up.scale, down.w, down.scale (scales may be empty)
  uint64_t payload_bytes = 0;   // sum of the tensors' bytes
  uint64_t transfer_bytes = 0;  // sum of extents' lengths (packed: the slot bytes in use)
};

class ExpertLayout {
 public:
  // Validates every expert's tensors (shape, dtype) as bind_weight does. Fails for checkpoints
  // that are not on disk (in-memory synthetic ones) unless `packed`: then no extents, the
  // tensors lie back to back in the slot (kPackAlign-aligned) and are copied from memory.
  ExpertLayout(const Checkpoint& ck, const ExpertStoreParams& p, bool packed = false);

  const ExpertStoreParams& params() const { return p_; }
  const std::vector<std::string>& files() const { return files_; }
  bool packed() const { return packed_; }
  const ExpertRecord& record(int layer, int expert) const {
    return records_[size_t(layer) * size_t(p_.n_experts) + size_t(expert)];
  }
  uint64_t slot_bytes() const { return slot_bytes_; }
  // Payload bytes of the largest expert.
  uint64_t expert_bytes() const { return expert_bytes_; }
  // The expert's weights inside a slot starting at `base`.
  ExpertWeights bind(int layer, int expert, char* base) const;

 private:
  ExpertStoreParams p_;
  std::vector<std::string> files_;
  std::vector<ExpertRecord> records_;  // [layer * n_experts + expert]; empty for dense layers
  uint64_t slot_bytes_ = 0, expert_bytes_ = 0;
  bool packed_ = false;
};

// Slot size for experts of these shapes and dtype, without a checkpoint (the memory plan of a
// model whose layout is not known yet): each tensor padded by two blocks for alignment.
uint64_t estimate_slot_bytes(uint64_t payload_bytes);

}  // namespace vireo
