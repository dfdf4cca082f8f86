#pragma once
// The OpenAI request surface: parsing and validating /v1/completions and /v1/chat/completions
// bodies into scheduler requests, and the error shape on the wire. No HTTP here, so every rule is
// testable on its own.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "runtime/scheduler.h"
#include "server/text_output.h"
#include "server/tool_calls.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace vireo::server {

using ojson = nlohmann::ordered_json;

// A rejected request: HTTP status, and OpenAI's {"error": {message, type, param, code}}.
struct ApiError : Error {
  ApiError(int status, const std::string& message, std::string param = "",
           std::string type = "invalid_request_error", std::string code = "")
      : Error(message), status(status), param(std::move(param)), type(std::move(type)), code(std::move(code)) {}
  int status;
  std::string param, type, code;
};
std::string error_body(int status, const std::string& message, const std::string& param = "",
                       const std::string& type = "", const std::string& code = "");

// What the server knows about the model it serves.
struct ServedModel {
  std::string name;                           // the `model` field clients must send
  int64_t context = 0;                        // cache positions per sequence
  int64_t vocab = 0;
  std::shared_ptr<const Tokenizer> tokenizer;       // null: token-id prompts only, no text out
  std::shared_ptr<const ChatTemplate> chat_template;  // null: chat answers 400 with template_error
  std::string template_error;                 // why there is no chat template
  // Chat replies split into reasoning_content and content at these markers (serve
  // --reasoning-parser; none by default, as in vLLM).
  ThinkTokens think;
};

struct ApiRequest {
  bool chat = false;
  SchedRequest sched;                // prompt ids, max_tokens, sampling, logprobs
  std::vector<std::string> stop;     // stop strings (non-empty)
  bool include_stop = false;         // vLLM's include_stop_str_in_output: the text ends with the stop string
  // vLLM's skip_special_tokens: false writes special tokens' text too (a reasoning split still drops
  // its <think> / </think>, as vLLM's reasoning parsers take the markers out of both parts).
  bool skip_special = true;
  bool stream = false;
  bool include_usage = false;        // stream_options.include_usage
  bool continuous_usage = false;     // stream_options.continuous_usage_stats (vLLM's): usage in every chunk
  bool return_token_ids = false;     // extension: choices[].token_ids (and in stream chunks)
  int n = 1;                         // choices a prompt: n scheduler requests, choice i sampled with seed + i
  // Every prompt (/v1/completions takes a list: choice p * n + i is prompt p's i-th); sched.prompt
  // is the first. prompt_texts: each as sent ("" for ids; with echo, decoded).
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> prompt_texts;
  // /v1/completions `echo`: the text starts with the prompt's, and with logprobs the prompt's
  // tokens lead them (the first with none: sched.prompt_logprobs).
  bool echo = false;
  // Chat with `tools` (tool_choice not "none"): the output is read for GLM-5 tool calls
  // (server/tool_calls.h); while streaming, the calls go out as OpenAI's tool-call deltas as they
  // are read, and the text from the first <tool_call> on is not sent as content.
  bool parse_tools = false;
  bool parallel_tool_calls = true;  // false: at most the first call is returned (OpenAI's)
  StringParams tool_string_params;  // the tools' parameters declared strings (read as written)
  // Chat under a reasoning split (ServedModel::think): the markers, whether the prompt ends with
  // <think> (the reply starts inside the reasoning), and vLLM's include_reasoning (false: the
  // reasoning is left out of the response).
  ThinkTokens think;
  bool starts_in_reasoning = false;
  bool include_reasoning = true;
};

// Throws ApiError (status 400 naming the field, 404 for an unknown model).
ApiRequest parse_request(const std::string& body, bool chat, const ServedModel& m);

// vLLM's /tokenize and /detokenize (the model does not run). tokenize: a `prompt` string
// (add_special_tokens, default true) or chat `messages` (rendered as /v1/chat/completions renders
// them, with add_generation_prompt, default true; tools and chat_template_kwargs too) ->
// {count, max_model_len, tokens, token_strs (return_token_strs)}. detokenize: `tokens` ->
// {prompt}, special tokens spelled. Throw ApiError as parse_request does.
ojson tokenize(const std::string& body, const ServedModel& m);
ojson detokenize(const std::string& body, const ServedModel& m);

}  // namespace vireo::server
