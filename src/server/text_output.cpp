#include "server/text_output.h"

#include <algorithm>
#include <utility>

namespace vireo::server {

std::string StopMatcher::feed(std::string_view text) {
  if (stopped_) return {};
  held_.append(text);
  if (stops_.empty()) return std::exchange(held_, {});
  size_t first = std::string::npos, len = 0;
  for (const std::string& s : stops_)
    if (const size_t at = held_.find(s); at < first) first = at, len = s.size();
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, first + (include_stop_ ? len : 0));
    held_.clear();
    return out;
  }
  // Withhold the longest suffix that is a proper prefix of some stop string.
  size_t keep = 0;
  for (const std::string& s : stops_)
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k)
      if (std::string_view(held_).substr(held_.size() - k) == std::string_view(s).substr(0, k)) {
        keep = k;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  if (stopped_) return {};
  return std::exchange(held_, {});
}

ThinkTokens think_tokens_of(const Tokenizer& tokenizer) {
  const std::optional<uint32_t> open = tokenizer.token_to_id("<think>"), close = tokenizer.token_to_id("</think>");
  if (!open || !close) return {};
  return {int32_t(*open), int32_t(*close)};
}

TextOutput::TextOutput(const Tokenizer* tokenizer, std::vector<std::string> stops, ThinkTokens think,
                       bool starts_in_reasoning, bool include_stop, bool skip_special)
    : matcher_(std::move(stops), include_stop),
      think_(think),
      in_reasoning_(think.splits() && starts_in_reasoning),
      include_stop_(include_stop),
      skip_special_(skip_special) {
  if (tokenizer) decoder_.emplace(*tokenizer, skip_special);
}

TextPiece TextOutput::token(int32_t id) {
  ++fed_;
  if (in_reasoning_) content_start_ = fed_;
  if (!decoder_) return {{}, in_reasoning_, {}};
  // A marker that splits here (</think> ending the reasoning, <think> opening the reply) is text in
  // neither part: with special tokens written it is not decoded at all (a byte-level vocabulary's
  // text is then the rest's, as if it were cut out). Elsewhere it is text like any special token.
  const bool closes = think_.splits() && in_reasoning_ && id == think_.close;
  const bool opens = think_.splits() && fed_ == 1 && id == think_.open;
  std::string released =
      matcher_.feed((closes || opens) && !skip_special_ ? std::string() : decoder_->step(uint32_t(id)));
  if (!in_reasoning_) {
    TextPiece out = content_piece(std::move(released));
    if (opens) {
      in_reasoning_ = true;  // (nothing was withheld before the first id)
      content_start_ = fed_;
    }
    return out;
  }
  TextPiece out{std::move(released), true, {}};
  if (closes) {
    // The reasoning ends: an incomplete character is settled into it; a possible stop string's
    // start stays withheld (a stop string may go on in the content).
    out.text += matcher_.feed(decoder_->finish());
    in_reasoning_ = false;
  }
  reasoning_held_ = matcher_.held();
  return out;
}

TextPiece TextOutput::content_piece(std::string released) {
  const size_t r = std::min(released.size(), reasoning_held_);
  reasoning_held_ = matcher_.stopped() ? 0 : reasoning_held_ - r;
  return {released.substr(r), false, released.substr(0, r)};
}

TextPiece TextOutput::stop_token(int32_t id) {
  if (include_stop_) return token(id);
  ++fed_;
  if (in_reasoning_) content_start_ = fed_;
  return {{}, in_reasoning_, {}};
}

TextPiece TextOutput::finish() {
  if (!decoder_) return {{}, in_reasoning_, {}};
  std::string released = matcher_.feed(decoder_->finish());
  if (!matcher_.stopped()) released += matcher_.flush();
  if (in_reasoning_) return {std::move(released), true, {}};
  return content_piece(std::move(released));
}

}  // namespace vireo::server
