// The OpenAI request parser (server/openai_api.h; and /tokenize's and /detokenize's) under fuzzing: bodies built from
// valid requests with values swapped for others of any type, keys dropped or added, and bytes edited, must either parse
// into a request within its limits or be refused with an ApiError naming the field (one line): never another exception,
// a crash or a hang. tests/server covers each rule end to end.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "server/openai_api.h"
#include "server/tool_calls.h"
#include "test_helpers.h"

using namespace vireo::server;

namespace {

ServedModel demo_served() {
  const std::string dir = std::string(VIREO_SOURCE_DIR) + "/models/vireo-demo";
  ServedModel m;
  m.name = "vireo-demo";
  m.context = 256;
  m.vocab = 8192;
  m.tokenizer = std::make_shared<vireo::Tokenizer>(vireo::Tokenizer::from_file(dir + "/tokenizer.json"));
  m.chat_template =
      std::make_shared<vireo::ChatTemplate>(vireo::ChatTemplate::from_tokenizer_config(dir + "/tokenizer_config.json"));
  m.think = think_tokens_of(*m.tokenizer);
  EXPECT_TRUE(m.think.splits());
  return m;
}

// Valid requests touching every field the parser reads.
std::vector<std::pair<bool, ojson>> seed_bodies() {
  const ojson tool = {{"type", "function"},
                      {"function",
                       {{"name", "get_weather"},
                        {"description", "The weather"},
                        {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}};
  std::vector<std::pair<bool, ojson>> out;
  out.push_back({true,
                 {{"model", "vireo-demo"},
                  {"messages",
                   {{{"role", "system"}, {"content", "Be terse."}},
                    {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Hi"}}}}},
                    {{"role", "assistant"},
                     {"content", nullptr},
                     {"tool_calls",
                      {{{"id", "c1"},
                        {"type", "function"},
                        {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}}}}},
                    {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "sunny"}},
                    {{"role", "user"}, {"content", "And tomorrow?"}}}},
                  {"tools", {tool}},
                  {"tool_choice", "auto"},
                  {"parallel_tool_calls", false},
                  {"max_completion_tokens", 8},
                  {"temperature", 0.7},
                  {"top_p", 0.9},
                  {"top_k", 40},
                  {"min_p", 0.05},
                  {"seed", 7},
                  {"stop", {"\n\n", "END"}},
                  {"logprobs", true},
                  {"top_logprobs", 3},
                  {"presence_penalty", 0.5},
                  {"frequency_penalty", -0.5},
                  {"repetition_penalty", 1.1},
                  {"logit_bias", {{"13", -100}, {"42", 5}}},
                  {"min_tokens", 2},
                  {"stop_token_ids", {3, 4}},
                  {"stream", true},
                  {"stream_options", {{"include_usage", true}}},
                  {"chat_template_kwargs", {{"enable_thinking", false}}},
                  {"include_reasoning", false},
                  {"include_stop_str_in_output", true},
                  {"add_generation_prompt", true},
                  {"return_token_ids", true},
                  {"n", 2}}});
  out.push_back(
      {true,
       {{"messages", {{{"role", "user"}, {"content", "Hi"}}, {{"role", "assistant"}, {"content", "Hello, "}}}},
        {"add_generation_prompt", false},
        {"continue_final_message", true},
        {"truncate_prompt_tokens", 6},
        {"max_tokens", 4}}});
  out.push_back({false,
                 {{"model", "vireo-demo"},
                  {"prompt", {"Hello there", {440, 435, 1131}}},
                  {"max_tokens", 4},
                  {"echo", true},
                  {"logprobs", 2},
                  {"n", 3},
                  {"best_of", 1},
                  {"ignore_eos", true},
                  {"truncate_prompt_tokens", 2},
                  {"bad_words", {"Hello", " world"}},
                  {"allowed_token_ids", {440, 435, 7}},
                  {"skip_special_tokens", false},
                  {"temperature", 0},
                  {"response_format", {{"type", "text"}}}}});
  out.push_back({false, {{"prompt", "Once upon a time"}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}}});
  return out;
}

// A JSON value of a random type and size, extremes included.
ojson random_value(std::mt19937& rng, int depth = 0) {
  switch (rng() % (depth > 2 ? 9 : 11)) {
    case 0: return nullptr;
    case 1: return bool(rng() % 2);
    case 2: {
      const int64_t picks[] = {0, -1, 1, 2, 16, 17, 20, 21, 128, 255, 256, 8191, 8192, INT32_MAX, INT64_MIN, INT64_MAX};
      return picks[rng() % std::size(picks)];
    }
    case 3: return uint64_t(UINT64_MAX - rng() % 3);
    case 4: {
      const double picks[] = {-2.5, -0.0, 0.5, 1.0, 2.0, 2.0001, 100.0, 1e308, -1e308, 1e-320};
      return picks[rng() % std::size(picks)];
    }
    case 5: return std::string(rng() % 3 ? "x" : "");
    case 6: {
      const char* picks[] = {"auto",      "none", "required", "text",    "json_object", "user",
                             "assistant", "tool", "function", "<think>", "@BAD-UTF8@",  "13"};
      return picks[rng() % std::size(picks)];
    }
    case 7: return std::string(size_t(rng() % 3000), 'a');
    case 8: return ojson::array();
    case 9: {
      ojson a = ojson::array();
      for (int i = 0, n = int(rng() % 4); i < n; ++i) a.push_back(random_value(rng, depth + 1));
      return a;
    }
    default: {
      ojson o = ojson::object();
      const char* keys[] = {"type", "text", "role", "content", "name", "function", "arguments", "include_usage", "13"};
      for (int i = 0, n = int(rng() % 4); i < n; ++i) o[keys[rng() % std::size(keys)]] = random_value(rng, depth + 1);
      return o;
    }
  }
}

// Every value's location in `j` (objects' members and arrays' elements, recursively).
void collect(ojson& j, std::vector<ojson*>& at) {
  at.push_back(&j);
  if (j.is_object())
    for (auto& [k, v] : j.items()) collect(v, at);
  else if (j.is_array())
    for (auto& v : j) collect(v, at);
}

}  // namespace

// add_special_tokens (vLLM's): /v1/completions' text gets the tokenizer's BOS unless it is false;
// a chat's rendering (which writes its own) gets none unless it is true. Gemma 3's tokenizer,
// whose post-processor adds a BOS.
TEST(OpenAiApi, AddSpecialTokensIsHonoured) {
  const std::string dir = std::string(VIREO_SHARED_DIR) + "/data/tokenizers/gemma3";
  const std::string tok_json = vireo::test::gunzip_file(dir + "/tokenizer.json.gz");
  const std::string config = vireo::test::gunzip_file(dir + "/tokenizer_config.json.gz");
  if (tok_json.empty() || config.empty()) GTEST_SKIP() << "shared tokenizers not available in " << dir;
  ServedModel m;
  m.name = "g3";
  m.context = 4096;
  m.tokenizer = std::make_shared<vireo::Tokenizer>(vireo::Tokenizer::from_json(tok_json));
  m.vocab = int64_t(m.tokenizer->vocab_size());
  m.chat_template = std::make_shared<vireo::ChatTemplate>(
      vireo::ChatTemplate::from_tokenizer_config_json(ojson::parse(config), "gemma3"));
  auto ids = [](const std::vector<uint32_t>& u) { return std::vector<int32_t>(u.begin(), u.end()); };
  const auto with = ids(m.tokenizer->encode("Hello there", true)),
             without = ids(m.tokenizer->encode("Hello there", false));
  ASSERT_EQ(with.size(), without.size() + 1);  // the BOS
  EXPECT_EQ(parse_request(R"({"prompt": "Hello there", "max_tokens": 1})", false, m).prompts[0], with);
  EXPECT_EQ(parse_request(R"({"prompt": ["Hello there"], "add_special_tokens": false, "max_tokens": 1})", false, m)
                .prompts[0],
            without);
  const std::string rendered = m.chat_template->render(ojson::parse(R"([{"role": "user", "content": "hi"}])"), true);
  const std::string chat = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1)";
  EXPECT_EQ(parse_request(chat + "}", true, m).prompts[0], ids(m.tokenizer->encode(rendered, false)));
  EXPECT_EQ(parse_request(chat + R"(, "add_special_tokens": true})", true, m).prompts[0],
            ids(m.tokenizer->encode(rendered, true)));
}

// vLLM's documents reach the chat template (for templates that describe retrieved documents).
TEST(OpenAiApi, DocumentsReachTheChatTemplate) {
  ServedModel m = demo_served();
  m.chat_template = std::make_shared<vireo::ChatTemplate>(
      "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[0].content }}",
      std::map<std::string, std::string>{}, "docs");
  const ApiRequest r = parse_request(
      R"({"messages": [{"role": "user", "content": "Q"}], "max_tokens": 1,
          "documents": [{"title": "A", "text": "one"}, {"title": "B", "text": "two"}]})",
      true, m);
  const auto& p = r.prompts[0];
  EXPECT_EQ(m.tokenizer->decode(std::vector<uint32_t>(p.begin(), p.end()), false), "[A: one][B: two]Q");
  try {
    parse_request(R"({"messages": [{"role": "user", "content": "Q"}], "documents": ["x"]})", true, m);
    FAIL() << "a document that is not an object was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "documents");
  }
}

// A refusal quoting what the client sent stays one line: a role with a newline in it (found by a
// 200x fuzz campaign, seed 63) is named with the newline escaped.
TEST(OpenAiApi, RefusalsQuotingTheRequestAreOneLine) {
  const ServedModel m = demo_served();
  try {
    parse_request(R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assist\nant\u0001", "content": "x"}]})",
                  true, m);
    FAIL() << "an unknown role was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "messages[1].role");
    EXPECT_EQ(std::string(e.what()),
              "messages[1].role: unknown role 'assist\\nant\\x01' (expected system, developer, user, assistant or "
              "tool)");
  }
}

TEST(OpenAiApi, FuzzedBodiesParseOrNameTheField) {
  const ServedModel m = demo_served();
  const auto seeds = seed_bodies();
  for (const auto& [chat, body] : seeds) ASSERT_NO_THROW(parse_request(body.dump(), chat, m)) << body.dump();
  std::mt19937 rng(uint32_t(vireo::test::fuzz_seed(2026)));
  const char* extra_keys[] = {"n",
                              "best_of",
                              "suffix",
                              "functions",
                              "guided_json",
                              "tool_choice",
                              "messages",
                              "prompt",
                              "max_tokens",
                              "logit_bias",
                              "stop",
                              "seed",
                              "echo",
                              "include_reasoning",
                              "truncate_prompt_tokens",
                              "allowed_token_ids",
                              "add_special_tokens",
                              "documents",
                              "priority",
                              "bad_words",
                              "skip_special_tokens"};
  int parsed = 0, refused = 0;
  for (int iter = 0; iter < vireo::test::fuzz_iterations(4000); ++iter) {
    auto [chat, body] = seeds[rng() % seeds.size()];
    for (int e = 0, edits = 1 + int(rng() % 3); e < edits; ++e) {
      std::vector<ojson*> at;
      collect(body, at);
      ojson* target = at[rng() % at.size()];
      switch (rng() % 4) {
        case 0:
        case 1: *target = random_value(rng); break;
        case 2: {  // one member or element dropped (rebuilt: nlohmann 3.11.2's ordered_map erase
                   // leaves its moved members' parent links stale under JSON_DIAGNOSTICS)
          if (!target->is_structured() || target->empty()) break;
          const size_t drop = rng() % target->size();
          ojson kept = target->is_object() ? ojson::object() : ojson::array();
          size_t i = 0;
          for (auto it = target->begin(); it != target->end(); ++it, ++i)
            if (i != drop) {
              if (kept.is_object()) kept[it.key()] = it.value();
              else kept.push_back(it.value());
            }
          *target = std::move(kept);
          break;
        }
        default:
          if (body.is_object()) body[extra_keys[rng() % std::size(extra_keys)]] = random_value(rng);
          break;
      }
    }
    std::string text = body.dump();
    for (size_t p; (p = text.find("@BAD-UTF8@")) != std::string::npos;) text.replace(p, 10, "\xff\xfe");
    if (rng() % 8 == 0 && !text.empty()) text[rng() % text.size()] = char(rng() % 128);  // often not JSON then
    SCOPED_TRACE(text.substr(0, 600));
    try {
      const ApiRequest r = parse_request(text, chat, m);
      ++parsed;
      ASSERT_FALSE(r.prompts.empty());
      ASSERT_GE(r.n, 1);
      ASSERT_LE(r.n, 16);
      ASSERT_LE(int64_t(r.prompts.size()) * r.n, 128);
      for (const auto& p : r.prompts) {
        ASSERT_FALSE(p.empty());
        for (int32_t id : p) ASSERT_TRUE(id >= 0 && id < m.vocab) << id;
        ASSERT_LE(int64_t(p.size()) + r.sched.max_tokens, m.context);
      }
      ASSERT_GE(r.sched.max_tokens, 0);
      ASSERT_LE(r.sched.top_logprobs, 20);
      ASSERT_TRUE(r.sched.sampling.temperature >= 0 && r.sched.sampling.temperature <= 2);
      ASSERT_TRUE(r.sched.sampling.top_p > 0 && r.sched.sampling.top_p <= 1);
    } catch (const ApiError& e) {
      ++refused;
      const std::string msg = e.what();
      ASSERT_FALSE(msg.empty());
      ASSERT_EQ(msg.find('\n'), std::string::npos) << msg;
      ASSERT_TRUE(e.status == 400 || e.status == 404) << e.status;
    } catch (const std::exception& e) {
      FAIL() << "not an ApiError: " << e.what();
    }
    // /tokenize and /detokenize read the same bodies (and refuse most).
    for (auto read : {tokenize, detokenize}) {
      try {
        read(text, m);
      } catch (const ApiError& e) {
        ASSERT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
      } catch (const std::exception& e) {
        FAIL() << "not an ApiError: " << e.what();
      }
    }
  }
  // Both outcomes happen often (the mutations are not all refused, nor all harmless).
  EXPECT_GT(parsed, 200);
  EXPECT_GT(refused, 1000);
}

namespace {

// Generated text is anyone's: seed calls edited by inserting tags and bytes (invalid UTF-8 among
// them), erasing runs and overwriting bytes.
std::string mutated_tool_text(std::mt19937& rng) {
  std::string s =
      "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>d</arg_key>"
      "<arg_value>{\"a\": [1, 2]}</arg_value></tool_call><tool_call>now</tool_call>";
  const std::vector<std::string> fragments = {
      "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "{",
      "}",           "\"",           "[",         "\xff",       "\n",          "\xc3\xa9",     "</arg_va"};
  for (int e = 0, edits = 1 + int(rng() % 5); e < edits; ++e) {
    const size_t pos = rng() % (s.size() + 1);
    switch (rng() % 3) {
      case 0: s.insert(pos, fragments[rng() % fragments.size()]); break;
      case 1: s.erase(std::min(pos, s.size()), 1 + rng() % 12); break;
      default:
        if (!s.empty()) s[std::min(pos, s.size() - 1)] = char(rng() % 256);
    }
  }
  return s;
}

}  // namespace

// The tool-call reader takes any bytes without throwing, and what it reads is complete calls with
// a name and a JSON object's arguments.
TEST(ToolCalls, FuzzedTextNeverThrows) {
  std::mt19937 rng(uint32_t(vireo::test::fuzz_seed(77)));
  for (int iter = 0; iter < vireo::test::fuzz_iterations(3000); ++iter) {
    const std::string s = mutated_tool_text(rng);
    SCOPED_TRACE(s);
    std::string rest;
    std::vector<ToolCall> calls;
    ASSERT_NO_THROW(calls = parse_tool_calls(s, &rest, {{"get_weather", {"city"}}}));
    for (const ToolCall& c : calls) {
      EXPECT_FALSE(c.name.empty());
      EXPECT_TRUE(ojson::parse(c.arguments).is_object()) << c.arguments;
    }
  }
}

// Streamed in pieces of any size, the same text gives each complete call's name first and
// arguments whose pieces add up to the call read whole, whatever the bytes (a string parameter's
// value sent as it comes included).
TEST(ToolCalls, FuzzedTextStreamsTheCallsItReadsWhole) {
  std::mt19937 rng(uint32_t(vireo::test::fuzz_seed(78)));
  const StringParams strings = {{"get_weather", {"city"}}};
  for (int iter = 0; iter < vireo::test::fuzz_iterations(3000); ++iter) {
    const std::string s = mutated_tool_text(rng);
    SCOPED_TRACE(s);
    const std::vector<ToolCall> whole = parse_tool_calls(s, nullptr, strings);
    ToolCallReader reader(strings);
    std::vector<std::string> names, args;
    for (size_t at = 0; at < s.size();) {
      const size_t n = std::min(s.size() - at, size_t(1 + rng() % 17));
      for (const ToolCallDelta& d : reader.feed(std::string_view(s).substr(at, n))) {
        ASSERT_EQ(d.starts, d.index == names.size());  // a call starts once, before its arguments
        if (d.starts) {
          names.push_back(d.name);
          args.emplace_back();
        }
        args[d.index] += d.arguments;
      }
      at += n;
    }
    ASSERT_EQ(reader.calls().size(), whole.size());
    ASSERT_GE(names.size(), whole.size());  // a call cut off or leaving the format: started, not read
    ASSERT_LE(names.size(), whole.size() + 1);
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_EQ(names[i], whole[i].name);
      EXPECT_EQ(args[i], whole[i].arguments);
      EXPECT_EQ(reader.calls()[i].arguments, whole[i].arguments);
    }
  }
}
