#include "cli/text_model.h"

#include "core/error.h"
#include "io/json_file.h"

namespace vireo::cli {

std::vector<int32_t> to_i32(const std::vector<uint32_t>& ids) { return std::vector<int32_t>(ids.begin(), ids.end()); }

TextModel TextModel::load(const std::string& dir, bool need_template) {
  const std::string tj = dir + "/tokenizer.json", tc = dir + "/tokenizer_config.json";
  if (!file_exists(tj)) fail(dir, ": no tokenizer.json (text input needs the model's tokenizer; use --prompt-ids)");
  TextModel m{Tokenizer::from_file(tj), std::nullopt};
  if (file_exists(tc)) {
    Json cfg = read_json_file(tc);
    if (cfg.contains("chat_template") && !cfg["chat_template"].is_null())
      m.chat_template = ChatTemplate::from_tokenizer_config(tc);
  }
  if (need_template && !m.chat_template) fail(tc, ": no chat_template (needed for chat)");
  return m;
}

std::vector<int32_t> TextModel::chat_prompt(const nlohmann::ordered_json& messages,
                                            const nlohmann::ordered_json& extra) const {
  if (!chat_template) fail("this model has no chat template");
  return to_i32(tokenizer.encode(chat_template->render(messages, true, extra), false));
}

}  // namespace vireo::cli
