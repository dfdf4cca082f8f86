#pragma once
// Single-sequence generation: prefill the prompt (in one step, or in chunks of
// GenerateOptions::prefill_chunk tokens), then decode one token at a time (absorbed attention)
// until max_new_tokens or an EOS id.
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "model/glm_dsa/model.h"
#include "runtime/sampler.h"

namespace vireo {

struct GenerateOptions {
  int64_t max_new_tokens = 128;
  SamplingParams sampling;
  bool stop_at_eos = true;
  // Prompt tokens per forward step (0: the whole prompt in one step). A memory plan sizes scratch
  // for one step, so under a budget the prompt is fed in chunks of the planned size; the tokens
  // chosen are the same (each chunk appends to the cache what one step would have).
  int64_t prefill_chunk = 0;
  // Greedy decode steps queued as one chunk (GlmDsaModel::queue_step's `steps`: on a backend
  // that records, one CUDA graph launch a chunk: ~15 us a step less on an H200). The tokens are
  // the same at any size; a larger chunk hands tokens over in bursts of this many, and where
  // generation stops up to 2 * decode_steps - 1 steps past the stop run and are dropped (one chunk
  // runs ahead of the one being read). Sampling decodes a step at a time.
  int decode_steps = 8;
  // Speculative decoding with the model's MTP layer (GlmDsaModel::has_mtp): each step the main
  // model runs the next token and the MTP layer's draft of the one after as one two-token
  // forward, up to two tokens a forward. Greedy keeps the draft where the main model's argmax
  // agrees: the same tokens as plain greedy decoding (each position's logits are computed as one
  // decode step computes them). Sampling keeps it with probability min(1, p / q) and otherwise
  // redraws (runtime/speculative.h): every token distributed as plain sampling's, with other draws
  // (the first token, drawn from the prompt's logits, is plain sampling's). Logits come back to
  // the host when sampling.
  bool mtp_drafts = false;
  // Tokens already in the cache row before the prompt (a chat's earlier turns): with
  // sampling.repetition_penalty they count as the prompt's. With penalties every step's logits
  // come back and the host picks, a step at a time (not with mtp_drafts).
  std::vector<int32_t> history;
};

struct GenerateResult {
  std::vector<int32_t> tokens;   // generated ids (the EOS id included if it stopped there)
  bool stopped_at_eos = false;
  int64_t prompt_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  int64_t drafted = 0, accepted = 0;  // mtp_drafts: drafts verified, and kept
};

// on_token(id) is called as each token is chosen; returning false stops generation.
GenerateResult generate(GlmDsaModel& model, MlaCache& cache, int row, const std::vector<int32_t>& prompt,
                        const GenerateOptions& opt, const std::function<bool(int32_t)>& on_token = nullptr);

}  // namespace vireo
