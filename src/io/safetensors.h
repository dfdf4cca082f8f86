#pragma once
// Safetensors files, memory-mapped read-only, and checkpoint directories (one model.safetensors
// or shards listed by model.safetensors.index.json). Every header entry is validated on open
// (known dtype, offsets inside the file, byte size = numel * dtype size), so later code can trust
// any TensorInfo it gets.
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace vireo {

struct TensorInfo {
  std::string name;
  std::string file;  // the shard it lives in
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // inside the mapping
  size_t nbytes = 0;
  uint64_t file_offset = 0;  // byte offset of the data in `file` (for pread-based streaming)

  std::string shape_str() const;
  // A Tensor view of the mapped bytes (at most 4 dims).
  Tensor view() const;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  size_t file_size() const { return size_; }

 private:
  // The file's read-only mapping, unmapped by its own destructor: a member's destructor also runs
  // when the constructor throws on a bad header, where ~SafetensorsFile does not (each refused
  // file used to keep its mapping: a 200x fuzz campaign ran out of mappings).
  struct Mapping {
    void* p = nullptr;
    size_t n = 0;
    Mapping() = default;
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping();
  };
  std::string path_;
  Mapping map_;
  size_t size_ = 0;
  std::map<std::string, TensorInfo> tensors_;
};

class Checkpoint {
 public:
  // Opens a checkpoint directory: model.safetensors.index.json if present, else
  // model.safetensors, else every *.safetensors file in the directory.
  static std::unique_ptr<Checkpoint> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorInfo* find(const std::string& name) const;
  // The tensor `name`, which must exist and have exactly `shape`; errors name the tensor.
  const TensorInfo& require(const std::string& name, const std::vector<int64_t>& shape) const;
  const std::map<std::string, const TensorInfo*>& tensors() const { return tensors_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

  // A checkpoint held in memory (synthetic models for benchmarks and tests): add_tensor
  // allocates zeroed, 64-byte aligned storage owned by the checkpoint and returns it.
  static std::unique_ptr<Checkpoint> in_memory(const std::string& name);
  void* add_tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape);

 private:
  std::deque<TensorInfo> owned_infos_;
  std::deque<HostBuffer> owned_data_;
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> tensors_;
};

std::string shape_to_string(const std::vector<int64_t>& shape);

}  // namespace vireo
