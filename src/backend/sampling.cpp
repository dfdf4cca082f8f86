// The sampling reference (sampling.h). Compiled with -ffp-contract=off (CMakeLists.txt): every
// float/double step here must round exactly as the CUDA kernels' __*_rn intrinsics do.
#include "backend/sampling.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace vireo {

void validate_sample_row_args(const SampleRowArgs& a, int64_t row) {
  if (!(a.temperature >= 0) || !std::isfinite(a.temperature))
    fail("sample_rows: row ", row, ": temperature must be >= 0, got ", a.temperature);
  if (a.top_k < 0) fail("sample_rows: row ", row, ": top_k must be >= 0, got ", a.top_k);
  if (!(a.top_p > 0 && a.top_p <= 1)) fail("sample_rows: row ", row, ": top_p must be in (0, 1], got ", a.top_p);
  if (!(a.min_p >= 0 && a.min_p <= 1)) fail("sample_rows: row ", row, ": min_p must be in [0, 1], got ", a.min_p);
  if (!(a.uniform >= 0 && a.uniform < 1)) fail("sample_rows: row ", row, ": uniform must be in [0, 1), got ", a.uniform);
}

namespace {

// Fills the levels above values[0..L.size[0]) (level by level, as a GPU does in parallel).
void build_levels(const float* values, double* sums, const SumLevels& L) {
  for (int l = 1; l <= L.count; ++l)
    for (int64_t j = 0; j < L.size[l]; ++j) sums[L.offset[l] + j] = level_block_sum(values, sums, L, l, j);
}

}  // namespace

void sample_candidate_order(const float* logits, int64_t vocab, int64_t n, SampleWorkspace& ws) {
  ws.ids.resize(size_t(n));
  if (n * 16 <= vocab) {  // few candidates: a partial sort of (key << 32 | id) beats sorting them all
    ws.keys.resize(size_t(vocab));
    for (int64_t i = 0; i < vocab; ++i) ws.keys[size_t(i)] = (uint64_t(sample_order_key(logits[i])) << 32) | uint64_t(i);
    if (n == 1) std::nth_element(ws.keys.begin(), ws.keys.begin(), ws.keys.end());
    else std::partial_sort(ws.keys.begin(), ws.keys.begin() + n, ws.keys.end());
    for (int64_t i = 0; i < n; ++i) ws.ids[size_t(i)] = int32_t(ws.keys[size_t(i)] & 0xffffffffu);
    return;
  }
  // A stable LSD radix sort of the keys, 8 bits a pass, ids starting in ascending order: equal
  // keys keep ascending ids. ~10x faster than std::sort on a 155k-token vocabulary.
  std::vector<uint32_t>* k = ws.radix_keys;
  std::vector<int32_t>* id = ws.radix_ids;
  for (int b = 0; b < 2; ++b) {
    k[b].resize(size_t(vocab));
    id[b].resize(size_t(vocab));
  }
  for (int64_t i = 0; i < vocab; ++i) {
    k[0][size_t(i)] = sample_order_key(logits[i]);
    id[0][size_t(i)] = int32_t(i);
  }
  int cur = 0;
  for (int shift = 0; shift < 32; shift += 8) {
    int64_t start[257] = {};
    for (int64_t i = 0; i < vocab; ++i) ++start[((k[cur][size_t(i)] >> shift) & 0xffu) + 1];
    if (*std::max_element(start + 1, start + 257) == vocab) continue;  // one digit throughout: nothing moves
    for (int d = 0; d < 256; ++d) start[d + 1] += start[d];
    const int nxt = cur ^ 1;
    for (int64_t i = 0; i < vocab; ++i) {
      const uint32_t key = k[cur][size_t(i)];
      const int64_t at = start[(key >> shift) & 0xffu]++;
      k[nxt][size_t(at)] = key;
      id[nxt][size_t(at)] = id[cur][size_t(i)];
    }
    cur = nxt;
  }
  std::copy(id[cur].begin(), id[cur].begin() + n, ws.ids.begin());
}

WarpedCandidates sample_warp(const float* logits, int64_t vocab, const SampleRowArgs& a, SampleWorkspace& ws) {
  if (vocab <= 0) fail("sample_rows: empty row");
  const int64_t n = a.temperature == 0.0f ? 1 : sample_candidates(a, vocab);
  sample_candidate_order(logits, vocab, n, ws);
  WarpedCandidates w;
  if (n == 1) {
    ws.prob.assign(1, 1.0f);
    w.keep = 1;
    w.levels = sum_levels(1);
    ws.sums.resize(size_t(w.levels.doubles));
    build_levels(ws.prob.data(), ws.sums.data(), w.levels);
    w.mass = 1.0;
    return w;
  }

  // Probabilities: weights normalized by their level total.
  const float inv_t = pm::div(1.0f, a.temperature), x0 = logits[ws.ids[0]];
  ws.prob.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) ws.prob[size_t(i)] = sample_weight(logits[ws.ids[size_t(i)]], x0, inv_t);
  SumLevels L = sum_levels(n);
  ws.sums.resize(size_t(L.doubles));
  build_levels(ws.prob.data(), ws.sums.data(), L);
  const double weight_total = ws.sums[size_t(L.offset[L.count])];
  for (float& p : ws.prob) p = pm::to_float(pm::div(double(p), weight_total));
  build_levels(ws.prob.data(), ws.sums.data(), L);

  // top-p: the shortest prefix whose mass reaches top_p (at least one candidate).
  int64_t keep = n;
  if (a.top_p < 1.0f) keep = level_search(ws.prob.data(), ws.sums.data(), L, double(a.top_p), false) + 1;
  // min-p: candidates up to the first one below min_p times the best's probability.
  if (a.min_p > 0.0f) {
    const float floor = pm::mul(a.min_p, ws.prob[0]);
    for (int64_t i = 1; i < keep; ++i)
      if (ws.prob[size_t(i)] < floor) {
        keep = i;
        break;
      }
  }
  if (keep != n) {
    L = resize_levels(L, keep);
    build_levels(ws.prob.data(), ws.sums.data(), L);
  }
  w.keep = keep;
  w.levels = L;
  w.mass = ws.sums[size_t(L.offset[L.count])];
  return w;
}

int32_t sample_row(const float* logits, int64_t vocab, const SampleRowArgs& a, SampleWorkspace& ws) {
  if (vocab <= 0) fail("sample_rows: empty row");
  if (a.temperature == 0.0f || sample_candidates(a, vocab) == 1) {  // the best candidate, no probabilities
    sample_candidate_order(logits, vocab, 1, ws);
    return ws.ids[0];
  }
  return sample_draw(sample_warp(logits, vocab, a, ws), a.uniform, ws);
}

int32_t sample_draw(const WarpedCandidates& w, double uniform, const SampleWorkspace& ws) {
  // The first candidate whose running mass exceeds uniform * the kept mass.
  const double target = pm::mul(uniform, w.mass);
  return ws.ids[size_t(level_search(ws.prob.data(), ws.sums.data(), w.levels, target, true))];
}

}  // namespace vireo
