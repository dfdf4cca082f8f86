#include "text/tokenizer_bpe.h"

#include <algorithm>
#include <array>
#include <queue>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/unicode.h"

namespace vireo {

namespace {
struct ByteTables {
  std::array<char32_t, 256> to_char{};
  std::unordered_map<char32_t, int> to_byte;
  ByteTables() {
    // Printable Latin-1 bytes keep their code point; the rest map to 256, 257, ... in order.
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_char[b] = printable ? char32_t(b) : char32_t(256 + n++);
      to_byte[to_char[b]] = b;
    }
  }
};
const ByteTables& byte_tables() {
  static const ByteTables t;
  return t;
}

// The raw bytes a byte-level token spells, or nullopt if it has a character outside the table.
std::optional<std::string> byte_level_bytes(std::string_view token) {
  std::string out;
  std::size_t i = 0;
  while (i < token.size()) {
    int b = char_to_byte(unicode::next_code_point(token, i));
    if (b < 0) return std::nullopt;
    out.push_back(static_cast<char>(b));
  }
  return out;
}

std::string opt_string(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? std::string() : it->get<std::string>();
}
bool opt_bool(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && !it->is_null() && it->get<bool>();
}
}  // namespace

char32_t byte_to_char(uint8_t b) { return byte_tables().to_char[b]; }
int char_to_byte(char32_t c) {
  const auto& m = byte_tables().to_byte;
  auto it = m.find(c);
  return it == m.end() ? -1 : it->second;
}

void MergeMap::reserve(std::size_t n) {
  std::size_t cap = 16;
  shift_ = 60;
  while (cap < 2 * n) {
    cap <<= 1;
    --shift_;
  }
  entries_.assign(cap, Entry{});
  mask_ = cap - 1;
  size_ = 0;
}

void MergeMap::insert(uint32_t a, uint32_t b, Value v) {
  uint64_t key = (uint64_t(a) << 32) | b;
  for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
    Entry& e = entries_[i];
    if (e.key == key) {
      e.value = v;
      return;
    }
    if (e.key == kEmpty) {
      e.key = key;
      e.value = v;
      ++size_;
      return;
    }
  }
}

uint32_t token_id(const nlohmann::json& v, const std::string& where, const std::string& what) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= int64_t(kMaxTokenId))
    fail(where, ": ", what, " must be a token id in [0, ", kMaxTokenId, "), got ", v.dump());
  return uint32_t(v.get<int64_t>());
}

BpeModel::BpeModel(const nlohmann::json& model, bool byte_level, const std::string& where)
    : byte_level_(byte_level) {
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
    fail(where, ": model.dropout is not supported (inference needs deterministic BPE)");
  const auto& vocab = model.at("vocab");
  if (!vocab.is_object()) fail(where, ": model.vocab must be an object");
  vocab_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it)
    vocab_.emplace(it.key(), token_id(it.value(), where, "model.vocab[\"" + it.key() + "\"]"));

  fuse_unk_ = opt_bool(model, "fuse_unk");
  byte_fallback_ = opt_bool(model, "byte_fallback");
  ignore_merges_ = opt_bool(model, "ignore_merges");
  prefix_ = opt_string(model, "continuing_subword_prefix");
  suffix_ = opt_string(model, "end_of_word_suffix");
  std::string unk = opt_string(model, "unk_token");
  if (!unk.empty()) {
    auto it = vocab_.find(unk);
    if (it == vocab_.end()) fail(where, ": model.unk_token \"", unk, "\" is not in model.vocab");
    unk_id_ = it->second;
  }

  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  std::fill(std::begin(fallback_ids_), std::end(fallback_ids_), -1);
  if (byte_level_) {
    for (const auto& [tok, id] : vocab_) {
      auto bytes = byte_level_bytes(tok);
      if (!bytes) continue;  // not reachable from byte-level input
      if (bytes->size() == 1 && prefix_.empty() && suffix_.empty())
        byte_ids_[static_cast<uint8_t>((*bytes)[0])] = id;
      vocab_bytes_.emplace(std::move(*bytes), id);
    }
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    auto it = vocab_.find(std::string_view(name));
    if (it != vocab_.end()) fallback_ids_[b] = it->second;
  }

  const auto& merges = model.at("merges");
  merges_.reserve(merges.size());
  uint32_t rank = 0;
  for (const auto& m : merges) {
    std::string a, b;
    if (m.is_string()) {
      // Legacy "left right" spelling: tokens of this format never contain a space.
      const std::string& s = m.get_ref<const std::string&>();
      auto sp = s.find(' ');
      if (sp == std::string::npos) fail(where, ": model.merges entry \"", s, "\" is not \"left right\"");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      fail(where, ": model.merges entry ", rank, " is neither \"a b\" nor [a, b]");
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b);
    if (ia == vocab_.end() || ib == vocab_.end())
      fail(where, ": model.merges entry ", rank, " uses a token missing from model.vocab: \"",
           ia == vocab_.end() ? a : b, "\"");
    std::string merged = a + (b.compare(0, prefix_.size(), prefix_) == 0 ? b.substr(prefix_.size()) : b);
    auto im = vocab_.find(merged);
    if (im == vocab_.end())
      fail(where, ": model.merges entry ", rank, " makes \"", merged, "\", which is not in model.vocab");
    merges_.insert(ia->second, ib->second, {rank, im->second});
    ++rank;
  }
}

void BpeModel::initial_symbols(std::string_view w, std::vector<uint32_t>& ids) const {
  if (byte_level_ && prefix_.empty() && suffix_.empty()) {
    bool all = true;
    for (char c : w) {
      int64_t id = byte_ids_[static_cast<uint8_t>(c)];
      if (id < 0) {
        all = false;
        break;
      }
      ids.push_back(static_cast<uint32_t>(id));
    }
    if (all) return;
    ids.clear();
  }
  // General path, following tokenizers' merge_word: one symbol per character (per byte for
  // byte-level input), then byte fallback or unk for symbols missing from the vocabulary.
  int64_t pending_unk = -1;  // an unk symbol not yet emitted (fuse_unk extends it)
  std::string s;
  std::size_t i = 0;
  while (i < w.size()) {
    std::size_t n = byte_level_ ? 1 : unicode::utf8_len(static_cast<unsigned char>(w[i]));
    bool first = i == 0, last = i + n >= w.size();
    std::string_view piece = w.substr(i, n);
    i += n;
    s.clear();
    if (!first) s += prefix_;
    if (byte_level_) {
      unicode::append_utf8(s, byte_to_char(static_cast<uint8_t>(piece[0])));
    } else {
      s += piece;
    }
    if (last) s += suffix_;
    auto it = vocab_.find(std::string_view(s));
    if (it != vocab_.end()) {
      if (pending_unk >= 0) {
        ids.push_back(static_cast<uint32_t>(pending_unk));
        pending_unk = -1;
      }
      ids.push_back(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool ok = true;
      for (char c : s) ok = ok && fallback_ids_[static_cast<uint8_t>(c)] >= 0;
      if (ok) {
        for (char c : s) ids.push_back(static_cast<uint32_t>(fallback_ids_[static_cast<uint8_t>(c)]));
        continue;
      }
    }
    if (!unk_id_) fail("tokenizer: \"", s, "\" is not in the vocabulary and the model has no unk_token");
    if (pending_unk >= 0 && !fuse_unk_) ids.push_back(static_cast<uint32_t>(pending_unk));
    pending_unk = *unk_id_;
  }
  if (pending_unk >= 0) ids.push_back(static_cast<uint32_t>(pending_unk));
}

void BpeModel::apply_merges(std::vector<uint32_t>& ids) const {
  const std::size_t n = ids.size();
  if (n < 2) return;
  if (n <= 24) {
    // Short words: rescanning all pairs beats a heap. Lowest rank wins, leftmost on ties.
    std::vector<uint32_t>& s = ids;
    while (s.size() > 1) {
      uint32_t best_rank = UINT32_MAX, best_id = 0;
      std::size_t best = 0;
      for (std::size_t i = 0; i + 1 < s.size(); ++i) {
        const MergeMap::Value* v = merges_.find(s[i], s[i + 1]);
        if (v && v->rank < best_rank) {
          best_rank = v->rank;
          best_id = v->id;
          best = i;
        }
      }
      if (best_rank == UINT32_MAX) break;
      s[best] = best_id;
      s.erase(s.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    }
    return;
  }
  // Long words: a linked list of symbols and a heap of candidate merges, (rank, position) order.
  struct Sym {
    uint32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Sym> sym(n);
  for (std::size_t i = 0; i < n; ++i)
    sym[i] = {ids[i], int32_t(i) - 1, i + 1 < n ? int32_t(i + 1) : -1, true};
  struct Cand {
    uint32_t rank;
    uint32_t pos;
    uint32_t id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  for (std::size_t i = 0; i + 1 < n; ++i)
    if (const auto* v = merges_.find(ids[i], ids[i + 1])) heap.push({v->rank, uint32_t(i), v->id});
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& left = sym[c.pos];
    if (!left.alive || left.next < 0) continue;
    Sym& right = sym[left.next];
    // Stale entry: the pair at this position changed since it was queued.
    const auto* v = merges_.find(left.id, right.id);
    if (!v || v->id != c.id) continue;
    left.id = c.id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) sym[left.next].prev = int32_t(c.pos);
    if (left.prev >= 0)
      if (const auto* pv = merges_.find(sym[left.prev].id, left.id))
        heap.push({pv->rank, uint32_t(left.prev), pv->id});
    if (left.next >= 0)
      if (const auto* nv = merges_.find(left.id, sym[left.next].id))
        heap.push({nv->rank, c.pos, nv->id});
  }
  ids.clear();
  for (int32_t i = 0; i >= 0; i = sym[i].next) ids.push_back(sym[i].id);
}

void BpeModel::merge_word(std::string_view word, std::vector<uint32_t>& ids) const {
  ids.clear();
  initial_symbols(word, ids);
  apply_merges(ids);
}

void BpeModel::tokenize(std::string_view word, std::vector<uint32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const StringIdMap& m = byte_level_ ? vocab_bytes_ : vocab_;
    auto it = m.find(word);
    if (it != m.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::unique_lock lock(cache_mutex_, std::try_to_lock);
    if (lock.owns_lock()) {
      auto it = cache_.find(word);
      if (it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
  }
  thread_local std::vector<uint32_t> ids;
  merge_word(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::unique_lock lock(cache_mutex_, std::try_to_lock);
    if (lock.owns_lock()) {
      if (cache_.size() >= kCacheMaxEntries) cache_.clear();
      cache_.emplace(std::string(word), ids);
    }
  }
}

}  // namespace vireo
