#pragma once
// Tensor: a non-owning, contiguous, row-major view (dtype, shape, device, pointer).
// Owning storage lives elsewhere: mmap'd checkpoint files (io), HostBuffer below, or a backend's
// device allocations.
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace vireo {

enum class Device : uint8_t { CPU, CUDA };

struct Tensor {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};

  Tensor() = default;
  Tensor(void* data_, DType dtype_, std::initializer_list<int64_t> dims, Device dev = Device::CPU)
      : data(data_), dtype(dtype_), device(dev) {
    VIREO_ASSERT(dims.size() <= kMaxDims);
    for (int64_t d : dims) shape[ndim++] = d;
  }

  bool empty() const { return data == nullptr; }
  // dim(-1) is the last dimension.
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  template <typename T> T* ptr() const { return static_cast<T*>(data); }
  float* f32() const { return static_cast<float*>(data); }
  std::string shape_str() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
  // Rows [r0, r0 + n) along the first dimension.
  Tensor rows(int64_t r0, int64_t n) const {
    Tensor t = *this;
    size_t row_bytes = ndim > 0 && shape[0] ? nbytes() / size_t(shape[0]) : 0;
    t.data = static_cast<char*>(data) + size_t(r0) * row_bytes;
    t.shape[0] = n;
    return t;
  }
  Tensor reshaped(std::initializer_list<int64_t> dims) const {
    Tensor t(data, dtype, dims, device);
    VIREO_ASSERT(t.numel() == numel());
    return t;
  }
};

// A 64-byte aligned host allocation of f32 (or any dtype) values, zero-initialized.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t bytes) { resize(bytes); }
  void resize(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    ptr_.reset(rounded ? static_cast<char*>(std::aligned_alloc(64, rounded)) : nullptr);
    if (rounded && !ptr_) fail("out of memory allocating ", bytes, " bytes");
    if (rounded) std::memset(ptr_.get(), 0, rounded);
    bytes_ = bytes;
  }
  void* data() const { return ptr_.get(); }
  size_t bytes() const { return bytes_; }
  Tensor view(DType dtype, std::initializer_list<int64_t> dims) const {
    Tensor t(ptr_.get(), dtype, dims);
    VIREO_ASSERT(t.nbytes() <= bytes_);
    return t;
  }

 private:
  struct Free { void operator()(char* p) const { std::free(p); } };
  std::unique_ptr<char, Free> ptr_;
  size_t bytes_ = 0;
};

}  // namespace vireo
