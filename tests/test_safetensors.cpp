// Safetensors parsing and checkpoint directories: valid files load, every malformed file is an
// Error naming the file, never a crash.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "io/json_file.h"
#include "io/npy.h"
#include "io/safetensors.h"
#include "test_helpers.h"

using namespace vireo;
using namespace vireo::test;

namespace {

// header JSON text + data bytes -> file bytes
std::string pack(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string valid_data() {
  std::string d(24, '\0');
  float a[4] = {1, 2, 3, 4};
  std::memcpy(d.data(), a, 16);
  uint16_t b[4] = {0x3f80, 0x4000, 0x4040, 0x4080};  // bf16 1, 2, 3, 4
  std::memcpy(d.data() + 16, b, 8);
  return d;
}

const char* kValidHeader =
    R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},)"
    R"( "b": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]}, "__metadata__": {"format": "pt"}})";

std::string open_error(const std::string& bytes) {
  TempDir d("st");
  write_file(d / "x.safetensors", bytes);
  try {
    SafetensorsFile f(d / "x.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, ReadsValidFile) {
  TempDir d("st");
  write_file(d / "model.safetensors", pack(kValidHeader, valid_data()));
  auto ck = Checkpoint::open(d.str());
  const TensorInfo& a = ck->require("a", {2, 2});
  EXPECT_EQ(a.dtype, DType::F32);
  float a3;  // (memcpy: this file's data is not 4-byte aligned)
  std::memcpy(&a3, static_cast<const char*>(a.data) + 12, 4);
  EXPECT_EQ(a3, 4.0f);
  const TensorInfo& b = ck->require("b", {4});
  uint16_t b2;
  std::memcpy(&b2, static_cast<const char*>(b.data) + 4, 2);
  EXPECT_EQ(bf16_to_f32(b2), 3.0f);
  EXPECT_EQ(b.file_offset, 8 + std::strlen(kValidHeader) + 16);
}

TEST(Safetensors, RequireNamesTensorAndShape) {
  TempDir d("st");
  write_file(d / "model.safetensors", pack(kValidHeader, valid_data()));
  auto ck = Checkpoint::open(d.str());
  try {
    ck->require("a", {4, 1});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor a has shape [2, 2], expected [4, 1]"), std::string::npos) << e.what();
  }
  try {
    ck->require("missing.weight", {3});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing tensor missing.weight"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, MalformedFilesAreErrors) {
  const std::string data = valid_data();
  EXPECT_NE(open_error("abc").find("truncated"), std::string::npos);
  EXPECT_NE(open_error(pack(kValidHeader, data).substr(0, 40)).find("truncated"), std::string::npos);
  EXPECT_NE(open_error(pack(kValidHeader, data.substr(0, 20))).find("truncated"), std::string::npos);
  EXPECT_NE(open_error(pack("{not json", data)).find("invalid JSON"), std::string::npos);
  EXPECT_NE(open_error(pack(R"({"a": {"dtype": "Q4_K", "shape": [2, 2], "data_offsets": [0, 16]}})", data))
                .find("unknown dtype Q4_K"), std::string::npos);
  EXPECT_NE(open_error(pack(R"({"a": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 16]}})", data))
                .find("expected 24"), std::string::npos);
  EXPECT_NE(open_error(pack(R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}})", data))
                .find("reversed"), std::string::npos);
  EXPECT_NE(open_error(pack(R"({"a": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}})", data))
                .find("negative"), std::string::npos);
  EXPECT_NE(open_error(pack("[1, 2]", data)).find("not a JSON object"), std::string::npos);
  // (a number past double's range: nlohmann's out_of_range, not parse_error)
  EXPECT_NE(open_error(pack(R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 1e999]}})", data))
                .find("invalid JSON"),
            std::string::npos);
}

// read_json_file names the file for every JSON it cannot read, a number past double's range too.
TEST(JsonFile, UnreadableJsonNamesTheFile) {
  TempDir d("json");
  for (const std::string text : {"{\"a\": ", "{\"a\": 1e800}"}) {
    write_file(d / "x.json", text);
    try {
      read_json_file(d / "x.json");
      ADD_FAILURE() << text << ": read";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("x.json: malformed JSON"), std::string::npos) << e.what();
    }
  }
}

// A refused file leaves nothing mapped: its mapping goes when the constructor throws. (It used to
// stay, one a refused file, until a 200x fuzz campaign under ASan ran the process out of mappings.)
TEST(Safetensors, RefusedFilesLeaveNoMapping) {
  if (!std::filesystem::exists("/proc/self/maps")) GTEST_SKIP() << "no /proc/self/maps to count mappings in";
  auto mappings = [] {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    int n = 0;
    while (std::getline(maps, line)) ++n;
    return n;
  };
  TempDir d("refused");
  // Refused after the file is mapped: the header parses, its data_offsets are reversed.
  write_file(d / "x.safetensors",
             pack(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", std::string(8, '\0')));
  EXPECT_NE(open_error(read_file(d / "x.safetensors")).find("reversed"), std::string::npos);
  const int before = mappings();
  for (int i = 0; i < 200; ++i) EXPECT_THROW(SafetensorsFile(d / "x.safetensors"), Error);
  EXPECT_LT(mappings() - before, 20);
}

TEST(Safetensors, FuzzedHeadersFailCleanly) {
  const std::string good = pack(kValidHeader, valid_data());
  TempDir d("fuzz");
  uint64_t s = vireo::test::fuzz_seed(99);
  auto rnd = [&]() { s = s * 6364136223846793005ull + 1442695040888963407ull; return uint32_t(s >> 33); };
  int opened = 0;
  for (int it = 0; it < vireo::test::fuzz_iterations(600); ++it) {
    std::string t = good;
    int edits = 1 + int(rnd() % 3);
    for (int k = 0; k < edits && !t.empty(); ++k) {
      size_t pos = rnd() % t.size();
      switch (rnd() % 4) {
        case 0: t[pos] = char(rnd() & 0xff); break;
        case 1: t[pos] = "0123456789[]{},\":-"[rnd() % 18]; break;
        case 2: t.erase(pos, 1 + rnd() % 6); break;
        default: t.resize(rnd() % t.size()); break;
      }
    }
    write_file(d / "x.safetensors", t);
    try {
      SafetensorsFile f(d / "x.safetensors");
      ++opened;
      for (const auto& [name, info] : f.tensors())  // every accepted tensor lies inside the file
        ASSERT_LE(info.file_offset + info.nbytes, f.file_size()) << name;
    } catch (const Error&) {
    }
  }
  EXPECT_GT(opened, 0);
}

TEST(Safetensors, ShardedIndex) {
  TempDir d("shard");
  write_file(d / "m-1.safetensors", pack(R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})",
                                         valid_data().substr(0, 16)));
  write_file(d / "m-2.safetensors", pack(R"({"b": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}})",
                                         valid_data().substr(16)));
  write_file(d / "model.safetensors.index.json",
             R"({"metadata": {}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}})");
  auto ck = Checkpoint::open(d.str());
  EXPECT_TRUE(ck->has("a"));
  EXPECT_TRUE(ck->has("b"));
  EXPECT_EQ(ck->files().size(), 2u);
  // A weight_map entry whose tensor is not in its shard.
  write_file(d / "model.safetensors.index.json",
             R"({"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-2.safetensors"}})");
  try {
    Checkpoint::open(d.str());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor c listed in weight_map is missing"), std::string::npos) << e.what();
  }
  write_file(d / "model.safetensors.index.json", R"({"weight_map": {"a": "m-3.safetensors"}})");
  EXPECT_THROW(Checkpoint::open(d.str()), Error);
}

TEST(Npy, RoundTrip) {
  TempDir d("npy");
  std::vector<float> v = {1.5f, -2, 3, 4, 5, 6};
  write_npy_f32(d / "x.npy", v.data(), {2, 3});
  NpyArray a = read_npy_f32(d / "x.npy");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data, v);
  EXPECT_EQ(read_file(d / "x.npy").size() % 64, 24u % 64);  // header padded to 64 bytes, then 24 data bytes
}

// Malformed .npy files (the fixtures' expected outputs) are refused with a message naming the
// file: bad shape entries, a shape larger than the data, a header running past the end, and
// random truncations and byte flips of a valid file never crash or allocate what the file lacks.
TEST(Npy, MalformedFilesFailCleanly) {
  TempDir d("npy");
  std::vector<float> v(12, 1.0f);
  write_npy_f32(d / "ok.npy", v.data(), {3, 4});
  const std::string ok = read_file(d / "ok.npy");
  auto error_of = [&](const std::string& bytes) {
    write_file(d / "x.npy", bytes);
    try {
      read_npy_f32(d / "x.npy");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto with_shape = [&](const std::string& shape) {
    std::string s = ok;
    const size_t at = s.find("(3, 4)");
    return s.replace(at, 6, shape);
  };
  EXPECT_NE(error_of(with_shape("(3, x)")).find("shape entry"), std::string::npos);
  EXPECT_NE(error_of(with_shape("(-3,4)")).find("shape entry"), std::string::npos);
  EXPECT_NE(error_of(with_shape("(9999999999999,9999999999)")).find("truncated data"), std::string::npos);
  EXPECT_NE(error_of(with_shape("(4, 4)")).find("truncated data"), std::string::npos);
  EXPECT_EQ(error_of(with_shape("(0, 4)")), "");  // an empty array is valid
  std::string long_header = ok;
  long_header[8] = '\xff';
  long_header[9] = '\x7f';
  EXPECT_NE(error_of(long_header).find("runs past the end"), std::string::npos);
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    std::string s = ok;
    if (i % 2) s.resize(rng() % s.size());
    else s[rng() % s.size()] = char(rng() % 256);
    const std::string err = error_of(s);
    if (!err.empty()) {
      EXPECT_NE(err.find("x.npy"), std::string::npos) << err;
    }
  }
}
