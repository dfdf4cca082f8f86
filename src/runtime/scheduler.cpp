#include "runtime/scheduler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace vireo {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
  }
  return "?";
}

bool RequestHandle::next(SchedEvent& ev, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return false;
  ev = std::move(events_.front());
  events_.pop_front();
  return true;
}

void RequestHandle::push(SchedEvent ev) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(ev));
  }
  cv_.notify_one();
}

Scheduler::Scheduler(GlmDsaModel& model, Backend& backend, const SchedulerOptions& opt)
    : model_(model),
      opt_(opt),
      vocab_(model.config().vocab_size),
      bytes_per_token_(MlaCache::bytes_per_token(model.cache_shape())),
      cache_(backend, model.cache_shape(), opt.max_batch, opt.context) {
  if (opt_.prefill_chunk <= 0) fail("prefill chunk must be positive, got ", opt_.prefill_chunk);
  if (opt_.cache_budget_bytes == 0) opt_.cache_budget_bytes = cache_.bytes_allocated();
  if (opt_.mtp_drafts && !model.has_mtp()) fail("speculative decoding: the model was loaded without its MTP layer");
  const int64_t rows_of_logits = opt_.mtp_drafts ? 2 : 1;  // a verification step's two rows
  logits_.assign(size_t(opt_.max_batch), std::vector<float>(size_t(rows_of_logits * vocab_)));
  if (opt_.mtp_drafts) mtp_logits_.assign(size_t(opt_.max_batch), std::vector<float>(size_t(vocab_)));
  lp_scratch_.resize(size_t(vocab_));
  idx_scratch_.resize(size_t(vocab_));
  row_free_.assign(size_t(opt_.max_batch), true);
  row_prefix_.assign(size_t(opt_.max_batch), {});
  row_freed_at_.assign(size_t(opt_.max_batch), 0);
  if (opt_.mtp_drafts) opt_.reuse_prefixes = false;
  stats_.cache_bytes_allocated = cache_.bytes_allocated();
  if (opt_.start_thread) thread_ = std::thread([this] { engine_loop(); });
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  try {
    drop_queued();
  } catch (const std::exception&) {  // the backend failed: nothing left to read
  }
  SchedEvent ev;
  ev.kind = SchedEvent::Kind::Error;
  ev.message = "the server is shutting down";
  ev.time = std::chrono::steady_clock::now();
  for (Running& r : running_) r.handle->push(ev);
  for (Waiting& w : waiting_) w.handle->push(ev);
}

std::shared_ptr<RequestHandle> Scheduler::submit(SchedRequest r) {
  if (r.prompt.empty()) fail("prompt: the prompt is empty");
  for (int32_t id : r.prompt)
    if (id < 0 || id >= vocab_) fail("prompt: token id ", id, " is out of range (vocabulary of ", vocab_, ")");
  if (r.max_tokens < (r.prompt_logprobs ? 0 : 1))
    fail("max_tokens: must be at least ", r.prompt_logprobs ? 0 : 1, ", got ", r.max_tokens);
  const int64_t P = int64_t(r.prompt.size());
  if (P >= opt_.context) fail("prompt: ", P, " tokens do not fit the context of ", opt_.context, " tokens");
  if (r.max_tokens > opt_.context - P)  // (not P + max_tokens: a request's max_tokens may be near 2^63)
    fail("max_tokens: prompt (", P, " tokens) + max_tokens (", r.max_tokens, ") exceed the context of ",
         opt_.context, " tokens");
  const size_t need = size_t(P + r.max_tokens) * bytes_per_token_;
  if (need > opt_.cache_budget_bytes)
    fail("max_tokens: prompt + max_tokens need ", need, " cache bytes, over the admission budget of ",
         opt_.cache_budget_bytes);
  if (r.top_logprobs < 0 || r.top_logprobs > 20) fail("top_logprobs: must be in [0, 20], got ", r.top_logprobs);
  for (int32_t id : r.stop_token_ids)
    if (id < 0 || id >= vocab_) fail("stop_token_ids: token id ", id, " is out of range (vocabulary of ", vocab_, ")");
  validate_sampling(r.sampling);
  if (r.sampling.min_tokens > r.max_tokens)
    fail("min_tokens: ", r.sampling.min_tokens, " is more than max_tokens (", r.max_tokens, ")");
  if (opt_.mtp_drafts && r.sampling.adjusts_logits())
    fail(r.sampling.first_adjustment(),
         ": penalties, logit biases, allowed ids and bad words are not supported with speculative decoding "
         "(this server drafts with --mtp)");
  for (const auto& bias : r.sampling.logit_bias)
    if (bias.first >= vocab_)
      fail("logit_bias: token id ", bias.first, " is out of range (vocabulary of ", vocab_, ")");
  for (const int32_t id : r.sampling.allowed_ids)
    if (id >= vocab_) fail("allowed_token_ids: token id ", id, " is out of range (vocabulary of ", vocab_, ")");
  for (const auto& word : r.sampling.bad_words)
    for (const int32_t id : word)
      if (id >= vocab_) fail("bad_words: token id ", id, " is out of range (vocabulary of ", vocab_, ")");
  auto h = std::make_shared<RequestHandle>();
  h->submitted_ = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) fail("the server is shutting down");
    h->id_ = next_id_++;
    waiting_.push_back({h, std::move(r)});
    stats_.waiting = waiting_.size();
  }
  cv_.notify_all();
  return h;
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Scheduler::engine_loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) return;
    }
    if (step()) continue;
    std::unique_lock<std::mutex> lock(mu_);
    // Idle: nothing running. Wake for a new request (a cancelled waiting one is dropped by step()).
    cv_.wait(lock, [&] { return stop_ || !waiting_.empty(); });
  }
}

void Scheduler::finish(Running& r, SchedEvent ev) {
  ev.time = std::chrono::steady_clock::now();
  const bool failed = ev.kind == SchedEvent::Kind::Error;
  r.handle->push(std::move(ev));
  // Reuse: keep the entries of the prompt's whole chunks (a failed step may have left the row's
  // entries half written: drop them).
  const int64_t keep = opt_.reuse_prefixes && !failed ? r.prefilled / opt_.prefill_chunk * opt_.prefill_chunk : 0;
  cache_.trim(r.row, keep);
  row_prefix_[size_t(r.row)].assign(r.req.prompt.begin(), r.req.prompt.begin() + keep);
  row_freed_at_[size_t(r.row)] = ++frees_;
  row_free_[size_t(r.row)] = true;
  reserved_ -= r.reserved;
  r.handle = nullptr;  // marks the slot for removal
}

// Samples the next id from `logits` (the row's last position) and emits it; finishes the request
// at EOS or max_tokens.
void Scheduler::emit_token(Running& r, const float* logits) {
  emit_chosen(r, logits ? r.sampler->sample(logits, vocab_) : r.chosen, logits);
}

void Scheduler::fill_logprobs(SchedEvent& ev, const float* logits, int top) {
  // log-softmax of the raw logits: what the model assigns, independent of the sampling warpers.
  float mx = logits[0];
  for (int64_t i = 1; i < vocab_; ++i) mx = std::max(mx, logits[i]);
  double sum = 0;
  for (int64_t i = 0; i < vocab_; ++i) sum += std::exp(double(logits[i]) - mx);
  const float lse = mx + float(std::log(sum));
  ev.logprob = logits[ev.token] - lse;
  const int k = int(std::min<int64_t>(top, vocab_));
  if (k > 0) {
    std::iota(idx_scratch_.begin(), idx_scratch_.end(), 0);
    std::partial_sort(idx_scratch_.begin(), idx_scratch_.begin() + k, idx_scratch_.end(),
                      [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; });
    for (int i = 0; i < k; ++i) ev.top.push_back({idx_scratch_[size_t(i)], logits[idx_scratch_[size_t(i)]] - lse});
  }
}

void Scheduler::emit_prompt_logprobs(Running& r, int64_t at, int64_t T, const float* rows) {
  const int64_t P = int64_t(r.req.prompt.size());
  for (int64_t j = 0; j < T && at + j + 1 < P; ++j) {
    SchedEvent ev;
    ev.kind = SchedEvent::Kind::PromptToken;
    ev.token = r.req.prompt[size_t(at + j + 1)];
    fill_logprobs(ev, rows + j * vocab_, r.req.top_logprobs);
    ev.time = std::chrono::steady_clock::now();
    r.handle->push(std::move(ev));
  }
}

void Scheduler::emit_chosen(Running& r, int32_t id_chosen, const float* logits) {
  SchedEvent ev;
  ev.kind = SchedEvent::Kind::Token;
  ev.token = id_chosen;
  if (logits && (r.req.logprobs || r.req.top_logprobs > 0)) fill_logprobs(ev, logits, r.req.top_logprobs);
  const int32_t id = ev.token;
  const bool stops = stops_at(r, id);
  ev.ends_by_id = stops;
  ev.time = std::chrono::steady_clock::now();
  r.handle->push(std::move(ev));
  r.last = id;
  ++r.generated;
  ++tokens_generated_;
  if (stops) {
    SchedEvent f;
    f.kind = SchedEvent::Kind::Finish;
    f.reason = FinishReason::Stop;
    finish(r, std::move(f));
  } else if (r.generated >= r.req.max_tokens) {
    SchedEvent f;
    f.kind = SchedEvent::Kind::Finish;
    f.reason = FinishReason::Length;
    finish(r, std::move(f));
  }
}

std::pair<int, int64_t> Scheduler::pick_row(const SchedRequest& req) const {
  int best = -1;
  int64_t best_len = -1;
  const int64_t P = int64_t(req.prompt.size());
  for (size_t i = 0; i < row_free_.size(); ++i) {
    if (!row_free_[i]) continue;
    const std::vector<int32_t>& kept = row_prefix_[i];
    int64_t len = 0;
    if (opt_.reuse_prefixes && !req.prompt_logprobs) {
      const int64_t n = std::min<int64_t>(int64_t(kept.size()), P - 1);  // the last token runs: its logits
      while (len < n && kept[size_t(len)] == req.prompt[size_t(len)]) ++len;
      len = len / opt_.prefill_chunk * opt_.prefill_chunk;
    }
    // The longest match; else the row holding least (an empty one), the least recently freed.
    const bool better = best < 0 || len > best_len ||
                        (len == best_len && len == 0 &&
                         std::make_pair(kept.size(), row_freed_at_[i]) <
                             std::make_pair(row_prefix_[size_t(best)].size(), row_freed_at_[size_t(best)]));
    if (better) best = int(i), best_len = len;
  }
  return {best, std::max<int64_t>(best_len, 0)};
}

void Scheduler::count_cache_bytes() {
  size_t kept = 0;
  for (size_t i = 0; i < row_free_.size(); ++i)
    if (row_free_[i]) kept += size_t(cache_.length(int(i))) * bytes_per_token_;
  stats_.cache_bytes_kept = kept;
  stats_.cache_bytes_in_use = cache_.bytes_in_use() - kept;
}

bool Scheduler::ends_request(const Running& r, int32_t id) const {
  return stops_at(r, id) || r.generated + 1 >= r.req.max_tokens;
}

bool Scheduler::stops_at(const Running& r, int32_t id) const {
  const auto& extra = r.req.stop_token_ids;
  return (r.req.stop_at_eos && model_.config().eos_ids.count(id)) ||
         std::find(extra.begin(), extra.end(), id) != extra.end();
}

bool Scheduler::lone_decoding(bool waiting) const {
  if (!opt_.pipeline || opt_.mtp_drafts || waiting || running_.size() != 1) return false;
  const Running& r = running_[0];
  return r.handle && !r.handle->cancelled() && r.prefilled >= int64_t(r.req.prompt.size()) && !r.needs_logits();
}

void Scheduler::drop_queued() {
  for (; queued_ > 0; --queued_) model_.take_step();
}

void Scheduler::take_queued(Running& r) {
  const int32_t id = model_.take_step();
  --queued_;
  if (!r.handle || r.handle->cancelled()) return;
  if (ends_request(r, id)) drop_queued();  // read before finish() frees the row
  r.chosen = id;
  emit_token(r, nullptr);
}

void Scheduler::fail_queued(Running& r, const std::string& message) {
  try {
    drop_queued();
  } catch (const std::exception&) {
    queued_ = 0;  // the backend failed: what is still queued cannot be read
  }
  if (!r.handle) return;
  SchedEvent ev;
  ev.kind = SchedEvent::Kind::Error;
  ev.message = message;
  finish(r, std::move(ev));
}

void Scheduler::settle_queued(Running& r) {
  try {
    while (queued_ > 0) take_queued(r);
  } catch (const std::exception& e) {
    fail_queued(r, e.what());
  }
}

void Scheduler::pipelined_step(Running& r) {
  const bool sampled = r.req.sampling.temperature != 0.0f;
  const int chunk = sampled ? 1 : opt_.decode_steps;  // sampled steps: one a launch
  auto queue = [&](const int32_t* token) {
    // At most a chunk of the steps that would still emit a token (max_tokens); at least one.
    const int k = int(std::clamp<int64_t>(r.req.max_tokens - r.generated - queued_, 1, chunk));
    SampleRowArgs args;
    if (sampled) args = r.sampler->next_row_args();  // drawn in token order, as request_output does
    queued_ += model_.queue_step(token, cache_, r.row, sampled ? &args : nullptr, k);
  };
  try {
    if (queued_ == 0) queue(&r.last);
    // A chunk past the one being read, while its steps would still emit a token (max_tokens).
    if (queued_ <= chunk && r.generated + queued_ < r.req.max_tokens) queue(nullptr);
    take_queued(r);
  } catch (const std::exception& e) {  // as a failed batched step: this request ends, serving goes on
    fail_queued(r, e.what());
  }
}

void Scheduler::request_output(Running& r, BatchItem& it, bool emits) {
  if (!emits) return;
  if (r.needs_logits()) {
    it.logits = logits_[size_t(r.row)].data();
    return;
  }
  it.token = &r.chosen;
  if (r.req.sampling.temperature != 0.0f) {
    // Drawn now, in the order tokens are emitted: the stream Sampler::sample would use.
    r.sample = r.sampler->next_row_args();
    it.sample = &r.sample;
  }
}

bool Scheduler::step() {
  bool waiting = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting = !waiting_.empty();
  }
  // Queued steps end before anything else changes (a cancel, an admission, a batch).
  if (queued_ > 0 && !lone_decoding(waiting)) settle_queued(running_[0]);
  // Cancelled running requests leave first, freeing their rows for admission.
  for (Running& r : running_)
    if (r.handle && r.handle->cancelled()) {
      SchedEvent f;
      f.kind = SchedEvent::Kind::Finish;
      f.reason = FinishReason::Cancelled;
      finish(r, std::move(f));
    }
  std::erase_if(running_, [](const Running& r) { return r.handle == nullptr; });
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (it->handle->cancelled()) {
        SchedEvent f;
        f.kind = SchedEvent::Kind::Finish;
        f.reason = FinishReason::Cancelled;
        f.time = std::chrono::steady_clock::now();
        it->handle->push(std::move(f));
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    // Admission in arrival order (no overtaking, so a long request cannot starve).
    while (!waiting_.empty()) {
      const Waiting& w = waiting_.front();
      const size_t need = (w.req.prompt.size() + size_t(w.req.max_tokens)) * bytes_per_token_;
      const auto [row, reused] = pick_row(w.req);
      if (row < 0 || reserved_ + need > opt_.cache_budget_bytes) break;
      Running r;
      r.handle = w.handle;
      r.req = std::move(waiting_.front().req);
      if (r.req.sampling.min_tokens > 0) {  // the ids min_tokens holds back: every id the request stops at
        if (r.req.stop_at_eos)
          r.req.sampling.eos_ids.assign(model_.config().eos_ids.begin(), model_.config().eos_ids.end());
        r.req.sampling.eos_ids.insert(r.req.sampling.eos_ids.end(), r.req.stop_token_ids.begin(),
                                      r.req.stop_token_ids.end());
      }
      r.sampler = std::make_unique<Sampler>(r.req.sampling);
      r.sampler->set_prompt(r.req.prompt);
      r.row = row;
      r.reserved = need;
      row_free_[size_t(row)] = false;
      reserved_ += need;
      cache_.trim(r.row, reused);  // the prompt's first `reused` tokens are in the row already
      r.prefilled = reused;
      stats_.prefix_tokens_reused += uint64_t(reused);
      running_.push_back(std::move(r));
      waiting_.pop_front();
    }
    stats_.waiting = waiting_.size();
    stats_.running = running_.size();
    stats_.cache_bytes_reserved = reserved_;
    count_cache_bytes();
    waiting = !waiting_.empty();
  }
  if (running_.empty()) return false;
  if (lone_decoding(waiting)) {
    pipelined_step(running_[0]);
    return end_step();
  }

  // The step: every decoding row's last token, then prompt chunks in admission order within the
  // prefill budget (at least one token always fits, so every prompt advances eventually).
  std::vector<BatchItem> items;
  std::vector<size_t> owner;  // items[i] belongs to running_[owner[i]]
  for (size_t i = 0; i < running_.size(); ++i) {
    Running& r = running_[i];
    if (r.prefilled < int64_t(r.req.prompt.size())) continue;
    BatchItem it;
    if (opt_.mtp_drafts) {
      it = verify_item(r);
    } else {
      it.row = r.row;
      it.tokens = &r.last;
      it.T = 1;
      request_output(r, it, true);
    }
    items.push_back(it);
    owner.push_back(i);
  }
  // A prompt is read in chunks of prefill_chunk tokens from its start (the last one shorter),
  // whatever else the step runs: a chunk's length picks its attention path, so fixed chunks give a
  // request's rows the bits they have alone. Chunks join the step in admission order while they
  // fit the budget (the first always does).
  int64_t budget = opt_.prefill_chunk;
  std::vector<int64_t> chunk(running_.size(), 0);
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Running& r = running_[i];
    const int64_t left = int64_t(r.req.prompt.size()) - r.prefilled;
    if (left <= 0) continue;
    const int64_t T = std::min(left, opt_.prefill_chunk);
    if (T > budget) break;
    budget -= T;
    chunk[i] = T;
    prompt_tokens_run_ += uint64_t(T);
    BatchItem it;
    it.row = r.row;
    it.tokens = r.req.prompt.data() + r.prefilled;
    it.T = T;
    it.keep_hidden = opt_.mtp_drafts;
    request_output(r, it, T == left);
    if (r.req.prompt_logprobs) {
      // Every row: each predicts the prompt's next token (the last, the first new one). The rows
      // come a slice at a time (GlmDsaModel::set_logit_rows), each made into PromptToken events
      // as it comes, so no [T, vocab] is held; the prompt's last row is kept for the first token.
      Running* held = &r;  // (running_ does not change during the step)
      const int64_t at = r.prefilled;
      const bool last_chunk = T == left;
      it.logits = nullptr;
      it.all_logits = true;
      it.rows_out = [this, held, at, T, last_chunk](int64_t first, int64_t n, const float* rows) {
        emit_prompt_logprobs(*held, at + first, n, rows);
        if (last_chunk && first + n == T)
          std::copy_n(rows + (n - 1) * vocab_, vocab_, logits_[size_t(held->row)].begin());
      };
    }
    items.push_back(it);
    owner.push_back(i);
  }
  try {
    model_.forward_batch(items, cache_);
  } catch (const std::exception& e) {
    // A failed step poisons every row in it: end those requests, keep serving the rest.
    for (size_t i : owner) {
      Running& r = running_[i];
      if (!r.handle) continue;
      SchedEvent ev;
      ev.kind = SchedEvent::Kind::Error;
      ev.message = e.what();
      finish(r, std::move(ev));
    }
  }
  std::vector<MtpItem> mtp;  // mtp_drafts: every row's part of the step's MTP pass
  std::vector<Running*> mtp_owner;
  for (size_t k = 0; k < items.size(); ++k) {
    Running& r = running_[owner[k]];
    if (!r.handle) continue;
    const int64_t P = int64_t(r.req.prompt.size());
    if (chunk[owner[k]] > 0 && r.prefilled < P) {
      const int64_t at = r.prefilled, n = chunk[owner[k]];
      r.prefilled += n;
      // prompt_logprobs: its PromptToken events went out during the step (rows_out), and the
      // prompt's last row, the first token's, is in logits_.
      const float* last = r.req.prompt_logprobs ? logits_[size_t(r.row)].data() : items[k].logits;
      if (r.req.prompt_logprobs && r.prefilled == P && r.req.max_tokens == 0) {  // echo: the prompt's logprobs only
        SchedEvent f;
        f.kind = SchedEvent::Kind::Finish;
        f.reason = FinishReason::Length;
        finish(r, std::move(f));
        continue;
      }
      if (r.prefilled == P) emit_token(r, last);
      if (!r.handle || !opt_.mtp_drafts) continue;
      // The MTP entries at the chunk's positions read the token after each: the prompt's, and
      // after the prompt's last, the first token.
      r.mtp_next.assign(r.req.prompt.begin() + at + 1, r.req.prompt.end());
      r.mtp_next.resize(size_t(n));
      if (r.prefilled == P) r.mtp_next.back() = r.last;
      MtpItem x;
      x.row = r.row;
      x.T = n;
      x.next = r.mtp_next.data();
      x.pos0 = at;
      mtp.push_back(x);
      mtp_owner.push_back(r.prefilled == P ? &r : nullptr);  // a draft after the prompt only
      continue;
    } else if (opt_.mtp_drafts) {
      MtpItem x;
      if (after_verify(r, items[k].logits, x)) {
        mtp.push_back(x);
        mtp_owner.push_back(&r);
      }
      continue;
    }
    emit_token(r, items[k].logits);
  }
  if (!mtp.empty()) mtp_pass(mtp, mtp_owner);
  return end_step();
}

BatchItem Scheduler::verify_item(Running& r) {
  BatchItem it;
  it.row = r.row;
  r.pair[0] = r.last;
  r.pair[1] = r.draft;
  it.tokens = r.pair;
  it.T = 2;
  it.all_logits = true;
  it.keep_hidden = true;
  r.verify_pos = cache_.length(r.row);
  // Sampling needs p on the host, logprobs the rows; greedy otherwise picks on the backend.
  if (r.needs_logits() || r.req.sampling.temperature != 0.0f) it.logits = logits_[size_t(r.row)].data();
  else it.token = r.picks;
  return it;
}

bool Scheduler::after_verify(Running& r, const float* logits, MtpItem& mtp) {
  // The verdict, drawing from the request's sampler in generate()'s order.
  DraftVerdict v;
  int32_t bonus = -1;  // the main model's token after a kept draft
  if (r.req.sampling.temperature == 0.0f) {
    if (logits) {
      r.picks[0] = argmax(logits, vocab_);
      r.picks[1] = argmax(logits + vocab_, vocab_);
    }
    v = {r.picks[0] == r.draft, r.picks[0]};
    bonus = r.picks[1];
  } else {
    v = judge_sampled_draft(logits, vocab_, r.draft, r.q, *r.sampler, sample_ws_, p_, &bonus);
  }
  ++drafted_;
  drafts_kept_ += v.kept;
  const int64_t m = r.verify_pos;
  emit_chosen(r, v.token, logits);
  if (!r.handle) return false;
  if (v.kept) {
    emit_chosen(r, bonus, logits ? logits + vocab_ : nullptr);
    if (!r.handle) return false;
    r.mtp_next = {v.token, bonus};
  } else {
    cache_.trim(r.row, m + 1);
    r.mtp_next = {v.token};
  }
  mtp.row = r.row;
  mtp.T = int64_t(r.mtp_next.size());
  mtp.next = r.mtp_next.data();
  mtp.pos0 = m;
  return true;
}

void Scheduler::mtp_pass(std::vector<MtpItem>& items, const std::vector<Running*>& owners) {
  for (size_t i = 0; i < items.size(); ++i) {
    Running* r = owners[i];
    if (!r) continue;
    if (r->req.sampling.temperature == 0.0f) items[i].draft = &r->draft;
    else items[i].logits = mtp_logits_[size_t(r->row)].data();
  }
  try {
    model_.mtp_forward_batch(items, cache_);
  } catch (const std::exception& e) {  // as a failed step: the rows in it end
    for (const MtpItem& x : items)
      for (Running& r : running_)
        if (r.handle && r.row == x.row) {
          SchedEvent ev;
          ev.kind = SchedEvent::Kind::Error;
          ev.message = e.what();
          finish(r, std::move(ev));
        }
    return;
  }
  for (size_t i = 0; i < items.size(); ++i) {
    Running* r = owners[i];
    if (!r || r->req.sampling.temperature == 0.0f) continue;
    r->draft = draw_draft(mtp_logits_[size_t(r->row)].data(), vocab_, *r->sampler, sample_ws_, r->q);
  }
}

bool Scheduler::end_step() {
  std::erase_if(running_, [](const Running& r) { return r.handle == nullptr; });
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.steps;
  stats_.drafted = drafted_;
  stats_.drafts_kept = drafts_kept_;
  stats_.prompt_tokens_run = prompt_tokens_run_;
  stats_.tokens_generated = tokens_generated_;
  stats_.running = running_.size();
  stats_.cache_bytes_reserved = reserved_;
  count_cache_bytes();
  return true;
}

}  // namespace vireo
