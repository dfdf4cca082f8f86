#pragma once
// Tool calls in GLM-5's format (the chat template's, and the published GLM-4.5 / GLM-5 one): the
// model writes each call as
//   <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value>...</tool_call>
// after any text, the tags being special tokens. parse_tool_calls turns the text from the first
// <tool_call> on (decoded with the special tokens spelled) into OpenAI's tool_calls: each value
// that parses as JSON (a number, true, an object...) is that JSON value, any other one a string,
// as vLLM's GLM-4.5 parser does.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/tokenizer.h"

namespace vireo::server {

struct ToolCall {
  std::string name;
  nlohmann::ordered_json arguments = nlohmann::ordered_json::object();
};

// The complete calls of `text` (which starts at the first <tool_call>), in order; `rest` gets what
// follows the last complete call (a call cut off by max_tokens, or text after the calls).
std::vector<ToolCall> parse_tool_calls(const std::string& text, std::string* rest);

// A generation's ids read for calls: from the first <tool_call> token on, decoded with the special
// tokens spelled; where there is a complete call, *content becomes the text before it (special
// tokens skipped, as the rest of the server's text). No <tool_call> token: no calls. At most
// max_calls are returned (OpenAI's parallel_tool_calls false: the first).
std::vector<ToolCall> split_tool_calls(const Tokenizer& tokenizer, const std::vector<int32_t>& ids,
                                       std::string* content, size_t max_calls = SIZE_MAX);

}  // namespace vireo::server
