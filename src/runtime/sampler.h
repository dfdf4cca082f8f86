#pragma once
// Token sampling: greedy (temperature 0) or temperature -> top-k -> top-p -> min-p (the order
// transformers applies its warpers in), with a seeded generator whose stream is identical on
// every platform.
#include <cstdint>
#include <utility>
#include <vector>

#include "backend/sampling.h"

namespace vireo {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
  uint64_t seed = 0;
  // Penalties on the logits before everything above (greedy too), as transformers and vLLM apply
  // them: repetition_penalty r (> 0; 1: off) on every token of the prompt or generated so far
  // (logit / r where the logit is > 0, else logit * r); then frequency_penalty f and
  // presence_penalty p ([-2, 2]; 0: off, OpenAI's) on generated tokens: logit - f x count, then
  // - p once if it was generated at all.
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  // OpenAI's logit_bias: (token id, bias in [-100, 100]) added to the logit before the penalties
  // (vLLM's order); -100 in effect bans the token.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // vLLM's allowed_token_ids: only these ids can be drawn (every other logit -inf, before the
  // biases); empty: every id.
  std::vector<int32_t> allowed_ids;
  // vLLM's bad_words as token sequences: a sequence's last token cannot be drawn where the tokens
  // drawn so far end with the rest of it (a one-token sequence: never).
  std::vector<std::vector<int32_t>> bad_words;
  // vLLM's min_tokens: until this many tokens were drawn, the ids in `eos_ids` (the model's EOS
  // ids, which the caller fills in) cannot be (their logits -inf, after everything above).
  int64_t min_tokens = 0;
  std::vector<int32_t> eos_ids;
  bool has_penalties() const {
    return repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f;
  }
  // Penalties or biases: the token is picked on the host from the adjusted logits.
  bool adjusts_logits() const {
    return has_penalties() || !logit_bias.empty() || !allowed_ids.empty() || !bad_words.empty() || min_tokens > 0;
  }
  // The field speculative decoding refuses, for its message ("" when none).
  const char* first_adjustment() const {
    return min_tokens > 0               ? "min_tokens"
           : !logit_bias.empty()        ? "logit_bias"
           : !allowed_ids.empty()       ? "allowed_token_ids"
           : !bad_words.empty()         ? "bad_words"
           : repetition_penalty != 1.0f ? "repetition_penalty"
           : frequency_penalty != 0.0f  ? "frequency_penalty"
           : presence_penalty != 0.0f   ? "presence_penalty"
                                        : "";
  }
};

// Validates ranges; errors name the flag/parameter.
void validate_sampling(const SamplingParams& p);

// Index of the largest logit (ties: the lowest index, as torch.argmax).
int32_t argmax(const float* logits, int64_t n);

// p.allowed_ids' mask, then p.logit_bias, then the penalties of `p`, then min_tokens' ban while fewer than p.min_tokens
// were `drawn`, then p.bad_words' bans after the tokens drawn so far (`drawn_ids`), applied to logits[0..vocab) in
// place (vocab = in_context.size()): `in_context` flags the tokens of the prompt or generated (the repetition
// penalty's), `generated` counts each token's generations, `touched` lists every token flagged or counted (the only
// logits the penalties change).
void adjust_logits(const SamplingParams& p, float* logits, const std::vector<uint8_t>& in_context,
                   const std::vector<int32_t>& generated, const std::vector<int32_t>& touched, int64_t drawn = 0,
                   const std::vector<int32_t>& drawn_ids = {});

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // The next token from a row of host logits: argmax when greedy, else the reference
  // sample_row (backend/sampling.h) with the stream's next uniform. With biases or penalties, on a
  // copy of the row adjusted by them (adjust_logits) and the history: the prompt given to
  // set_prompt and every token drawn here.
  int32_t sample(const float* logits, int64_t vocab);
  // The prompt, for the repetition penalty (without one: ignored).
  void set_prompt(const std::vector<int32_t>& prompt);
  // The same draw for a backend to make (Backend::sample_rows): the parameters and the stream's
  // next uniform. Greedy takes no uniform (as sample() does not), so the two calls can be mixed
  // and the stream stays the same.
  SampleRowArgs next_row_args();
  const SamplingParams& params() const { return params_; }
  // The stream's next uniform in [0, 1) (speculative sampling's keep-or-redraw decisions).
  double next_uniform();

 private:
  // Adds a token to the penalties' history; ids outside the vocabulary fail with a message.
  void note(int32_t token, int64_t vocab, bool generated);

  SamplingParams params_;
  uint64_t state_;
  SampleWorkspace ws_;
  // Biases and penalties: the history (sized to the vocabulary at the first sample), the adjusted row.
  std::vector<int32_t> prompt_;
  std::vector<uint8_t> in_context_;
  std::vector<int32_t> generated_, touched_;
  int64_t drawn_ = 0;               // tokens drawn (min_tokens)
  std::vector<int32_t> drawn_ids_;  // with bad_words: every token drawn, in order
  std::vector<float> adjusted_;
};

}  // namespace vireo
