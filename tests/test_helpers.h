#pragma once
// Shared test utilities: temporary directories, file I/O, running the vireo binary.
#include <sys/wait.h>
#include <unistd.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

namespace vireo::test {

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The decompressed contents of a .gz file ("" if it cannot be opened).
inline std::string gunzip_file(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) return "";
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) out.append(buf, size_t(n));
  gzclose(f);
  return out;
}

inline void write_file(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(data.data(), std::streamsize(data.size()));
}

// A fresh directory under the system temp dir, removed on destruction.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("vireo_test_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string str() const { return path.string(); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

struct RunResult {
  int exit_code = -1;   // -1: killed by a signal
  int signal = 0;
  std::string out, err;
};

// Runs `vireo <args>` (a shell-quoted argument string) capturing stdout and stderr.
inline RunResult run_vireo(const std::string& args, const std::string& stdin_text = "") {
  TempDir tmp("run");
  const std::string out = tmp / "out", err = tmp / "err", in = tmp / "in";
  write_file(in, stdin_text);
  const std::string cmd = std::string(VIREO_BIN) + " " + args + " <" + in + " >" + out + " 2>" + err;
  int status = std::system(cmd.c_str());
  RunResult r;
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

// The fuzz tests' size and seed: as CI runs them by default; VIREO_FUZZ_SCALE=N runs N times the
// iterations and VIREO_FUZZ_SEED=S shifts every seed, for longer campaigns (e.g. under
// scripts/test-sanitized.sh: `VIREO_FUZZ_SCALE=50 VIREO_FUZZ_SEED=7 bash scripts/test-sanitized.sh -R Fuzz`).
inline int fuzz_iterations(int base) {
  const char* e = std::getenv("VIREO_FUZZ_SCALE");
  const long k = e && *e ? std::strtol(e, nullptr, 10) : 1;
  return base * int(k > 0 ? k : 1);
}
inline uint64_t fuzz_seed(uint64_t base) {
  const char* e = std::getenv("VIREO_FUZZ_SEED");
  return base + (e && *e ? std::strtoull(e, nullptr, 10) * 0x9E3779B97F4A7C15ull : 0);
}

inline int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  if (!s.empty() && s.back() != '\n') ++n;
  return n;
}

// A command that fails as bad input must: exit code 1, one line on stderr naming the problem.
inline void expect_clean_error(const RunResult& r, const std::string& needle) {
  EXPECT_EQ(r.signal, 0) << "crashed with signal " << r.signal;
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.rfind("vireo: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "expected '" << needle << "' in: " << r.err;
}

// The bytes of a row of `vireo plan`'s table ("  resident weights   10.75 MiB ...").
inline double table_bytes(const std::string& table, const std::string& row) {
  std::smatch m;
  std::regex re("  " + row + " +([0-9.]+) (B|KiB|MiB|GiB)");
  if (!std::regex_search(table, m, re)) {
    ADD_FAILURE() << "no row " << row << " in\n" << table;
    return 0;
  }
  const std::string u = m[2];
  const double mult = u == "B" ? 1 : u == "KiB" ? 1024.0 : u == "MiB" ? 1048576.0 : 1073741824.0;
  return std::stod(m[1]) * mult;
}

}  // namespace vireo::test
