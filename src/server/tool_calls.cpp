#include "server/tool_calls.h"

#include <algorithm>
#include <initializer_list>

#include <nlohmann/json.hpp>

namespace vireo::server {

namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>", kKey = "<arg_key>", kKeyEnd = "</arg_key>",
                           kValue = "<arg_value>", kValueEnd = "</arg_value>";

constexpr size_t kLongestTag = std::max(kClose.size(), kValueEnd.size());  // 12

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

std::string trim(std::string_view s) {
  size_t a = 0, b = s.size();
  while (a < b && is_space(s[a])) ++a;
  while (b > a && is_space(s[b - 1])) --b;
  return std::string(s.substr(a, b - a));
}

// The earliest of `tags` in text from `from`: its position and its index in the list (npos, -1:
// none of them is there yet).
struct Found {
  size_t pos = std::string::npos;
  int which = -1;
};
Found find_first(std::string_view text, size_t from, std::initializer_list<std::string_view> tags) {
  Found f;
  int i = 0;
  for (std::string_view tag : tags) {
    const size_t p = text.find(tag, from);
    if (p < f.pos) f = {p, i};
    ++i;
  }
  return f;
}

// How many bytes at the end of text[from..] may still become one of `tags` (a proper prefix of one).
size_t partial_tag(std::string_view text, size_t from, std::initializer_list<std::string_view> tags) {
  size_t keep = 0;
  for (std::string_view tag : tags)
    for (size_t n = std::min(tag.size() - 1, text.size() - from); n > keep; --n)
      if (text.substr(text.size() - n) == tag.substr(0, n)) {
        keep = n;
        break;
      }
  return keep;
}

// What may follow the whitespace at text[from..]: `tag` (1), not it (-1), or not known yet (0).
int starts_with_after_space(std::string_view text, size_t from, std::string_view tag, size_t* at) {
  while (from < text.size() && is_space(text[from])) ++from;
  *at = from;
  const std::string_view rest = text.substr(from);
  if (rest.size() >= tag.size()) return rest.substr(0, tag.size()) == tag ? 1 : -1;
  return tag.substr(0, rest.size()) == rest ? 0 : -1;
}

// JSON text of a string, invalid UTF-8 replaced (as the server's JSON output does).
std::string json_string(std::string_view s) {
  return ojson(std::string(s)).dump(-1, ' ', false, ojson::error_handler_t::replace);
}
// The escaped characters of s, without the quotes. Escaping goes byte by byte from an ASCII byte on,
// so pieces cut right after ASCII bytes escape to the pieces of the whole.
std::string json_chars(std::string_view s) {
  const std::string q = json_string(s);
  return q.substr(1, q.size() - 2);
}

}  // namespace

bool ToolCallReader::string_param(const std::string& key) const {
  const auto tool = string_params_.find(call_.name);
  return tool != string_params_.end() && std::find(tool->second.begin(), tool->second.end(), key) != tool->second.end();
}

void ToolCallReader::emit(std::vector<ToolCallDelta>& out, std::string piece, bool starts) {
  call_.arguments += piece;
  const size_t index = started_ - 1;
  if (!starts && !out.empty() && out.back().index == index) {
    out.back().arguments += piece;
  } else if (starts || !piece.empty()) {
    out.push_back({index, starts, starts ? call_.name : std::string(), std::move(piece)});
  }
}

std::vector<ToolCallDelta> ToolCallReader::feed(std::string_view text) {
  text_ += text;
  std::vector<ToolCallDelta> out;
  step(out);
  return out;
}

void ToolCallReader::step(std::vector<ToolCallDelta>& out) {
  const std::string_view t = text_;
  // The earliest of `tags` from at_, searched from where the last search left off (less a tag's
  // length: one may straddle the old end), so a long value waiting for its end is not read again
  // at every piece.
  auto find = [&](std::initializer_list<std::string_view> tags) {
    const Found f = find_first(t, std::max(at_, scanned_), tags);
    scanned_ = f.pos == std::string::npos && t.size() >= kLongestTag ? t.size() - kLongestTag + 1 : 0;
    return f;
  };
  auto end_call = [&] {
    emit(out, first_arg_ ? "{}" : "}");
    calls_.push_back(std::move(call_));
    call_ = {};
    consumed_ = at_;
    state_ = calls_.size() >= max_calls_ ? State::Done : State::Between;
  };
  for (;;) {
    switch (state_) {
      case State::Done: return;
      case State::Between: {  // whitespace, then <tool_call> (anything else ends the calls)
        size_t p = 0;
        const int r = starts_with_after_space(t, at_, kOpen, &p);
        if (r < 0) state_ = State::Done;
        if (r <= 0) return;
        at_ = p + kOpen.size();
        call_ = {"", ""};
        first_arg_ = true;
        state_ = State::Name;
        break;
      }
      case State::Name: {  // up to the first <arg_key> or </tool_call>
        const Found f = find({kKey, kClose});
        if (f.pos == std::string::npos) return;
        call_.name = trim(t.substr(at_, f.pos - at_));
        if (call_.name.empty()) {
          state_ = State::Done;
          return;
        }
        ++started_;
        emit(out, "", /*starts=*/true);
        if (f.which == 0) {
          at_ = f.pos + kKey.size();
          state_ = State::Key;
        } else {
          at_ = f.pos + kClose.size();
          end_call();
        }
        break;
      }
      case State::Key: {  // the key, up to </arg_key> (any other tag first: not this format)
        const Found f = find({kKeyEnd, kValue, kValueEnd, kClose});
        if (f.pos == std::string::npos) return;
        if (f.which != 0) {
          state_ = State::Done;
          return;
        }
        key_ = trim(t.substr(at_, f.pos - at_));
        at_ = f.pos + kKeyEnd.size();
        state_ = State::KeyEnd;
        break;
      }
      case State::KeyEnd: {  // then <arg_value> (what lies between is not read)
        const Found f = find({kValue, kValueEnd, kClose});
        if (f.pos == std::string::npos) return;
        if (f.which != 0) {
          state_ = State::Done;
          return;
        }
        at_ = f.pos + kValue.size();
        streaming_value_ = string_param(key_);
        if (streaming_value_) {
          emit(out, std::string(first_arg_ ? "{" : ",") + json_string(key_) + ":\"");
          first_arg_ = false;
        }
        state_ = State::Value;
        break;
      }
      case State::Value: {  // up to </arg_value>; a string parameter's text goes out as it comes
        const Found f = find({kValueEnd, kClose});
        if (f.pos == std::string::npos) {
          if (streaming_value_) {
            // Held back: what may still become a tag, and the bytes of a character not yet whole
            // (a piece ends right after an ASCII byte).
            size_t end = t.size() - partial_tag(t, at_, {kValueEnd, kClose});
            while (end > at_ && static_cast<unsigned char>(t[end - 1]) >= 0x80) --end;
            if (end > at_) {
              emit(out, json_chars(t.substr(at_, end - at_)));
              at_ = end;
            }
          }
          return;
        }
        if (f.which != 0) {
          state_ = State::Done;
          return;
        }
        const std::string_view value = t.substr(at_, f.pos - at_);
        at_ = f.pos + kValueEnd.size();
        if (streaming_value_) {
          emit(out, json_chars(value) + "\"");
        } else {
          const ojson parsed = ojson::parse(value, nullptr, /*allow_exceptions=*/false);
          const std::string v =
              parsed.is_discarded() ? json_string(value) : parsed.dump(-1, ' ', false, ojson::error_handler_t::replace);
          emit(out, std::string(first_arg_ ? "{" : ",") + json_string(key_) + ":" + v);
          first_arg_ = false;
        }
        state_ = State::AfterValue;
        break;
      }
      case State::AfterValue: {  // whitespace, then <arg_key> or </tool_call>
        size_t p = 0;
        const int key = starts_with_after_space(t, at_, kKey, &p), close = starts_with_after_space(t, at_, kClose, &p);
        if (key < 0 && close < 0) state_ = State::Done;
        if (key <= 0 && close <= 0) return;
        if (key > 0) {
          at_ = p + kKey.size();
          state_ = State::Key;
        } else {
          at_ = p + kClose.size();
          end_call();
        }
        break;
      }
    }
  }
}

std::vector<ToolCall> parse_tool_calls(const std::string& text, std::string* rest, const StringParams& string_params) {
  ToolCallReader reader(string_params);
  reader.feed(text);
  if (rest) *rest = reader.rest();
  return reader.calls();
}

std::vector<ToolCall> split_tool_calls(const Tokenizer& tokenizer, const std::vector<int32_t>& ids,
                                       std::string* content, size_t max_calls, const StringParams& string_params,
                                       bool skip_special) {
  const std::optional<uint32_t> open = tokenizer.token_to_id("<tool_call>");
  const auto at = open ? std::find(ids.begin(), ids.end(), int32_t(*open)) : ids.end();
  if (at == ids.end()) return {};
  const std::vector<uint32_t> before(ids.begin(), at), calls(at, ids.end());
  ToolCallReader reader(string_params, max_calls);
  reader.feed(tokenizer.decode(calls, false));
  std::vector<ToolCall> out = reader.calls();
  if (!out.empty() && content) *content = tokenizer.decode(before, skip_special);
  return out;
}

}  // namespace vireo::server
