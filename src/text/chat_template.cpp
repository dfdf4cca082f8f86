#include "text/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace vireo {

namespace {

// transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens apply_chat_template passes along.
const char* const kSpecialTokenNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                          "pad_token", "cls_token", "mask_token"};

// Reasoning field names, the first being the one templates read (transformers' _REASONING_FIELDS).
const char* const kReasoningFields[] = {"reasoning_content", "thinking", "reasoning"};

using ojson = nlohmann::ordered_json;

// apply_chat_template's clean-up: drop null-valued keys, then alias the reasoning fields as
// {"thinking": r, **message, "reasoning_content": r}.
ojson normalize_message(const ojson& msg, size_t index) {
  if (!msg.is_object()) fail("chat message ", index, " must be an object, got ", msg.type_name());
  ojson m = ojson::object();
  for (auto it = msg.begin(); it != msg.end(); ++it)
    if (!it.value().is_null()) m[it.key()] = it.value();
  const ojson* reasoning = nullptr;
  for (const char* f : kReasoningFields)
    if (m.contains(f)) {
      reasoning = &m[f];
      break;
    }
  if (!reasoning) return m;
  ojson r = *reasoning;
  ojson out = ojson::object();
  out["thinking"] = r;
  for (auto it = m.begin(); it != m.end(); ++it) out[it.key()] = it.value();
  out["reasoning_content"] = r;
  return out;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path, ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A JSON file, or a one-line Error naming it.
ojson read_json(const std::string& path) {
  const std::string text = read_text(path);
  try {
    return ojson::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": invalid JSON: ", e.what());
  }
}

std::string token_text(const ojson& v, const std::string& key, const std::string& origin) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  fail(origin, ": ", key, " must be a string or an AddedToken object with \"content\"");
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, std::map<std::string, std::string> special_tokens,
                           const std::string& name)
    : default_(std::make_shared<jinja::Template>(source, name)), special_tokens_(std::move(special_tokens)) {}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path) {
  return from_tokenizer_config_json(read_json(path), path);
}

ChatTemplate ChatTemplate::from_tokenizer_config_json(const ojson& config, const std::string& origin) {
  if (!config.is_object()) fail(origin, ": tokenizer config must be a JSON object");
  ChatTemplate ct;
  for (const char* name : kSpecialTokenNames)
    if (config.contains(name) && !config[name].is_null()) ct.special_tokens_[name] = token_text(config[name], name, origin);
  if (!config.contains("chat_template") || config["chat_template"].is_null()) fail(origin, ": no chat_template");
  const ojson& t = config["chat_template"];
  if (t.is_string()) {
    ct.default_ = std::make_shared<jinja::Template>(t.get<std::string>(), origin + ":chat_template");
    return ct;
  }
  if (!t.is_array()) fail(origin, ": chat_template must be a string or a list of {name, template}");
  for (const ojson& entry : t) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() || !entry.contains("template") ||
        !entry["template"].is_string())
      fail(origin, ": each chat_template entry needs string \"name\" and \"template\"");
    std::string name = entry["name"].get<std::string>();
    auto tmpl = std::make_shared<jinja::Template>(entry["template"].get<std::string>(), origin + ":chat_template[" + name + "]");
    if (name == "default") ct.default_ = tmpl;
    else if (name == "tool_use") ct.tool_use_ = tmpl;
  }
  if (!ct.default_) fail(origin, ": chat_template has several named templates but none named \"default\"");
  return ct;
}

bool ChatTemplate::model_dir_has_template(const std::string& dir) {
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(dir) / "chat_template.jinja")) return true;
  const fs::path cfg = fs::path(dir) / "tokenizer_config.json";
  if (!fs::exists(cfg)) return false;
  const ojson config = ojson::parse(read_text(cfg.string()), nullptr, /*allow_exceptions=*/false);
  return config.is_object() && config.contains("chat_template") && !config["chat_template"].is_null();
}

ChatTemplate ChatTemplate::from_model_dir(const std::string& dir, const std::string& template_file) {
  namespace fs = std::filesystem;
  const fs::path cfg = fs::path(dir) / "tokenizer_config.json",
                 file = template_file.empty() ? fs::path(dir) / "chat_template.jinja" : fs::path(template_file);
  if (!template_file.empty() && !fs::is_regular_file(file)) fail(template_file, ": no such template file");
  if (!fs::exists(file)) {
    if (!fs::exists(cfg)) fail(dir, ": no chat template (neither chat_template.jinja nor tokenizer_config.json)");
    return from_tokenizer_config(cfg.string());
  }
  ojson config = fs::exists(cfg) ? read_json(cfg.string()) : ojson::object();
  if (!config.is_object()) fail(cfg.string(), ": tokenizer config must be a JSON object");
  // The file's template as the config's, named ones beside it ("default" is the file's).
  ojson named = ojson::array({{{"name", "default"}, {"template", read_text(file.string())}}});
  const fs::path extra = fs::path(dir) / "additional_chat_templates";
  if (template_file.empty() && fs::is_directory(extra)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(extra))
      if (e.path().extension() == ".jinja") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) named.push_back({{"name", f.stem().string()}, {"template", read_text(f.string())}});
  }
  config["chat_template"] = named.size() == 1 ? named[0]["template"] : named;
  return from_tokenizer_config_json(config, file.string());
}

const std::string& ChatTemplate::bos_token() const {
  static const std::string empty;
  auto it = special_tokens_.find("bos_token");
  return it == special_tokens_.end() ? empty : it->second;
}

const std::string& ChatTemplate::eos_token() const {
  static const std::string empty;
  auto it = special_tokens_.find("eos_token");
  return it == special_tokens_.end() ? empty : it->second;
}

std::string ChatTemplate::render(const ojson& messages, bool add_generation_prompt, const ojson& extra) const {
  if (!messages.is_array()) fail("chat messages must be a JSON array");
  if (messages.empty()) fail("cannot apply chat template to an empty conversation");
  if (!extra.is_null() && !extra.is_object()) fail("chat template extra variables must be a JSON object");
  ojson context = ojson::object();
  for (const auto& [k, v] : special_tokens_) context[k] = v;
  ojson tools = nullptr, documents = nullptr;
  if (extra.is_object())
    for (auto it = extra.begin(); it != extra.end(); ++it) {
      if (it.key() == "tools") tools = it.value();
      else if (it.key() == "documents") documents = it.value();
      else context[it.key()] = it.value();
    }
  ojson msgs = ojson::array();
  for (size_t i = 0; i < messages.size(); ++i) msgs.push_back(normalize_message(messages[i], i));
  context["messages"] = std::move(msgs);
  context["tools"] = tools;
  context["documents"] = documents;
  context["add_generation_prompt"] = add_generation_prompt;
  const auto& tmpl = (!tools.is_null() && tool_use_) ? tool_use_ : default_;
  return tmpl->render(context);
}

std::string ChatTemplate::render_context(const ojson& context) const { return default_->render(context); }

}  // namespace vireo
