// Encode throughput of vireo's tokenizer, one thread. Driven by tools/bench_tokenizer.py, which
// times the Python `tokenizers` package on the same documents in the same run.
// Usage: vireo_tokenizer_bench TOKENIZER_JSON[.gz] CORPUS RUNS
//   CORPUS: documents separated by NUL bytes. Prints one JSON line: best-run MB/s, id count and
//   an FNV-1a checksum of all ids (so the driver can check both sides produced the same ids).
#include <ctime>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "text/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON CORPUS RUNS\n", argv[0]);
    return 2;
  }
  try {
    vireo::Tokenizer tok = vireo::Tokenizer::from_file(argv[1]);
    std::ifstream f(argv[2], std::ios::binary);
    if (!f) vireo::fail(argv[2], ": cannot open");
    std::stringstream ss;
    ss << f.rdbuf();
    std::string all = ss.str();
    std::vector<std::string_view> docs;
    for (size_t pos = 0; pos < all.size();) {
      size_t end = all.find('\0', pos);
      if (end == std::string::npos) end = all.size();
      docs.emplace_back(all.data() + pos, end - pos);
      pos = end + 1;
    }
    size_t bytes = 0;
    for (auto d : docs) bytes += d.size();
    int runs = std::stoi(argv[3]);
    double best = 1e30;
    uint64_t checksum = 0;
    size_t count = 0;
    // Run 0 warms the word cache, as the Python side's warm-up does.
    for (int r = 0; r <= runs; ++r) {
      uint64_t h = 1469598103934665603ull;
      size_t n = 0;
      // Process CPU time, as the Python driver measures: robust to other load on the machine.
      std::clock_t t0 = std::clock();
      for (auto d : docs) {
        std::vector<uint32_t> ids = tok.encode(d, false);
        for (uint32_t id : ids) h = (h ^ id) * 1099511628211ull;
        n += ids.size();
      }
      double s = double(std::clock() - t0) / CLOCKS_PER_SEC;
      if (r > 0 && s < best) best = s;
      checksum = h;
      count = n;
    }
    std::printf("{\"mb_per_s\": %.3f, \"seconds\": %.4f, \"bytes\": %zu, \"ids\": %zu, \"checksum\": %llu}\n",
                bytes / best / 1e6, best, bytes, count, (unsigned long long)checksum);
  } catch (const vireo::Error& e) {
    std::fprintf(stderr, "vireo_tokenizer_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
