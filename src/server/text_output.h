#pragma once
// Generated ids -> the text a client sees: incremental detokenization (special tokens skipped), and
// stop strings matched on the text. Text that could still turn out to be the start of a stop string
// is withheld until it cannot, so a stop string never leaks into the output, even when it spans
// several tokens.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"

namespace vireo::server {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Appends `text`; returns what may be emitted now. After a stop string is found, stopped() is
  // true and the returned text is everything before it.
  std::string feed(std::string_view text);
  std::string flush();  // the withheld rest (at the end of generation)
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

class TextOutput {
 public:
  // `tokenizer` may be null: the model has no tokenizer, and there is no text.
  TextOutput(const Tokenizer* tokenizer, std::vector<std::string> stops);
  std::string token(int32_t id);  // text made final by this id (possibly empty)
  std::string finish();           // the rest at the end
  bool stopped() const { return matcher_.stopped(); }

 private:
  std::optional<DecodeStream> decoder_;
  StopMatcher matcher_;
};

}  // namespace vireo::server
