#pragma once
// The text side of a model directory: tokenizer.json and, where present, the chat template in
// tokenizer_config.json.
#include <optional>
#include <string>

#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace vireo::cli {

struct TextModel {
  Tokenizer tokenizer;
  std::optional<ChatTemplate> chat_template;  // absent when tokenizer_config.json has none

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

}  // namespace vireo::cli
