#pragma once
// A model's chat template, rendered the way transformers' tokenizer.apply_chat_template renders it
// (transformers 5.x): the same jinja2 environment (see jinja.h), the same variables (messages,
// tools, documents, add_generation_prompt, the special tokens, extra keyword arguments) and the
// same clean-up of messages first (keys whose value is null are dropped; reasoning given as
// reasoning_content, thinking or reasoning is visible to the template under both
// `reasoning_content` and `thinking`).
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "text/jinja.h"

namespace vireo {

class ChatTemplate {
 public:
  // Reads `chat_template` (a string, or the list-of-{name, template} form) and the special tokens
  // (bos_token, eos_token, ...; plain strings or AddedToken dicts) from a tokenizer_config.json.
  static ChatTemplate from_tokenizer_config(const std::string& path);
  static ChatTemplate from_tokenizer_config_json(const nlohmann::ordered_json& config, const std::string& origin);
  // A model directory's template as transformers loads it: chat_template.jinja where the directory
  // has one (transformers >= 4.49 saves the template there; it wins over the config's), with any
  // named ones in additional_chat_templates/NAME.jinja, else tokenizer_config.json's chat_template;
  // the special tokens from tokenizer_config.json either way. Throws a one-line Error naming
  // what is missing.
  // template_file: a .jinja file used instead of the directory's template (serve --chat-template).
  static ChatTemplate from_model_dir(const std::string& dir, const std::string& template_file = "");
  // Whether from_model_dir finds a template in `dir` (without parsing it).
  static bool model_dir_has_template(const std::string& dir);

  // One template; `special_tokens` maps names such as "bos_token" to their text.
  ChatTemplate(const std::string& source, std::map<std::string, std::string> special_tokens,
               const std::string& name = "chat_template");

  // `messages`: [{"role": ..., "content": ..., ...}, ...]. `extra` may hold "tools" and
  // "documents" (passed as those variables, null when absent) and any other template variable
  // (enable_thinking, ...), which override the special tokens. Ordered JSON keeps the caller's key
  // order, which tojson exposes; a plain nlohmann::json converts implicitly.
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  // The raw form: renders the default template with exactly these top-level variables.
  std::string render_context(const nlohmann::ordered_json& context) const;

  const std::string& bos_token() const;
  const std::string& eos_token() const;
  const std::map<std::string, std::string>& special_tokens() const { return special_tokens_; }
  bool has_tool_use_template() const { return tool_use_ != nullptr; }

 private:
  ChatTemplate() = default;

  std::shared_ptr<const jinja::Template> default_;
  std::shared_ptr<const jinja::Template> tool_use_;  // the "tool_use" named template, if any
  std::map<std::string, std::string> special_tokens_;
};

}  // namespace vireo
