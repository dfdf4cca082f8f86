#pragma once
// The text side of a model directory: tokenizer.json and, where present, the chat template
// (chat_template.jinja, else tokenizer_config.json's: ChatTemplate::from_model_dir).
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "server/text_output.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace vireo::cli {

struct TextModel {
  Tokenizer tokenizer;
  std::optional<ChatTemplate> chat_template;  // chat_template.jinja's, else tokenizer_config.json's; may be absent

  // Throws a one-line Error naming the missing file; `need_template` makes a missing chat
  // template an error too.
  static TextModel load(const std::string& dir, bool need_template = false);
  // The chat prompt for `messages` with the generation prompt appended, as token ids (the
  // template writes its own special tokens, so none are added, as apply_chat_template does).
  // `extra`: the template's keyword arguments (enable_thinking).
  std::vector<int32_t> chat_prompt(const nlohmann::ordered_json& messages,
                                   const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;
};

std::vector<int32_t> to_i32(const std::vector<uint32_t>& ids);

// --thinking auto|on|off of run --chat and chat: the chat template's enable_thinking (auto: not
// passed, the template's default).
void add_thinking_flag(CLI::App& app, std::string& thinking);
nlohmann::ordered_json thinking_args(const std::string& thinking);

// A chat reply printed to stdout as it is generated. A reasoning model's reply (its tokenizer has
// <think> and </think>) is split as the server splits it (server/text_output.h): the reasoning is
// printed between <think> and </think>, as the model wrote it, and kept apart from the content.
class ChatReply {
 public:
  ChatReply(const TextModel& tm, const std::vector<int32_t>& prompt);
  // stops: stop strings (run --stop): the reply ends before the first (stopped()).
  ChatReply(const TextModel& tm, const std::vector<int32_t>& prompt, std::vector<std::string> stops);
  void token(int32_t id) { show(text_.token(id)); }
  bool stopped() const { return text_.stopped(); }
  void finish();  // the rest, then a newline
  const std::string& reasoning() const { return reasoning_; }
  const std::string& content() const { return content_; }

 private:
  ChatReply(const TextModel& tm, const std::vector<int32_t>& prompt, std::vector<std::string> stops,
            server::ThinkTokens think);
  void show(const server::TextPiece& piece);
  server::TextOutput text_;
  std::string reasoning_, content_;
  bool in_reasoning_ = false;
};

}  // namespace vireo::cli
