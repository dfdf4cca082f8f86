#pragma once
// The BPE model of tokenizer.json: vocabulary, merges ranked by position, byte fallback, unk.
// Words are merged lowest rank first (leftmost on ties), exactly as `tokenizers` does.
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace vireo {

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using StringIdMap = std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>>;

// Open-addressing map from a token pair (left id, right id) to (rank, merged id): the hot lookup
// of the merge loop, so it avoids std::unordered_map's node chasing.
class MergeMap {
 public:
  struct Value {
    uint32_t rank;
    uint32_t id;
  };
  void reserve(std::size_t n);
  void insert(uint32_t a, uint32_t b, Value v);  // a later insert of the same pair wins
  const Value* find(uint32_t a, uint32_t b) const {
    uint64_t key = (uint64_t(a) << 32) | b;
    for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
      const Entry& e = entries_[i];
      if (e.key == key) return &e.value;
      if (e.key == kEmpty) return nullptr;
    }
  }
  std::size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  struct Entry {
    uint64_t key = kEmpty;
    Value value{};
  };
  std::size_t slot(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull) >> shift_; }
  std::vector<Entry> entries_;
  std::size_t mask_ = 0, size_ = 0;
  int shift_ = 64;
};

// Token ids above this are refused (the id tables are sized by the largest id; real
// vocabularies stay under 2^19).
constexpr uint32_t kMaxTokenId = 1u << 22;
// A token id field of tokenizer.json: an integer in [0, kMaxTokenId), else fail naming `where`
// and `what`.
uint32_t token_id(const nlohmann::json& v, const std::string& where, const std::string& what);

class BpeModel {
 public:
  // `byte_level`: the pre-tokenizer ends with ByteLevel, so words arrive as raw bytes and the
  // vocabulary's byte-to-unicode spelling is undone here once, instead of per word at run time.
  BpeModel(const nlohmann::json& model, bool byte_level, const std::string& where);

  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<uint32_t>& out) const;

  const StringIdMap& vocab() const { return vocab_; }  // as spelled in tokenizer.json

 private:
  void merge_word(std::string_view word, std::vector<uint32_t>& ids) const;
  void initial_symbols(std::string_view word, std::vector<uint32_t>& ids) const;
  void apply_merges(std::vector<uint32_t>& ids) const;

  StringIdMap vocab_;        // token (tokenizer.json spelling) -> id
  StringIdMap vocab_bytes_;  // byte_level: token as raw bytes -> id (for ignore_merges)
  bool byte_level_;
  int64_t byte_ids_[256];      // byte_level: id of each single-byte token, -1 if absent
  int64_t fallback_ids_[256];  // byte_fallback: id of "<0xXX>", -1 if absent
  MergeMap merges_;
  std::optional<uint32_t> unk_id_;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  std::string prefix_, suffix_;  // continuing_subword_prefix, end_of_word_suffix

  // Cache of merged words (as `tokenizers` keeps one): most words of real text repeat.
  static constexpr std::size_t kCacheMaxWordBytes = 256;
  static constexpr std::size_t kCacheMaxEntries = 1 << 16;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<uint32_t>, StringHash, std::equal_to<>> cache_;
};

// The GPT-2 byte-to-unicode table: byte b is spelled as code point byte_to_char(b).
char32_t byte_to_char(uint8_t b);
// Inverse of byte_to_char; -1 for code points outside the table.
int char_to_byte(char32_t c);

}  // namespace vireo
