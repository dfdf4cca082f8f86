#pragma once
// NumPy .npy files (format 1.0), float32 little-endian, C order.
#include <cstdint>
#include <string>
#include <vector>

namespace vireo {

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
};
// Reads a float32 (<f4) C-order .npy; anything else is an Error naming the file.
NpyArray read_npy_f32(const std::string& path);

}  // namespace vireo
