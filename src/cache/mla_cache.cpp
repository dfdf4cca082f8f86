#include "cache/mla_cache.h"

#include "core/error.h"

namespace vireo {

size_t MlaCache::bytes_per_token(const MlaCacheShape& s) {
  size_t n = 0;
  for (int l = 0; l < s.n_layers; ++l) n += size_t(s.kv_dim) + (s.has_index[size_t(l)] ? size_t(s.index_dim) : 0);
  return n * sizeof(float);
}

MlaCache::MlaCache(Backend& backend, const MlaCacheShape& shape, int rows, int64_t capacity)
    : shape_(shape), rows_(rows), capacity_(capacity), length_(size_t(rows), 0) {
  if (rows <= 0 || capacity <= 0) fail("cache: rows and capacity must be positive");
  VIREO_ASSERT(int(shape.has_index.size()) == shape.n_layers);
  for (int l = 0; l < shape.n_layers; ++l) {
    size_t n = size_t(rows) * size_t(capacity) * size_t(shape.kv_dim);
    kv_.push_back(backend.alloc_f32(n));
    bytes_ += n * sizeof(float);
    if (shape.has_index[size_t(l)]) {
      size_t m = size_t(rows) * size_t(capacity) * size_t(shape.index_dim);
      index_.push_back(backend.alloc_f32(m));
      bytes_ += m * sizeof(float);
    } else {
      index_.push_back(nullptr);
    }
  }
}

void MlaCache::set_length(int row, int64_t n) {
  if (n < 0 || n > capacity_) fail("cache: length ", n, " exceeds the context capacity ", capacity_);
  length_[size_t(row)] = n;
}

void MlaCache::trim(int row, int64_t n) {
  if (n < 0 || n > length_[size_t(row)]) fail("cache: cannot trim row ", row, " of length ", length_[size_t(row)], " to ", n);
  length_[size_t(row)] = n;
}

float* MlaCache::kv(int layer, int row) const {
  return kv_[size_t(layer)].get() + size_t(row) * size_t(capacity_) * size_t(shape_.kv_dim);
}

float* MlaCache::index_keys(int layer, int row) const {
  if (!index_[size_t(layer)]) return nullptr;
  return index_[size_t(layer)].get() + size_t(row) * size_t(capacity_) * size_t(shape_.index_dim);
}

size_t MlaCache::bytes_in_use() const {
  size_t tokens = 0;
  for (int64_t n : length_) tokens += size_t(n);
  return tokens * bytes_per_token(shape_);
}

}  // namespace vireo
