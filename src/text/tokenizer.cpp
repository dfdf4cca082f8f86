#include "text/tokenizer.h"

#include <algorithm>
#include <deque>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <utf8proc.h>
#include <zlib.h>

#include "core/error.h"
#include "text/tokenizer_bpe.h"
#include "text/tokenizer_regex.h"
#include "text/unicode.h"

namespace vireo {

using json = nlohmann::json;

namespace {

constexpr const char* kReplacementChar = "\xEF\xBF\xBD";
// GPT-2's split, used by the ByteLevel pre-tokenizer when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct AddedToken {
  uint32_t id = 0;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, normalized = false, single_word = false;
};

// Leftmost-longest multi-pattern matcher over bytes (what `tokenizers` builds with
// aho-corasick's LeftmostLongest): at the first position where any pattern matches, the longest
// one wins; scanning resumes after it. Patterns are few and short, so a byte trie with a
// first-byte filter is fast enough.
class TokenTrie {
 public:
  TokenTrie() : nodes_(1) {}
  void add(std::string_view s, int value) {
    if (s.empty()) return;
    int n = 0;
    for (char ch : s) {
      auto c = static_cast<uint8_t>(ch);
      int next = child(n, c);
      if (next < 0) {
        next = static_cast<int>(nodes_.size());
        nodes_[n].next.emplace_back(c, next);
        nodes_.emplace_back();
      }
      n = next;
    }
    if (nodes_[n].value < 0) nodes_[n].value = value;  // the first added pattern wins
    first_[static_cast<uint8_t>(s[0])] = true;
    empty_ = false;
  }
  bool empty() const { return empty_; }
  // Finds the leftmost-longest match starting at or after `from`.
  bool find(std::string_view s, std::size_t from, std::size_t& start, std::size_t& end, int& value) const {
    for (std::size_t i = from; i < s.size(); ++i) {
      if (!first_[static_cast<uint8_t>(s[i])]) continue;
      int n = 0, best = -1;
      std::size_t best_end = 0;
      for (std::size_t j = i; j < s.size(); ++j) {
        n = child(n, static_cast<uint8_t>(s[j]));
        if (n < 0) break;
        if (nodes_[n].value >= 0) {
          best = nodes_[n].value;
          best_end = j + 1;
        }
      }
      if (best >= 0) {
        start = i;
        end = best_end;
        value = best;
        return true;
      }
    }
    return false;
  }

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int>> next;
    int value = -1;
  };
  int child(int n, uint8_t c) const {
    for (const auto& [k, v] : nodes_[n].next)
      if (k == c) return v;
    return -1;
  }
  std::vector<Node> nodes_;
  bool first_[256] = {};
  bool empty_ = true;
};

enum class NormKind { NFC, NFD, NFKC, NFKD, Lowercase, Replace, Prepend, Strip };
struct Normalizer {
  NormKind kind;
  std::string pattern, content;  // Replace (literal pattern), Prepend (content)
  std::shared_ptr<TokenizerRegex> regex;  // Replace with a Regex pattern
  bool left = false, right = false;        // Strip
};

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
enum class PreKind { Split, ByteLevel, Metaspace, Digits };
struct PreTokenizer {
  PreKind kind;
  std::shared_ptr<TokenizerRegex> regex;  // Split (Regex) or ByteLevel (use_regex)
  std::string literal;                    // Split (String); Metaspace replacement
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
  int prepend_scheme = 0;         // Metaspace: 0 always, 1 first, 2 never
  bool split = true;              // Metaspace
  bool individual_digits = false;
};

// One post-processing template for a single sequence: special ids around the sequence.
struct PostTemplate {
  std::vector<uint32_t> before, after;
};

enum class DecKind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace };
struct DecoderStage {
  DecKind kind;
  std::string pattern, content;  // Replace
  std::shared_ptr<TokenizerRegex> regex;
  char32_t strip_char = ' ';
  std::size_t start = 0, stop = 0;  // Strip
  std::string replacement;          // Metaspace
  bool prepend = true;              // Metaspace: prepend_scheme != never
};

struct Piece {
  std::string_view s;
  // How many leading bytes of s are aligned to offset 0 of the whole input (0: none). Metaspace's
  // prepend_scheme "first" prepends to every piece that starts there; a first character that the
  // normalizer expands (NFKC "½" -> "1⁄2") can start several pieces.
  std::size_t origin_span;
};

std::string type_of(const json& j, const std::string& where) {
  auto it = j.find("type");
  if (it == j.end() || !it->is_string()) fail(where, ": missing \"type\"");
  return it->get<std::string>();
}

bool get_bool(const json& j, const char* key, bool dflt) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? dflt : it->get<bool>();
}

// A tokenizer.json pattern: {"String": "..."} or {"Regex": "..."}.
void parse_pattern(const json& j, const std::string& where, std::string& literal,
                   std::shared_ptr<TokenizerRegex>& regex) {
  if (!j.is_object()) fail(where, ": \"pattern\" must be {\"String\": ...} or {\"Regex\": ...}");
  if (j.contains("String")) {
    literal = j["String"].get<std::string>();
  } else if (j.contains("Regex")) {
    regex = std::make_shared<TokenizerRegex>(j["Regex"].get<std::string>(), where);
  } else {
    fail(where, ": \"pattern\" must be {\"String\": ...} or {\"Regex\": ...}");
  }
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty() || s.find(from) == std::string::npos) return;
  std::string out;
  out.reserve(s.size());
  std::size_t pos = 0;
  for (std::size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out += to;
  }
  out.append(s, pos);
  s = std::move(out);
}

void regex_replace_all(std::string& s, const TokenizerRegex& re, std::string_view to) {
  std::string out;
  std::size_t pos = 0;
  bool any = false;
  re.for_each_match(s, [&](std::size_t a, std::size_t b) {
    out.append(s, pos, a - pos);
    out += to;
    pos = b;
    any = true;
  });
  if (!any) return;
  out.append(s, pos);
  s = std::move(out);
}

std::string read_file(const std::string& path) {
  if (path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0) {
    gzFile f = gzopen(path.c_str(), "rb");
    if (!f) fail(path, ": cannot open");
    std::string out;
    char buf[1 << 16];
    int n;
    while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
    int err = 0;
    const char* msg = gzerror(f, &err);
    gzclose(f);
    if (n < 0 || (err != Z_OK && err != Z_STREAM_END)) fail(path, ": gzip read error: ", msg);
    return out;
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path, ": cannot open");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

struct TokenizerImpl {
  std::string origin;
  std::vector<AddedToken> added;
  TokenTrie raw_trie, norm_trie;  // values index `added`
  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pretokenizers;
  std::unique_ptr<BpeModel> model;
  std::vector<PostTemplate> post;
  bool has_decoder = false;
  std::vector<DecoderStage> decoders;
  std::vector<std::string> id_to_token;
  std::vector<uint8_t> has_token, special;
  StringIdMap token_to_id;

  void parse_normalizer(const json& j);
  void parse_pretokenizer(const json& j);
  void parse_post(const json& j, const json& added_json);
  void parse_decoder(const json& j);

  std::string normalize(std::string_view s) const;
  template <typename F>
  void split_added(const TokenTrie& trie, std::string_view s, bool parse_special, F&& f) const;
  void encode_chunk(std::string_view s, bool at_origin, bool parse_special, std::vector<uint32_t>& out) const;
  void pretokenize_and_model(std::string_view s, std::size_t origin_span, std::vector<uint32_t>& out) const;
  std::string decode_tokens(std::vector<std::string> tokens, bool at_start, bool* clean) const;
  bool token_of(uint32_t id, bool skip_special, std::string& tok) const;
};

// ---------------------------------------------------------------------------------------------
// Loading

void TokenizerImpl::parse_normalizer(const json& j) {
  if (j.is_null()) return;
  const std::string where = origin + ": normalizer";
  std::string t = type_of(j, where);
  Normalizer n{};
  if (t == "Sequence") {
    for (const auto& sub : j.at("normalizers")) parse_normalizer(sub);
    return;
  } else if (t == "NFC") {
    n.kind = NormKind::NFC;
  } else if (t == "NFD") {
    n.kind = NormKind::NFD;
  } else if (t == "NFKC") {
    n.kind = NormKind::NFKC;
  } else if (t == "NFKD") {
    n.kind = NormKind::NFKD;
  } else if (t == "Lowercase") {
    n.kind = NormKind::Lowercase;
  } else if (t == "Replace") {
    n.kind = NormKind::Replace;
    parse_pattern(j.at("pattern"), where + " Replace", n.pattern, n.regex);
    n.content = j.at("content").get<std::string>();
  } else if (t == "Prepend") {
    n.kind = NormKind::Prepend;
    n.content = j.at("prepend").get<std::string>();
  } else if (t == "Strip") {
    n.kind = NormKind::Strip;
    n.left = get_bool(j, "strip_left", false);
    n.right = get_bool(j, "strip_right", false);
  } else {
    fail(where, ": unsupported normalizer type \"", t, "\"");
  }
  normalizers.push_back(std::move(n));
}

void TokenizerImpl::parse_pretokenizer(const json& j) {
  if (j.is_null()) return;
  const std::string where = origin + ": pre_tokenizer";
  std::string t = type_of(j, where);
  PreTokenizer p{};
  if (t == "Sequence") {
    for (const auto& sub : j.at("pretokenizers")) parse_pretokenizer(sub);
    return;
  } else if (t == "Split") {
    p.kind = PreKind::Split;
    parse_pattern(j.at("pattern"), where + " Split", p.literal, p.regex);
    std::string b = j.at("behavior").get<std::string>();
    if (b == "Removed") p.behavior = Behavior::Removed;
    else if (b == "Isolated") p.behavior = Behavior::Isolated;
    else if (b == "MergedWithPrevious") p.behavior = Behavior::MergedWithPrevious;
    else if (b == "MergedWithNext") p.behavior = Behavior::MergedWithNext;
    else if (b == "Contiguous") p.behavior = Behavior::Contiguous;
    else fail(where, " Split: unknown behavior \"", b, "\"");
    p.invert = get_bool(j, "invert", false);
  } else if (t == "ByteLevel") {
    p.kind = PreKind::ByteLevel;
    p.add_prefix_space = get_bool(j, "add_prefix_space", true);
    if (get_bool(j, "use_regex", true)) p.regex = std::make_shared<TokenizerRegex>(kGpt2Pattern, where);
  } else if (t == "Metaspace") {
    p.kind = PreKind::Metaspace;
    p.literal = j.value("replacement", std::string("\xE2\x96\x81"));
    if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
      std::string s = j["prepend_scheme"].get<std::string>();
      if (s == "always") p.prepend_scheme = 0;
      else if (s == "first") p.prepend_scheme = 1;
      else if (s == "never") p.prepend_scheme = 2;
      else fail(where, " Metaspace: unknown prepend_scheme \"", s, "\"");
    } else {
      p.prepend_scheme = get_bool(j, "add_prefix_space", true) ? 0 : 2;
    }
    p.split = get_bool(j, "split", true);
  } else if (t == "Digits") {
    p.kind = PreKind::Digits;
    p.individual_digits = get_bool(j, "individual_digits", false);
  } else {
    fail(where, ": unsupported pre_tokenizer type \"", t, "\"");
  }
  if (!pretokenizers.empty() && pretokenizers.back().kind == PreKind::ByteLevel)
    fail(where, ": a ", t, " after ByteLevel is not supported (ByteLevel must come last)");
  pretokenizers.push_back(std::move(p));
}

void TokenizerImpl::parse_post(const json& j, const json& added_json) {
  if (j.is_null()) return;
  const std::string where = origin + ": post_processor";
  std::string t = type_of(j, where);
  auto id_of = [&](const json& pair, const char* field) {
    // Roberta/Bert store [token, id].
    if (!pair.is_array() || pair.size() != 2) fail(where, " ", t, ": \"", field, "\" must be [token, id]");
    return token_id(pair[1], where, t + " " + field + " id");
  };
  if (t == "Sequence") {
    for (const auto& sub : j.at("processors")) parse_post(sub, added_json);
  } else if (t == "ByteLevel") {
    // Only adjusts offsets, which vireo does not report.
  } else if (t == "TemplateProcessing") {
    PostTemplate pt;
    bool seen_seq = false;
    const auto& specials = j.at("special_tokens");
    for (const auto& item : j.at("single")) {
      if (item.contains("Sequence")) {
        if (item["Sequence"].value("id", std::string("A")) != "A")
          fail(where, " TemplateProcessing: single template refers to sequence B");
        seen_seq = true;
      } else if (item.contains("SpecialToken")) {
        std::string name = item["SpecialToken"].at("id").get<std::string>();
        if (!specials.contains(name))
          fail(where, " TemplateProcessing: special token \"", name, "\" not in special_tokens");
        for (const auto& id : specials[name].at("ids"))
          (seen_seq ? pt.after : pt.before).push_back(token_id(id, where, "special token \"" + name + "\" id"));
      } else {
        fail(where, " TemplateProcessing: unknown template item ", item.dump());
      }
    }
    post.push_back(std::move(pt));
  } else if (t == "RobertaProcessing" || t == "BertProcessing") {
    PostTemplate pt;
    pt.before.push_back(id_of(j.at("cls"), "cls"));
    pt.after.push_back(id_of(j.at("sep"), "sep"));
    post.push_back(std::move(pt));
  } else {
    fail(where, ": unsupported post_processor type \"", t, "\"");
  }
}

void TokenizerImpl::parse_decoder(const json& j) {
  if (j.is_null()) return;
  has_decoder = true;
  const std::string where = origin + ": decoder";
  std::string t = type_of(j, where);
  DecoderStage d{};
  if (t == "Sequence") {
    for (const auto& sub : j.at("decoders")) parse_decoder(sub);
    return;
  } else if (t == "ByteLevel") {
    d.kind = DecKind::ByteLevel;
  } else if (t == "Replace") {
    d.kind = DecKind::Replace;
    parse_pattern(j.at("pattern"), where + " Replace", d.pattern, d.regex);
    d.content = j.at("content").get<std::string>();
  } else if (t == "ByteFallback") {
    d.kind = DecKind::ByteFallback;
  } else if (t == "Fuse") {
    d.kind = DecKind::Fuse;
  } else if (t == "Strip") {
    d.kind = DecKind::Strip;
    std::string c = j.at("content").get<std::string>();
    std::size_t i = 0;
    if (c.empty() || !unicode::is_valid_utf8(c)) fail(where, " Strip: \"content\" must be one character");
    d.strip_char = unicode::next_code_point(c, i);
    d.start = j.value("start", std::size_t(0));
    d.stop = j.value("stop", std::size_t(0));
  } else if (t == "Metaspace") {
    d.kind = DecKind::Metaspace;
    d.replacement = j.value("replacement", std::string("\xE2\x96\x81"));
    if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null())
      d.prepend = j["prepend_scheme"].get<std::string>() != "never";
    else
      d.prepend = get_bool(j, "add_prefix_space", true);
  } else {
    fail(where, ": unsupported decoder type \"", t, "\"");
  }
  decoders.push_back(std::move(d));
}

Tokenizer Tokenizer::from_file(const std::string& path) { return from_json(read_file(path), path); }

Tokenizer Tokenizer::from_json(std::string_view text, const std::string& origin) {
  auto impl = std::make_shared<TokenizerImpl>();
  impl->origin = origin;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(origin, ": invalid JSON: ", e.what());
  }
  try {
    const json& model = j.at("model");
    std::string mtype = model.contains("type") ? model["type"].get<std::string>() : "BPE";
    if (mtype != "BPE") fail(origin, ": unsupported model type \"", mtype, "\" (only BPE)");
    if (j.contains("normalizer")) impl->parse_normalizer(j["normalizer"]);
    if (j.contains("pre_tokenizer")) impl->parse_pretokenizer(j["pre_tokenizer"]);
    bool byte_level = !impl->pretokenizers.empty() && impl->pretokenizers.back().kind == PreKind::ByteLevel;
    impl->model = std::make_unique<BpeModel>(model, byte_level, origin);
    // By reference, not a copy: JSON errors then name the value's full path (/added_tokens/3/...).
    const json no_added = json::array();
    const json& added_json = j.contains("added_tokens") ? j.at("added_tokens") : no_added;
    if (!added_json.is_array()) fail(origin, ": added_tokens must be an array");
    if (j.contains("post_processor")) impl->parse_post(j["post_processor"], added_json);
    if (j.contains("decoder")) impl->parse_decoder(j["decoder"]);

    // Id tables: model vocabulary first, added tokens override (as tokenizers' id_to_token).
    uint32_t max_id = 0;
    for (const auto& [tok, id] : impl->model->vocab()) max_id = std::max(max_id, id + 1);
    for (const auto& a : added_json) max_id = std::max(max_id, token_id(a.at("id"), origin, "added_tokens id") + 1);
    impl->id_to_token.resize(max_id);
    impl->has_token.assign(max_id, 0);
    impl->special.assign(max_id, 0);
    for (const auto& [tok, id] : impl->model->vocab()) {
      impl->id_to_token[id] = tok;
      impl->has_token[id] = 1;
      impl->token_to_id.emplace(tok, id);
    }
    for (const auto& a : added_json) {
      AddedToken t;
      t.id = token_id(a.at("id"), origin, "added_tokens id");
      t.content = a.at("content").get<std::string>();
      t.special = get_bool(a, "special", false);
      t.lstrip = get_bool(a, "lstrip", false);
      t.rstrip = get_bool(a, "rstrip", false);
      t.single_word = get_bool(a, "single_word", false);
      t.normalized = get_bool(a, "normalized", !t.special);
      impl->id_to_token[t.id] = t.content;
      impl->has_token[t.id] = 1;
      impl->special[t.id] = t.special;
      impl->token_to_id[t.content] = t.id;
      impl->added.push_back(std::move(t));
    }
    // Matching order as tokenizers builds it: special tokens first, then the others.
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t i = 0; i < impl->added.size(); ++i) {
        const AddedToken& t = impl->added[i];
        if (t.special != (pass == 0)) continue;
        if (t.normalized) impl->norm_trie.add(impl->normalize(t.content), static_cast<int>(i));
        else impl->raw_trie.add(t.content, static_cast<int>(i));
      }
    }
  } catch (const json::exception& e) {
    fail(origin, ": malformed tokenizer.json: ", e.what());
  }
  return Tokenizer(std::move(impl));
}

// ---------------------------------------------------------------------------------------------
// Encoding

std::string TokenizerImpl::normalize(std::string_view in) const {
  std::string s(in);
  for (const Normalizer& n : normalizers) {
    switch (n.kind) {
      case NormKind::NFC: s = unicode::nfc(s); break;
      case NormKind::NFD: s = unicode::nfd(s); break;
      case NormKind::NFKC: s = unicode::nfkc(s); break;
      case NormKind::NFKD: s = unicode::nfkd(s); break;
      case NormKind::Lowercase: {
        std::string out;
        out.reserve(s.size());
        for (std::size_t i = 0; i < s.size();)
          unicode::append_utf8(out, static_cast<char32_t>(utf8proc_tolower(
                                        static_cast<utf8proc_int32_t>(unicode::next_code_point(s, i)))));
        s = std::move(out);
        break;
      }
      case NormKind::Replace:
        if (n.regex) regex_replace_all(s, *n.regex, n.content);
        else replace_all(s, n.pattern, n.content);
        break;
      case NormKind::Prepend:
        if (!s.empty()) s = n.content + s;
        break;
      case NormKind::Strip: {
        std::size_t a = 0, b = s.size();
        if (n.left)
          for (std::size_t i = 0; i < s.size();) {
            std::size_t at = i;
            if (!unicode::is_white_space(unicode::next_code_point(s, i))) break;
            a = i;
            (void)at;
          }
        if (n.right)
          while (b > a) {
            std::size_t k = b - 1;
            while (k > a && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
            std::size_t i = k;
            if (!unicode::is_white_space(unicode::next_code_point(s, i))) break;
            b = k;
          }
        s = s.substr(a, b - a);
        break;
      }
    }
  }
  return s;
}

namespace {
bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  std::size_t k = s.size() - 1;
  while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
  return unicode::is_word_char(unicode::next_code_point(s, k));
}
bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  std::size_t i = 0;
  return unicode::is_word_char(unicode::next_code_point(s, i));
}
}  // namespace

// Splits s around added tokens, calling f(begin, end, token or nullptr) in order; mirrors
// AddedVocabulary::find_matches (single_word, lstrip, rstrip included).
template <typename F>
void TokenizerImpl::split_added(const TokenTrie& trie, std::string_view s, bool parse_special, F&& f) const {
  if (trie.empty()) {
    f(std::size_t(0), s.size(), nullptr);
    return;
  }
  std::size_t done = 0, from = 0, start = 0, stop = 0;
  int value = -1;
  while (trie.find(s, from, start, stop, value)) {
    from = stop;
    const AddedToken& t = added[static_cast<std::size_t>(value)];
    // Like tokenizers, a skipped special token's bytes are not rescanned for other tokens.
    if (!parse_special && t.special) continue;
    if (t.single_word) {
      bool start_space = start == 0 || !ends_with_word(s.substr(0, start));
      bool stop_space = stop == s.size() || !starts_with_word(s.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) {
      std::size_t k = start;
      while (k > 0) {
        std::size_t p = k - 1;
        while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        std::size_t i = p;
        if (!unicode::is_white_space(unicode::next_code_point(s, i))) break;
        k = p;
      }
      start = std::max(k, done);
    }
    if (t.rstrip) {
      for (std::size_t i = stop; i < s.size();) {
        if (!unicode::is_white_space(unicode::next_code_point(s, i))) break;
        stop = i;
      }
    }
    if (done < start) f(done, start, nullptr);
    f(start, stop, &t);
    done = stop;
  }
  if (done < s.size()) f(done, s.size(), nullptr);
}

void TokenizerImpl::encode_chunk(std::string_view s, bool at_origin, bool parse_special,
                                 std::vector<uint32_t>& out) const {
  std::string normalized;
  std::string_view n = s;
  std::size_t origin_span = 0;
  if (at_origin && !s.empty()) origin_span = unicode::utf8_len(static_cast<unsigned char>(s[0]));
  if (!normalizers.empty()) {
    normalized = normalize(s);
    n = normalized;
    if (origin_span) origin_span = std::max<std::size_t>(1, normalize(s.substr(0, origin_span)).size());
  }
  split_added(norm_trie, n, parse_special, [&](std::size_t a, std::size_t b, const AddedToken* t) {
    if (t) out.push_back(t->id);
    else pretokenize_and_model(n.substr(a, b - a), a < origin_span ? origin_span - a : 0, out);
  });
}

namespace {
// Applies a split behaviour to (range, is_match) events covering a piece, as tokenizers'
// NormalizedString::split does, appending the non-empty results.
void emit_split(const Piece& p, std::vector<std::pair<std::pair<std::size_t, std::size_t>, bool>>& ev,
                Behavior behavior, bool invert, std::vector<Piece>& out) {
  if (invert)
    for (auto& e : ev) e.second = !e.second;
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  switch (behavior) {
    case Behavior::Removed:
      for (auto& e : ev)
        if (!e.second) ranges.push_back(e.first);
      break;
    case Behavior::Isolated:
      for (auto& e : ev) ranges.push_back(e.first);
      break;
    case Behavior::MergedWithPrevious: {
      bool prev_match = false;
      for (auto& e : ev) {
        if (e.second && !prev_match && !ranges.empty()) ranges.back().second = e.first.second;
        else ranges.push_back(e.first);
        prev_match = e.second;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool prev_match = false;
      for (auto it = ev.rbegin(); it != ev.rend(); ++it) {
        if (it->second && !prev_match && !ranges.empty()) ranges.back().first = it->first.first;
        else ranges.push_back(it->first);
        prev_match = it->second;
      }
      std::reverse(ranges.begin(), ranges.end());
      break;
    }
    case Behavior::Contiguous: {
      bool prev_match = false, first = true;
      for (auto& e : ev) {
        if (!first && e.second == prev_match) ranges.back().second = e.first.second;
        else ranges.push_back(e.first);
        prev_match = e.second;
        first = false;
      }
      break;
    }
  }
  for (auto [a, b] : ranges)
    if (b > a) out.push_back({p.s.substr(a, b - a), a < p.origin_span ? p.origin_span - a : 0});
}

using Events = std::vector<std::pair<std::pair<std::size_t, std::size_t>, bool>>;

void regex_events(std::string_view s, const TokenizerRegex& re, Events& ev) {
  std::size_t prev = 0;
  re.for_each_match(s, [&](std::size_t a, std::size_t b) {
    if (prev != a) ev.push_back({{prev, a}, false});
    ev.push_back({{a, b}, true});
    prev = b;
  });
  if (prev != s.size()) ev.push_back({{prev, s.size()}, false});
}

void literal_events(std::string_view s, std::string_view lit, Events& ev) {
  std::size_t prev = 0;
  if (!lit.empty())
    for (std::size_t hit; (hit = s.find(lit, prev)) != std::string_view::npos;) {
      if (prev != hit) ev.push_back({{prev, hit}, false});
      ev.push_back({{hit, hit + lit.size()}, true});
      prev = hit + lit.size();
    }
  if (prev != s.size()) ev.push_back({{prev, s.size()}, false});
}

template <typename Pred>
void char_events(std::string_view s, Pred pred, Events& ev) {
  std::size_t last = 0;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t b = i;
    char32_t c = unicode::next_code_point(s, i);
    if (pred(c)) {
      if (last < b) ev.push_back({{last, b}, false});
      ev.push_back({{b, i}, true});
      last = i;
    }
  }
  if (last < s.size()) ev.push_back({{last, s.size()}, false});
}
}  // namespace

void TokenizerImpl::pretokenize_and_model(std::string_view s, std::size_t origin_span,
                                          std::vector<uint32_t>& out) const {
  if (s.empty()) return;
  thread_local std::vector<Piece> cur, next;
  thread_local Events ev;
  thread_local std::deque<std::string> arena;  // storage for pieces a pre-tokenizer rewrote
  arena.clear();
  cur.clear();
  cur.push_back({s, origin_span});
  for (const PreTokenizer& pt : pretokenizers) {
    next.clear();
    for (const Piece& p0 : cur) {
      Piece p = p0;
      ev.clear();
      switch (pt.kind) {
        case PreKind::Split:
          if (pt.regex) regex_events(p.s, *pt.regex, ev);
          else literal_events(p.s, pt.literal, ev);
          emit_split(p, ev, pt.behavior, pt.invert, next);
          break;
        case PreKind::ByteLevel:
          // The byte-to-unicode mapping itself is folded into the model's vocabulary.
          if (pt.add_prefix_space && p.s[0] != ' ') {
            arena.push_back(" " + std::string(p.s));
            p.s = arena.back();
            if (p.origin_span) ++p.origin_span;
          }
          if (pt.regex) {
            regex_events(p.s, *pt.regex, ev);
            emit_split(p, ev, Behavior::Isolated, false, next);
          } else {
            next.push_back(p);
          }
          break;
        case PreKind::Metaspace: {
          std::string t(p.s);
          replace_all(t, " ", pt.literal);
          if (p.origin_span) p.origin_span += t.size() - p.s.size();  // spaces grew into "▁"
          bool starts = t.compare(0, pt.literal.size(), pt.literal) == 0;
          if (!starts && (pt.prepend_scheme == 0 || (pt.prepend_scheme == 1 && p.origin_span > 0))) {
            t = pt.literal + t;
            if (p.origin_span) p.origin_span += pt.literal.size();
          }
          arena.push_back(std::move(t));
          p.s = arena.back();
          if (pt.split) {
            literal_events(p.s, pt.literal, ev);
            emit_split(p, ev, Behavior::MergedWithNext, false, next);
          } else {
            next.push_back(p);
          }
          break;
        }
        case PreKind::Digits:
          char_events(p.s, unicode::is_numeric, ev);
          emit_split(p, ev, pt.individual_digits ? Behavior::Isolated : Behavior::Contiguous, false, next);
          break;
      }
    }
    std::swap(cur, next);
  }
  // Copy: the model call below may not re-enter, but keep `cur` intact for clarity.
  for (const Piece& p : cur) model->tokenize(p.s, out);
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens,
                                        bool parse_special_tokens) const {
  const TokenizerImpl& t = *impl_;
  std::string repaired;
  if (!unicode::is_valid_utf8(text)) {
    repaired = unicode::to_valid_utf8(text);
    text = repaired;
  }
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  t.split_added(t.raw_trie, text, parse_special_tokens, [&](std::size_t a, std::size_t b, const AddedToken* tok) {
    if (tok) ids.push_back(tok->id);
    else t.encode_chunk(text.substr(a, b - a), a == 0, parse_special_tokens, ids);
  });
  if (add_special_tokens)
    for (const PostTemplate& pt : t.post) {
      if (pt.before.empty() && pt.after.empty()) continue;
      std::vector<uint32_t> wrapped(pt.before);
      wrapped.insert(wrapped.end(), ids.begin(), ids.end());
      wrapped.insert(wrapped.end(), pt.after.begin(), pt.after.end());
      ids = std::move(wrapped);
    }
  return ids;
}

// ---------------------------------------------------------------------------------------------
// Decoding

bool TokenizerImpl::token_of(uint32_t id, bool skip_special, std::string& tok) const {
  if (id >= has_token.size() || !has_token[id]) return false;
  if (skip_special && special[id]) return false;
  tok = id_to_token[id];
  return true;
}

namespace {
// Parses "<0xAB>" as tokenizers' ByteFallback decoder does.
int fallback_byte(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  int h = hex(t[3]), l = hex(t[4]);
  return h < 0 || l < 0 ? -1 : h * 16 + l;
}

// Lossy UTF-8 conversion; `truncated_tail` says the input ends inside a character that more
// bytes could still complete.
std::string lossy(std::string_view s, bool& truncated_tail) {
  std::string out;
  out.reserve(s.size());
  truncated_tail = false;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t bad = 0;
    bool trunc = false;
    std::size_t n = unicode::valid_sequence_len(s, i, &bad, &trunc);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += kReplacementChar;
      i += bad;
      truncated_tail = trunc;
    }
  }
  return out;
}

std::vector<char32_t> to_chars(const std::string& s) {
  std::vector<char32_t> c;
  for (std::size_t i = 0; i < s.size();) c.push_back(unicode::next_code_point(s, i));
  return c;
}
}  // namespace

// Runs the decoder chain over `tokens` exactly as tokenizers' decode_chain does when `at_start`
// (the tokens begin the sequence). For streaming, `clean` reports whether the decoded text of
// these tokens followed by any later tokens is this text followed by the later tokens' text
// decoded with at_start=false, i.e. whether the stream may emit here.
std::string TokenizerImpl::decode_tokens(std::vector<std::string> toks, bool at_start, bool* clean) const {
  bool ok = true, joined = false;
  if (!has_decoder) {
    std::string out;
    for (std::size_t i = 0; i < toks.size(); ++i) {
      if (i > 0 || !at_start) out += ' ';
      out += toks[i];
    }
    if (clean) *clean = true;
    return out;
  }
  for (const DecoderStage& d : decoders) {
    switch (d.kind) {
      case DecKind::ByteLevel: {
        std::string bytes;
        for (const std::string& t : toks) {
          std::size_t mark = bytes.size();
          bool all = true;
          for (std::size_t i = 0; i < t.size();) {
            int b = char_to_byte(unicode::next_code_point(t, i));
            if (b < 0) {
              all = false;
              break;
            }
            bytes.push_back(static_cast<char>(b));
          }
          if (!all) {  // a token outside the byte alphabet (an added token) stands for itself
            bytes.resize(mark);
            bytes += t;
          }
        }
        bool trunc = false;
        std::string text = lossy(bytes, trunc);
        if (trunc) ok = false;
        toks.assign(1, std::move(text));
        joined = true;
        break;
      }
      case DecKind::Replace:
        for (std::string& t : toks) {
          if (d.regex) regex_replace_all(t, *d.regex, d.content);
          else replace_all(t, d.pattern, d.content);
        }
        if (joined && (d.regex || to_chars(d.pattern).size() > 1)) ok = false;
        break;
      case DecKind::ByteFallback: {
        std::vector<std::string> out;
        std::string run;
        auto flush = [&] {
          if (run.empty()) return;
          if (unicode::is_valid_utf8(run)) {
            out.push_back(run);
          } else {
            for (std::size_t k = 0; k < run.size(); ++k) out.push_back(kReplacementChar);
          }
          run.clear();
        };
        for (std::string& t : toks) {
          int b = fallback_byte(t);
          if (b >= 0) {
            run.push_back(static_cast<char>(b));
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        // A run still open at the end may yet be completed (or spoiled) by the next bytes.
        if (!run.empty()) ok = false;
        flush();
        toks = std::move(out);
        break;
      }
      case DecKind::Fuse: {
        std::string all;
        for (const std::string& t : toks) all += t;
        toks.assign(1, std::move(all));
        joined = true;
        break;
      }
      case DecKind::Strip:
        for (std::size_t k = 0; k < toks.size(); ++k) {
          std::vector<char32_t> c = to_chars(toks[k]);
          std::size_t a = 0, b = c.size();
          // After a join the single token is the whole text: its start is the sequence start.
          std::size_t start = joined && !at_start ? 0 : d.start;
          while (a < start && a < b && c[a] == d.strip_char) ++a;
          while (c.size() - b < d.stop && b > a && c[b - 1] == d.strip_char) --b;
          if (joined && (d.stop > 0 || (a == b && a < start))) ok = false;
          std::string out;
          for (std::size_t i = a; i < b; ++i) unicode::append_utf8(out, c[i]);
          toks[k] = std::move(out);
        }
        break;
      case DecKind::Metaspace:
        for (std::size_t k = 0; k < toks.size(); ++k) {
          bool first = k == 0 && at_start && d.prepend;
          std::string& t = toks[k];
          replace_all(t, d.replacement, first ? "" : " ");
        }
        if (joined && d.prepend) ok = false;
        break;
    }
  }
  if (clean) *clean = ok;
  std::string out;
  for (const std::string& t : toks) out += t;
  return out;
}

std::string Tokenizer::decode(std::span<const uint32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  std::string tok;
  for (uint32_t id : ids)
    if (impl_->token_of(id, skip_special_tokens, tok)) toks.push_back(tok);
  return impl_->decode_tokens(std::move(toks), true, nullptr);
}

std::size_t Tokenizer::vocab_size() const { return impl_->id_to_token.size(); }

std::optional<uint32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->token_to_id.find(token);
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::id_to_token(uint32_t id) const {
  if (id >= impl_->has_token.size() || !impl_->has_token[id]) return std::nullopt;
  return impl_->id_to_token[id];
}

bool Tokenizer::is_special(uint32_t id) const { return id < impl_->special.size() && impl_->special[id]; }

DecodeStream::DecodeStream(const Tokenizer& tokenizer, bool skip_special_tokens)
    : impl_(tokenizer.impl_), skip_special_(skip_special_tokens) {}

std::string DecodeStream::step(uint32_t id) {
  std::string tok;
  if (!impl_->token_of(id, skip_special_, tok)) return {};  // decode() drops these ids too
  pending_.push_back(id);
  std::vector<std::string> toks;
  toks.reserve(pending_.size());
  for (uint32_t p : pending_) toks.push_back(impl_->id_to_token[p]);
  bool clean = false;
  std::string text = impl_->decode_tokens(std::move(toks), at_start_, &clean);
  if (!clean) return {};
  pending_.clear();
  at_start_ = false;
  return text;
}

std::string DecodeStream::finish() {
  if (pending_.empty()) return {};
  std::vector<std::string> toks;
  for (uint32_t p : pending_) toks.push_back(impl_->id_to_token[p]);
  std::string text = impl_->decode_tokens(std::move(toks), at_start_, nullptr);
  pending_.clear();
  at_start_ = false;
  return text;
}

}  // namespace vireo
