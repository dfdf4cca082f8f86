#include "server/openai_api.h"

#include <cmath>
#include <limits>
#include <random>

namespace vireo::server {

namespace {

const char* status_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 413: return "invalid_request_error";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, param + ": " + message, param);
}

std::string type_of(const ojson& v) {
  if (v.is_number_integer()) return "an integer";
  if (v.is_number()) return "a number";
  return std::string("a ") + v.type_name();
}

// The field if present and not null.
const ojson* field(const ojson& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

bool get_bool(const ojson& body, const char* key, bool def) {
  const ojson* v = field(body, key);
  if (!v) return def;
  if (!v->is_boolean()) bad(key, "must be a boolean, got " + type_of(*v));
  return v->get<bool>();
}

double get_number(const ojson& body, const char* key, double def, double lo, double hi) {
  const ojson* v = field(body, key);
  if (!v) return def;
  if (!v->is_number()) bad(key, "must be a number, got " + type_of(*v));
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi)) bad(key, str("must be in [", lo, ", ", hi, "], got ", x));
  return x;
}

int64_t get_int(const ojson& body, const char* key, int64_t def, int64_t lo, int64_t hi) {
  const ojson* v = field(body, key);
  if (!v) return def;
  // 5.0 is accepted as 5 (some clients serialize every number as a float).
  if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() && std::abs(v->get<double>()) < 9e15)
    return get_int(ojson{{key, int64_t(v->get<double>())}}, key, def, lo, hi);
  if (!v->is_number_integer()) bad(key, "must be an integer, got " + type_of(*v));
  const int64_t x = v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : v->get<int64_t>();
  if (x < lo || x > hi) bad(key, str("must be in [", lo, ", ", hi, "], got ", x));
  return x;
}

std::vector<int32_t> token_ids(const ojson& arr, const std::string& param, const ServedModel& m) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < arr.size(); ++i) {
    const ojson& t = arr[i];
    if (!t.is_number_integer()) bad(param, str("element ", i, " must be a token id (integer), got ", type_of(t)));
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= m.vocab) bad(param, str("token id ", id, " is out of range (vocabulary of ", m.vocab, ")"));
    ids.push_back(int32_t(id));
  }
  return ids;
}

std::vector<int32_t> encode(const ServedModel& m, const std::string& text, bool add_special, const std::string& param) {
  if (!m.tokenizer)
    bad(param, "model '" + m.name + "' has no tokenizer (tokenizer.json); send the prompt as a list of token ids");
  std::vector<uint32_t> u = m.tokenizer->encode(text, add_special);
  return std::vector<int32_t>(u.begin(), u.end());
}

// /v1/completions' prompt: a string, a list of token ids, or a list of either (one choice each),
// with the text each came as (empty for ids). Text is encoded with the tokenizer's special tokens
// (a BOS) unless add_special_tokens is false, as in vLLM.
std::vector<std::pair<std::vector<int32_t>, std::string>> completion_prompts(const ojson& body, const ServedModel& m) {
  const ojson* p = field(body, "prompt");
  if (!p) bad("prompt", "is required");
  const bool add_special = get_bool(body, "add_special_tokens", true);
  if (p->is_string()) return {{encode(m, p->get<std::string>(), add_special, "prompt"), p->get<std::string>()}};
  if (!p->is_array()) bad("prompt", "must be a string or a list of token ids, got " + type_of(*p));
  if (p->empty()) bad("prompt", "is empty");
  if ((*p)[0].is_number()) return {{token_ids(*p, "prompt", m), ""}};
  if (p->size() > 64) bad("prompt", str("at most 64 prompts a request, got ", p->size()));
  std::vector<std::pair<std::vector<int32_t>, std::string>> out;
  for (size_t i = 0; i < p->size(); ++i) {
    const ojson& one = (*p)[i];
    const std::string at = str("prompt[", i, "]");
    if (one.is_string()) out.push_back({encode(m, one.get<std::string>(), add_special, at), one.get<std::string>()});
    else if (one.is_array() && !one.empty()) out.push_back({token_ids(one, at, m), ""});
    else bad(at, "must be a string or a non-empty list of token ids, got " + type_of(one));
  }
  return out;
}

// `tools` (OpenAI's function tools), checked; null when the request has none, or tool_choice is
// "none" (then they are not described to the model either).
const ojson* chat_tools(const ojson& body, const ServedModel& m) {
  const ojson* tools = field(body, "tools");
  if (!tools || tools->is_null()) return nullptr;
  if (!tools->is_array()) bad("tools", "must be a list of tools, got " + type_of(*tools));
  for (size_t i = 0; i < tools->size(); ++i) {
    const ojson& t = (*tools)[i];
    const std::string at = str("tools[", i, "]");
    const ojson* type = t.is_object() ? field(t, "type") : nullptr;
    if (!type || !type->is_string() || type->get<std::string>() != "function")
      bad(at + ".type", "only function tools are supported");
    const ojson* fn = field(t, "function");
    const ojson* name = fn && fn->is_object() ? field(*fn, "name") : nullptr;
    if (!name || !name->is_string() || name->get<std::string>().empty())
      bad(at + ".function.name", "is required (a non-empty string)");
    if (const ojson* params = field(*fn, "parameters"); params && !params->is_object())
      bad(at + ".function.parameters", "must be an object (a JSON schema), got " + type_of(*params));
  }
  if (!m.tokenizer || !m.tokenizer->token_to_id("<tool_call>"))
    bad("tools", "model '" + m.name + "' has no <tool_call> token: tool calls are read in GLM-5's format");
  const ojson* choice = field(body, "tool_choice");
  if (choice && choice->is_string() && choice->get<std::string>() == "none") return nullptr;
  return tools;
}

// Each tool's parameters its JSON schema declares strings (`"type": "string"` under
// parameters.properties): their values are read as written, not as JSON (server/tool_calls.h).
StringParams string_params_of(const ojson& tools) {
  StringParams out;
  for (const ojson& t : tools) {
    const ojson& fn = t.at("function");
    const ojson* params = field(fn, "parameters");
    const ojson* props = params ? field(*params, "properties") : nullptr;
    if (!props || !props->is_object()) continue;
    std::vector<std::string>& names = out[fn.at("name").get<std::string>()];
    for (const auto& [name, schema] : props->items())
      if (const ojson* type = schema.is_object() ? field(schema, "type") : nullptr;
          type && type->is_string() && type->get<std::string>() == "string")
        names.push_back(name);
  }
  return out;
}

// transformers' continue_final_message (vLLM's too): the rendered conversation cut right after the
// final message's text, so the reply continues that message (an assistant's prefill) instead of
// starting a new one. The text is found from the end of the rendering, as transformers finds it:
// with its trailing spaces where the template kept them, without where it trimmed them.
std::string continued_final_message(const std::string& rendered, const ojson& messages) {
  const ojson& content = messages.back().contains("content") ? messages.back()["content"] : ojson();
  std::string last;
  if (content.is_string()) last = content.get<std::string>();
  else if (content.is_array())
    for (auto it = content.rbegin(); it != content.rend(); ++it)
      if (it->is_object() && it->contains("text")) {
        last = (*it)["text"].get<std::string>();
        break;
      }
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  size_t a = 0, b = last.size();
  while (a < b && is_space(last[a])) ++a;
  while (b > a && is_space(last[b - 1])) --b;
  const std::string stripped = last.substr(a, b - a), lstripped = last.substr(a);
  const std::string at = str("messages[", messages.size() - 1, "].content");
  if (stripped.empty()) bad(at, "continue_final_message needs text in the final message to continue");
  const size_t loc = rendered.rfind(stripped);
  if (loc == std::string::npos)
    bad(at, "continue_final_message: the chat template does not write the final message's text as given");
  const bool kept = rendered.compare(loc, lstripped.size(), lstripped) == 0;
  return rendered.substr(0, loc + (kept ? lstripped.size() : stripped.size()));
}

std::vector<int32_t> chat_prompt(const ojson& body, const ServedModel& m, const ojson* tools,
                                 bool add_generation_prompt = true) {
  const bool continue_final = get_bool(body, "continue_final_message", false);
  if (continue_final && add_generation_prompt)
    bad("continue_final_message", "needs add_generation_prompt false (the reply continues the final message)");
  const ojson* msgs = field(body, "messages");
  if (!msgs) bad("messages", "is required");
  if (!msgs->is_array()) bad("messages", "must be a list of messages, got " + type_of(*msgs));
  if (msgs->empty()) bad("messages", "must hold at least one message");
  static const char* const roles[] = {"system", "developer", "user", "assistant", "tool"};
  for (size_t i = 0; i < msgs->size(); ++i) {
    const ojson& msg = (*msgs)[i];
    const std::string at = str("messages[", i, "]");
    if (!msg.is_object()) bad(at, "must be an object, got " + type_of(msg));
    const ojson* role = field(msg, "role");
    if (!role) bad(at + ".role", "is required");
    if (!role->is_string()) bad(at + ".role", "must be a string, got " + type_of(*role));
    const std::string r = role->get<std::string>();
    if (std::find_if(std::begin(roles), std::end(roles), [&](const char* x) { return r == x; }) == std::end(roles))
      bad(at + ".role", "unknown role '" + r + "' (expected system, developer, user, assistant or tool)");
    const ojson* content = field(msg, "content");
    if (!content) {
      if (r != "assistant") bad(at + ".content", "is required");
      continue;
    }
    if (content->is_string()) continue;
    if (!content->is_array()) bad(at + ".content", "must be a string or a list of content parts, got " + type_of(*content));
    for (size_t j = 0; j < content->size(); ++j) {
      const ojson& part = (*content)[j];
      const std::string pat = str(at, ".content[", j, "]");
      if (!part.is_object()) bad(pat, "must be an object, got " + type_of(part));
      const ojson* type = field(part, "type");
      if (!type || !type->is_string() || type->get<std::string>() != "text")
        bad(pat + ".type", "only text content parts are supported");
      const ojson* text = field(part, "text");
      if (!text || !text->is_string()) bad(pat + ".text", "must be a string");
    }
  }
  if (!m.chat_template)
    throw ApiError(400, "messages: model '" + m.name + "' has no usable chat template (" + m.template_error +
                            "); use /v1/completions", "messages");
  ojson extra = ojson::object();
  if (const ojson* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) bad("chat_template_kwargs", "must be an object, got " + type_of(*kw));
    extra = *kw;
  }
  // OpenAI's assistant tool calls carry their arguments as a JSON string; the template writes
  // each argument, so it gets them as an object.
  ojson messages = *msgs;
  for (size_t i = 0; i < messages.size(); ++i) {
    ojson* calls = messages[i].contains("tool_calls") ? &messages[i]["tool_calls"] : nullptr;
    if (!calls || calls->is_null()) continue;
    if (!calls->is_array()) bad(str("messages[", i, "].tool_calls"), "must be a list, got " + type_of(*calls));
    for (size_t j = 0; j < calls->size(); ++j) {
      ojson& c = (*calls)[j];
      const std::string at = str("messages[", i, "].tool_calls[", j, "]");
      if (!c.is_object() || !c.contains("function") || !c["function"].is_object() || !c["function"].contains("name"))
        bad(at + ".function", "must be an object with a name");
      ojson& args = c["function"]["arguments"];
      if (args.is_string()) {
        ojson parsed = ojson::parse(args.get<std::string>(), nullptr, /*allow_exceptions=*/false);
        if (!parsed.is_object()) bad(at + ".function.arguments", "must be a JSON object (as a string)");
        args = parsed;
      }
    }
  }
  if (tools) extra["tools"] = *tools;
  if (const ojson* docs = field(body, "documents"); docs && !docs->is_null()) {  // vLLM's: for RAG templates
    if (!docs->is_array() || std::any_of(docs->begin(), docs->end(), [](const ojson& d) { return !d.is_object(); }))
      bad("documents", "must be a list of objects (each a document's fields), got " + type_of(*docs));
    extra["documents"] = *docs;
  }
  std::string text;
  try {
    text = m.chat_template->render(messages, add_generation_prompt, extra);
  } catch (const Error& e) {
    bad("messages", std::string("the chat template rejected them: ") + e.what());
  }
  if (continue_final) text = continued_final_message(text, messages);
  // The template writes the special tokens itself: transformers tokenizes it without adding any,
  // and vLLM too unless add_special_tokens is true.
  return encode(m, text, get_bool(body, "add_special_tokens", false), "messages");
}

ojson parse_body(const std::string& text) {
  ojson body = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) throw ApiError(400, "the request body is not valid JSON");
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object, got " + type_of(body));
  return body;
}

void check_model(const ojson& body, const ServedModel& m) {
  if (const ojson* model = field(body, "model")) {
    if (!model->is_string()) bad("model", "must be a string, got " + type_of(*model));
    if (model->get<std::string>() != m.name)
      throw ApiError(
          404, "The model '" + model->get<std::string>() + "' does not exist (this server serves '" + m.name + "')",
          "model", "invalid_request_error", "model_not_found");
  }
}

}  // namespace

ojson tokenize(const std::string& body_text, const ServedModel& m) {
  const ojson body = parse_body(body_text);
  check_model(body, m);
  std::vector<int32_t> ids;
  if (field(body, "messages")) {
    if (field(body, "prompt")) bad("prompt", "send either prompt or messages, not both");
    ids = chat_prompt(body, m, chat_tools(body, m), get_bool(body, "add_generation_prompt", true));
  } else {
    const ojson* p = field(body, "prompt");
    if (!p) bad("prompt", "is required (or messages)");
    if (!p->is_string()) bad("prompt", "must be a string, got " + type_of(*p));
    ids = encode(m, p->get<std::string>(), get_bool(body, "add_special_tokens", true), "prompt");
  }
  ojson out = {{"count", ids.size()}, {"max_model_len", m.context}, {"tokens", ids}, {"token_strs", nullptr}};
  if (get_bool(body, "return_token_strs", false)) {
    ojson strs = ojson::array();
    for (int32_t id : ids) strs.push_back(m.tokenizer->decode(std::vector<uint32_t>{uint32_t(id)}, false));
    out["token_strs"] = strs;
  }
  return out;
}

ojson detokenize(const std::string& body_text, const ServedModel& m) {
  const ojson body = parse_body(body_text);
  check_model(body, m);
  const ojson* t = field(body, "tokens");
  if (!t) bad("tokens", "is required");
  if (!t->is_array()) bad("tokens", "must be a list of token ids, got " + type_of(*t));
  const std::vector<int32_t> ids = token_ids(*t, "tokens", m);
  if (!m.tokenizer) bad("tokens", "model '" + m.name + "' has no tokenizer (tokenizer.json)");
  return {{"prompt", m.tokenizer->decode(std::vector<uint32_t>(ids.begin(), ids.end()), false)}};
}

std::string error_body(int status, const std::string& message, const std::string& param, const std::string& type,
                       const std::string& code) {
  ojson e = {{"message", message},
             {"type", type.empty() ? status_type(status) : type},
             {"param", param.empty() ? ojson(nullptr) : ojson(param)},
             {"code", code.empty() ? ojson(nullptr) : ojson(code)}};
  return ojson{{"error", e}}.dump();
}

namespace {

// vLLM's bad_words as token sequences, by its rule: each word (leading spaces dropped) encoded as it
// is, and with a space before it where that gives as many tokens and another first one (the word
// in the middle of text).
std::vector<std::vector<int32_t>> bad_word_ids(const ojson& words, const ServedModel& m) {
  if (!words.is_array()) bad("bad_words", "must be a list of strings, got " + type_of(words));
  if (words.size() > 64) bad("bad_words", str("at most 64 words, got ", words.size()));
  if (!words.empty() && !m.tokenizer) bad("bad_words", "bad words need a tokenizer, and this model has none");
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < words.size(); ++i) {
    if (!words[i].is_string()) bad("bad_words", str("element ", i, " must be a string, got ", type_of(words[i])));
    std::string word = words[i].get<std::string>();
    word.erase(0, word.find_first_not_of(" \t\n\r\f\v"));
    const std::vector<int32_t> plain = encode(m, word, false, "bad_words");
    if (plain.empty()) bad("bad_words", str("element ", i, " encodes to no tokens"));
    out.push_back(plain);
    const std::vector<int32_t> spaced = encode(m, " " + word, false, "bad_words");
    if (!spaced.empty() && spaced.size() == plain.size() && spaced[0] != plain[0]) out.push_back(spaced);
  }
  return out;
}

// vLLM's truncate_prompt_tokens: k keeps each prompt's last k tokens (a rendered chat's too); -1 as
// many as leave room for one generated token. A truncated prompt is echoed as the model saw it.
void truncate_prompts(const ojson& body, const ServedModel& m, ApiRequest& r) {
  const ojson* v = field(body, "truncate_prompt_tokens");
  if (!v || v->is_null()) return;
  const int64_t k = get_int(body, "truncate_prompt_tokens", -1, -1, INT64_MAX);
  if (k == 0) bad("truncate_prompt_tokens", "must be a number of tokens to keep (at least 1), or -1, got 0");
  if (k > m.context)
    bad("truncate_prompt_tokens", str("keeps at most this server's context of ", m.context, " tokens, got ", k));
  const size_t keep = size_t(k < 0 ? m.context - 1 : k);
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    std::vector<int32_t>& ids = r.prompts[i];
    if (ids.size() <= keep) continue;
    ids.erase(ids.begin(), ids.end() - ptrdiff_t(keep));
    if (i < r.prompt_texts.size()) r.prompt_texts[i].clear();
  }
}

}  // namespace

ApiRequest parse_request(const std::string& body_text, bool chat, const ServedModel& m) {
  const ojson body = parse_body(body_text);
  ApiRequest r;
  r.chat = chat;
  check_model(body, m);
  // Unsupported knobs fail loudly rather than being silently ignored.
  r.n = int(get_int(body, "n", 1, 1, 16));
  if (const ojson* rf = field(body, "response_format")) {
    const ojson* type = rf->is_object() ? field(*rf, "type") : nullptr;
    if (!type || !type->is_string() || type->get<std::string>() != "text")
      bad("response_format", "only {\"type\": \"text\"} is supported (no constrained decoding)");
  }
  for (const char* guided : {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"})
    if (field(body, guided)) bad(guided, "constrained decoding is not supported by this server");
  if (field(body, "functions") || field(body, "function_call"))
    bad(field(body, "functions") ? "functions" : "function_call", "function calling is not supported by this server");
  // vLLM's and OpenAI's other knobs that would change the output, refused unless at their default.
  if (get_bool(body, "use_beam_search", false)) bad("use_beam_search", "beam search is not supported by this server");
  r.skip_special = get_bool(body, "skip_special_tokens", true);
  if (get_bool(body, "return_tokens_as_token_ids", false))
    bad("return_tokens_as_token_ids", "only false is supported (return_token_ids lists the ids)");
  if (const ojson* pr = field(body, "priority"); pr && !(pr->is_number() && pr->get<double>() == 0))
    bad("priority", "only 0 is supported (requests are served in arrival order)");
  if (const ojson* lp = field(body, "logits_processors"); lp && !lp->is_null())
    bad("logits_processors", "is not supported by this server");
  if (const ojson* ct = field(body, "chat_template"); ct && !ct->is_null())
    bad("chat_template", "a request's own template is not accepted (the server's --chat-template sets it)");
  if (field(body, "prompt_logprobs"))
    bad("prompt_logprobs", chat ? "is not supported for chat" : "use echo with logprobs (the prompt's tokens scored)");
  if (field(body, "audio")) bad("audio", "audio output is not supported by this server");
  if (const ojson* mod = field(body, "modalities"))
    if (!mod->is_array() || std::any_of(mod->begin(), mod->end(), [](const ojson& x) { return x != "text"; }))
      bad("modalities", "only [\"text\"] is supported");
  if (chat && get_bool(body, "echo", false)) bad("echo", "is not supported for chat (only /v1/completions echoes)");
  r.include_stop = get_bool(body, "include_stop_str_in_output", false);
  if (const ojson* tc = field(body, "tool_choice");
      tc && !(tc->is_string() && (tc->get<std::string>() == "none" || tc->get<std::string>() == "auto")))
    bad("tool_choice",
        "only \"auto\" or \"none\" (forcing a call needs constrained decoding, which this server does "
        "not do)");
  if (!chat) {
    r.echo = get_bool(body, "echo", false);
    if (get_int(body, "best_of", 1, 1, 128) != 1) bad("best_of", "only best_of = 1 is supported");
    if (field(body, "suffix")) bad("suffix", "is not supported");
  }

  r.stream = get_bool(body, "stream", false);
  if (const ojson* so = field(body, "stream_options")) {
    if (!so->is_object()) bad("stream_options", "must be an object, got " + type_of(*so));
    if (!r.stream) bad("stream_options", "is only allowed when stream is true");
    r.include_usage = get_bool(*so, "include_usage", false);
    r.continuous_usage = get_bool(*so, "continuous_usage_stats", false);
  }
  r.return_token_ids = get_bool(body, "return_token_ids", false);

  SamplingParams& s = r.sched.sampling;
  s.temperature = float(get_number(body, "temperature", 1.0, 0, 2));
  s.top_p = float(get_number(body, "top_p", 1.0, 0, 1));
  if (s.top_p <= 0) bad("top_p", "must be in (0, 1], got 0");
  const int64_t top_k = get_int(body, "top_k", 0, -1, INT32_MAX);
  s.top_k = top_k < 0 ? 0 : int(top_k);  // -1 means off, as in vLLM
  s.min_p = float(get_number(body, "min_p", 0, 0, 1));
  // Penalties (OpenAI's two, and transformers' / vLLM's repetition_penalty): such a request's
  // logits come back to the host, which penalizes them by its prompt and tokens so far.
  s.presence_penalty = float(get_number(body, "presence_penalty", 0, -2, 2));
  s.frequency_penalty = float(get_number(body, "frequency_penalty", 0, -2, 2));
  s.repetition_penalty = float(get_number(body, "repetition_penalty", 1, 0, 100));
  if (s.repetition_penalty <= 0) bad("repetition_penalty", "must be in (0, 100], got 0");
  if (const ojson* lb = field(body, "logit_bias"); lb && !lb->is_null()) {
    if (!lb->is_object()) bad("logit_bias", "must be an object of token ids to biases, got " + type_of(*lb));
    for (const auto& [key, value] : lb->items()) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
      }
      if (used != key.size() || id < 0 || id > INT32_MAX)
        bad("logit_bias", "key '" + key + "' is not a token id (expected {\"13\": -100, ...})");
      if (!value.is_number() || !(value.get<double>() >= -100 && value.get<double>() <= 100))
        bad("logit_bias", "the bias of token " + key + " must be a number in [-100, 100]");
      std::erase_if(s.logit_bias, [&](const auto& b) { return b.first == int32_t(id); });  // "13" and "013"
      s.logit_bias.push_back({int32_t(id), float(value.get<double>())});
    }
  }
  if (const ojson* ids = field(body, "allowed_token_ids"); ids && !ids->is_null()) {  // vLLM's
    if (!ids->is_array()) bad("allowed_token_ids", "must be a list of token ids, got " + type_of(*ids));
    if (ids->empty()) bad("allowed_token_ids", "must not be empty (leave it out to allow every token)");
    s.allowed_ids = token_ids(*ids, "allowed_token_ids", m);
    std::sort(s.allowed_ids.begin(), s.allowed_ids.end());
    s.allowed_ids.erase(std::unique(s.allowed_ids.begin(), s.allowed_ids.end()), s.allowed_ids.end());
  }
  if (const ojson* bw = field(body, "bad_words"); bw && !bw->is_null()) s.bad_words = bad_word_ids(*bw, m);
  s.min_tokens = get_int(body, "min_tokens", 0, 0, INT32_MAX);  // vLLM's: no EOS before this many
  if (const ojson* seed = field(body, "seed")) {
    if (!seed->is_number_integer()) bad("seed", "must be an integer, got " + type_of(*seed));
    s.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : uint64_t(seed->get<int64_t>());
  } else {
    static thread_local std::mt19937_64 gen{std::random_device{}()};
    s.seed = gen();
  }
  r.sched.stop_at_eos = !get_bool(body, "ignore_eos", false);
  if (const ojson* ids = field(body, "stop_token_ids"); ids && !ids->is_null()) {  // vLLM's
    if (!ids->is_array()) bad("stop_token_ids", "must be a list of token ids, got " + type_of(*ids));
    if (ids->size() > 64) bad("stop_token_ids", str("at most 64 ids, got ", ids->size()));
    r.sched.stop_token_ids = token_ids(*ids, "stop_token_ids", m);
  }

  if (chat) {
    r.sched.logprobs = get_bool(body, "logprobs", false);
    r.sched.top_logprobs = int(get_int(body, "top_logprobs", 0, 0, 20));
    if (r.sched.top_logprobs > 0 && !r.sched.logprobs) bad("top_logprobs", "requires logprobs to be true");
  } else if (const ojson* lp = field(body, "logprobs")) {
    if (lp->is_boolean()) bad("logprobs", "must be an integer in [0, 20] for /v1/completions, got a boolean");
    r.sched.logprobs = true;
    r.sched.top_logprobs = int(get_int(body, "logprobs", 0, 0, 20));
  }

  if (const ojson* stop = field(body, "stop")) {
    if (stop->is_string()) {
      r.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > 16) bad("stop", str("at most 16 stop strings, got ", stop->size()));
      for (const ojson& x : *stop) {
        if (!x.is_string()) bad("stop", "must be a string or a list of strings, got a list holding " + type_of(x));
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "must be a string or a list of strings, got " + type_of(*stop));
    }
    std::erase_if(r.stop, [](const std::string& x) { return x.empty(); });
    if (!r.stop.empty() && !m.tokenizer) bad("stop", "stop strings need a tokenizer, and this model has none");
  }

  if (chat) {
    const ojson* tools = chat_tools(body, m);
    r.parse_tools = tools != nullptr;
    if (tools) r.tool_string_params = string_params_of(*tools);
    r.parallel_tool_calls = get_bool(body, "parallel_tool_calls", true);
    r.prompts.push_back(chat_prompt(body, m, tools, get_bool(body, "add_generation_prompt", true)));
    r.think = m.think;
    r.starts_in_reasoning = m.think.opened_by(r.prompts[0]);
    r.include_reasoning = get_bool(body, "include_reasoning", true);
  } else {
    for (auto& [ids, text] : completion_prompts(body, m)) {
      r.prompts.push_back(std::move(ids));
      r.prompt_texts.push_back(std::move(text));
    }
  }
  truncate_prompts(body, m, r);
  if (int64_t(r.prompts.size()) * r.n > 128)
    bad("n", str(r.prompts.size(), " prompts x n = ", r.n, " is more than 128 choices"));
  const char* prompt_field = chat ? "messages" : "prompt";
  int64_t P = 0;  // the longest prompt
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    const std::string at = r.prompts.size() > 1 ? str(prompt_field, "[", i, "]") : std::string(prompt_field);
    const int64_t n = int64_t(r.prompts[i].size());
    if (n == 0) bad(at, "encodes to no tokens");
    if (n >= m.context)
      bad(at, str("the prompt has ", n, " tokens, but this server's context is ", m.context,
                  " tokens (prompt + max_tokens must fit)"));
    P = std::max(P, n);
  }
  r.sched.prompt = r.prompts[0];
  if (r.echo) {
    r.sched.prompt_logprobs = r.sched.logprobs;
    for (size_t i = 0; i < r.prompts.size(); ++i)  // a prompt sent as ids is echoed decoded
      if (r.prompt_texts[i].empty() && m.tokenizer)
        r.prompt_texts[i] = m.tokenizer->decode(std::vector<uint32_t>(r.prompts[i].begin(), r.prompts[i].end()), false);
  }
  const char* max_field = chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  // echo with logprobs scores the prompt: max_tokens 0 asks for nothing more (lm-eval's loglikelihood).
  const int64_t max_tokens = get_int(body, max_field, -1, r.sched.prompt_logprobs ? 0 : 1, INT64_MAX);
  if (max_tokens < 0) {
    r.sched.max_tokens = m.context - P;  // as much as the context allows
  } else if (max_tokens > m.context - P) {  // (P + max_tokens could overflow: max_tokens may be 2^63 - 1)
    bad(max_field, str("prompt (", P, " tokens) + ", max_field, " (", max_tokens, ") exceed this server's context of ",
                       m.context, " tokens"));
  } else {
    r.sched.max_tokens = max_tokens;
  }
  return r;
}

}  // namespace vireo::server
