#pragma once
// The MLA cache: per layer, per row (one row per sequence), per position, the compressed
// [latent (kv_lora) | k_rope (qk_rope)] entry, plus the DSA indexer key on layers that run their
// own indexer. Per-head keys and values are never cached (spec §3.1). Rows have independent
// lengths so a batch of sequences can share one cache; trim() rolls a row back (speculative
// decoding, retries).
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"

namespace vireo {

struct MlaCacheShape {
  int n_layers = 0;
  int64_t kv_dim = 0;            // kv_lora_rank + qk_rope_head_dim
  int64_t index_dim = 0;         // indexer head dim (0: no indexer)
  std::vector<bool> has_index;   // [n_layers]: layer stores indexer keys
};

class MlaCache {
 public:
  // Allocates rows x capacity positions for every layer through `backend` (f32 entries).
  MlaCache(Backend& backend, const MlaCacheShape& shape, int rows, int64_t capacity);

  int rows() const { return rows_; }
  int64_t capacity() const { return capacity_; }
  // Unique per cache object over the process lifetime (a new cache may reuse a freed one's
  // addresses; this tells them apart).
  uint64_t id() const { return id_; }
  const MlaCacheShape& shape() const { return shape_; }
  int64_t length(int row) const { return length_[size_t(row)]; }
  void set_length(int row, int64_t n);
  // Drops positions >= n of `row` (n <= length).
  void trim(int row, int64_t n);
  void reset(int row) { trim(row, 0); }

  float* kv(int layer, int row) const;           // [capacity, kv_dim]
  float* index_keys(int layer, int row) const;   // [capacity, index_dim]; null if the layer has none

  // Bytes allocated (exact), and bytes holding live entries.
  size_t bytes_allocated() const { return bytes_; }
  size_t bytes_in_use() const;
  // Bytes one position of one row takes across all layers.
  static size_t bytes_per_token(const MlaCacheShape& shape);

 private:
  uint64_t id_ = next_id();
  static uint64_t next_id() {
    static std::atomic<uint64_t> n{0};
    return ++n;
  }
  MlaCacheShape shape_;
  int rows_;
  int64_t capacity_;
  std::vector<int64_t> length_;
  std::vector<std::shared_ptr<float>> kv_, index_;  // [layer]
  size_t bytes_ = 0;
};

}  // namespace vireo
