#pragma once
// Helpers shared by the fixture suites (CPU and CUDA): comparing logits and running a model over
// a token sequence in either attention path.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "model/glm_dsa/model.h"

namespace vireo::test {

// Relative L2 error of each row (position); infinite where a row is not finite.
inline std::vector<double> row_rel_l2(const float* got, const float* want, int64_t T, int64_t V) {
  std::vector<double> out(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    double num = 0, den = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double d = double(got[t * V + v]) - want[t * V + v];
      num += d * d;
      den += double(want[t * V + v]) * want[t * V + v];
    }
    out[size_t(t)] = std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-30)) : INFINITY;
  }
  return out;
}

// Worst relative L2 error over rows (positions); infinite if anything is not finite.
inline double max_row_rel_l2(const float* got, const float* want, int64_t T, int64_t V) {
  double worst = 0;
  for (double e : row_rel_l2(got, want, T, V)) worst = std::max(worst, e);
  return worst;
}

// Mean relative L2 error over rows: the typical row, where one flipped routing decision at a
// near-tie would dominate the worst.
inline double mean_row_rel_l2(const float* got, const float* want, int64_t T, int64_t V) {
  double sum = 0;
  for (double e : row_rel_l2(got, want, T, V)) sum += e;
  return T > 0 ? sum / double(T) : 0;
}

// Teacher-forced logits [T, vocab]: the whole sequence at once (reconstructed attention) or one
// token at a time through the cache (absorbed attention).
inline std::vector<float> run_logits(GlmDsaModel& m, Backend& be, const std::vector<int32_t>& ids, bool decode) {
  const int64_t T = int64_t(ids.size()), V = m.config().vocab_size;
  MlaCache cache(be, m.cache_shape(), 1, T);
  std::vector<float> out(static_cast<size_t>(T * V));
  if (!decode) {
    m.forward(ids.data(), T, cache, 0, out.data(), true, AttentionPath::Reconstructed);
  } else {
    for (int64_t t = 0; t < T; ++t)
      m.forward(&ids[size_t(t)], 1, cache, 0, out.data() + t * V, false, AttentionPath::Absorbed);
  }
  return out;
}

// Pipelined decoding against one step at a time: a sequence decoded by queue_step, `depth`
// queue_steps ahead (each fed the pick of the one before, on the backend), each a chunk of up to
// `chunk` steps, against forward_next on another cache row, `n` steps from the same prompt.
// Returns the two pick sequences; the caller compares them. Both rows end at the same length.
struct QueuedAndSingle {
  std::vector<int32_t> queued, single;
  int64_t queued_length = 0, single_length = 0;
};
inline QueuedAndSingle queued_and_single_steps(GlmDsaModel& m, Backend& be, const std::vector<int32_t>& prompt,
                                               int depth, int n, int chunk = 1) {
  const int64_t P = int64_t(prompt.size());
  MlaCache cache(be, m.cache_shape(), 2, P + n + 1);
  QueuedAndSingle r;
  int32_t t = m.forward_next(prompt.data(), P, cache, 0, nullptr);
  for (int i = 0; i < n; ++i) {
    r.single.push_back(t);
    t = m.forward_next(&t, 1, cache, 0, nullptr, AttentionPath::Absorbed);
  }
  const int32_t first = m.forward_next(prompt.data(), P, cache, 1, nullptr);
  r.queued.push_back(first);
  int queued = 0;  // steps
  auto queue = [&](const int32_t* token) {
    queued += m.queue_step(token, cache, 1, nullptr, std::min(chunk, n - 1 - queued));
  };
  for (int d = 0; d < depth && queued < n - 1; ++d) queue(queued == 0 ? &first : nullptr);
  while (int(r.queued.size()) < n) {
    r.queued.push_back(m.take_step());
    if (queued < n - 1 && m.queued_steps() <= (depth - 1) * chunk) queue(nullptr);
  }
  r.single_length = cache.length(0) - 1;  // the single row also ran a step on its last pick
  r.queued_length = cache.length(1);
  return r;
}

}  // namespace vireo::test
