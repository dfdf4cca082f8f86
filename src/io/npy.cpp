#include "io/npy.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace vireo {

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  std::string dims;
  int64_t n = 1;
  for (int64_t d : shape) {
    dims += std::to_string(d) + ", ";
    n *= d;
  }
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  size_t total = 10 + header.size() + 1;
  header += std::string((64 - total % 64) % 64, ' ') + "\n";
  std::ofstream out(path, std::ios::binary);
  if (!out) fail(path, ": cannot open for writing");
  const char magic[] = "\x93NUMPY\x01\x00";
  out.write(magic, 8);
  uint16_t hl = uint16_t(header.size());
  out.put(char(hl & 0xff));
  out.put(char(hl >> 8));
  out.write(header.data(), std::streamsize(header.size()));
  out.write(reinterpret_cast<const char*>(data), std::streamsize(n * 4));
  if (!out) fail(path, ": write failed");
}

NpyArray read_npy_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open");
  char magic[10];
  in.read(magic, 10);
  if (!in || std::memcmp(magic, "\x93NUMPY", 6) != 0) fail(path, ": not a .npy file");
  uint32_t hl = uint8_t(magic[8]) | (uint32_t(uint8_t(magic[9])) << 8);
  if (magic[6] != 1) {  // version 2/3: 4-byte header length
    char more[2];
    in.read(more, 2);
    hl |= (uint32_t(uint8_t(more[0])) << 16) | (uint32_t(uint8_t(more[1])) << 24);
  }
  std::string header(hl, '\0');
  in.read(header.data(), hl);
  if (header.find("'<f4'") == std::string::npos) fail(path, ": expected float32 ('<f4') data");
  if (header.find("'fortran_order': False") == std::string::npos) fail(path, ": expected C order");
  auto lp = header.find("'shape': (");
  auto rp = header.find(')', lp);
  if (lp == std::string::npos || rp == std::string::npos) fail(path, ": no shape in header");
  NpyArray arr;
  std::stringstream ss(header.substr(lp + 10, rp - lp - 10));
  std::string tok;
  int64_t n = 1;
  while (std::getline(ss, tok, ',')) {
    if (tok.find_first_not_of(' ') == std::string::npos) continue;
    arr.shape.push_back(std::stoll(tok));
    n *= arr.shape.back();
  }
  arr.data.resize(size_t(n));
  in.read(reinterpret_cast<char*>(arr.data.data()), std::streamsize(n * 4));
  if (!in) fail(path, ": truncated data");
  return arr;
}

}  // namespace vireo
