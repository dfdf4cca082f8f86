#pragma once
// Helpers shared by the expert-store suites (test_experts.cpp, test_device_store.cpp): a model's
// prefill logits and greedy continuation, and an expert's payload bytes in a checkpoint.
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cache/mla_cache.h"
#include "model/glm_dsa/model.h"
#include "runtime/generate.h"

namespace vireo::test {

// Logits of every position of `ids` from an empty cache, reconstructed attention.   [T, vocab]
inline std::vector<float> prefill_logits(GlmDsaModel& m, Backend& be, const std::vector<int32_t>& ids) {
  const int64_t T = int64_t(ids.size()), V = m.config().vocab_size;
  MlaCache cache(be, m.cache_shape(), 1, T);
  std::vector<float> out(size_t(T * V));
  m.forward(ids.data(), T, cache, 0, out.data(), true, AttentionPath::Reconstructed);
  return out;
}

// Logits of `n` single-token decode steps after `prompt` (the steps feed the prompt's tokens
// again, in order): the decode path's bits, step by step.                          [n, vocab]
inline std::vector<float> decode_logits(GlmDsaModel& m, Backend& be, const std::vector<int32_t>& prompt, int64_t n) {
  const int64_t V = m.config().vocab_size;
  MlaCache cache(be, m.cache_shape(), 1, int64_t(prompt.size()) + n);
  std::vector<float> out(size_t(n * V));
  m.forward(prompt.data(), int64_t(prompt.size()), cache, 0, out.data());
  for (int64_t i = 0; i < n; ++i)
    m.forward(&prompt[size_t(i) % prompt.size()], 1, cache, 0, out.data() + i * V);
  return out;
}

// Two sequences decoded together: row 0 after `prompt`, row 1 after its first half, then `n`
// batched steps of one token each (the prompt's tokens again). Logits [n, 2, vocab].
inline std::vector<float> batched_decode_logits(GlmDsaModel& m, Backend& be, const std::vector<int32_t>& prompt,
                                                int64_t n) {
  const int64_t V = m.config().vocab_size, P = int64_t(prompt.size());
  MlaCache cache(be, m.cache_shape(), 2, P + n);
  std::vector<float> out(size_t(n * 2 * V));
  m.forward(prompt.data(), P, cache, 0, out.data());
  m.forward(prompt.data(), std::max<int64_t>(1, P / 2), cache, 1, out.data());
  for (int64_t i = 0; i < n; ++i) {
    BatchItem a, b;
    a.row = 0;
    a.tokens = &prompt[size_t(i) % prompt.size()];
    a.T = 1;
    a.logits = out.data() + (2 * i) * V;
    b.row = 1;
    b.tokens = &prompt[size_t(i + 1) % prompt.size()];
    b.T = 1;
    b.logits = out.data() + (2 * i + 1) * V;
    m.forward_batch({a, b}, cache);
  }
  return out;
}

// n greedy tokens after `prompt` (end-of-sequence tokens do not stop it).
inline std::vector<int32_t> greedy(GlmDsaModel& m, Backend& be, const std::vector<int32_t>& prompt, int64_t n) {
  MlaCache cache(be, m.cache_shape(), 1, int64_t(prompt.size()) + n);
  GenerateOptions opt;
  opt.max_new_tokens = n;
  opt.stop_at_eos = false;
  return generate(m, cache, 0, prompt, opt).tokens;
}

// Bytes of routed expert `expert` of `layer` in the checkpoint: its three weights and scales.
inline uint64_t payload_bytes(const Checkpoint& ck, int layer, int expert) {
  uint64_t n = 0;
  const std::string x = "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + ".";
  for (const char* t : {"gate_proj", "up_proj", "down_proj"})
    for (const char* s : {".weight", ".weight_scale_inv"})
      if (const TensorInfo* i = ck.find(x + t + s)) n += i->nbytes;
  return n;
}

}  // namespace vireo::test
