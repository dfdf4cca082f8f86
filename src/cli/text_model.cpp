#include "cli/text_model.h"

#include <cstdio>

#include "core/error.h"
#include "io/json_file.h"

namespace vireo::cli {

std::vector<int32_t> to_i32(const std::vector<uint32_t>& ids) { return std::vector<int32_t>(ids.begin(), ids.end()); }

TextModel TextModel::load(const std::string& dir, bool need_template) {
  const std::string tj = dir + "/tokenizer.json";
  if (!file_exists(tj)) fail(dir, ": no tokenizer.json (text input needs the model's tokenizer; use --prompt-ids)");
  TextModel m{Tokenizer::from_file(tj), std::nullopt};
  if (ChatTemplate::model_dir_has_template(dir)) m.chat_template = ChatTemplate::from_model_dir(dir);
  if (need_template && !m.chat_template)
    fail(dir, ": no chat template (neither chat_template.jinja nor a chat_template in tokenizer_config.json)");
  return m;
}

std::vector<int32_t> TextModel::chat_prompt(const nlohmann::ordered_json& messages,
                                            const nlohmann::ordered_json& extra) const {
  if (!chat_template) fail("this model has no chat template");
  return to_i32(tokenizer.encode(chat_template->render(messages, true, extra), false));
}

void add_thinking_flag(CLI::App& app, std::string& thinking) {
  app.add_option("--thinking", thinking,
                 "A reasoning model's thinking (the template's enable_thinking): on, off, or auto (the template's "
                 "default). The reasoning is printed between <think> and </think> and kept apart from the reply's "
                 "content")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
}

nlohmann::ordered_json thinking_args(const std::string& thinking) {
  nlohmann::ordered_json args = nlohmann::ordered_json::object();
  if (thinking != "auto") args["enable_thinking"] = thinking == "on";
  return args;
}

ChatReply::ChatReply(const TextModel& tm, const std::vector<int32_t>& prompt) : ChatReply(tm, prompt, {}) {}
ChatReply::ChatReply(const TextModel& tm, const std::vector<int32_t>& prompt, std::vector<std::string> stops)
    : ChatReply(tm, prompt, std::move(stops), server::think_tokens_of(tm.tokenizer)) {}
ChatReply::ChatReply(const TextModel& tm, const std::vector<int32_t>& prompt, std::vector<std::string> stops,
                     server::ThinkTokens think)
    : text_(&tm.tokenizer, std::move(stops), think, think.opened_by(prompt)) {}

// <think> before the reasoning's first piece, </think> before the content's first text (the
// reasoning's withheld tail may still come with a content id's piece) or at the end.
void ChatReply::show(const server::TextPiece& piece) {
  if ((piece.reasoning || !piece.held_reasoning.empty()) && !in_reasoning_ && reasoning_.empty()) {
    std::fputs("<think>", stdout);
    in_reasoning_ = true;
  }
  reasoning_ += piece.held_reasoning;
  std::fputs(piece.held_reasoning.c_str(), stdout);
  if (!piece.reasoning && in_reasoning_ && !piece.text.empty()) {
    std::fputs("</think>", stdout);
    in_reasoning_ = false;
  }
  (piece.reasoning ? reasoning_ : content_) += piece.text;
  std::fputs(piece.text.c_str(), stdout);
  std::fflush(stdout);
}

void ChatReply::finish() {
  const server::TextPiece last = text_.finish();
  show(last);
  if (!last.reasoning && in_reasoning_) std::fputs("</think>", stdout);
  std::fputs("\n", stdout);
  std::fflush(stdout);
}

}  // namespace vireo::cli
