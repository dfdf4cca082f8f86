#pragma once
// Token sampling: greedy (temperature 0) or temperature -> top-k -> top-p -> min-p (the order
// transformers applies its warpers in), with a seeded generator whose stream is identical on
// every platform.
#include <cstdint>

#include "backend/sampling.h"

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
  // The next token from a row of host logits: argmax when greedy, else the reference
  // sample_row (backend/sampling.h) with the stream's next uniform.
  int32_t sample(const float* logits, int64_t vocab);
  // The same draw for a backend to make (Backend::sample_rows): the parameters and the stream's
  // next uniform. Greedy takes no uniform (as sample() does not), so the two calls can be mixed
  // and the stream stays the same.
  SampleRowArgs next_row_args();
  const SamplingParams& params() const { return params_; }
  // The stream's next uniform in [0, 1) (speculative sampling's keep-or-redraw decisions).
  double next_uniform();

 private:
  SamplingParams params_;
  uint64_t state_;
  SampleWorkspace ws_;
};

}  // namespace vireo
