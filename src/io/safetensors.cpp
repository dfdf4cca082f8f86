#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/json_file.h"

namespace vireo {

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string TensorInfo::shape_str() const { return shape_to_string(shape); }

Tensor TensorInfo::view() const {
  Tensor t;
  t.data = const_cast<void*>(data);  // mapped read-only; vireo never writes weights
  t.dtype = dtype;
  if (shape.size() > size_t(Tensor::kMaxDims)) fail("tensor ", name, ": ", shape.size(), " dims (at most 4 supported)");
  t.ndim = int(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  return t;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail(path, ": cannot open safetensors file: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail(path, ": cannot stat: ", std::strerror(errno));
  }
  size_ = size_t(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    fail(path, ": truncated safetensors file (", size_, " bytes, no header)");
  }
  void* const mapped = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;  // (before close may set it)
  ::close(fd);
  if (mapped == MAP_FAILED) fail(path, ": mmap failed: ", std::strerror(map_errno));
  map_.p = mapped;
  map_.n = size_;
  const uint8_t* base = static_cast<const uint8_t*>(mapped);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(base[i]) << (8 * i);
  if (header_len > size_ - 8)
    fail(path, ": truncated safetensors file (header claims ", header_len, " bytes, file has ", size_, ")");
  Json header;
  try {
    header = Json::parse(base + 8, base + 8 + header_len);
  } catch (const Json::exception&) {
    fail(path, ": malformed safetensors header (invalid JSON)");
  }
  if (!header.is_object()) fail(path, ": malformed safetensors header (not a JSON object)");
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = size_ - data_start;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const Json& e = it.value();
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      fail(path, ": tensor ", name, ": header entry needs dtype, shape and data_offsets");
    TensorInfo info;
    info.name = name;
    info.file = path;
    if (!e["dtype"].is_string()) fail(path, ": tensor ", name, ": dtype is not a string");
    std::string dt = e["dtype"].get<std::string>();
    if (!parse_dtype(dt, &info.dtype))
      fail(path, ": tensor ", name, ": unknown dtype ", dt, " (expected F32, BF16, F16, F8_E4M3, I32, I64, U8 or F64)");
    if (!e["shape"].is_array()) fail(path, ": tensor ", name, ": shape is not an array");
    uint64_t numel = 1;
    for (const Json& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        fail(path, ": tensor ", name, ": shape has a non-integer or negative dimension");
      info.shape.push_back(d.get<int64_t>());
      if (info.shape.back() > 0 && numel > (uint64_t(1) << 62) / uint64_t(info.shape.back()))
        fail(path, ": tensor ", name, ": shape too large");
      numel *= uint64_t(info.shape.back());
    }
    const Json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(path, ": tensor ", name, ": data_offsets must be two non-negative integers");
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (b > en) fail(path, ": tensor ", name, ": data_offsets [", b, ", ", en, "] are reversed");
    if (en > data_size)
      fail(path, ": truncated safetensors file: tensor ", name, " ends at byte ", data_start + en,
           " but the file has ", size_, " bytes");
    uint64_t expect = numel * dtype_size(info.dtype);
    if (en - b != expect)
      fail(path, ": tensor ", name, ": ", en - b, " bytes for shape ", info.shape_str(), " ", dt,
           " (expected ", expect, ")");
    info.data = base + data_start + b;
    info.nbytes = size_t(expect);
    info.file_offset = data_start + b;
    tensors_.emplace(name, std::move(info));
  }
}

SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile::Mapping::~Mapping() {
  if (p) ::munmap(p, n);
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

const TensorInfo& Checkpoint::require(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorInfo* t = find(name);
  if (!t) fail(dir_, ": missing tensor ", name, " (expected shape ", shape_to_string(shape), ")");
  if (t->shape != shape)
    fail(dir_, ": tensor ", name, " has shape ", t->shape_str(), ", expected ", shape_to_string(shape));
  return *t;
}

std::unique_ptr<Checkpoint> Checkpoint::open(const std::string& dir) {
  auto ck = std::make_unique<Checkpoint>();
  ck->dir_ = dir;
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) fail(dir, ": not a model directory");
  std::vector<std::string> shard_files;
  const std::string index_path = dir + "/model.safetensors.index.json";
  Json weight_map;
  if (file_exists(index_path)) {
    Json index = read_json_file(index_path);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      fail(index_path, ": field weight_map missing or not an object");
    weight_map = index["weight_map"];
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
      if (!it.value().is_string()) fail(index_path, ": weight_map[", it.key(), "] is not a file name");
      std::string f = it.value().get<std::string>();
      if (f.find('/') != std::string::npos) fail(index_path, ": weight_map[", it.key(), "] names a path outside the directory: ", f);
      if (std::find(shard_files.begin(), shard_files.end(), f) == shard_files.end()) shard_files.push_back(f);
    }
  } else if (file_exists(dir + "/model.safetensors")) {
    shard_files.push_back("model.safetensors");
  } else {
    if (DIR* d = ::opendir(dir.c_str())) {
      while (dirent* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n.size() > 12 && n.substr(n.size() - 12) == ".safetensors") shard_files.push_back(n);
      }
      ::closedir(d);
    }
    std::sort(shard_files.begin(), shard_files.end());
    if (shard_files.empty()) fail(dir, ": no model.safetensors, model.safetensors.index.json or *.safetensors file");
  }
  for (const std::string& f : shard_files) {
    const std::string path = dir + "/" + f;
    if (!file_exists(path)) fail(index_path, ": shard ", f, " listed in weight_map does not exist");
    ck->files_.push_back(std::make_unique<SafetensorsFile>(path));
    for (const auto& [name, info] : ck->files_.back()->tensors()) {
      if (ck->tensors_.count(name)) fail(path, ": tensor ", name, " also appears in ", ck->tensors_[name]->file);
      ck->tensors_[name] = &info;
    }
  }
  if (!weight_map.is_null()) {
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
      const TensorInfo* t = ck->find(it.key());
      if (!t) fail(index_path, ": tensor ", it.key(), " listed in weight_map is missing from ", it.value().get<std::string>());
    }
  }
  return ck;
}

std::unique_ptr<Checkpoint> Checkpoint::in_memory(const std::string& name) {
  auto ck = std::make_unique<Checkpoint>();
  ck->dir_ = name;
  return ck;
}

void* Checkpoint::add_tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape) {
  if (tensors_.count(name)) fail(dir_, ": tensor ", name, " added twice");
  size_t numel = 1;
  for (int64_t d : shape) numel *= size_t(d);
  owned_data_.emplace_back(numel * dtype_size(dtype));
  TensorInfo info;
  info.name = name;
  info.file = dir_;
  info.dtype = dtype;
  info.shape = shape;
  info.data = owned_data_.back().data();
  info.nbytes = numel * dtype_size(dtype);
  owned_infos_.push_back(std::move(info));
  tensors_[name] = &owned_infos_.back();
  return owned_data_.back().data();
}

}  // namespace vireo
