// The sampling reference (sampling.h). Compiled with -ffp-contract=off (CMakeLists.txt): every
// float/double step here must round exactly as the CUDA kernels' __*_rn intrinsics do.
#include "backend/sampling.h"

#include <algorithm>
#include <cmath>
#include <utility>

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
  for (int l = 1; l <= L.count; ++l) {
    int64_t j = 0;
    // Level 1's whole blocks eight at a time: eight independent chains of additions, each in its
    // block's order (level_block_sum's bits), instead of one chain after another.
    if (l == 1)
      for (const int64_t whole = L.size[0] / kSumBlock; j + 8 <= whole; j += 8) {
        double s[8] = {};
        const float* v = values + j * kSumBlock;
        for (int64_t k = 0; k < kSumBlock; ++k)
          for (int c = 0; c < 8; ++c) s[c] = pm::add(s[c], double(v[c * kSumBlock + k]));
        for (int c = 0; c < 8; ++c) sums[L.offset[1] + j + c] = s[c];
      }
    for (; j < L.size[l]; ++j) sums[L.offset[l] + j] = level_block_sum(values, sums, L, l, j);
  }
}

}  // namespace

void sample_candidate_order(const float* logits, int64_t vocab, int64_t n, SampleWorkspace& ws) {
  ws.ids.resize(size_t(n));
  ws.order_keys.resize(size_t(n));
  if (n == 1) {  // the smallest key, the first id holding it
    uint32_t best = sample_order_key(logits[0]);
    int64_t at = 0;
    for (int64_t i = 1; i < vocab; ++i) {
      const uint32_t key = sample_order_key(logits[i]);
      if (key < best) best = key, at = i;
    }
    ws.ids[0] = int32_t(at);
    ws.order_keys[0] = best;
    return;
  }
  if (n * 16 <= vocab) {
    // Few candidates: one pass keeping each (key << 32 | id) below the n-th smallest seen so
    // far; whenever 4n are kept the n smallest are picked out and the bound tightens. Then sort.
    const size_t cap = size_t(std::max<int64_t>(4 * n, 256));
    ws.keys.clear();
    ws.keys.reserve(cap);
    uint64_t bound = ~uint64_t(0);
    for (int64_t i = 0; i < vocab; ++i) {
      const uint32_t order_key = sample_order_key(logits[i]);
      if (order_key > uint32_t(bound >> 32)) continue;  // the common case, decided on 32 bits (4x faster)
      const uint64_t key = (uint64_t(order_key) << 32) | uint64_t(i);
      if (key >= bound) continue;
      ws.keys.push_back(key);
      if (ws.keys.size() == cap) {
        std::nth_element(ws.keys.begin(), ws.keys.begin() + (n - 1), ws.keys.end());
        ws.keys.resize(size_t(n));
        bound = ws.keys[size_t(n - 1)];
      }
    }
    std::partial_sort(ws.keys.begin(), ws.keys.begin() + n, ws.keys.end());
    for (int64_t i = 0; i < n; ++i) {
      ws.ids[size_t(i)] = int32_t(ws.keys[size_t(i)] & 0xffffffffu);
      ws.order_keys[size_t(i)] = uint32_t(ws.keys[size_t(i)] >> 32);
    }
    return;
  }
  // A stable LSD radix sort of the keys, 11 bits a pass (three passes; the histograms of all
  // three counted in one read), ids starting in ascending order: equal keys keep ascending ids.
  // A pass whose digit is the same for every key moves nothing and is skipped.
  constexpr int kBits = 11, kPasses = 3;
  constexpr uint32_t kDigits = 1u << kBits;
  static_assert(kBits * kPasses >= 32 && kBits * (kPasses - 1) < 32);
  for (int b = 0; b < 2; ++b) {
    ws.radix_keys[b].resize(size_t(vocab));
    ws.radix_ids[b].resize(size_t(vocab));
  }
  uint32_t* key[2] = {ws.radix_keys[0].data(), ws.radix_keys[1].data()};
  int32_t* id[2] = {ws.radix_ids[0].data(), ws.radix_ids[1].data()};
  std::vector<int64_t> start(size_t(kPasses) * kDigits, 0);  // each pass's digit counts, then starts
  for (int64_t i = 0; i < vocab; ++i) {
    const uint32_t k = sample_order_key(logits[i]);
    key[0][i] = k;
    id[0][i] = int32_t(i);
    ++start[k & (kDigits - 1)];
    ++start[kDigits + ((k >> kBits) & (kDigits - 1))];
    ++start[2 * kDigits + (k >> (2 * kBits))];
  }
  int cur = 0;
  for (int p = 0; p < kPasses; ++p) {
    int64_t* s = &start[size_t(p) * kDigits];
    if (*std::max_element(s, s + kDigits) == vocab) continue;  // one digit throughout
    int64_t at = 0;
    for (uint32_t d = 0; d < kDigits; ++d) at += std::exchange(s[d], at);
    const uint32_t* kc = key[cur];
    const int32_t* ic = id[cur];
    uint32_t* kn = key[cur ^ 1];
    int32_t* in = id[cur ^ 1];
    const int shift = p * kBits;
    for (int64_t i = 0; i < vocab; ++i) {
      const int64_t to = s[(kc[i] >> shift) & (kDigits - 1)]++;
      kn[to] = kc[i];
      in[to] = ic[i];
    }
    cur ^= 1;
  }
  std::copy(id[cur], id[cur] + n, ws.ids.begin());
  std::copy(key[cur], key[cur] + n, ws.order_keys.begin());
}

namespace {

// prob[i] = the weight of the candidate with key keys[i] (sample_weight against keys[0]'s logit).
// Compiled twice: where the CPU has FMA instructions pm::exp's fmas are one instruction each
// instead of a call into libm (this build targets x86-64 without FMA). Each fma is one rounding
// either way, so both give the same bits (SamplingReference.WarpIsTheStraightforwardComputationBitForBit).
[[gnu::always_inline]] inline void candidate_weights_body(const uint32_t* keys, int64_t n, float inv_t, float* prob) {
  const float x0 = sample_order_logit(keys[0]);
  for (int64_t i = 0; i < n; ++i) prob[i] = sample_weight(sample_order_logit(keys[i]), x0, inv_t);
}

#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target("fma"), gnu::flatten]] void candidate_weights_fma(const uint32_t* keys, int64_t n, float inv_t,
                                                                float* prob) {
  candidate_weights_body(keys, n, inv_t, prob);
}
#endif

void candidate_weights_portable(const uint32_t* keys, int64_t n, float inv_t, float* prob) {
  candidate_weights_body(keys, n, inv_t, prob);
}

}  // namespace

void sample_candidate_weights(const uint32_t* keys, int64_t n, float inv_t, float* prob, bool allow_fma) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has_fma = __builtin_cpu_supports("fma");
  if (allow_fma && has_fma) return candidate_weights_fma(keys, n, inv_t, prob);
#endif
  (void)allow_fma;
  candidate_weights_portable(keys, n, inv_t, prob);
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
  ws.prob.resize(size_t(n));
  sample_candidate_weights(ws.order_keys.data(), n, pm::div(1.0f, a.temperature), ws.prob.data());
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
