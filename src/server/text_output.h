#pragma once
// Generated ids -> the text a client sees: incremental detokenization (special tokens skipped, or
// not: vLLM's skip_special_tokens), and
// stop strings matched on the text. Text that could still turn out to be the start of a stop string
// is withheld until it cannot, so a stop string never leaks into the output, even when it spans
// several tokens.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"

namespace vireo::server {

class StopMatcher {
 public:
  // include_stop: the text returned at a stop ends with the stop string (vLLM's
  // include_stop_str_in_output), else just before it.
  explicit StopMatcher(std::vector<std::string> stops, bool include_stop = false)
      : stops_(std::move(stops)), include_stop_(include_stop) {}
  // Appends `text`; returns what may be emitted now. After a stop string is found, stopped() is
  // true and the returned text is everything before it (and it, with include_stop). The earliest
  // stop string wins; of two starting there, the one listed first.
  std::string feed(std::string_view text);
  std::string flush();  // the withheld rest (at the end of generation)
  bool stopped() const { return stopped_; }
  size_t held() const { return held_.size(); }  // bytes withheld now

 private:
  std::vector<std::string> stops_;
  bool include_stop_ = false;
  std::string held_;
  bool stopped_ = false;
};

// A reasoning model's thinking markers (special tokens): GLM-5's and DeepSeek-R1's <think> and
// </think>. -1: none (no reasoning split).
struct ThinkTokens {
  int32_t open = -1, close = -1;
  bool splits() const { return close >= 0; }
  // Whether a reply to `prompt` starts inside the reasoning (the prompt ends with <think>: a
  // template with thinking on).
  bool opened_by(const std::vector<int32_t>& prompt) const {
    return splits() && !prompt.empty() && prompt.back() == open;
  }
};
// The tokenizer's <think> and </think> (none where it lacks either).
ThinkTokens think_tokens_of(const Tokenizer& tokenizer);

// Text pieces: with ThinkTokens, what comes before </think> is the reasoning (a generation starts
// inside it where the prompt ends with <think>, or enters it where its first token is <think>),
// the rest the content, as vLLM's glm45 / deepseek_r1 reasoning parsers split a chat reply. Stop
// strings are matched on the whole text, as vLLM's detokenizer matches them before any parser
// splits it: one may span </think>, and the reasoning's tail that could start one is withheld past
// the marker (an incomplete character is settled into the reasoning there). So a content id's piece
// may first release such reasoning text (held_reasoning), then its own.
struct TextPiece {
  std::string text;  // the id's part's text (the reasoning's where `reasoning`)
  bool reasoning = false;
  std::string held_reasoning;  // (content pieces) reasoning text released before `text`
};

class TextOutput {
 public:
  // `tokenizer` may be null: the model has no tokenizer, and there is no text. skip_special false:
  // special tokens' text is written too, but for a reasoning split's markers where they split (the
  // </think> that ends the reasoning, a <think> that opens the reply), which are in neither part,
  // as vLLM's reasoning parsers leave them out.
  TextOutput(const Tokenizer* tokenizer, std::vector<std::string> stops, ThinkTokens think = {},
             bool starts_in_reasoning = false, bool include_stop = false, bool skip_special = true);
  TextPiece token(int32_t id);  // text made final by this id (possibly empty)
  // The id that ended the generation (an EOS or a stop token id): counted but not written, as vLLM
  // leaves a stop token's text out unless include_stop_str_in_output (then it is token(id)).
  TextPiece stop_token(int32_t id);
  TextPiece finish();           // the rest at the end
  bool stopped() const { return matcher_.stopped(); }
  // How many of the ids fed so far are reasoning (with </think>): the content's ids start here.
  size_t content_start() const { return content_start_; }

 private:
  // Text the matcher released after the reasoning ended: its first reasoning_held_ bytes are the
  // reasoning's.
  TextPiece content_piece(std::string released);

  std::optional<DecodeStream> decoder_;
  StopMatcher matcher_;
  ThinkTokens think_;
  bool in_reasoning_ = false, include_stop_ = false, skip_special_ = true;
  size_t fed_ = 0, content_start_ = 0;
  size_t reasoning_held_ = 0;  // of the matcher's withheld bytes, the reasoning's (they come first)
};

}  // namespace vireo::server
