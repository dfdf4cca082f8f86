#pragma once
// Tool calls in GLM-5's format (the chat template's, and the published GLM-4.5 / GLM-5 one): the
// model writes each call as
//   <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value>...</tool_call>
// after any text, the tags being special tokens. The text from the first <tool_call> on (decoded
// with the special tokens spelled) is read into OpenAI's tool_calls: each call's name and its
// arguments as the text of a JSON object. A value of a parameter the request's tool declares a
// string (`"type": "string"` in its JSON schema) is that string as written; any other value that
// parses as JSON (a number, true, an object...) is that JSON value, and the rest strings, as vLLM's
// GLM-4.5 parser does.
//
// One reader serves a reply read whole and one streamed: ToolCallReader takes the text in pieces
// of any size and gives OpenAI's streamed deltas as soon as they are known (a call's name once it
// is complete, then its arguments' JSON text in pieces, a string parameter's value as it comes,
// any other value once complete). A call's pieces add up to the arguments the whole text gives, so
// a streamed reply carries the calls a reply read whole does. What the whole text does not give
// (a call cut off by max_tokens, or one leaving the format part way) has already sent its first
// pieces when the stream sees that; its deltas stop there.
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"

namespace vireo::server {

struct ToolCall {
  std::string name;
  std::string arguments = "{}";  // a JSON object's text: {"K1":V1,...}, keys in the order written
};

// Each tool's parameters declared "type": "string" in the request (tool name -> parameter names).
using StringParams = std::map<std::string, std::vector<std::string>, std::less<>>;

// One streamed step of a call: `index` counts the calls of the reply from 0; a call's first delta
// has `starts` set and its name; `arguments` continues the call's arguments text.
struct ToolCallDelta {
  size_t index = 0;
  bool starts = false;
  std::string name;
  std::string arguments;
};

class ToolCallReader {
 public:
  // At most max_calls calls are read (OpenAI's parallel_tool_calls false: the first).
  explicit ToolCallReader(StringParams string_params = {}, size_t max_calls = SIZE_MAX)
      : string_params_(std::move(string_params)), max_calls_(max_calls) {}
  // More text (the first piece starts at the first <tool_call>); the deltas it completes, in order,
  // those of one call joined.
  std::vector<ToolCallDelta> feed(std::string_view text);
  const std::vector<ToolCall>& calls() const { return calls_; }  // the complete calls so far
  size_t calls_started() const { return started_; }              // calls whose first delta went out
  // What follows the last complete call in the text fed (a call cut off, or text after the calls).
  std::string rest() const { return text_.substr(consumed_); }

 private:
  enum class State { Between, Name, Key, KeyEnd, Value, AfterValue, Done };
  void step(std::vector<ToolCallDelta>& out);  // reads as far as the text allows
  void emit(std::vector<ToolCallDelta>& out, std::string piece, bool starts = false);
  bool string_param(const std::string& key) const;

  StringParams string_params_;
  size_t max_calls_;
  std::string text_;     // everything fed
  size_t at_ = 0;        // where reading goes on
  size_t consumed_ = 0;  // the end of the last complete call
  size_t scanned_ = 0;   // where the next search for a tag may start (none ends before it)
  State state_ = State::Between;
  size_t started_ = 0;  // calls named so far
  ToolCall call_;       // the call being read
  bool first_arg_ = true;
  std::string key_;               // the argument being read
  bool streaming_value_ = false;  // its value is a string parameter's, sent as it comes
  std::vector<ToolCall> calls_;
};

// The complete calls of `text` (which starts at the first <tool_call>), in order; `rest` gets what
// follows the last complete call (a call cut off by max_tokens, or text after the calls).
std::vector<ToolCall> parse_tool_calls(const std::string& text, std::string* rest,
                                       const StringParams& string_params = {});

// A generation's ids read for calls: from the first <tool_call> token on, decoded with the special
// tokens spelled; where there is a complete call, *content becomes the text before it (special
// tokens skipped unless skip_special is false, as the rest of the request's text). No <tool_call>
// token: no calls. At most max_calls are returned (OpenAI's parallel_tool_calls false: the first).
std::vector<ToolCall> split_tool_calls(const Tokenizer& tokenizer, const std::vector<int32_t>& ids,
                                       std::string* content, size_t max_calls = SIZE_MAX,
                                       const StringParams& string_params = {}, bool skip_special = true);

}  // namespace vireo::server
