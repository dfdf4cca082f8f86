// The continuous-batching scheduler without HTTP: greedy outputs under batching equal the same
// requests run alone and transformers' greedy continuations, for prompts of different lengths
// arriving at different steps; cancellation frees rows; admission waits for a row and for budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <thread>

#include "backend/backend.h"
#include "io/json_file.h"
#include "io/npy.h"
#include "model/glm_dsa/model.h"
#include "runtime/generate.h"
#include "runtime/scheduler.h"
#include "cuda_test_util.h"
#include "test_helpers.h"

using namespace vireo;
using vireo::test::TempDir;
using vireo::test::write_file;

namespace {

const std::string kFixtures = VIREO_FIXTURES_DIR;
const std::string kDemo = std::string(VIREO_SOURCE_DIR) + "/models/vireo-demo";

struct Loaded {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<GlmDsaModel> model;
  explicit Loaded(const std::string& dir, bool cuda = false, bool mtp = false) {
#ifdef VIREO_HAVE_CUDA
    backend = cuda ? make_cuda_backend() : make_cpu_backend();
#else
    backend = make_cpu_backend();
#endif
    if (!mtp) {
      model = GlmDsaModel::load(dir, *backend);
      return;
    }
    GlmDsaConfig c = load_glm_dsa_config(dir);
    enable_mtp(c, dir);
    model = GlmDsaModel::create(std::move(c), Checkpoint::open(dir), *backend);
  }
};

SchedRequest greedy(std::vector<int32_t> prompt, int64_t n) {
  SchedRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = n;
  r.stop_at_eos = false;
  return r;
}

// Every event of a finished request: the ids, and how it ended.
struct Outcome {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  FinishReason reason = FinishReason::Stop;
  bool finished = false, error = false;
};

Outcome drain(RequestHandle& h) {
  Outcome o;
  SchedEvent ev;
  while (h.next(ev, std::chrono::milliseconds(0))) {
    if (ev.kind == SchedEvent::Kind::Token) {
      o.ids.push_back(ev.token);
      o.logprobs.push_back(ev.logprob);
    } else if (ev.kind == SchedEvent::Kind::Finish) {
      o.finished = true;
      o.reason = ev.reason;
    } else {
      o.error = true;
    }
  }
  return o;
}

SchedulerOptions manual(int rows, int64_t context, int64_t chunk, bool mtp = false) {
  SchedulerOptions o;
  o.max_batch = rows;
  o.context = context;
  o.prefill_chunk = chunk;
  o.start_thread = false;
  o.mtp_drafts = mtp;
  return o;
}

// One request alone through its own scheduler: the reference a batch must reproduce.
std::vector<int32_t> alone(Loaded& m, const SchedRequest& r, int64_t chunk) {
  Scheduler s(*m.model, *m.backend, manual(1, 256, chunk));
  auto h = s.submit(r);
  while (s.step()) {}
  Outcome o = drain(*h);
  EXPECT_TRUE(o.finished);
  return o.ids;
}

// Requests submitted at given steps into one scheduler; returns each one's outcome.
std::vector<Outcome> staggered_outcomes(Loaded& m, const std::vector<std::pair<int, SchedRequest>>& arrivals,
                                        const SchedulerOptions& opt, size_t* max_running = nullptr,
                                        SchedulerStats* last = nullptr) {
  Scheduler s(*m.model, *m.backend, opt);
  std::vector<std::shared_ptr<RequestHandle>> hs(arrivals.size());
  size_t submitted = 0;
  for (int step = 0; step < 10000; ++step) {
    for (size_t i = 0; i < arrivals.size(); ++i)
      if (arrivals[i].first == step) {
        hs[i] = s.submit(arrivals[i].second);
        ++submitted;
      }
    const bool ran = s.step();
    if (max_running) *max_running = std::max(*max_running, s.stats().running);
    if (!ran && submitted == arrivals.size()) break;
  }
  std::vector<Outcome> out;
  for (auto& h : hs) {
    out.push_back(drain(*h));
    EXPECT_TRUE(out.back().finished);
  }
  EXPECT_EQ(s.stats().cache_bytes_in_use, 0u);
  EXPECT_EQ(s.stats().cache_bytes_reserved, 0u);
  if (last) *last = s.stats();
  return out;
}

std::vector<std::vector<int32_t>> staggered(Loaded& m, const std::vector<std::pair<int, SchedRequest>>& arrivals,
                                            int rows, int64_t chunk, size_t* max_running = nullptr) {
  std::vector<std::vector<int32_t>> ids;
  for (Outcome& o : staggered_outcomes(m, arrivals, manual(rows, 256, chunk), max_running)) ids.push_back(o.ids);
  return ids;
}

// The demo model's greedy cases (tests/fixtures/demo) as requests of their continuations' length
// arriving `spacing` steps apart; `want`: transformers' continuations.
std::vector<std::pair<int, SchedRequest>> demo_arrivals(int spacing, std::vector<std::vector<int32_t>>& want) {
  const Json e = read_json_file(kFixtures + "/demo/expected.json");
  std::vector<std::pair<int, SchedRequest>> arrivals;
  int step = 0;
  for (const Json& c : e["greedy"]["cases"]) {
    auto cont = c["continuation_ids"].get<std::vector<int32_t>>();
    arrivals.push_back({step, greedy(c["prompt_ids"].get<std::vector<int32_t>>(), int64_t(cont.size()))});
    want.push_back(cont);
    step += spacing;
  }
  return arrivals;
}

}  // namespace

TEST(Scheduler, StaggeredBatchEqualsSingleRequestsOnF32Fixture) {
  Loaded m(kFixtures + "/glm_dsa_shared_f32");
  const Json e = read_json_file(kFixtures + "/glm_dsa_shared_f32/expected.json");
  const auto toks = e["tokens"].get<std::vector<int32_t>>();
  const auto gp = e["greedy_prompt"].get<std::vector<int32_t>>();
  const auto gn = e["greedy_new"].get<std::vector<int32_t>>();
  // Prompt lengths 1..40 arriving at steps 0..9; chunk 8 splits the long ones across steps.
  std::vector<std::pair<int, SchedRequest>> arrivals = {
      {0, greedy(gp, int64_t(gn.size()))},
      {0, greedy({toks.begin(), toks.begin() + 40}, 12)},
      {2, greedy({toks.begin() + 3, toks.begin() + 4}, 20)},
      {3, greedy({toks.begin() + 5, toks.begin() + 22}, 9)},
      {9, greedy({toks.begin() + 10, toks.begin() + 37}, 15)},
  };
  size_t max_running = 0;
  auto got = staggered(m, arrivals, 4, 8, &max_running);
  EXPECT_GE(max_running, 3u);
  // The oracle: transformers' greedy continuation.
  EXPECT_EQ(got[0], gn);
  for (size_t i = 0; i < arrivals.size(); ++i)
    EXPECT_EQ(got[i], alone(m, arrivals[i].second, 8)) << "request " << i;
}

TEST(Scheduler, StaggeredBatchEqualsTransformersGreedyOnDemoModel) {
  Loaded m(kDemo);
  std::vector<std::vector<int32_t>> want;
  const auto arrivals = demo_arrivals(3, want);  // each arrives while the earlier ones decode
  auto got = staggered(m, arrivals, 4, 32);  // 7 requests, 4 rows: some wait for admission
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "case " << i;
}

// A request's logprobs in a batch are its logprobs alone, bit for bit: the CPU computes each
// row of a batched step (other sequences decoding, prompt chunks beside it) as it would alone,
// and a prompt is read in the same chunks (here 16 tokens, so most prompts take several steps,
// sharing the budget with others) as alone.
TEST(Scheduler, BatchedRequestsGetTheirAloneLogprobsBitForBit) {
  Loaded m(kDemo);
  std::vector<std::vector<int32_t>> want;
  auto arrivals = demo_arrivals(2, want);
  for (auto& [at, r] : arrivals) {
    r.max_tokens = 24;
    r.logprobs = true;
  }
  size_t max_running = 0;
  const std::vector<Outcome> batched = staggered_outcomes(m, arrivals, manual(4, 256, 16), &max_running);
  EXPECT_GE(max_running, 4u);
  for (size_t i = 0; i < arrivals.size(); ++i) {
    const std::vector<Outcome> alone_run = staggered_outcomes(m, {{0, arrivals[i].second}}, manual(1, 256, 16));
    EXPECT_EQ(batched[i].ids, alone_run[0].ids) << "case " << i;
    EXPECT_EQ(batched[i].logprobs, alone_run[0].logprobs) << "case " << i;
  }
}

// serve --mtp: every decoding row verifies the MTP layer's draft each step, in a batch with other
// rows' verifications and prompt chunks. On the CPU, greedy requests get transformers' greedy
// continuations; sampled ones the tokens `generate` with drafts gives them alone for their seed
// (the same draws in the same order); logprobs those of the plain scheduler, bit for bit; and
// drafts are kept. On CUDA (whose batched products are not one row's bits): greedy requests get
// the plain CUDA scheduler's tokens, logprobs within 1e-3, sampled runs repeat themselves.
void mtp_drafts_keep_each_requests_tokens(bool cuda) {
  Loaded m(kDemo, cuda, true);
  const Json e = read_json_file(kFixtures + "/demo/expected.json");
  std::vector<std::vector<int32_t>> want;
  auto arrivals = demo_arrivals(2, want);
  arrivals[1].second.logprobs = true;
  arrivals[1].second.top_logprobs = 2;
  const size_t n_greedy = arrivals.size();
  for (uint64_t seed : {3, 4, 5}) {  // sampled, arriving among the greedy ones
    SchedRequest r = greedy(e["greedy"]["cases"][seed % n_greedy]["prompt_ids"].get<std::vector<int32_t>>(), 40);
    r.sampling.temperature = 0.8f;
    r.sampling.top_p = 0.95f;
    r.sampling.seed = seed;
    arrivals.push_back({int(seed), r});
  }
  SchedulerStats st;
  size_t max_running = 0;
  const std::vector<Outcome> got = staggered_outcomes(m, arrivals, manual(3, 256, 16, true), &max_running, &st);
  EXPECT_GE(max_running, 3u);
  const std::vector<Outcome> plain = staggered_outcomes(m, arrivals, manual(3, 256, 16, false));
  for (size_t i = 0; i < n_greedy; ++i) {
    EXPECT_EQ(got[i].ids, plain[i].ids) << "case " << i;
    if (!cuda) {
      EXPECT_EQ(got[i].ids, want[i]) << "case " << i;
    }
  }
  ASSERT_EQ(got[1].logprobs.size(), plain[1].logprobs.size());
  if (!cuda) {
    EXPECT_EQ(got[1].logprobs, plain[1].logprobs);  // a verification step's rows are decode steps' bits
  }
  for (size_t t = 0; t < got[1].logprobs.size(); ++t) EXPECT_NEAR(got[1].logprobs[t], plain[1].logprobs[t], 1e-3);
  const std::vector<Outcome> again = cuda ? staggered_outcomes(m, arrivals, manual(3, 256, 16, true)) : got;
  for (size_t i = n_greedy; i < arrivals.size(); ++i) {
    const SchedRequest& r = arrivals[i].second;
    EXPECT_EQ(got[i].ids.size(), size_t(r.max_tokens)) << "sampled request " << i;
    EXPECT_NE(got[i].ids, plain[i].ids) << "sampled request " << i;  // other draws than plain sampling's
    if (cuda) {
      EXPECT_EQ(got[i].ids, again[i].ids) << "sampled request " << i;
      continue;
    }
    MlaCache cache(*m.backend, m.model->cache_shape(), 1, 256);
    GenerateOptions g;
    g.max_new_tokens = r.max_tokens;
    g.stop_at_eos = r.stop_at_eos;
    g.sampling = r.sampling;
    g.mtp_drafts = true;
    g.prefill_chunk = 16;  // the scheduler's chunks
    EXPECT_EQ(got[i].ids, generate(*m.model, cache, 0, r.prompt, g).tokens) << "sampled request " << i;
  }
  std::printf("  drafts kept: %llu of %llu\n", (unsigned long long)st.drafts_kept, (unsigned long long)st.drafted);
  EXPECT_GT(st.drafts_kept, st.drafted / 5);
  // Without the MTP layer bound, the option is refused.
  Loaded plain_model(kDemo, cuda);
  try {
    Scheduler s(*plain_model.model, *plain_model.backend, manual(1, 64, 16, true));
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("loaded without its MTP layer"), std::string::npos) << err.what();
  }
}

TEST(Scheduler, MtpDraftsKeepEachRequestsTokens) { mtp_drafts_keep_each_requests_tokens(false); }

TEST(Scheduler, MtpDraftsKeepEachRequestsTokensOnCuda) {
  REQUIRE_CUDA();
  mtp_drafts_keep_each_requests_tokens(true);
}

// Requests with penalties (tests/fixtures/penalties.json: transformers' greedy continuations under
// repetition, frequency and presence penalties) batched with plain greedy and sampled requests:
// each gets transformers' tokens on the penalties' host path, the same as generate() gives, and
// the others their own tokens alone. A drafting (--mtp) scheduler refuses penalties by name.
void penalized_requests_get_transformers_tokens(bool cuda) {
  Loaded m(kDemo, cuda);
  const Json golden = read_json_file(kFixtures + "/penalties.json");
  std::vector<std::pair<int, SchedRequest>> arrivals;
  std::vector<std::vector<int32_t>> want;
  int step = 0;
  for (const Json& c : golden["cases"]) {
    if (c["model"].get<std::string>() != "vireo-demo") continue;
    auto cont = c["new"].get<std::vector<int32_t>>();
    SchedRequest r = greedy(c["prompt"].get<std::vector<int32_t>>(), int64_t(cont.size()));
    r.sampling.repetition_penalty = c["repetition_penalty"].get<float>();
    r.sampling.frequency_penalty = c["frequency_penalty"].get<float>();
    r.sampling.presence_penalty = c["presence_penalty"].get<float>();
    arrivals.push_back({step++, r});
    want.push_back(cont);
  }
  ASSERT_EQ(want.size(), 4u);
  std::vector<std::vector<int32_t>> others;  // beside them: demo_arrivals' greedy requests, one sampled
  auto plain = demo_arrivals(1, others);
  plain.resize(2);
  plain[1].second.sampling.temperature = 0.8f;
  plain[1].second.sampling.seed = 11;
  for (auto& a : plain) arrivals.push_back(a);
  const std::vector<Outcome> got = staggered_outcomes(m, arrivals, manual(4, 256, 16));
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].ids, want[i]) << "penalized request " << i;
    if (cuda) continue;
    MlaCache cache(*m.backend, m.model->cache_shape(), 1, 256);
    GenerateOptions g;
    g.max_new_tokens = arrivals[i].second.max_tokens;
    g.stop_at_eos = false;
    g.sampling = arrivals[i].second.sampling;
    EXPECT_EQ(generate(*m.model, cache, 0, arrivals[i].second.prompt, g).tokens, want[i]) << "generate " << i;
  }
  EXPECT_EQ(got[want.size()].ids, others[0]);
  EXPECT_EQ(got[want.size() + 1].ids, alone(m, plain[1].second, 16));

  Loaded drafting(kDemo, cuda, true);
  Scheduler s(*drafting.model, *drafting.backend, manual(1, 64, 16, true));
  SchedRequest r = greedy({1, 2}, 4);
  r.sampling.presence_penalty = 0.5f;
  SchedRequest allowed = greedy({1, 2}, 4);
  allowed.sampling.allowed_ids = {3, 4};
  for (const auto& [req, name] : {std::pair{r, "presence_penalty"}, std::pair{allowed, "allowed_token_ids"}}) {
    try {
      s.submit(req);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(std::string(name) + ": penalties, logit biases, allowed ids and bad words "
                                                                "are not supported with speculative",
                                            0),
                0u)
          << e.what();
    }
  }
}

TEST(Scheduler, PenalizedRequestsGetTransformersTokens) { penalized_requests_get_transformers_tokens(false); }

TEST(Scheduler, PenalizedRequestsGetTransformersTokensOnCuda) {
  REQUIRE_CUDA();
  penalized_requests_get_transformers_tokens(true);
}

// prompt_logprobs (the server's echo with logprobs): each prompt token's logprob given the tokens
// before it is the log-softmax of transformers' teacher-forced logits (tests/fixtures: one full
// forward over `tokens`), through prompt chunks of 8 beside another request; the alternatives are
// the row's best; max_tokens 0 ends after the prompt, and with tokens asked for they are the plain
// request's.
void prompt_logprobs_are_the_teacher_forced_log_softmax(bool cuda) {
  Loaded m(kFixtures + "/glm_dsa_full_f32", cuda);
  const Json e = read_json_file(kFixtures + "/glm_dsa_full_f32/expected.json");
  const auto toks = e["tokens"].get<std::vector<int32_t>>();
  const NpyArray want = read_npy_f32(kFixtures + "/glm_dsa_full_f32/logits.npy");
  const int64_t V = want.shape[1];
  SchedRequest echo = greedy(toks, 0);
  echo.prompt_logprobs = true;
  echo.top_logprobs = 3;
  SchedRequest echo_more = echo;
  echo_more.max_tokens = 5;
  echo_more.prompt.resize(40);
  const SchedRequest other = greedy({toks.begin() + 3, toks.begin() + 20}, 6);
  // At most 3 rows of logits held (a server's bound, GlmDsaModel::set_logit_rows): a step's 8-row
  // chunks and decode row come out of lm_head in slices, the prompt rows handed over as they come.
  m.model->set_logit_rows(3);
  Scheduler s(*m.model, *m.backend, manual(3, 256, 8));
  auto h0 = s.submit(echo), h1 = s.submit(other), h2 = s.submit(echo_more);
  for (int i = 0; i < 1000 && s.step(); ++i) {
  }
  double worst = 0;
  auto check = [&](RequestHandle& h, size_t P, size_t tokens) {
    SchedEvent ev;
    size_t at = 1, generated = 0;
    bool finished = false;
    while (h.next(ev, std::chrono::milliseconds(0))) {
      if (ev.kind == SchedEvent::Kind::PromptToken) {
        ASSERT_EQ(generated, 0u) << "a prompt token after a generated one";
        ASSERT_LT(at, P);
        EXPECT_EQ(ev.token, toks[at]);
        const float* row = &want.data[size_t(at - 1) * size_t(V)];
        double mx = row[0], sum = 0;
        for (int64_t i = 1; i < V; ++i) mx = std::max(mx, double(row[i]));
        for (int64_t i = 0; i < V; ++i) sum += std::exp(double(row[i]) - mx);
        const double lse = mx + std::log(sum);
        worst = std::max(worst, std::fabs(ev.logprob - (row[toks[at]] - lse)));
        ASSERT_EQ(ev.top.size(), 3u);
        EXPECT_EQ(ev.top[0].id, int32_t(std::max_element(row, row + V) - row));
        EXPECT_GE(ev.top[0].logprob, ev.top[1].logprob);
        ++at;
      } else if (ev.kind == SchedEvent::Kind::Token) {
        ++generated;
      } else {
        EXPECT_EQ(ev.kind, SchedEvent::Kind::Finish);
        EXPECT_EQ(ev.reason, FinishReason::Length);
        finished = true;
      }
    }
    EXPECT_EQ(at, P);
    EXPECT_EQ(generated, tokens);
    EXPECT_TRUE(finished);
  };
  check(*h0, toks.size(), 0);
  check(*h2, 40, 5);
  EXPECT_EQ(m.model->logit_buffer_rows(), 3);
  std::printf("  prompt logprobs: max |diff| %.2e from transformers' log-softmax\n", worst);
  EXPECT_LT(worst, cuda ? 1e-3 : 1e-4);
  if (!cuda) {  // CUDA's batched steps are not batch-invariant
    EXPECT_EQ(drain(*h1).ids, alone(m, other, 8));
  }
  SchedRequest plain = echo_more;
  plain.prompt_logprobs = false;
  plain.top_logprobs = 0;
  Scheduler s2(*m.model, *m.backend, manual(1, 256, 8));
  auto h3 = s2.submit(plain);
  while (s2.step()) {
  }
  Scheduler s3(*m.model, *m.backend, manual(1, 256, 8));
  auto h4 = s3.submit(echo_more);
  while (s3.step()) {
  }
  std::vector<int32_t> echoed;
  SchedEvent ev;
  while (h4->next(ev, std::chrono::milliseconds(0)))
    if (ev.kind == SchedEvent::Kind::Token) echoed.push_back(ev.token);
  EXPECT_EQ(echoed, drain(*h3).ids);
  SchedRequest zero = greedy(toks, 0);  // max_tokens 0 only with prompt_logprobs
  EXPECT_THROW(s3.submit(zero), Error);
  // max_tokens near 2^63 is refused by name (prompt + max_tokens overflowed before: UBSan, session 57).
  SchedRequest huge = greedy(toks, std::numeric_limits<int64_t>::max());
  try {
    s3.submit(huge);
    ADD_FAILURE() << "accepted max_tokens 2^63 - 1";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("max_tokens: prompt (", 0), 0u) << e.what();
  }
}

// prompt_logprobs on a drafting (--mtp) scheduler: its prompt chunks keep their hidden rows for the
// MTP pass, and with at most 3 rows of logits held their rows come in slices. The PromptToken
// events are the plain scheduler's, the tokens after them transformers' greedy continuation on
// the demo model (beside another greedy request), and its chunks write the MTP layer's entries as
// a plain request's do: the same drafts verified and kept as without prompt_logprobs.
void prompt_logprobs_with_drafts_are_the_plain_ones(bool cuda) {
  std::vector<std::vector<int32_t>> want;
  const auto arrivals = demo_arrivals(1, want);
  SchedRequest echo = arrivals[4].second;  // 70 prompt tokens: 9 chunks of 8
  echo.prompt_logprobs = true;
  echo.logprobs = true;
  echo.top_logprobs = 2;
  struct Seen {
    std::vector<int32_t> prompt, tokens;
    std::vector<float> logprobs;
    SchedulerStats stats;
  };
  auto run = [&](const SchedRequest& r, bool mtp) {
    Loaded m(kDemo, cuda, mtp);
    m.model->set_logit_rows(3);
    Scheduler s(*m.model, *m.backend, manual(2, 256, 8, mtp));
    auto h = s.submit(r), other = s.submit(arrivals[1].second);
    while (s.step()) {
    }
    Seen seen;
    SchedEvent ev;
    while (h->next(ev, std::chrono::milliseconds(0))) {
      if (ev.kind == SchedEvent::Kind::PromptToken) seen.prompt.push_back(ev.token);
      else if (ev.kind == SchedEvent::Kind::Token) seen.tokens.push_back(ev.token);
      else EXPECT_EQ(ev.kind, SchedEvent::Kind::Finish);
      if (ev.kind != SchedEvent::Kind::Finish) seen.logprobs.push_back(ev.logprob);
    }
    EXPECT_EQ(drain(*other).ids, want[1]) << (mtp ? "drafting" : "plain");
    seen.stats = s.stats();
    return seen;
  };
  const Seen plain = run(echo, false), drafted = run(echo, true);
  EXPECT_EQ(plain.prompt, std::vector<int32_t>(echo.prompt.begin() + 1, echo.prompt.end()));
  EXPECT_EQ(plain.tokens, want[4]);
  EXPECT_EQ(drafted.prompt, plain.prompt);
  EXPECT_EQ(drafted.tokens, plain.tokens);
  ASSERT_EQ(drafted.logprobs.size(), plain.logprobs.size());
  for (size_t i = 0; i < plain.logprobs.size(); ++i)
    EXPECT_NEAR(drafted.logprobs[i], plain.logprobs[i], cuda ? 1e-3 : 1e-5) << "event " << i;
  const Seen unscored = run(arrivals[4].second, true);
  EXPECT_EQ(unscored.tokens, want[4]);
  EXPECT_GT(drafted.stats.drafts_kept, 0u);
  EXPECT_EQ(drafted.stats.drafted, unscored.stats.drafted);
  EXPECT_EQ(drafted.stats.drafts_kept, unscored.stats.drafts_kept);
}

TEST(Scheduler, PromptLogprobsWithDraftsAreThePlainOnes) { prompt_logprobs_with_drafts_are_the_plain_ones(false); }

TEST(Scheduler, PromptLogprobsWithDraftsAreThePlainOnesOnCuda) {
  REQUIRE_CUDA();
  prompt_logprobs_with_drafts_are_the_plain_ones(true);
}

TEST(Scheduler, PromptLogprobsAreTheTeacherForcedLogSoftmax) {
  prompt_logprobs_are_the_teacher_forced_log_softmax(false);
}

TEST(Scheduler, PromptLogprobsAreTheTeacherForcedLogSoftmaxOnCuda) {
  REQUIRE_CUDA();
  prompt_logprobs_are_the_teacher_forced_log_softmax(true);
}

// min_tokens (vLLM's): with EOS made the greedy pick at every step (logit_bias +100), a request
// ends at its first token; with min_tokens 5 its first 5 tokens are something else and the 6th
// is the EOS; the same through generate(). More than max_tokens is refused by name.
TEST(Scheduler, MinTokensHoldsBackEos) {
  Loaded m(kDemo);
  const int32_t eos = int32_t(*m.model->config().eos_ids.begin());
  SchedRequest r = greedy({440, 435, 1131}, 12);
  r.stop_at_eos = true;
  r.sampling.logit_bias = {{eos, 100.0f}};
  Scheduler s(*m.model, *m.backend, manual(2, 256, 16));
  auto h0 = s.submit(r);
  r.sampling.min_tokens = 5;
  auto h1 = s.submit(r);
  while (s.step()) {
  }
  const Outcome at_once = drain(*h0), held = drain(*h1);
  EXPECT_EQ(at_once.ids, std::vector<int32_t>{eos});
  ASSERT_EQ(held.ids.size(), 6u);
  EXPECT_EQ(held.ids.back(), eos);
  EXPECT_EQ(std::count(held.ids.begin(), held.ids.end(), eos), 1);
  EXPECT_EQ(held.reason, FinishReason::Stop);
  MlaCache cache(*m.backend, m.model->cache_shape(), 1, 64);
  GenerateOptions g;
  g.max_new_tokens = 12;
  g.sampling = r.sampling;
  EXPECT_EQ(generate(*m.model, cache, 0, r.prompt, g).tokens, held.ids);
  r.sampling.min_tokens = 13;
  try {
    s.submit(r);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("min_tokens: 13 is more than max_tokens (12)", 0), 0u) << e.what();
  }
  // stop_token_ids (vLLM's): the request ends at the first of them it emits (ignore_eos or not);
  // min_tokens holds them back as it does the EOS ids.
  const Json e = read_json_file(kFixtures + "/demo/expected.json");
  const Json& c = e["greedy"]["cases"][0];
  const auto cont = c["continuation_ids"].get<std::vector<int32_t>>();
  const int32_t x = cont[4];
  const size_t first = size_t(std::find(cont.begin(), cont.end(), x) - cont.begin());
  SchedRequest st = greedy(c["prompt_ids"].get<std::vector<int32_t>>(), 20);
  st.stop_token_ids = {x};
  auto h2 = s.submit(st);
  st.sampling.min_tokens = int64_t(first) + 3;
  auto h3 = s.submit(st);
  while (s.step()) {
  }
  const Outcome stopped = drain(*h2), held2 = drain(*h3);
  EXPECT_EQ(stopped.ids, std::vector<int32_t>(cont.begin(), cont.begin() + long(first) + 1));
  EXPECT_EQ(stopped.reason, FinishReason::Stop);
  ASSERT_GE(held2.ids.size(), first + 3);
  EXPECT_EQ(std::count(held2.ids.begin(), held2.ids.begin() + long(first) + 3, x), 0);
  if (held2.reason == FinishReason::Stop) {
    EXPECT_EQ(held2.ids.back(), x);
  }
  st.stop_token_ids = {int32_t(m.model->config().vocab_size)};
  EXPECT_THROW(s.submit(st), Error);
}

// reuse_prefixes: requests whose prompts start as finished ones' did reuse the kept entries of the
// shared whole chunks (8 tokens here), and get the tokens and logprobs they get in a scheduler that
// reuses nothing, bit for bit (the CPU); the kept bytes are counted apart from those in use.
TEST(Scheduler, ReusedPrefixesKeepTheBits) {
  Loaded m(kDemo);
  const Json e = read_json_file(kFixtures + "/demo/expected.json");
  const auto ids = e["logits"]["token_ids"].get<std::vector<int32_t>>();
  auto request = [](std::vector<int32_t> prompt) {
    SchedRequest r = greedy(std::move(prompt), 6);
    r.logprobs = true;
    r.top_logprobs = 2;
    return r;
  };
  const std::vector<int32_t> a(ids.begin(), ids.begin() + 40);
  std::vector<int32_t> b(ids.begin(), ids.begin() + 30);
  b.insert(b.end(), ids.begin() + 60, ids.begin() + 70);  // 30 shared, then other tokens
  const std::vector<int32_t> d(ids.begin() + 50, ids.begin() + 90);
  // a, then b (24 of its tokens reused: whole chunks of the 30 shared), a (24: the row now holds
  // b's), a again (32: all but its last token, in whole chunks), an unrelated prompt (0).
  const std::vector<std::pair<std::vector<int32_t>, uint64_t>> runs = {{a, 0}, {b, 24}, {a, 24}, {a, 32}, {d, 0}};
  SchedulerOptions reuse = manual(2, 256, 8);
  reuse.reuse_prefixes = true;
  Scheduler s(*m.model, *m.backend, reuse);
  uint64_t before = 0;
  for (const auto& [prompt, reused] : runs) {
    auto h = s.submit(request(prompt));
    while (s.step()) {
    }
    const Outcome got = drain(*h);
    EXPECT_EQ(s.stats().prefix_tokens_reused - before, reused);
    before = s.stats().prefix_tokens_reused;
    Scheduler fresh(*m.model, *m.backend, manual(2, 256, 8));
    auto hf = fresh.submit(request(prompt));
    while (fresh.step()) {
    }
    const Outcome want = drain(*hf);
    EXPECT_EQ(got.ids, want.ids);
    ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
    EXPECT_EQ(std::memcmp(got.logprobs.data(), want.logprobs.data(), got.logprobs.size() * sizeof(float)), 0)
        << "reused " << reused;
    EXPECT_EQ(s.stats().cache_bytes_in_use, 0u);
    // The matching row is taken each time; the unrelated prompt takes the empty one.
    EXPECT_EQ(s.stats().cache_bytes_kept,
              40 * MlaCache::bytes_per_token(m.model->cache_shape()) * (prompt == d ? 2 : 1))
        << "reused " << reused;
  }
  EXPECT_EQ(before, 80u);
}

TEST(Scheduler, CancellationFreesTheRowForTheNextRequest) {
  Loaded m(kFixtures + "/glm_dsa_shared_f32");
  Scheduler s(*m.model, *m.backend, manual(2, 64, 16));
  auto a = s.submit(greedy({5, 6, 7, 8}, 40));
  auto b = s.submit(greedy({9, 10, 11}, 40));
  auto c = s.submit(greedy({12, 13}, 5));
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(s.step());
  EXPECT_EQ(s.stats().running, 2u);
  EXPECT_EQ(s.stats().waiting, 1u);
  const size_t bpt = s.bytes_per_token();
  EXPECT_EQ(s.stats().cache_bytes_in_use, (4 + 4 + 3 + 4) * bpt);  // prompt + 4 decoded inputs each
  a->cancel();
  ASSERT_TRUE(s.step());  // a leaves, c takes its row and prefills
  EXPECT_EQ(s.stats().running, 2u);
  EXPECT_EQ(s.stats().waiting, 0u);
  EXPECT_EQ(s.stats().cache_bytes_in_use, (3 + 5) * bpt + 2 * bpt);
  Outcome oa = drain(*a);
  EXPECT_TRUE(oa.finished);
  EXPECT_EQ(oa.reason, FinishReason::Cancelled);
  EXPECT_EQ(oa.ids.size(), 5u);
  b->cancel();
  while (s.step()) {}
  EXPECT_EQ(drain(*b).reason, FinishReason::Cancelled);
  Outcome oc = drain(*c);
  EXPECT_EQ(oc.reason, FinishReason::Length);
  EXPECT_EQ(oc.ids, alone(m, greedy({12, 13}, 5), 16));
  EXPECT_EQ(s.stats().cache_bytes_in_use, 0u);
  EXPECT_EQ(s.stats().running, 0u);
}

TEST(Scheduler, CancelledWhileWaitingNeverRuns) {
  Loaded m(kFixtures + "/glm_dsa_shared_f32");
  Scheduler s(*m.model, *m.backend, manual(1, 64, 16));
  auto a = s.submit(greedy({5, 6}, 3));
  auto b = s.submit(greedy({7, 8}, 3));
  b->cancel();
  while (s.step()) {}
  EXPECT_EQ(drain(*a).ids.size(), 3u);
  Outcome ob = drain(*b);
  EXPECT_TRUE(ob.ids.empty());
  EXPECT_EQ(ob.reason, FinishReason::Cancelled);
}

TEST(Scheduler, AdmissionWaitsForCacheBudget) {
  Loaded m(kFixtures + "/glm_dsa_shared_f32");
  SchedulerOptions o = manual(4, 64, 16);
  const size_t bpt = MlaCache::bytes_per_token(m.model->cache_shape());
  o.cache_budget_bytes = 30 * bpt;  // room for one 4 + 20 request at a time, though 4 rows are free
  Scheduler s(*m.model, *m.backend, o);
  auto a = s.submit(greedy({1, 2, 3, 4}, 20));
  auto b = s.submit(greedy({4, 3, 2, 1}, 20));
  ASSERT_TRUE(s.step());
  EXPECT_EQ(s.stats().running, 1u);
  EXPECT_EQ(s.stats().waiting, 1u);
  EXPECT_EQ(s.stats().cache_bytes_reserved, 24 * bpt);
  while (s.step()) {}
  EXPECT_EQ(drain(*a).ids.size(), 20u);
  EXPECT_EQ(drain(*b).ids.size(), 20u);
  // A request that could never fit is refused up front, naming the field.
  try {
    s.submit(greedy({1, 2, 3, 4}, 40));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_tokens"), std::string::npos) << e.what();
  }
}

TEST(Scheduler, SubmitValidatesNamingTheField) {
  Loaded m(kFixtures + "/glm_dsa_shared_f32");
  Scheduler s(*m.model, *m.backend, manual(1, 16, 16));
  auto msg = [&](SchedRequest r) {
    try {
      s.submit(std::move(r));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(msg(greedy({}, 1)).rfind("prompt:", 0), 0u);
  EXPECT_EQ(msg(greedy({1, 99999}, 1)).rfind("prompt:", 0), 0u);
  EXPECT_EQ(msg(greedy(std::vector<int32_t>(16, 1), 1)).rfind("prompt:", 0), 0u);
  EXPECT_EQ(msg(greedy({1, 2}, 15)).rfind("max_tokens:", 0), 0u);
  EXPECT_EQ(msg(greedy({1, 2}, 0)).rfind("max_tokens:", 0), 0u);
  SchedRequest r = greedy({1}, 1);
  r.top_logprobs = 21;
  EXPECT_EQ(msg(r).rfind("top_logprobs:", 0), 0u);
  EXPECT_EQ(msg(greedy({1, 2}, 14)), "no error");
}

TEST(Scheduler, EosStopsAndLogprobsAreLogSoftmax) {
  Loaded m(kFixtures + "/glm_dsa_shared_f32");
  const Json e = read_json_file(kFixtures + "/glm_dsa_shared_f32/expected.json");
  const auto gp = e["greedy_prompt"].get<std::vector<int32_t>>();
  const auto gn = e["greedy_new"].get<std::vector<int32_t>>();
  Scheduler s(*m.model, *m.backend, manual(1, 128, 64));
  SchedRequest r = greedy(gp, 8);
  r.logprobs = true;
  r.top_logprobs = 3;
  auto h = s.submit(r);
  std::vector<SchedEvent> evs;
  while (s.step()) {}
  SchedEvent ev;
  while (h->next(ev, std::chrono::milliseconds(0))) evs.push_back(ev);
  ASSERT_EQ(evs.size(), 9u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(evs[i].token, gn[i]);
    ASSERT_EQ(evs[i].top.size(), 3u);
    EXPECT_EQ(evs[i].top[0].id, gn[i]);  // greedy: the chosen id is the most likely
    EXPECT_FLOAT_EQ(evs[i].top[0].logprob, evs[i].logprob);
    EXPECT_LE(evs[i].logprob, 0.0f);
    EXPECT_GE(evs[i].top[0].logprob, evs[i].top[1].logprob);
  }
  // stop_at_eos: generation ends at the first EOS id of the config.
  const int32_t eos = int32_t(*m.model->config().eos_ids.begin());
  Scheduler s2(*m.model, *m.backend, manual(1, 128, 64));
  // With stop_at_eos the greedy run ends just after the first EOS id, or runs to max_tokens.
  SchedRequest r2 = greedy(gp, 40);
  r2.stop_at_eos = true;
  auto h2 = s2.submit(r2);
  while (s2.step()) {}
  Outcome o = drain(*h2);
  const auto it = std::find(gn.begin(), gn.end(), eos);
  if (it == gn.end()) {
    EXPECT_EQ(o.reason, FinishReason::Length);
    EXPECT_EQ(o.ids, std::vector<int32_t>(gn.begin(), gn.begin() + 40));
  } else {
    EXPECT_EQ(o.reason, FinishReason::Stop);
    EXPECT_EQ(o.ids, std::vector<int32_t>(gn.begin(), it + 1));
  }
}

// A lone decoding request runs one step ahead of the host (SchedulerOptions::pipeline), or a chunk
// of steps ahead (decode_steps): the same events as step by step, greedy and sampled, ending at
// max_tokens, at an EOS id with steps queued past it, and cancelled between steps; the cache left
// empty and the row serving the next request. The f32 fixture with its EOS set to the 4th greedy
// token (108, first at index 3).
void lone_request_pipelined_equals_step_by_step(bool cuda) {
  namespace fs = std::filesystem;
  const std::string src = kFixtures + "/glm_dsa_shared_f32";
  const Json e = read_json_file(src + "/expected.json");
  const auto gp = e["greedy_prompt"].get<std::vector<int32_t>>();
  const auto gn = e["greedy_new"].get<std::vector<int32_t>>();
  ASSERT_EQ(gn[3], 108);
  ASSERT_EQ(std::find(gn.begin(), gn.end(), 108) - gn.begin(), 3);
  TempDir dir("pipeline");
  fs::copy_file(src + "/model.safetensors", dir / "model.safetensors");
  Json cfg = read_json_file(src + "/config.json");
  cfg["eos_token_id"] = 108;
  write_file(dir / "config.json", cfg.dump());
  write_file(dir / "generation_config.json", "{\"eos_token_id\": [108]}");
  Loaded m(dir.str(), cuda);
  auto run = [&](const SchedRequest& r, bool pipeline, int cancel_after, int chunk = 1) {
    SchedulerOptions o = manual(1, 128, 64);
    o.pipeline = pipeline;
    o.decode_steps = chunk;
    Scheduler s(*m.model, *m.backend, o);
    auto h = s.submit(r);
    for (int i = 1; s.step(); ++i)
      if (i == cancel_after) h->cancel();
    EXPECT_EQ(s.stats().cache_bytes_in_use, 0u);
    EXPECT_EQ(s.stats().cache_bytes_reserved, 0u);
    auto next = s.submit(greedy(gp, 6));
    while (s.step()) {}
    EXPECT_EQ(drain(*next).ids, std::vector<int32_t>(gn.begin(), gn.begin() + 6));
    return drain(*h);
  };
  SchedRequest sampled = greedy(gp, 12);
  sampled.sampling.temperature = 0.9f;
  sampled.sampling.top_k = 40;
  sampled.sampling.seed = 7;
  SchedRequest eos = greedy(gp, 12);
  eos.stop_at_eos = true;
  struct Case {
    const char* name;
    SchedRequest req;
    int cancel_after;
    FinishReason reason;
    size_t n;
  };
  const Case cases[] = {{"greedy", greedy(gp, 12), 0, FinishReason::Length, 12},
                        {"sampled", sampled, 0, FinishReason::Length, 12},
                        {"eos", eos, 0, FinishReason::Stop, 4},
                        {"cancelled", greedy(gp, 30), 5, FinishReason::Cancelled, 5}};
  for (const Case& c : cases) {
    const Outcome piped = run(c.req, true, c.cancel_after), stepped = run(c.req, false, c.cancel_after);
    EXPECT_TRUE(piped.finished && !piped.error) << c.name;
    EXPECT_EQ(piped.reason, c.reason) << c.name;
    EXPECT_EQ(piped.ids.size(), c.n) << c.name;
    EXPECT_EQ(piped.ids, stepped.ids) << c.name << (cuda ? " cuda" : " cpu");
    EXPECT_EQ(stepped.reason, c.reason) << c.name;
    if (c.req.sampling.temperature == 0.0f) {
      EXPECT_EQ(piped.ids, std::vector<int32_t>(gn.begin(), gn.begin() + int64_t(c.n))) << c.name;
    }
    // Greedy steps in chunks (SchedulerOptions::decode_steps; sampled ones stay a step a launch):
    // the same events, the EOS and max_tokens inside a chunk, the cache again left empty.
    for (int chunk : {3, 5}) {
      const Outcome chunked = run(c.req, true, c.cancel_after, chunk);
      EXPECT_TRUE(chunked.finished && !chunked.error) << c.name << " chunk " << chunk;
      EXPECT_EQ(chunked.reason, c.reason) << c.name << " chunk " << chunk;
      EXPECT_EQ(chunked.ids, stepped.ids) << c.name << " chunk " << chunk << (cuda ? " cuda" : " cpu");
    }
  }
}

TEST(Scheduler, LoneRequestPipelinedEqualsStepByStep) { lone_request_pipelined_equals_step_by_step(false); }

TEST(Scheduler, LoneRequestPipelinedEqualsStepByStepOnCuda) {
  REQUIRE_CUDA();
  lone_request_pipelined_equals_step_by_step(true);
}

TEST(Scheduler, EngineThreadServesConcurrentSubmitters) {
  Loaded m(kFixtures + "/glm_dsa_shared_f32");
  const Json e = read_json_file(kFixtures + "/glm_dsa_shared_f32/expected.json");
  const auto toks = e["tokens"].get<std::vector<int32_t>>();
  SchedulerOptions o;
  o.max_batch = 3;
  o.context = 128;
  o.prefill_chunk = 8;
  Scheduler s(*m.model, *m.backend, o);
  constexpr int kClients = 8;
  std::vector<SchedRequest> reqs;
  for (int i = 0; i < kClients; ++i)
    reqs.push_back(greedy({toks.begin() + i, toks.begin() + i + 1 + 4 * i}, 6 + i));
  std::vector<std::vector<int32_t>> got(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * i));
      auto h = s.submit(reqs[size_t(i)]);
      SchedEvent ev;
      while (h->next(ev, std::chrono::seconds(60))) {
        if (ev.kind == SchedEvent::Kind::Token) got[size_t(i)].push_back(ev.token);
        else break;
      }
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(got[size_t(i)], alone(m, reqs[size_t(i)], 8)) << "client " << i;
  EXPECT_EQ(s.stats().cache_bytes_in_use, 0u);
}
