// A generation's ids -> the text a client sees (server/text_output.h): stop strings withheld until
// they cannot match, and a reasoning model's reply split at </think> into reasoning and content,
// token by token as the server streams it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/text_output.h"
#include "text/tokenizer.h"

using namespace vireo::server;
using vireo::Tokenizer;

namespace {

const Tokenizer& demo_tokenizer() {
  static const Tokenizer tok =
      Tokenizer::from_file(std::string(VIREO_SOURCE_DIR) + "/models/vireo-demo/tokenizer.json");
  return tok;
}

std::vector<int32_t> ids_of(const std::string& text) {
  const std::vector<uint32_t> u = demo_tokenizer().encode(text, false);
  return std::vector<int32_t>(u.begin(), u.end());
}

// The ids of `parts` (text pieces, or single ids) in order.
std::vector<int32_t> cat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const std::vector<int32_t>& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

ThinkTokens demo_think() {
  const ThinkTokens t = think_tokens_of(demo_tokenizer());
  EXPECT_EQ(t.open, int32_t(*demo_tokenizer().token_to_id("<think>")));
  EXPECT_EQ(t.close, int32_t(*demo_tokenizer().token_to_id("</think>")));
  return t;
}

// Every piece of feeding `ids` then finishing, joined by part.
struct Parts {
  std::string reasoning, content;
  size_t content_start = 0;
  bool stopped = false;
};
Parts run(TextOutput& out, const std::vector<int32_t>& ids) {
  Parts p;
  auto take = [&](const TextPiece& piece) {
    EXPECT_TRUE(piece.held_reasoning.empty() || !piece.reasoning);
    p.reasoning += piece.held_reasoning;
    (piece.reasoning ? p.reasoning : p.content) += piece.text;
  };
  for (int32_t id : ids) {
    take(out.token(id));
    if (out.stopped()) break;
  }
  take(out.finish());
  p.content_start = out.content_start();
  p.stopped = out.stopped();
  return p;
}

}  // namespace

TEST(TextOutput, SplitsTheReplyAtThinkEnd) {
  const ThinkTokens think = demo_think();
  const std::vector<int32_t> reasoning = ids_of("Paris is the capital. ü"), content = ids_of(" It is Paris.");
  const std::vector<int32_t> ids = cat({reasoning, {think.close}, content});

  // The prompt ended with <think>: everything before </think> is reasoning.
  TextOutput inside(&demo_tokenizer(), {}, think, true);
  Parts p = run(inside, ids);
  EXPECT_EQ(p.reasoning, "Paris is the capital. ü");
  EXPECT_EQ(p.content, " It is Paris.");
  EXPECT_EQ(p.content_start, reasoning.size() + 1);

  // Started outside (thinking off): no split, the markers skipped as special tokens.
  TextOutput outside(&demo_tokenizer(), {}, think, false);
  p = run(outside, ids);
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, "Paris is the capital. ü It is Paris.");
  EXPECT_EQ(p.content_start, 0u);

  // A reply that opens its own reasoning with <think> as its first token enters it.
  const std::vector<int32_t> opened = cat({{think.open}, ids});
  TextOutput self(&demo_tokenizer(), {}, think, false);
  p = run(self, opened);
  EXPECT_EQ(p.reasoning, "Paris is the capital. ü");
  EXPECT_EQ(p.content, " It is Paris.");
  EXPECT_EQ(p.content_start, reasoning.size() + 2);

  // <think> later on is not an opening; no markers at all: no split.
  TextOutput later(&demo_tokenizer(), {}, think, false);
  const std::vector<int32_t> late = cat({content, {think.open}, reasoning});
  p = run(later, late);
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, " It is Paris.Paris is the capital. ü");
  TextOutput plain(&demo_tokenizer(), {}, {}, true);
  p = run(plain, ids);
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, "Paris is the capital. ü It is Paris.");
}

// skip_special false (vLLM's skip_special_tokens): special tokens' text is written, but for the
// markers where they split the reply (</think> ending the reasoning, <think> opening it), which are
// in neither part; where they do not split (thinking off, a <think> later on) they are text too.
TEST(TextOutput, SpecialTokensWrittenWhenNotSkipped) {
  const ThinkTokens think = demo_think();
  const int32_t eot = int32_t(*demo_tokenizer().token_to_id("<|endoftext|>"));
  const std::vector<int32_t> reasoning = ids_of("Paris is the capital. ü"), content = ids_of(" It is Paris.");
  const std::vector<int32_t> ids = cat({reasoning, {think.close}, content, {eot, think.open}, content});
  TextOutput inside(&demo_tokenizer(), {}, think, true, false, /*skip_special=*/false);
  Parts p = run(inside, ids);
  EXPECT_EQ(p.reasoning, "Paris is the capital. ü");
  EXPECT_EQ(p.content, " It is Paris.<|endoftext|><think> It is Paris.");
  EXPECT_EQ(p.content_start, reasoning.size() + 1);
  TextOutput skipped(&demo_tokenizer(), {}, think, true);
  p = run(skipped, ids);
  EXPECT_EQ(p.content, " It is Paris. It is Paris.");
  // Thinking off: no split, every marker is text.
  TextOutput outside(&demo_tokenizer(), {}, think, false, false, false);
  p = run(outside, ids);
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, "Paris is the capital. ü</think> It is Paris.<|endoftext|><think> It is Paris.");
  // A reply opening its reasoning with <think>: that one is in neither part.
  const std::vector<int32_t> opened = cat({{think.open}, ids});
  TextOutput self(&demo_tokenizer(), {}, think, false, false, false);
  p = run(self, opened);
  EXPECT_EQ(p.reasoning, "Paris is the capital. ü");
  EXPECT_EQ(p.content, " It is Paris.<|endoftext|><think> It is Paris.");
  // A stop string may match special tokens' text when it is written.
  TextOutput stop(&demo_tokenizer(), {"<|endoftext|>"}, think, true, false, false);
  p = run(stop, ids);
  EXPECT_TRUE(p.stopped);
  EXPECT_EQ(p.content, " It is Paris.");
}

TEST(TextOutput, SettlesWithheldTextIntoTheReasoning) {
  const ThinkTokens think = demo_think();
  // Stop strings are matched on the whole text, as vLLM's detokenizer matches them before its
  // reasoning parser splits the text: one spanning </think> stops there, the reasoning cut before
  // it. The reasoning's tail withheld past the marker comes out with the content's ids, still as
  // reasoning, once it cannot start one.
  const std::vector<int32_t> ids = cat({ids_of("We are do"), {think.close}, ids_of("ne. Done here.")});
  TextOutput out(&demo_tokenizer(), {"done", "Done"}, think, true);
  Parts p = run(out, ids);
  EXPECT_EQ(p.reasoning, "We are ");
  EXPECT_EQ(p.content, "");
  EXPECT_TRUE(p.stopped);
  EXPECT_EQ(p.content_start, ids_of("We are do").size() + 1);
  TextOutput later(&demo_tokenizer(), {"Done"}, think, true);
  p = run(later, ids);
  EXPECT_EQ(p.reasoning, "We are do");
  EXPECT_EQ(p.content, "ne. ");
  EXPECT_TRUE(p.stopped);
  TextOutput none(&demo_tokenizer(), {"done!"}, think, true);  // "do" withheld, then released
  std::vector<TextPiece> pieces;
  for (int32_t id : ids) pieces.push_back(none.token(id));
  pieces.push_back(none.finish());
  std::string reasoning, content;
  for (const TextPiece& piece : pieces) {
    reasoning += piece.held_reasoning;
    (piece.reasoning ? reasoning : content) += piece.text;
  }
  EXPECT_EQ(reasoning, "We are do");
  EXPECT_EQ(content, "ne. Done here.");
  // "do" is withheld through </think> and "ne" ("done" may still be "done!"), then released as
  // reasoning with the next content id's piece.
  const size_t close_at = ids_of("We are do").size();
  EXPECT_TRUE(pieces[close_at].reasoning);
  size_t held_at = 0;
  while (held_at < pieces.size() && pieces[held_at].held_reasoning.empty()) ++held_at;
  ASSERT_LT(held_at, pieces.size());
  EXPECT_GT(held_at, close_at + 1);
  EXPECT_EQ(pieces[held_at].held_reasoning, "do");
  EXPECT_FALSE(pieces[held_at].reasoning);
  // A reply ending at </think>: the withheld tail comes out at the end, as reasoning.
  const std::vector<int32_t> ends(ids.begin(), ids.begin() + std::ptrdiff_t(close_at + 1));
  TextOutput short_reply(&demo_tokenizer(), {"done"}, think, true);
  p = run(short_reply, ends);
  EXPECT_EQ(p.reasoning, "We are do");
  EXPECT_EQ(p.content, "");
  EXPECT_FALSE(p.stopped);

  // A stop string inside the reasoning stops there.
  TextOutput early(&demo_tokenizer(), {"are"}, think, true);
  p = run(early, ids);
  EXPECT_EQ(p.reasoning, "We ");
  EXPECT_EQ(p.content, "");
  EXPECT_TRUE(p.stopped);

  // A character whose bytes span two tokens, cut by </think>, is settled with the reasoning.
  const std::vector<int32_t> emoji = ids_of("🙂");
  ASSERT_GE(emoji.size(), 2u) << "the test needs a character of several byte tokens";
  const std::vector<int32_t> cut = cat({{emoji[0], think.close}, ids_of("ok")});
  TextOutput split(&demo_tokenizer(), {}, think, true);
  p = run(split, cut);
  EXPECT_EQ(p.reasoning, demo_tokenizer().decode(std::vector<uint32_t>{uint32_t(emoji[0])}, true));
  EXPECT_EQ(p.content, "ok");
}

// Stop strings on text fed in pieces: the earliest wins (of two starting there, the one listed
// first), withheld text is released once it cannot start one, and include_stop keeps the string.
TEST(TextOutput, StopMatcherTakesTheEarliestStop) {
  StopMatcher m({"cd", "bcd", "x"});
  EXPECT_EQ(m.feed("ab"), "a");  // "b" may start "bcd"
  EXPECT_EQ(m.feed("cde"), "");  // "bcd" starts before "cd"
  EXPECT_TRUE(m.stopped());
  StopMatcher kept({"cd", "bcd"}, true);
  std::string out = kept.feed("ab");
  out += kept.feed("cde");
  EXPECT_EQ(out, "abcd");
  StopMatcher tie({"ab", "abc"}, true);
  EXPECT_EQ(tie.feed("zabcz"), "zab");
  StopMatcher none({"zz"});
  EXPECT_EQ(none.feed("az"), "a");
  EXPECT_EQ(none.flush(), "z");
  EXPECT_FALSE(none.stopped());
}

// The id that ends a generation (an EOS, a stop token id) is counted but not written, unless
// include_stop_str_in_output asks for it, as vLLM's detokenizer does.
TEST(TextOutput, StopTokenIsCountedButNotWritten) {
  const std::vector<int32_t> ids = ids_of("Hello world.");
  ASSERT_GE(ids.size(), 2u);
  const std::vector<int32_t> head(ids.begin(), ids.end() - 1);
  const std::string all = demo_tokenizer().decode(std::vector<uint32_t>(ids.begin(), ids.end()), true);
  const std::string before = demo_tokenizer().decode(std::vector<uint32_t>(head.begin(), head.end()), true);
  ASSERT_NE(all, before);
  for (bool include : {false, true}) {
    TextOutput out(&demo_tokenizer(), {}, {}, false, include);
    std::string text;
    for (int32_t id : head) text += out.token(id).text;
    text += out.stop_token(ids.back()).text;
    text += out.finish().text;
    EXPECT_EQ(text, include ? all : before) << include;
  }
  // In the reasoning it still counts as a reasoning token.
  const ThinkTokens think = demo_think();
  TextOutput out(&demo_tokenizer(), {}, think, /*starts_in_reasoning=*/true);
  for (int32_t id : head) out.token(id);
  out.stop_token(ids.back());
  EXPECT_EQ(out.content_start(), ids.size());
}
