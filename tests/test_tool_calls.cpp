// GLM-5 tool calls read out of a generation's text (server/tool_calls.h): names, arguments as JSON
// values where they parse and strings where not (or where the tool declares a string), several
// calls, the malformed or cut-off rest left unread, and the same calls streamed as deltas.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include <nlohmann/json.hpp>

#include "server/tool_calls.h"
#include "text/tokenizer.h"

using namespace vireo::server;
using json = nlohmann::ordered_json;
using vireo::Tokenizer;

TEST(ToolCalls, ParsesGlmBlocks) {
  std::string rest;
  auto calls = parse_tool_calls(
      "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>"
      "<arg_value>3</arg_value><arg_key>opts</arg_key><arg_value>{\"units\": \"C\", \"hourly\": true}</arg_value>"
      "</tool_call>\n<tool_call>now</tool_call><|endoftext|>",
      &rest);
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].name, "get_weather");
  EXPECT_EQ(calls[0].arguments, R"({"city":"Paris","days":3,"opts":{"units":"C","hourly":true}})");
  EXPECT_EQ(calls[1].name, "now");
  EXPECT_EQ(calls[1].arguments, "{}");
  EXPECT_EQ(rest, "<|endoftext|>");
  // A value that is not JSON stays a string, spaces and all; "true" and "null" are JSON.
  calls = parse_tool_calls(
      "<tool_call>f<arg_key>q</arg_key><arg_value> two words </arg_value><arg_key>b</arg_key>"
      "<arg_value>true</arg_value><arg_key>n</arg_key><arg_value>null</arg_value></tool_call>",
      nullptr);
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].arguments, R"({"q":" two words ","b":true,"n":null})");
}

TEST(ToolCalls, LeavesWhatIsNotACompleteCall) {
  std::string rest;
  // Cut off by max_tokens: nothing read, all of it left.
  EXPECT_TRUE(parse_tool_calls("<tool_call>f<arg_key>a</arg_key><arg_value>1", &rest).empty());
  EXPECT_EQ(rest, "<tool_call>f<arg_key>a</arg_key><arg_value>1");
  // The first call complete, the second cut off.
  auto calls = parse_tool_calls("<tool_call>f</tool_call><tool_call>g<arg_key>", &rest);
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(rest, "<tool_call>g<arg_key>");
  // No name, a key without its value, text between the pairs, text between calls: not this format.
  EXPECT_TRUE(parse_tool_calls("<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", nullptr).empty());
  EXPECT_TRUE(parse_tool_calls("<tool_call>f<arg_key>a</arg_key></tool_call>", nullptr).empty());
  EXPECT_TRUE(parse_tool_calls("<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value> and <arg_key>b</arg_key>"
                               "<arg_value>2</arg_value></tool_call>",
                               nullptr)
                  .empty());
  calls = parse_tool_calls("<tool_call>f</tool_call> so then <tool_call>g</tool_call>", &rest);
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(rest, " so then <tool_call>g</tool_call>");
}

// The token-level split on the demo model's tokenizer, whose tool tags are special tokens: the text
// before the first <tool_call> (special tokens skipped, as the server's text), then the calls.
TEST(ToolCalls, SplitsAGenerationsIds) {
  const Tokenizer tok = Tokenizer::from_file(std::string(VIREO_SOURCE_DIR) + "/models/vireo-demo/tokenizer.json");
  auto ids_of = [&](const std::string& text) {
    const std::vector<uint32_t> u = tok.encode(text, false);
    return std::vector<int32_t>(u.begin(), u.end());
  };
  const auto ids = ids_of(
      "</think>Let me look.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
      "</arg_value></tool_call><|endoftext|>");
  ASSERT_NE(std::find(ids.begin(), ids.end(), int32_t(*tok.token_to_id("<tool_call>"))), ids.end());
  std::string content = "unchanged";
  const auto calls = split_tool_calls(tok, ids, &content);
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].name, "get_weather");
  EXPECT_EQ(calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(content, "Let me look.");
  // Two calls; parallel_tool_calls false keeps the first.
  const auto two =
      ids_of("<tool_call>a</tool_call><tool_call>b<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>");
  EXPECT_EQ(split_tool_calls(tok, two, nullptr).size(), 2u);
  const auto first = split_tool_calls(tok, two, nullptr, 1);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].name, "a");
  content = "unchanged";  // no call, or one cut off: nothing read, the content left alone
  EXPECT_TRUE(split_tool_calls(tok, ids_of("Just text."), &content).empty());
  EXPECT_TRUE(split_tool_calls(tok, ids_of("Text<tool_call>get_weather<arg_key>city"), &content).empty());
  EXPECT_EQ(content, "unchanged");
}

// Streaming: a call's name goes out once it is complete, a string parameter's value as it comes
// (held back where it may be the start of a closing tag, or an unfinished character), any other
// value once it is complete; the pieces add up to the call read whole.
TEST(ToolCalls, StreamsNamesThenArgumentsAsTheyCome) {
  const StringParams strings = {{"write_file", {"path", "text"}}};
  ToolCallReader r(strings);
  std::vector<ToolCallDelta> d = r.feed("<tool_call>write_fi");
  EXPECT_TRUE(d.empty());  // the name may go on
  d = r.feed("le<arg_key>path</arg_key><arg_value>a.txt</arg_value><arg_key>text</arg_key><arg_value>line \"1\"\n");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_TRUE(d[0].starts);
  EXPECT_EQ(d[0].index, 0u);
  EXPECT_EQ(d[0].name, "write_file");
  EXPECT_EQ(d[0].arguments, R"({"path":"a.txt","text":"line \"1\"\n)");
  d = r.feed("li\xc3");  // an unfinished character is held
  ASSERT_EQ(d.size(), 1u);
  EXPECT_FALSE(d[0].starts);
  EXPECT_EQ(d[0].arguments, "li");
  d = r.feed("\xa9ne 2</arg_va");  // as is what may become </arg_value>
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].arguments, "\xc3\xa9ne 2");
  d = r.feed("lue><arg_key>mode</arg_key><arg_value>644</arg_value>");  // not a string parameter: a number, whole
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].arguments, R"(","mode":644)");
  EXPECT_TRUE(r.calls().empty());
  d = r.feed("</tool_call><tool_call>now</tool_call>");
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].arguments, "}");
  EXPECT_TRUE(d[1].starts);
  EXPECT_EQ(d[1].index, 1u);
  EXPECT_EQ(d[1].arguments, "{}");
  ASSERT_EQ(r.calls().size(), 2u);
  const std::string whole = R"({"path":"a.txt","text":"line \"1\"\nli)"
                            "\xc3\xa9"
                            R"(ne 2","mode":644})";
  EXPECT_EQ(r.calls()[0].arguments, whole);
  EXPECT_EQ(json::parse(whole)["text"], "line \"1\"\nli\xc3\xa9ne 2");
  const auto once = parse_tool_calls(
      "<tool_call>write_file<arg_key>path</arg_key><arg_value>a.txt</arg_value><arg_key>text</arg_key><arg_value>line "
      "\"1\"\nli\xc3\xa9ne 2</arg_value><arg_key>mode</arg_key><arg_value>644</arg_value></tool_call>",
      nullptr, strings);
  ASSERT_EQ(once.size(), 1u);
  EXPECT_EQ(once[0].arguments, whole);
}

// A parameter the tool declares a string keeps what the model wrote, JSON-looking or not; the
// same value for another parameter (or tool) is read as JSON.
TEST(ToolCalls, StringParametersAreReadAsWritten) {
  const std::string text =
      "<tool_call>f<arg_key>s</arg_key><arg_value>123</arg_value><arg_key>n</arg_key><arg_value>123</arg_value>"
      "</tool_call><tool_call>g<arg_key>s</arg_key><arg_value>true</arg_value></tool_call>";
  const auto calls = parse_tool_calls(text, nullptr, {{"f", {"s"}}});
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].arguments, R"({"s":"123","n":123})");
  EXPECT_EQ(calls[1].arguments, R"({"s":true})");
  // A key written twice is sent twice (the stream cannot take back the first); JSON readers keep the last.
  EXPECT_EQ(parse_tool_calls("<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key>"
                             "<arg_value>2</arg_value></tool_call>",
                             nullptr)[0]
                .arguments,
            R"({"a":1,"a":2})");
}

// parallel_tool_calls false: the reader stops after the first call, and no second call starts.
TEST(ToolCalls, StreamStopsAfterMaxCalls) {
  ToolCallReader r({}, 1);
  const auto d = r.feed("<tool_call>a</tool_call><tool_call>b</tool_call>");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].name, "a");
  EXPECT_EQ(r.calls().size(), 1u);
  EXPECT_EQ(r.calls_started(), 1u);
}
