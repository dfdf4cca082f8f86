#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace vireo {

void validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) fail("temperature must be >= 0, got ", p.temperature);
  if (p.top_k < 0) fail("top_k must be >= 0, got ", p.top_k);
  if (!(p.top_p > 0 && p.top_p <= 1)) fail("top_p must be in (0, 1], got ", p.top_p);
  if (!(p.min_p >= 0 && p.min_p <= 1)) fail("min_p must be in [0, 1], got ", p.min_p);
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty))
    fail("repetition_penalty must be > 0 (1: off), got ", p.repetition_penalty);
  if (!(p.frequency_penalty >= -2 && p.frequency_penalty <= 2))
    fail("frequency_penalty must be in [-2, 2], got ", p.frequency_penalty);
  if (!(p.presence_penalty >= -2 && p.presence_penalty <= 2))
    fail("presence_penalty must be in [-2, 2], got ", p.presence_penalty);
  if (p.min_tokens < 0) fail("min_tokens must be >= 0, got ", p.min_tokens);
  for (const int32_t id : p.allowed_ids)
    if (id < 0) fail("allowed_token_ids: token id ", id, " is negative");
  for (const auto& word : p.bad_words)
    for (const int32_t id : word)
      if (id < 0) fail("bad_words: token id ", id, " is negative");
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0) fail("logit_bias: token id ", id, " is negative");
    if (!(bias >= -100 && bias <= 100))
      fail("logit_bias: the bias of token ", id, " must be in [-100, 100], got ", bias);
  }
}

void adjust_logits(const SamplingParams& p, float* logits, const std::vector<uint8_t>& in_context,
                   const std::vector<int32_t>& generated, const std::vector<int32_t>& touched, int64_t drawn,
                   const std::vector<int32_t>& drawn_ids) {
  if (!p.allowed_ids.empty()) {  // every other id -inf: keep the allowed logits, fill, put them back
    thread_local std::vector<float> kept;
    kept.resize(p.allowed_ids.size());
    for (size_t i = 0; i < kept.size(); ++i) kept[i] = logits[p.allowed_ids[i]];
    std::fill(logits, logits + in_context.size(), -INFINITY);
    for (size_t i = 0; i < kept.size(); ++i) logits[p.allowed_ids[i]] = kept[i];
  }
  for (const auto& [id, bias] : p.logit_bias) logits[id] += bias;
  for (const int32_t t : touched) {
    float& x = logits[t];
    if (in_context[size_t(t)] && p.repetition_penalty != 1.0f)
      x = x > 0.0f ? x / p.repetition_penalty : x * p.repetition_penalty;
    const int32_t n = generated[size_t(t)];
    if (n > 0) {
      if (p.frequency_penalty != 0.0f) x -= p.frequency_penalty * float(n);
      if (p.presence_penalty != 0.0f) x -= p.presence_penalty;
    }
  }
  if (drawn < p.min_tokens)
    for (const int32_t id : p.eos_ids) logits[id] = -INFINITY;
  for (const std::vector<int32_t>& word : p.bad_words) {  // vLLM's rule: the rest of the word ends what was drawn
    if (word.empty() || word.size() - 1 > drawn_ids.size()) continue;
    const size_t rest = word.size() - 1;
    if (std::equal(word.begin(), word.end() - 1, drawn_ids.end() - ptrdiff_t(rest))) logits[word.back()] = -INFINITY;
  }
}

int32_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

Sampler::Sampler(const SamplingParams& p) : params_(p), state_(p.seed ^ 0x9e3779b97f4a7c15ull) {
  validate_sampling(p);
}

double Sampler::next_uniform() {
  // splitmix64: a fixed, portable stream for a given seed.
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return double(z >> 11) * (1.0 / 9007199254740992.0);
}

SampleRowArgs Sampler::next_row_args() {
  SampleRowArgs a;
  a.temperature = params_.temperature;
  a.top_k = params_.top_k;
  a.top_p = params_.top_p;
  a.min_p = params_.min_p;
  a.uniform = params_.temperature == 0.0f ? 0.0 : next_uniform();
  return a;
}

void Sampler::set_prompt(const std::vector<int32_t>& prompt) {
  if (params_.repetition_penalty != 1.0f) prompt_ = prompt;
}

void Sampler::note(int32_t token, int64_t vocab, bool generated) {
  if (token < 0 || token >= vocab) fail("penalties: token id ", token, " is outside the vocabulary of ", vocab);
  if (!in_context_[size_t(token)] && generated_[size_t(token)] == 0) touched_.push_back(token);
  in_context_[size_t(token)] = 1;
  if (generated) ++generated_[size_t(token)];
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (params_.adjusts_logits()) {
    if (in_context_.empty()) {  // the first row: the ids checked against its vocabulary, the history sized to it
      for (const auto& bias : params_.logit_bias)
        if (bias.first >= vocab) fail("logit_bias: token id ", bias.first, " is outside the vocabulary of ", vocab);
      for (const int32_t id : params_.allowed_ids)
        if (id >= vocab) fail("allowed_token_ids: token id ", id, " is outside the vocabulary of ", vocab);
      for (const auto& word : params_.bad_words)
        for (const int32_t id : word)
          if (id >= vocab) fail("bad_words: token id ", id, " is outside the vocabulary of ", vocab);
      for (const int32_t id : params_.eos_ids)
        if (id < 0 || id >= vocab) fail("min_tokens: EOS id ", id, " is outside the vocabulary of ", vocab);
      in_context_.assign(size_t(vocab), 0);
      generated_.assign(size_t(vocab), 0);
      for (const int32_t t : prompt_) note(t, vocab, false);
    }
    if (int64_t(in_context_.size()) != vocab)  // (so every later row has the vocabulary checked above)
      fail("penalties: a row of ", vocab, " logits after rows of ", in_context_.size());
    adjusted_.assign(logits, logits + vocab);
    adjust_logits(params_, adjusted_.data(), in_context_, generated_, touched_, drawn_, drawn_ids_);
    logits = adjusted_.data();
  }
  const int32_t t =
      params_.temperature == 0.0f ? argmax(logits, vocab) : sample_row(logits, vocab, next_row_args(), ws_);
  if (params_.adjusts_logits()) {
    note(t, vocab, true);
    ++drawn_;
    if (!params_.bad_words.empty()) drawn_ids_.push_back(t);
  }
  return t;
}

}  // namespace vireo
