#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

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

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  const SamplingParams& p = params_;
  if (p.temperature == 0.0f) return argmax(logits, vocab);
  idx_.resize(size_t(vocab));
  std::iota(idx_.begin(), idx_.end(), 0);
  // Candidates by descending logit (ties: lower id), truncated by top-k.
  int64_t n = vocab;
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
  if (p.top_k > 0 && p.top_k < vocab) {
    n = p.top_k;
    std::partial_sort(idx_.begin(), idx_.begin() + n, idx_.end(), by_logit);
  } else {
    std::sort(idx_.begin(), idx_.end(), by_logit);
  }
  prob_.resize(size_t(n));
  const float inv_t = 1.0f / p.temperature;
  const float m = logits[idx_[0]] * inv_t;
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    prob_[size_t(i)] = std::exp(logits[idx_[size_t(i)]] * inv_t - m);
    sum += prob_[size_t(i)];
  }
  for (int64_t i = 0; i < n; ++i) prob_[size_t(i)] = float(prob_[size_t(i)] / sum);
  if (p.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p (always at least one token)
    double cum = 0;
    int64_t keep = n;
    for (int64_t i = 0; i < n; ++i) {
      cum += prob_[size_t(i)];
      if (cum >= p.top_p) { keep = i + 1; break; }
    }
    n = keep;
  }
  if (p.min_p > 0.0f) {
    const float floor = p.min_p * prob_[0];
    int64_t keep = 1;
    while (keep < n && prob_[size_t(keep)] >= floor) ++keep;
    n = keep;
  }
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += prob_[size_t(i)];
  double r = next_uniform() * total;
  for (int64_t i = 0; i < n; ++i) {
    r -= prob_[size_t(i)];
    if (r < 0) return idx_[size_t(i)];
  }
  return idx_[size_t(n - 1)];
}

}  // namespace vireo
