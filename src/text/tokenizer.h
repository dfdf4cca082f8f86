#pragma once
// Tokenizer: loads a Hugging Face tokenizer.json (BPE model) and encodes/decodes exactly as the
// Python `tokenizers` package does. Pipeline of encode:
//   added/special tokens matched on the raw text -> normalizer -> added tokens with
//   normalized=true matched on the normalized text -> pre-tokenizer -> BPE per word ->
//   post-processor (only with add_special_tokens).
// decode maps ids to token strings and runs the decoder chain. DecodeStream decodes one id at a
// time, emitting only text that can no longer change: never a broken UTF-8 character, and the
// concatenation of its outputs always equals decode() of all the ids.
// Thread safety: a loaded Tokenizer is immutable and may be used from many threads at once.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vireo {

struct TokenizerImpl;

class Tokenizer {
 public:
  // Reads tokenizer.json, or tokenizer.json.gz when the path ends in ".gz". Throws vireo::Error
  // naming the file and the field or component type that is wrong or unsupported.
  static Tokenizer from_file(const std::string& path);
  // `origin` names the source in error messages.
  static Tokenizer from_json(std::string_view json_text, const std::string& origin = "tokenizer.json");

  // Input that is not valid UTF-8 is first repaired: each maximal ill-formed subsequence becomes
  // U+FFFD (what Python's bytes.decode("utf-8", "replace") does), then encoded as usual.
  // add_special_tokens: run the post-processor (e.g. prepend BOS).
  // parse_special_tokens=false reads special tokens spelled in the text as plain text (tokenizers'
  // encode_special_tokens=True), so that user content cannot inject control tokens; non-special
  // added tokens are still matched.
  std::vector<uint32_t> encode(std::string_view text, bool add_special_tokens = true,
                               bool parse_special_tokens = true) const;

  // Ids with no token (out of range) are skipped, as `tokenizers` does. The result is valid UTF-8:
  // byte tokens that do not form characters decode to U+FFFD as in `tokenizers`.
  std::string decode(std::span<const uint32_t> ids, bool skip_special_tokens = false) const;

  // One past the largest id (model vocabulary and added tokens).
  std::size_t vocab_size() const;
  std::optional<uint32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(uint32_t id) const;  // as spelled in tokenizer.json
  bool is_special(uint32_t id) const;                          // an added token with special=true

 private:
  explicit Tokenizer(std::shared_ptr<const TokenizerImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const TokenizerImpl> impl_;
  friend class DecodeStream;
};

// Incremental detokenization for generation. step() returns the text that became final with this
// id (often empty while a multi-byte character or a byte-fallback run is incomplete); finish()
// returns the rest. Concatenating every step() and finish() equals
// tokenizer.decode(all ids, skip_special_tokens).
class DecodeStream {
 public:
  explicit DecodeStream(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  std::string step(uint32_t id);
  std::string finish();

 private:
  std::shared_ptr<const TokenizerImpl> impl_;
  bool skip_special_;
  bool at_start_ = true;          // nothing emitted yet: position-dependent decoders apply
  std::vector<uint32_t> pending_;  // ids whose text is not final yet
};

}  // namespace vireo
