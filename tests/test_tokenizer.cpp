// Tokenizer tests: exactness against the Python `tokenizers` package (goldens made by
// tools/make_tokenizer_goldens.py from the real tokenizers in ../shared), streaming decode,
// invalid UTF-8, and errors for unsupported components.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <random>
#include <filesystem>
#include <thread>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <zlib.h>

#include "core/error.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "test_helpers.h"

namespace {

using vireo::DecodeStream;
using vireo::Tokenizer;
using json = nlohmann::json;
namespace fs = std::filesystem;

std::string tokenizer_path(const std::string& name) {
  return std::string(VIREO_SHARED_DIR) + "/data/tokenizers/" + name + "/tokenizer.json.gz";
}
std::string data_dir() { return std::string(VIREO_SOURCE_DIR) + "/tests/data/tokenizer"; }

std::string gunzip_file(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + path);
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, n);
  gzclose(f);
  return out;
}

// Variants: real tokenizers with other components patched in (tests/data/tokenizer/variants.json,
// written by the golden script, which applies the same patches before asking `tokenizers`).
const json& variants() {
  static json v = [] {
    std::ifstream f(data_dir() + "/variants.json");
    return json::parse(f);
  }();
  return v;
}
std::string base_of(const std::string& name) {
  return variants().contains(name) ? variants()[name]["base"].get<std::string>() : name;
}

// Loading a 262k-vocabulary tokenizer takes a while: load each once for the whole binary.
const Tokenizer& load(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto& slot = cache[name];
  if (slot) return *slot;
  if (!variants().contains(name)) {
    slot = std::make_unique<Tokenizer>(Tokenizer::from_file(tokenizer_path(name)));
    return *slot;
  }
  json j = json::parse(gunzip_file(tokenizer_path(base_of(name))));
  for (const auto& [key, value] : variants()[name]["set"].items()) {
    if (key.rfind("model.", 0) == 0) j["model"][key.substr(6)] = value;
    else j[key] = value;
  }
  slot = std::make_unique<Tokenizer>(Tokenizer::from_json(j.dump(), name));
  return *slot;
}

struct Corpus {
  std::vector<std::string> texts;
  std::vector<std::string> kinds;
};
const Corpus& corpus() {
  static Corpus c = [] {
    Corpus c;
    std::ifstream f(data_dir() + "/corpus.jsonl");
    std::string line;
    while (std::getline(f, line)) {
      json j = json::parse(line);
      c.kinds.push_back(j["kind"]);
      if (j.contains("hex")) {
        std::string hex = j["hex"], bytes;
        for (size_t i = 0; i + 1 < hex.size(); i += 2) bytes.push_back(char(std::stoi(hex.substr(i, 2), nullptr, 16)));
        c.texts.push_back(bytes);
      } else {
        c.texts.push_back(j["text"]);
      }
    }
    return c;
  }();
  return c;
}

std::string stream_decode(const Tokenizer& tok, const std::vector<uint32_t>& ids, bool skip, bool* valid) {
  DecodeStream ds(tok, skip);
  std::string out;
  *valid = true;
  for (uint32_t id : ids) {
    std::string piece = ds.step(id);
    *valid = *valid && vireo::unicode::is_valid_utf8(piece);
    out += piece;
  }
  std::string rest = ds.finish();
  *valid = *valid && vireo::unicode::is_valid_utf8(rest);
  return out + rest;
}

std::string show(const std::vector<uint32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

class TokenizerGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!fs::exists(tokenizer_path(base_of(GetParam()))))
      GTEST_SKIP() << "needs " << tokenizer_path(base_of(GetParam())) << " (the shared data folder is absent)";
  }
};

TEST_P(TokenizerGolden, EncodeDecodeMatchPythonTokenizers) {
  const Tokenizer& tok = load(GetParam());
  const Corpus& c = corpus();
  json golden = json::parse(gunzip_file(data_dir() + "/" + GetParam() + ".golden.json.gz"));
  const auto& cases = golden["cases"];
  ASSERT_EQ(cases.size(), c.texts.size()) << "golden out of date: rerun tools/make_tokenizer_goldens.py";
  ASSERT_GE(c.texts.size(), 2000u);
  size_t bad_plain = 0, bad_special = 0, bad_decode = 0, bad_stream = 0, shown = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string& text = c.texts[i];
    auto e = cases[i]["e"].get<std::vector<uint32_t>>();
    auto s = cases[i]["s"].get<std::vector<uint32_t>>();
    auto got_e = tok.encode(text, false);
    auto got_s = tok.encode(text, true);
    bool ok_e = got_e == e && tok.encode(text, false, false) == cases[i]["t"].get<std::vector<uint32_t>>();
    bool ok_s = got_s == s;
    bad_plain += !ok_e;
    bad_special += !ok_s;
    std::string d = tok.decode(s, false), ds = tok.decode(s, true);
    bool ok_d = d == cases[i]["d"].get<std::string>() && ds == cases[i]["ds"].get<std::string>();
    bad_decode += !ok_d;
    bool valid1 = false, valid2 = false;
    bool ok_stream = stream_decode(tok, s, false, &valid1) == d && stream_decode(tok, s, true, &valid2) == ds &&
                     valid1 && valid2;
    bad_stream += !ok_stream;
    if ((!ok_e || !ok_s || !ok_d || !ok_stream) && shown++ < 8) {
      ADD_FAILURE() << GetParam() << " case " << i << " (" << c.kinds[i] << ") text=" << json(vireo::unicode::to_valid_utf8(text)).dump()
                    << "\n  expected " << show(e) << "\n  got      " << show(got_e)
                    << (ok_d ? "" : "\n  decode differs: got " + json(d).dump() + " want " + cases[i]["d"].dump())
                    << (ok_stream ? "" : "\n  stream decode differs");
    }
  }
  std::printf("[tokenizer %s] %zu strings: encode (plain, specials as text) mismatches %zu, encode+special mismatches %zu, "
              "decode mismatches %zu, stream mismatches %zu\n",
              GetParam().c_str(), cases.size(), bad_plain, bad_special, bad_decode, bad_stream);
  EXPECT_EQ(bad_plain + bad_special + bad_decode + bad_stream, 0u);
}

TEST_P(TokenizerGolden, RandomIdsDecodeAndStreamMatch) {
  const Tokenizer& tok = load(GetParam());
  json golden = json::parse(gunzip_file(data_dir() + "/" + GetParam() + ".golden.json.gz"));
  size_t bad = 0;
  for (const auto& r : golden["random_decode"]) {
    auto ids = r["ids"].get<std::vector<uint32_t>>();
    for (bool skip : {false, true}) {
      std::string want = r[skip ? "ds" : "d"].get<std::string>();
      std::string got = tok.decode(ids, skip);
      bool valid = false;
      std::string streamed = stream_decode(tok, ids, skip, &valid);
      if (got != want || streamed != want || !valid) {
        if (bad++ < 5)
          ADD_FAILURE() << "ids " << show(ids) << " skip=" << skip << "\n  want " << json(want).dump() << "\n  got  "
                        << json(got).dump() << "\n  stream " << json(streamed).dump();
      }
    }
  }
  EXPECT_EQ(bad, 0u);
}

TEST_P(TokenizerGolden, InvalidUtf8IsReplacedLikePython) {
  const Tokenizer& tok = load(GetParam());
  // Each maximal ill-formed subsequence becomes one U+FFFD, then encoding proceeds as usual.
  EXPECT_EQ(tok.encode("a\xff" "b", false), tok.encode("a\xEF\xBF\xBD" "b", false));
  EXPECT_EQ(tok.encode("\xe2\x82 x", false), tok.encode("\xEF\xBF\xBD x", false));
  EXPECT_EQ(tok.encode("\xf0\x9f\x98", false), tok.encode("\xEF\xBF\xBD", false));
  EXPECT_EQ(tok.encode("\xc0\xaf", false), tok.encode("\xEF\xBF\xBD\xEF\xBF\xBD", false));
}

TEST_P(TokenizerGolden, ConcurrentEncodesAgree) {
  const Tokenizer& tok = load(GetParam());
  const Corpus& c = corpus();
  std::vector<std::vector<uint32_t>> want;
  for (size_t i = 0; i < 300; ++i) want.push_back(tok.encode(c.texts[i]));
  std::atomic<size_t> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (size_t i = 0; i < want.size(); ++i) bad += tok.encode(c.texts[i]) != want[i];
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Real, TokenizerGolden, ::testing::Values("deepseek_v3", "qwen3", "gemma3"));
INSTANTIATE_TEST_SUITE_P(Variant, TokenizerGolden,
                         ::testing::Values("gemma3_llama", "gemma3_metaspace", "qwen3_bytelevel_regex"));

TEST(TokenizerFile, LoadsPlainJsonAndGzip) {
  std::string gz = tokenizer_path("qwen3");
  if (!fs::exists(gz)) GTEST_SKIP() << "needs " << gz << " (the shared data folder is absent)";
  fs::path plain = fs::temp_directory_path() / "vireo_test_qwen3_tokenizer.json";
  {
    std::ofstream f(plain, std::ios::binary);
    f << gunzip_file(gz);
  }
  Tokenizer a = Tokenizer::from_file(plain.string());
  fs::remove(plain);
  const Tokenizer& b = load("qwen3");
  EXPECT_EQ(a.encode("Hello, world! 你好"), b.encode("Hello, world! 你好"));
  EXPECT_EQ(a.vocab_size(), b.vocab_size());
  EXPECT_EQ(a.token_to_id("<|im_start|>"), std::optional<uint32_t>(151644));
  EXPECT_TRUE(a.is_special(151644));
  EXPECT_EQ(a.id_to_token(151644), std::optional<std::string>("<|im_start|>"));
}

TEST(TokenizerStream, HoldsBackPartialCharacters) {
  std::string gz = tokenizer_path("qwen3");
  if (!fs::exists(gz)) GTEST_SKIP() << "needs " << gz << " (the shared data folder is absent)";
  const Tokenizer& tok = load("qwen3");
  // "€" is E2 82 AC: three byte-level tokens, the first two of which are not a character yet.
  std::vector<uint32_t> ids = {*tok.token_to_id("\xC3\xA2"), *tok.token_to_id("\xC4\xA4"), *tok.token_to_id("\xC2\xAC")};
  DecodeStream ds(tok);
  EXPECT_EQ(ds.step(ids[0]), "");
  EXPECT_EQ(ds.step(ids[1]), "");
  EXPECT_EQ(ds.step(ids[2]), "\xE2\x82\xAC");
  EXPECT_EQ(ds.finish(), "");
  DecodeStream truncated(tok);
  EXPECT_EQ(truncated.step(ids[0]), "");
  EXPECT_EQ(truncated.finish(), "\xEF\xBF\xBD");  // what decode() gives for the lone byte
}

// A tiny byte-fallback BPE written inline, for components the real tokenizers do not use.
std::string tiny_json(const std::string& normalizer, const std::string& pre, const std::string& decoder,
                      const std::string& model_type = "BPE") {
  return R"({"added_tokens":[{"id":0,"content":"<s>","special":true,"normalized":false,"lstrip":false,"rstrip":false,"single_word":false}],
    "normalizer":)" + normalizer + R"(,"pre_tokenizer":)" + pre + R"(,"post_processor":null,"decoder":)" + decoder + R"(,
    "model":{"type":")" + model_type + R"(","unk_token":"<unk>","fuse_unk":true,"byte_fallback":false,
      "vocab":{"<s>":0,"<unk>":1,"a":2,"b":3,"ab":4,"▁":5,"▁ab":6,"1":7,"2":8},
      "merges":[["a","b"],["▁","ab"]]}})";
}

TEST(TokenizerComponents, UnsupportedTypesAreNamed) {
  auto expect_error = [](const std::string& json_text, const std::string& needle) {
    try {
      Tokenizer::from_json(json_text, "tiny.json");
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const vireo::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("tiny.json"), std::string::npos) << e.what();
    }
  };
  expect_error(tiny_json(R"({"type":"BertNormalizer"})", "null", "null"), "BertNormalizer");
  expect_error(tiny_json("null", R"({"type":"Whitespace"})", "null"), "Whitespace");
  expect_error(tiny_json("null", "null", R"({"type":"CTC"})"), "CTC");
  expect_error(tiny_json("null", "null", "null", "Unigram"), "Unigram");
  expect_error("{not json", "invalid JSON");
}

TEST(TokenizerComponents, MetaspaceDigitsPrependStrip) {
  Tokenizer t = Tokenizer::from_json(
      tiny_json(R"({"type":"Sequence","normalizers":[{"type":"NFKC"}]})",
                R"({"type":"Sequence","pretokenizers":[{"type":"Digits","individual_digits":true},
                    {"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true}]})",
                R"({"type":"Sequence","decoders":[{"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true}]})"));
  // "ab ab": Metaspace makes "▁ab▁ab", split before each ▁ -> "▁ab" "▁ab".
  EXPECT_EQ(t.encode("ab ab"), (std::vector<uint32_t>{6, 6}));
  // Unknown characters fuse into one unk; the fullwidth "１" is NFKC-normalized to "1".
  EXPECT_EQ(t.encode("ab xyz"), (std::vector<uint32_t>{6, 5, 1}));
  EXPECT_EQ(t.encode("１2"), (std::vector<uint32_t>{5, 7, 5, 8}));
  EXPECT_EQ(t.decode(std::vector<uint32_t>{6, 6}), "ab ab");
  Tokenizer p = Tokenizer::from_json(
      tiny_json(R"({"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"▁"},{"type":"Replace","pattern":{"String":" "},"content":"▁"}]})",
                "null",
                R"({"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]})"));
  EXPECT_EQ(p.encode("ab"), (std::vector<uint32_t>{6}));
  EXPECT_EQ(p.decode(std::vector<uint32_t>{6, 6}), "ab ab");
  // Streaming with a position-dependent decoder still equals the full decode.
  DecodeStream ds(p);
  std::string s = ds.step(6);
  s += ds.step(6);
  s += ds.finish();
  EXPECT_EQ(s, "ab ab");
}

}  // namespace

// Structural and byte-level mutations of a real tokenizer.json (the demo model's byte-level BPE)
// must load or be refused with a vireo::Error naming the origin; a tokenizer that loads must
// encode and decode without crashing (or refuse with a vireo::Error). Deterministic, bounded.
TEST(TokenizerFile, FuzzMutationsLoadOrFailCleanly) {
  const std::string path = std::string(VIREO_SOURCE_DIR) + "/models/vireo-demo/tokenizer.json";
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const json base = json::parse(text);
  // Mutation targets: every node outside the vocab and merges, plus a sample of those.
  std::vector<json::json_pointer> targets;
  std::mt19937 rng(uint32_t(vireo::test::fuzz_seed(4242)));
  std::function<void(const json&, const json::json_pointer&)> walk = [&](const json& j, const json::json_pointer& p) {
    const std::string s = p.to_string();
    const bool big = s == "/model/vocab" || s == "/model/merges";
    if (!p.empty()) targets.push_back(p);
    if (j.is_object()) {
      for (auto it = j.begin(); it != j.end(); ++it)
        if (!big || rng() % 400 == 0) walk(it.value(), p / it.key());
    } else if (j.is_array()) {
      for (size_t i = 0; i < j.size(); ++i)
        if (!big || rng() % 400 == 0) walk(j[i], p / i);
    }
  };
  walk(base, json::json_pointer());
  ASSERT_GT(targets.size(), 100u);
  const std::vector<json> values = {nullptr, -1, 0, 7, int64_t(1) << 40, 1.5, "", "x", "Ġ", "a b c", "(", "[^", true,
                                    json::array(), json::object(), json::array({1, 2}), json::object({{"type", "Nope"}})};
  int loaded = 0, refused = 0;
  for (int iter = 0; iter < vireo::test::fuzz_iterations(300); ++iter) {
    std::string mutated;
    if (iter % 8 == 7) {  // bytes: cut short, or a stray byte
      mutated = text;
      const size_t pos = rng() % mutated.size();
      if (rng() % 2) mutated.resize(pos);
      else mutated[pos] = static_cast<char>(rng() % 256);
    } else {
      json j = base;
      for (int e = 0, edits = 1 + int(rng() % 3); e < edits; ++e) {
        const json::json_pointer& p = targets[rng() % targets.size()];
        if (!j.contains(p)) continue;
        if (rng() % 3 == 0) {
          json& parent = j.at(p.parent_pointer());
          if (parent.is_object()) parent.erase(p.back());
          else if (parent.is_array()) parent.erase(parent.begin() + long(std::stoul(p.back())));
        } else {
          j.at(p) = values[rng() % values.size()];
        }
      }
      mutated = j.dump();
    }
    try {
      Tokenizer t = Tokenizer::from_json(mutated, "fuzzed tokenizer.json");
      ++loaded;
      try {
        const auto ids = t.encode("Hello, world! 123 \xc3\xa9\xc3\xa0 \xf0\x9f\x8e\x89\n\tx");
        (void)t.decode(ids);
      } catch (const vireo::Error&) {
      }
    } catch (const vireo::Error& e) {
      ++refused;
      const std::string msg = e.what();
      EXPECT_NE(msg.find("fuzzed tokenizer.json"), std::string::npos) << msg;
      // A value of the wrong type is named by its path (JSON_DIAGNOSTICS), e.g. "(/added_tokens/3/special)".
      if (msg.find("type_error") != std::string::npos) {
        EXPECT_NE(msg.find("(/"), std::string::npos) << msg;
      }
    }
  }
  EXPECT_GT(loaded, 0);
  EXPECT_GT(refused, 0);
}
