#include "io/npy.h"

#include <charconv>

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
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail(path, ": cannot open");
  const uint64_t file_bytes = uint64_t(in.tellg());
  in.seekg(0);
  char magic[10];
  in.read(magic, 10);
  if (!in || std::memcmp(magic, "\x93NUMPY", 6) != 0) fail(path, ": not a .npy file");
  uint64_t hl = uint8_t(magic[8]) | (uint32_t(uint8_t(magic[9])) << 8), at = 10;
  if (magic[6] != 1) {  // version 2/3: 4-byte header length
    char more[2];
    in.read(more, 2);
    if (!in) fail(path, ": truncated header");
    hl |= (uint32_t(uint8_t(more[0])) << 16) | (uint32_t(uint8_t(more[1])) << 24);
    at = 12;
  }
  if (at + hl > file_bytes) fail(path, ": header length ", hl, " runs past the end of the file (", file_bytes, " bytes)");
  std::string header(hl, '\0');
  in.read(header.data(), std::streamsize(hl));
  if (header.find("'<f4'") == std::string::npos) fail(path, ": expected float32 ('<f4') data");
  if (header.find("'fortran_order': False") == std::string::npos) fail(path, ": expected C order");
  auto lp = header.find("'shape': (");
  auto rp = lp == std::string::npos ? lp : header.find(')', lp);
  if (lp == std::string::npos || rp == std::string::npos) fail(path, ": no shape in header");
  NpyArray arr;
  std::stringstream ss(header.substr(lp + 10, rp - lp - 10));
  std::string tok;
  // Elements, checked against what the file holds as they multiply (no overflow).
  const uint64_t avail = file_bytes - (at + hl), max_elems = avail / 4;
  uint64_t n = 1;
  bool zero = false, too_big = false;
  while (std::getline(ss, tok, ',')) {
    const size_t b = tok.find_first_not_of(' '), e = tok.find_last_not_of(' ');
    if (b == std::string::npos) continue;
    int64_t d = -1;
    const auto r = std::from_chars(tok.data() + b, tok.data() + e + 1, d);
    if (r.ec != std::errc() || r.ptr != tok.data() + e + 1 || d < 0)
      fail(path, ": shape entry '", tok, "' is not a non-negative integer");
    arr.shape.push_back(d);
    if (d == 0) zero = true;
    else if (n > max_elems / uint64_t(d)) too_big = true;
    else n *= uint64_t(d);
  }
  if (zero) n = 0;
  else if (too_big || n > max_elems) fail(path, ": truncated data (the shape needs more than the ", avail, " bytes after the header)");
  arr.data.resize(size_t(n));
  in.read(reinterpret_cast<char*>(arr.data.data()), std::streamsize(n * 4));
  if (!in) fail(path, ": truncated data");
  return arr;
}

}  // namespace vireo
