#include "runtime/generate.h"

namespace vireo {

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
    r.tokens.push_back(next);
    const bool keep_going = on_token ? on_token(next) : true;
    if (opt.stop_at_eos && c.eos_ids.count(next)) {
      r.stopped_at_eos = true;
      break;
    }
    if (!keep_going || i + 1 == opt.max_new_tokens) break;
    if (queued < steps && model.queued_steps() <= chunk_steps) queue(nullptr);
    next = model.take_step();
  }
  while (model.queued_steps() > 0) model.take_step();
  if (!r.tokens.empty()) cache.trim(row, start + P + int64_t(r.tokens.size()) - 1);
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return r;
}

}  // namespace vireo
