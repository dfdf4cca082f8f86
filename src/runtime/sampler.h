#pragma once
// Token sampling: greedy (temperature 0) or temperature -> top-k -> top-p -> min-p (the order
// transformers applies its warpers in), with a seeded generator whose stream is identical on
// every platform.
#include <cstdint>
#include <vector>

namespace vireo {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
  uint64_t seed = 0;
};

// Validates ranges; errors name the flag/parameter.
void validate_sampling(const SamplingParams& p);

// Index of the largest logit (ties: the lowest index, as torch.argmax).
int32_t argmax(const float* logits, int64_t n);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  int32_t sample(const float* logits, int64_t vocab);
  const SamplingParams& params() const { return params_; }

 private:
  double next_uniform();  // [0, 1)
  SamplingParams params_;
  uint64_t state_;
  std::vector<int32_t> idx_;
  std::vector<float> prob_;
};

}  // namespace vireo
