#include "server/tool_calls.h"

#include <algorithm>

namespace vireo::server {

namespace {

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t\r\n") - a + 1);
}

}  // namespace

std::vector<ToolCall> parse_tool_calls(const std::string& text, std::string* rest) {
  static const std::string kOpen = "<tool_call>", kClose = "</tool_call>", kKey = "<arg_key>", kKeyEnd = "</arg_key>",
                           kValue = "<arg_value>", kValueEnd = "</arg_value>";
  std::vector<ToolCall> calls;
  size_t at = 0;
  for (;;) {
    const size_t open = text.find(kOpen, at);
    if (open == std::string::npos || trim(text.substr(at, open - at)) != "") break;  // only calls, back to back
    const size_t close = text.find(kClose, open);
    if (close == std::string::npos) break;  // cut off
    const std::string body = text.substr(open + kOpen.size(), close - open - kOpen.size());
    ToolCall call;
    size_t k = body.find(kKey);
    call.name = trim(body.substr(0, k));
    bool ok = !call.name.empty();
    while (ok && k != std::string::npos) {
      const size_t ke = body.find(kKeyEnd, k), v = body.find(kValue, k), ve = body.find(kValueEnd, k);
      if (ke == std::string::npos || v == std::string::npos || ve == std::string::npos || !(ke < v && v < ve)) {
        ok = false;
        break;
      }
      const std::string key = trim(body.substr(k + kKey.size(), ke - k - kKey.size()));
      const std::string value = body.substr(v + kValue.size(), ve - v - kValue.size());
      nlohmann::ordered_json parsed = nlohmann::ordered_json::parse(value, nullptr, /*allow_exceptions=*/false);
      call.arguments[key] = parsed.is_discarded() ? nlohmann::ordered_json(value) : parsed;
      k = body.find(kKey, ve);
      if (trim(body.substr(ve + kValueEnd.size(),
                           (k == std::string::npos ? body.size() : k) - ve - kValueEnd.size())) != "")
        ok = false;  // text between the pairs: not this format
    }
    if (!ok) break;
    calls.push_back(std::move(call));
    at = close + kClose.size();
  }
  if (rest) *rest = text.substr(at);
  return calls;
}

std::vector<ToolCall> split_tool_calls(const Tokenizer& tokenizer, const std::vector<int32_t>& ids,
                                       std::string* content, size_t max_calls) {
  const std::optional<uint32_t> open = tokenizer.token_to_id("<tool_call>");
  const auto at = open ? std::find(ids.begin(), ids.end(), int32_t(*open)) : ids.end();
  if (at == ids.end()) return {};
  const std::vector<uint32_t> before(ids.begin(), at), calls(at, ids.end());
  std::vector<ToolCall> out = parse_tool_calls(tokenizer.decode(calls, false), nullptr);
  if (out.size() > max_calls) out.resize(max_calls);
  if (!out.empty() && content) *content = tokenizer.decode(before, true);
  return out;
}

}  // namespace vireo::server
