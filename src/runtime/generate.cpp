#include "runtime/generate.h"

#include "runtime/speculative.h"

namespace vireo {

namespace {

// Hands a chosen token over (r.tokens, on_token); returns whether generation goes on: not at an
// EOS (when stop_at_eos), not stopped by on_token, and under max_new_tokens.
bool emit(int32_t t, const GlmDsaConfig& c, const GenerateOptions& opt, const std::function<bool(int32_t)>& on_token,
          GenerateResult& r) {
  r.tokens.push_back(t);
  const bool keep_going = on_token ? on_token(t) : true;
  if (opt.stop_at_eos && c.eos_ids.count(t)) {
    r.stopped_at_eos = true;
    return false;
  }
  return keep_going && int64_t(r.tokens.size()) < opt.max_new_tokens;
}

// GenerateOptions::mtp_drafts. The main model's cache holds the prompt and every emitted token but
// the last (`next`, not yet run); the MTP layer's entries run one position behind the main model's
// (the entry at t needs the token after t), at the same positions.
//
// Greedy: the draft is the MTP layer's argmax, kept where the main model's argmax equals it, so
// the tokens are plain greedy decoding's. Sampled: the draft is drawn from the MTP layer's
// distribution q (the same warpers as the main model's), kept or redrawn by verify_draft against
// the main model's distribution p at that position, so every token is distributed as plain
// sampling's (not the same draws: the stream of uniforms is used differently).
GenerateResult generate_with_drafts(GlmDsaModel& model, MlaCache& cache, int row, const std::vector<int32_t>& prompt,
                                    const GenerateOptions& opt, const std::function<bool(int32_t)>& on_token) {
  using clock = std::chrono::steady_clock;
  const GlmDsaConfig& c = model.config();
  if (!model.has_mtp()) fail("speculative decoding: the model was loaded without its MTP layer");
  const bool greedy = opt.sampling.temperature == 0.0f;
  const int64_t V = c.vocab_size;
  Sampler sampler(opt.sampling);
  SampleWorkspace ws;
  // Sampled: host logits of the verify step's two rows and of the MTP layer's last row, and the
  // dense distributions p (the main model's at the draft's position) and q (the draft's).
  std::vector<float> rows(greedy ? 0 : size_t(2 * V)), mtp_row(greedy ? 0 : size_t(V));
  std::vector<double> p, q;
  int32_t draft = -1;
  // The MTP layer on `T` tokens following the kept hidden rows from pos0: the next draft (and q).
  auto draft_after = [&](int64_t T, const int32_t* following, int64_t pos0) {
    if (greedy) return model.mtp_forward(0, T, following, cache, row, pos0, nullptr, false, &draft);
    model.mtp_forward(0, T, following, cache, row, pos0, mtp_row.data(), false, nullptr);
    draft = draw_draft(mtp_row.data(), V, sampler, ws, q);
  };
  GenerateResult r;
  const int64_t P = int64_t(prompt.size()), chunk = opt.prefill_chunk > 0 ? opt.prefill_chunk : P;
  r.prompt_tokens = P;
  const int64_t start = cache.length(row);
  auto t0 = clock::now();
  // The prompt in chunks, each keeping its hidden rows for the MTP layer's entries at its
  // positions (the entry of a chunk's last position takes the next chunk's first token, or the
  // main model's pick after the prompt: its argmax, or the sampler's first draw as plain
  // sampling takes it).
  int32_t next = -1;
  for (int64_t at = 0; at < P; at += chunk) {
    const int64_t n = std::min(chunk, P - at);
    const bool last = at + n == P;
    BatchItem item;
    item.row = row;
    item.tokens = prompt.data() + at;
    item.T = n;
    item.keep_hidden = true;
    if (last && greedy) item.token = &next;
    if (last && !greedy) item.logits = rows.data();
    model.forward_batch({item}, cache);
    if (last && !greedy) next = sampler.sample(rows.data(), V);
    std::vector<int32_t> following(prompt.begin() + at + 1, prompt.begin() + at + n);
    following.push_back(last ? next : prompt[size_t(at + n)]);
    if (last) draft_after(n, following.data(), start + at);
    else model.mtp_forward(0, n, following.data(), cache, row, start + at, nullptr, false, nullptr);
  }
  auto t1 = clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  // Each round verifies [next, draft] at positions m, m + 1 with the attention path a one-token
  // step at m takes (so position m's logits are a decode step's, bit for bit).
  std::vector<int32_t> fresh{next};
  bool going = opt.max_new_tokens > 0;
  while (going) {
    for (size_t k = 0; k < fresh.size() && going; ++k) going = emit(fresh[k], c, opt, on_token, r);
    if (!going) break;
    const int64_t m = cache.length(row);
    const int32_t pair[2] = {next, draft};
    int32_t picks[2];
    BatchItem item;
    item.row = row;
    item.tokens = pair;
    item.T = 2;
    item.all_logits = true;
    if (greedy) item.token = picks;
    else item.logits = rows.data();
    item.keep_hidden = true;
    model.forward_batch({item}, cache, model.choose_path(1, m));
    ++r.drafted;
    DraftVerdict verdict;
    if (greedy) {
      verdict = {picks[0] == draft, picks[0]};
    } else {
      verdict = judge_sampled_draft(rows.data(), V, draft, q, sampler, ws, p, &picks[1]);
    }
    if (verdict.kept) {
      ++r.accepted;
      fresh = {draft, picks[1]};
    } else {
      cache.trim(row, m + 1);
      fresh = {verdict.token};
    }
    // The MTP entries at m (and m + 1): the next draft, for the position after the last fresh token.
    draft_after(int64_t(fresh.size()), fresh.data(), m);
    next = fresh.back();
  }
  if (!r.tokens.empty()) cache.trim(row, start + P + int64_t(r.tokens.size()) - 1);
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return r;
}

// Penalties and logit biases (SamplingParams::adjusts_logits): every step's logits come back and the sampler picks
// on the host, penalizing them by the history it keeps (the prompt and every token it drew), a
// step at a time. The cache ends as generate's: the prompt and every token but the last.
GenerateResult generate_on_host(GlmDsaModel& model, MlaCache& cache, int row, const std::vector<int32_t>& prompt,
                                const GenerateOptions& opt, const std::function<bool(int32_t)>& on_token) {
  using clock = std::chrono::steady_clock;
  const GlmDsaConfig& c = model.config();
  GenerateResult r;
  r.prompt_tokens = int64_t(prompt.size());
  SamplingParams sp = opt.sampling;
  if (sp.min_tokens > 0 && opt.stop_at_eos) sp.eos_ids.assign(c.eos_ids.begin(), c.eos_ids.end());  // min_tokens' ids
  Sampler sampler(sp);
  std::vector<int32_t> context = opt.history;
  context.insert(context.end(), prompt.begin(), prompt.end());
  sampler.set_prompt(context);
  std::vector<float> logits(size_t(c.vocab_size));
  auto t0 = clock::now();
  const int64_t P = int64_t(prompt.size()), chunk = opt.prefill_chunk > 0 ? opt.prefill_chunk : P;
  int64_t at = 0;
  for (; P - at > chunk; at += chunk) model.forward(prompt.data() + at, chunk, cache, row, nullptr);
  model.forward(prompt.data() + at, P - at, cache, row, logits.data());
  int32_t next = sampler.sample(logits.data(), c.vocab_size);
  auto t1 = clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  if (opt.max_new_tokens > 0)
    while (emit(next, c, opt, on_token, r)) {
      model.forward(&next, 1, cache, row, logits.data());
      next = sampler.sample(logits.data(), c.vocab_size);
    }
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return r;
}

}  // namespace

GenerateResult generate(GlmDsaModel& model, MlaCache& cache, int row, const std::vector<int32_t>& prompt,
                        const GenerateOptions& opt, const std::function<bool(int32_t)>& on_token) {
  using clock = std::chrono::steady_clock;
  const GlmDsaConfig& c = model.config();
  if (prompt.empty()) fail("the prompt is empty");
  if (int64_t(prompt.size()) + opt.max_new_tokens > cache.capacity() - cache.length(row))
    fail("prompt (", prompt.size(), " tokens) + max new tokens (", opt.max_new_tokens,
         ") exceed the context of ", cache.capacity() - cache.length(row), " tokens");
  if (opt.prefill_chunk < 0) fail("prefill chunk must be 0 (the whole prompt) or positive, got ", opt.prefill_chunk);
  if (opt.decode_steps < 1 || opt.decode_steps > int(Backend::kMaxQueuedRead))
    fail("decode steps a chunk must be 1 to ", Backend::kMaxQueuedRead, ", got ", opt.decode_steps);
  if (opt.sampling.adjusts_logits()) {
    if (opt.mtp_drafts)
      fail(opt.sampling.first_adjustment(),
           ": penalties, logit biases, allowed ids and bad words are not supported with speculative decoding");
    return generate_on_host(model, cache, row, prompt, opt, on_token);
  }
  if (opt.mtp_drafts) return generate_with_drafts(model, cache, row, prompt, opt, on_token);
  GenerateResult r;
  r.prompt_tokens = int64_t(prompt.size());
  Sampler sampler(opt.sampling);
  // The backend chooses each token (argmax, or sample_rows with the sampler's next uniform): no
  // logits are copied back, and the tokens equal Sampler::sample's on the same logits.
  const bool greedy = opt.sampling.temperature == 0.0f;
  int32_t next = -1;
  auto step = [&](const int32_t* tokens, int64_t T, AttentionPath path) {
    const SampleRowArgs args = sampler.next_row_args();
    next = model.forward_next(tokens, T, cache, row, greedy ? nullptr : &args, path);
  };
  auto t0 = clock::now();
  // Every chunk but the last only fills the cache: no token is chosen for it (nor a sampler draw
  // taken, so sampling sees the same stream of draws as a one-step prefill).
  const int64_t P = int64_t(prompt.size()), chunk = opt.prefill_chunk > 0 ? opt.prefill_chunk : P;
  int64_t at = 0;
  for (; P - at > chunk; at += chunk) model.forward(prompt.data() + at, chunk, cache, row, nullptr);
  step(prompt.data() + at, P - at, AttentionPath::Auto);
  auto t1 = clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  // Decoding runs ahead of the host: the step on token i + 1 (the pick of the step on token i,
  // which never leaves the device) is queued before token i + 1 is read back, so the host's work
  // on a token and a step's launch overlap the step before. Greedy decoding queues chunks of
  // decode_steps steps (one launch each), one chunk ahead of the one whose picks the host is
  // handing over. Where generation stops with steps queued past the stop, their picks are
  // dropped and the cache trimmed back to what one step at a time would have left: the prompt
  // and every token but the last.
  const int64_t start = cache.length(row) - P;
  const int64_t steps = opt.max_new_tokens - 1;  // decode steps one at a time would run, at most
  const int chunk_steps = greedy ? opt.decode_steps : 1;
  int64_t queued = 0;
  auto queue = [&](const int32_t* token) {
    const int k = int(std::min<int64_t>(chunk_steps, steps - queued));
    const SampleRowArgs args = sampler.next_row_args();
    queued += model.queue_step(token, cache, row, greedy ? nullptr : &args, k);
  };
  if (steps > 0) queue(&next);
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    if (!emit(next, c, opt, on_token, r)) break;
    if (queued < steps && model.queued_steps() <= chunk_steps) queue(nullptr);
    next = model.take_step();
  }
  while (model.queued_steps() > 0) model.take_step();
  if (!r.tokens.empty()) cache.trim(row, start + P + int64_t(r.tokens.size()) - 1);
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return r;
}

}  // namespace vireo
