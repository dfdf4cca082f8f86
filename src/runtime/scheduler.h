#pragma once
// Continuous batching over one model and one MLA cache (one cache row per running sequence).
//
// One engine thread owns the model and the cache. Callers submit() requests from any thread and
// read a per-request queue of events (token, finish, error). Between steps the engine drops
// cancelled requests (their rows are reset) and admits waiting ones in arrival order while a row is
// free and the admission budget (cache positions reserved as prompt + max_tokens, i.e. cache bytes)
// has room. One step runs every running row's next token (decode) plus prefill chunks of prompts
// still being read, capped at prefill_chunk prompt tokens per step so long prompts are interleaved
// with decodes instead of stalling them, through GlmDsaModel::forward_batch (one expert union per
// MoE layer). On the CPU a row of a batched step has the bits it has alone (cpu_matmul's rows do
// not depend on the batch) and a prompt is read in the same chunks whatever else runs, so a
// request's outputs do not depend on what else is in the batch: they are the outputs it gets
// alone with the same prefill_chunk, bit for bit.
// A request decoding alone runs one step ahead of the host (pipelined_step), with the same tokens.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache/mla_cache.h"
#include "model/glm_dsa/model.h"
#include "runtime/sampler.h"
#include "runtime/speculative.h"

namespace vireo {

enum class FinishReason : uint8_t {
  Stop,       // an EOS id was generated
  Length,     // max_tokens reached
  Cancelled,  // cancel() (client gone, stop string found by the caller)
};
const char* finish_reason_name(FinishReason r);  // "stop", "length", "cancelled"

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
};

struct SchedEvent {
  // PromptToken (SchedRequest::prompt_logprobs): prompt token i >= 1 and its logprob given the
  // tokens before it, in order, all before the first Token.
  enum class Kind : uint8_t { Token, Finish, Error, PromptToken };
  Kind kind = Kind::Token;
  int32_t token = -1;                        // Token, PromptToken
  float logprob = 0;                         // Token when logprobs were asked for; PromptToken
  std::vector<TokenLogprob> top;             // Token, PromptToken: the top_logprobs most likely ids, best first
  bool ends_by_id = false;                   // Token: the id ends the request (an EOS, or one of stop_token_ids)
  FinishReason reason = FinishReason::Stop;  // Finish
  std::string message;               // Error
  std::chrono::steady_clock::time_point time;  // when the engine produced it
};

struct SchedRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;
  SamplingParams sampling;
  bool stop_at_eos = true;
  bool logprobs = false;  // log-softmax of the raw logits (before temperature) of each chosen id
  int top_logprobs = 0;   // 0..20
  // The logprob of every prompt token after the first (PromptToken events; top_logprobs
  // alternatives each): the prompt's chunks return all their rows. max_tokens may then be 0.
  bool prompt_logprobs = false;
  // vLLM's stop_token_ids: more ids that end the request (finish reason Stop, the id emitted),
  // whatever stop_at_eos says; min_tokens holds them back too.
  std::vector<int32_t> stop_token_ids;
};

// A submitted request as its caller sees it: a queue of events, and cancel().
class RequestHandle {
 public:
  // Waits up to `timeout` for the next event; false if none came.
  bool next(SchedEvent& ev, std::chrono::milliseconds timeout);
  // Idempotent; the engine frees the request's row before its next step.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  uint64_t id() const { return id_; }
  std::chrono::steady_clock::time_point submitted() const { return submitted_; }

 private:
  friend class Scheduler;
  void push(SchedEvent ev);
  uint64_t id_ = 0;
  std::chrono::steady_clock::time_point submitted_;
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<SchedEvent> events_;
};

struct SchedulerOptions {
  int max_batch = 8;            // cache rows: sequences running at once
  int64_t context = 2048;       // cache positions per row: prompt + max_tokens must fit
  // Prompt tokens run per step, over all prefilling rows; each prompt is read in chunks of this
  // many tokens (the last shorter), so its rows get the same bits whatever else runs.
  int64_t prefill_chunk = 256;
  // Admission budget in cache bytes for the reservations (prompt + max_tokens) * bytes_per_token
  // of running requests; 0: the whole cache (max_batch * context positions).
  size_t cache_budget_bytes = 0;
  bool start_thread = true;     // false: the caller drives step() (tests)
  bool pipeline = true;         // a lone decoding request one step ahead (Scheduler::pipelined_step)
  // With pipeline, a lone greedy request's steps in chunks of this many (GlmDsaModel::queue_step's
  // `steps`: on CUDA one graph launch a chunk), one chunk ahead. The same tokens; a request that
  // arrives meanwhile waits for the queued chunks (up to 2 * decode_steps - 1 steps) to be read.
  int decode_steps = 1;
  // Speculative decoding with the model's MTP layer (GlmDsaModel::has_mtp; GenerateOptions::
  // mtp_drafts): each decoding row's step is a two-token item [last, draft], the draft kept as
  // `generate` keeps it (greedy: where the main model's argmax agrees; sampled: with probability
  // min(1, p / q), else redrawn), and one MTP pass over every row then drafts again. Every step
  // keeps its hidden rows, so none is pipelined. A request's tokens are those `generate` with
  // mtp_drafts gives it alone (the sampler's draws in the same order).
  bool mtp_drafts = false;
  // Prefix reuse: a finished request's row keeps the entries of its prompt's whole chunks, and a
  // request is admitted to the free row sharing the longest prompt prefix with it, rounded down to
  // whole chunks (and short of its last token), which it then does not run again. A prompt is read
  // in chunks from its start either way, so on the CPU the reused entries have the bits the
  // request would compute (its outputs are the same, bit for bit). Not with mtp_drafts (the MTP
  // entries read the token after each position) nor for prompt_logprobs.
  bool reuse_prefixes = false;
};

struct SchedulerStats {
  size_t waiting = 0, running = 0;
  size_t cache_bytes_in_use = 0;    // live cache entries of running requests (MlaCache::bytes_in_use)
  size_t cache_bytes_kept = 0;      // reuse_prefixes: entries free rows keep for later requests
  size_t cache_bytes_reserved = 0;  // admission reservations of running requests
  size_t cache_bytes_allocated = 0;
  uint64_t steps = 0;
  uint64_t drafted = 0, drafts_kept = 0;  // mtp_drafts: drafts verified, and kept
  uint64_t prefix_tokens_reused = 0;      // reuse_prefixes: prompt tokens admitted already cached
  uint64_t prompt_tokens_run = 0;         // prompt tokens prefilled (reused ones not counted)
  uint64_t tokens_generated = 0;          // tokens emitted
};

class Scheduler {
 public:
  Scheduler(GlmDsaModel& model, Backend& backend, const SchedulerOptions& opt);
  ~Scheduler();  // stops the engine; requests still open get an Error event
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Validates (non-empty prompt, ids inside the vocabulary, prompt + max_tokens within the
  // context and the admission budget, sampling ranges) and queues; throws vireo::Error naming the
  // field otherwise.
  std::shared_ptr<RequestHandle> submit(SchedRequest r);

  // One engine iteration: drop cancelled requests, admit, run one batched forward step and emit
  // its events. Returns false when there was nothing to run. Only for start_thread = false.
  bool step();

  SchedulerStats stats() const;
  const SchedulerOptions& options() const { return opt_; }
  size_t bytes_per_token() const { return bytes_per_token_; }

 private:
  struct Waiting {
    std::shared_ptr<RequestHandle> handle;
    SchedRequest req;
  };
  struct Running {
    std::shared_ptr<RequestHandle> handle;
    SchedRequest req;
    std::unique_ptr<Sampler> sampler;
    int row = 0;
    int64_t prefilled = 0;   // prompt tokens already in the cache
    int64_t generated = 0;   // tokens emitted
    int32_t last = -1;       // the last emitted token: the next decode input
    size_t reserved = 0;     // admission bytes
    int32_t chosen = -1;      // this step's token chosen on the backend (no logprobs)
    SampleRowArgs sample;     // this step's draw, when sampling on the backend
    // mtp_drafts: the MTP layer's draft of the token after `last` (sampling: drawn from q, its
    // distribution), verified by the next step's two-token item `pair` = [last, draft].
    int32_t draft = -1;
    std::vector<double> q;
    int32_t pair[2] = {-1, -1};
    int32_t picks[2] = {-1, -1};    // greedy: the backend's argmax of the pair's rows
    int64_t verify_pos = 0;         // the cache length before the two-token step
    std::vector<int32_t> mtp_next;  // the tokens the MTP pass reads after this step's rows
    // Requests that want no logprobs need no logits on the host: the backend picks the token
    // (argmax or sample_rows; on a GPU: 4 bytes copied back instead of the vocabulary's logits).
    // Logprobs need the row; penalties and biases too (the sampler adjusts it: the request's history).
    bool needs_logits() const {
      return req.logprobs || req.top_logprobs > 0 || req.prompt_logprobs || req.sampling.adjusts_logits();
    }
  };
  // Asks the step for what r needs from its item: nothing for a prompt chunk that is not the last,
  // else the logits (logprobs) or the token chosen on the backend.
  void request_output(Running& r, BatchItem& it, bool emits);
  void engine_loop();
  void finish(Running& r, SchedEvent ev);  // pushes ev, frees the row
  // Emits the next token: sampled from `logits` (the row's last position), or r.chosen when null.
  void emit_token(Running& r, const float* logits);
  // Emits `id`, its logprobs (when asked for) from `logits`, the row it was chosen from.
  void emit_chosen(Running& r, int32_t id, const float* logits);
  // ev.logprob of ev.token and its `top` best alternatives: log-softmax of the raw row.
  void fill_logprobs(SchedEvent& ev, const float* logits, int top);
  // prompt_logprobs: the PromptToken events of a chunk of T prompt tokens from `at` ([T, vocab] rows).
  void emit_prompt_logprobs(Running& r, int64_t at, int64_t T, const float* rows);
  // mtp_drafts: the two-token verification item of a decoding row, and what follows its step:
  // the verdict on the draft, the tokens emitted, the cache trimmed past a rejected draft, and
  // the row's part of the step's MTP pass (false: the request ended, no pass for it).
  BatchItem verify_item(Running& r);
  bool after_verify(Running& r, const float* logits, MtpItem& mtp);
  // The drafts of the step's MTP pass (rows that asked for one), drawn in each request's order.
  void mtp_pass(std::vector<MtpItem>& items, const std::vector<Running*>& owners);
  // Whether emitting `id` ends r (EOS, or its max_tokens-th token).
  bool ends_request(const Running& r, int32_t id) const;
  // Whether `id` is one r stops at: an EOS id (stop_at_eos) or one of its stop_token_ids.
  bool stops_at(const Running& r, int32_t id) const;
  // Pipelined decoding of a lone sequence (GlmDsaModel::queue_step), as `vireo run` decodes: while
  // one request runs, decoding, with no logits wanted and none waiting, each step queues the step
  // after it before its own pick is read, so the host's work between steps overlaps the GPU's
  // (H200, one stream through the server: +1.2% tokens/s at 2 layers bf16, +0.3% at 8 layers fp8;
  // BENCHMARKS, session 33). The tokens are those of the batched step: the same forward on the
  // same row, the sampler's draws taken in token order.
  bool lone_decoding(bool waiting) const;
  void pipelined_step(Running& r);
  // Reads the oldest queued step's pick and emits it (it is r's next token, its input already in
  // the cache), unless r has ended or is cancelled; a step queued past r's last token is read and
  // dropped before finish() frees the row.
  void take_queued(Running& r);
  void settle_queued(Running& r);  // every queued step, before a cancel, an admission or a batch
  void drop_queued();
  // A failed queue or read: r ends with an Error event (as in a failed batched step), the steps
  // still queued are dropped.
  void fail_queued(Running& r, const std::string& message);
  bool end_step();  // drops finished requests, counts the step; true

  GlmDsaModel& model_;
  SchedulerOptions opt_;
  int64_t vocab_ = 0;
  size_t bytes_per_token_ = 0;
  MlaCache cache_;
  std::vector<std::vector<float>> logits_;      // [row][vocab] (mtp_drafts: [row][2, vocab])
  std::vector<std::vector<float>> mtp_logits_;  // mtp_drafts: [row][vocab], the MTP pass's last row
  SampleWorkspace sample_ws_;
  std::vector<double> p_;                   // the main model's distribution at a verified draft's position
  std::vector<float> lp_scratch_;           // [vocab]
  std::vector<int32_t> idx_scratch_;        // [vocab]

  mutable std::mutex mu_;  // guards waiting_, stop_, and the stats below
  std::condition_variable cv_;
  std::deque<Waiting> waiting_;
  bool stop_ = false;
  uint64_t next_id_ = 1;
  SchedulerStats stats_;

  // Engine-thread state.
  std::vector<Running> running_;
  std::vector<bool> row_free_;
  // reuse_prefixes: the prompt tokens whose entries a free row kept, and when it was freed (the
  // least recently freed row without a match is the one given up).
  std::vector<std::vector<int32_t>> row_prefix_;
  std::vector<uint64_t> row_freed_at_;
  uint64_t frees_ = 0;
  // The free row for `prompt` and how many of its tokens that row already holds.
  std::pair<int, int64_t> pick_row(const SchedRequest& req) const;
  void count_cache_bytes();  // stats_'s in-use and kept bytes (under mu_)
  size_t reserved_ = 0;
  uint64_t drafted_ = 0, drafts_kept_ = 0;  // mtp_drafts, copied into stats_ by end_step
  uint64_t prompt_tokens_run_ = 0, tokens_generated_ = 0;  // likewise
  int queued_ = 0;  // steps queued by pipelined_step for running_[0] (every step of its chunks), picks not yet read
  std::thread thread_;
};

}  // namespace vireo
