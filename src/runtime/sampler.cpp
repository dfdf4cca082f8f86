#include "runtime/sampler.h"

#include <cmath>

#include "core/error.h"

namespace vireo {

void validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) fail("temperature must be >= 0, got ", p.temperature);
  if (p.top_k < 0) fail("top_k must be >= 0, got ", p.top_k);
  if (!(p.top_p > 0 && p.top_p <= 1)) fail("top_p must be in (0, 1], got ", p.top_p);
  if (!(p.min_p >= 0 && p.min_p <= 1)) fail("min_p must be in [0, 1], got ", p.min_p);
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

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (params_.temperature == 0.0f) return argmax(logits, vocab);
  return sample_row(logits, vocab, next_row_args(), ws_);
}

}  // namespace vireo
