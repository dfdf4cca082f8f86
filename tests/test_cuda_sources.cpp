// Rules of the CUDA backend's sources that no compiler checks, read from the source files (so
// they run on machines without a GPU, and without nvcc). Every kernel is launched as a
// programmatic dependent launch (`launch`, cuda_internal.h) and must call pdl_begin() (or
// pdl_begin(wait), cuda_kernels.cuh) before anything else: a kernel that skipped it would run concurrently with its
// predecessor and read its inputs before they are written, a race no result test is sure to catch.
// The one exception is its own form: a first statement that calls pdl_begin_after(loads), whose
// argument (loads of weights, which no kernel writes) is evaluated before the wait.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string read_all(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The text with // and /* */ comments blanked out (line breaks kept, for line numbers).
std::string strip_comments(const std::string& s) {
  std::string out = s;
  for (size_t i = 0; i + 1 < out.size(); ++i) {
    if (out[i] == '"') {  // string literals may hold "//"
      for (++i; i < out.size() && out[i] != '"'; ++i)
        if (out[i] == '\\') ++i;
    } else if (out[i] == '/' && out[i + 1] == '/') {
      for (; i < out.size() && out[i] != '\n'; ++i) out[i] = ' ';
    } else if (out[i] == '/' && out[i + 1] == '*') {
      for (; i + 1 < out.size() && !(out[i] == '*' && out[i + 1] == '/'); ++i)
        if (out[i] != '\n') out[i] = ' ';
      if (i + 1 < out.size()) out[i] = out[i + 1] = ' ';
    }
  }
  return out;
}

int line_of(const std::string& s, size_t pos) { return 1 + int(std::count(s.begin(), s.begin() + long(pos), '\n')); }

struct Finding {
  std::vector<std::string> missing_wait, chevron_launch;
  int kernels = 0;
};

Finding scan(const std::string& name, const std::string& text) {
  Finding f;
  const std::string s = strip_comments(text);
  for (size_t p = s.find("__global__"); p != std::string::npos; p = s.find("__global__", p + 1)) {
    const size_t body = s.find('{', p), semi = s.find(';', p);
    if (body == std::string::npos || semi < body) continue;  // a declaration
    ++f.kernels;
    size_t q = body + 1;
    while (q < s.size() && std::isspace(static_cast<unsigned char>(s[q]))) ++q;
    // pdl_begin() or pdl_begin(wait), the form whose wait a kernel that waits on counters instead may skip;
    // or a first statement that calls pdl_begin_after(...).
    const size_t first_end = s.find(';', q);
    const bool after =
        first_end != std::string::npos && s.substr(q, first_end - q).find("pdl_begin_after(") != std::string::npos;
    if (s.compare(q, 10, "pdl_begin(") != 0 && !after)
      f.missing_wait.push_back(name + ":" + std::to_string(line_of(s, p)));
  }
  for (size_t p = s.find("<<<"); p != std::string::npos; p = s.find("<<<", p + 3))
    f.chevron_launch.push_back(name + ":" + std::to_string(line_of(s, p)));
  return f;
}

}  // namespace

TEST(CudaSources, ScannerFindsAKernelWithoutPdlBegin) {
  const Finding bad = scan("x.cu",
                           "// __global__ void in_a_comment() {}\n"
                           "__global__ void ok(int n) {\n  pdl_begin();\n  if (n) return;\n}\n"
                           "template <int N>\n__global__ void __launch_bounds__(256) late(int n) {\n  if (n) return;\n"
                           "  pdl_begin();\n}\n"
                           "__global__ void declared(int);\n"
                           "void host() { ok<<<1, 32, 0, 0>>>(1); }\n"
                           "__global__ void ahead(const uint4* w) {\n  const uint4 a = pdl_begin_after(load(w));\n}\n"
                           "__global__ void ahead_late(const uint4* w) {\n  const uint4 a = load(w);\n"
                           "  pdl_begin_after(a);\n}\n");
  EXPECT_EQ(bad.kernels, 4);
  ASSERT_EQ(bad.missing_wait.size(), 2u);
  EXPECT_EQ(bad.missing_wait[0], "x.cu:7");
  EXPECT_EQ(bad.missing_wait[1], "x.cu:16");
  ASSERT_EQ(bad.chevron_launch.size(), 1u);
  EXPECT_EQ(bad.chevron_launch[0], "x.cu:12");
}

TEST(CudaSources, EveryKernelBeginsWithPdlBeginAndIsLaunchedByLaunch) {
  const std::filesystem::path dir = std::filesystem::path(VIREO_SOURCE_DIR) / "src" / "backend" / "cuda";
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int kernels = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string ext = e.path().extension().string();
    if (ext != ".cu" && ext != ".cuh" && ext != ".h") continue;
    const Finding f = scan(e.path().filename().string(), read_all(e.path()));
    kernels += f.kernels;
    for (const std::string& where : f.missing_wait)
      ADD_FAILURE() << where << ": a __global__ kernel whose body does not begin with pdl_begin(...);";
    for (const std::string& where : f.chevron_launch)
      ADD_FAILURE() << where << ": a <<<>>> launch; use launch() (cuda_internal.h)";
  }
  EXPECT_GE(kernels, 50) << "the scan found too few kernels in " << dir;
}
