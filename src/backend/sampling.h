#pragma once
// Sampling one token from a row of logits: temperature -> top-k -> top-p -> min-p (the order
// transformers applies its warpers in), then a draw with a uniform number the caller supplies.
//
// This is the reference every backend reproduces bit for bit (Backend::sample_rows): the same
// seed gives the same token on the CPU and on a GPU. Everything that could differ is fixed here:
//  - candidate order: descending logit, ties by lower token id (sample_order_key: -0 == +0);
//  - arithmetic: portable_math.h (one IEEE rounding per step, the same exp on both sides);
//  - summation order: sums run through "levels" (SumLevels): level 0 is the values in candidate
//    order, each entry of level l + 1 the sequential double sum of kSumBlock consecutive entries
//    of level l, up to a single entry, the total. A GPU builds each level in parallel and gets the
//    same doubles as the sequential CPU loops.
//  - prefix searches (the top-p cutoff, the draw) walk down the same levels (level_search).
#include <cstdint>
#include <vector>

#include "core/portable_math.h"

namespace vireo {

// One row's sampling parameters; temperature 0 picks the first candidate (the largest logit,
// ties by lower id) and ignores the rest.
struct SampleRowArgs {
  float temperature = 1.0f;  // > 0 (0: greedy)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // (0, 1]; 1: off
  float min_p = 0.0f;        // [0, 1]; 0: off
  double uniform = 0.0;      // the draw, in [0, 1)
};

// One-line errors naming the parameter (row `row` of a sample_rows call).
void validate_sample_row_args(const SampleRowArgs& a, int64_t row);

constexpr int64_t kSumBlock = 32;
constexpr int kMaxSumLevels = 8;  // enough for 32^7 > 2^31 values

// Where the levels of sums over n values live in one double array: level l (1 <= l <= count) has
// size[l] entries at offset[l]; size[0] = n is the values themselves; size[count] == 1.
struct SumLevels {
  int count = 0;
  int64_t size[kMaxSumLevels + 1] = {};
  int64_t offset[kMaxSumLevels + 1] = {};
  int64_t doubles = 0;  // total array length
};

static VIREO_HD inline SumLevels sum_levels(int64_t n) {
  SumLevels L;
  L.size[0] = n;
  int64_t at = 0;
  do {
    ++L.count;
    L.size[L.count] = (L.size[L.count - 1] + kSumBlock - 1) / kSumBlock;
    L.offset[L.count] = at;
    at += L.size[L.count];
  } while (L.size[L.count] > 1);
  L.doubles = at;
  return L;
}

// The levels over the first m <= L.size[0] values, kept at L's offsets. Every entry but the last
// of each level covers the same values as before (so it holds the same sum); a GPU recomputes
// only the last ones.
static VIREO_HD inline SumLevels resize_levels(const SumLevels& L, int64_t m) {
  SumLevels R = L;
  R.size[0] = m;
  R.count = 0;
  do {
    ++R.count;
    R.size[R.count] = (R.size[R.count - 1] + kSumBlock - 1) / kSumBlock;
  } while (R.size[R.count] > 1);
  return R;
}

// Entry j of level l (l = 0: the value itself, widened).
static VIREO_HD inline double level_entry(const float* values, const double* sums, const SumLevels& L, int l, int64_t j) {
  return l == 0 ? double(values[j]) : sums[L.offset[l] + j];
}

// Entry j of level l >= 1: the sequential sum of its kSumBlock children at level l - 1.
static VIREO_HD inline double level_block_sum(const float* values, const double* sums, const SumLevels& L, int l,
                                       int64_t j) {
  const int64_t a = j * kSumBlock, b = a + kSumBlock < L.size[l - 1] ? a + kSumBlock : L.size[l - 1];
  double s = 0.0;
  for (int64_t k = a; k < b; ++k) s = pm::add(s, level_entry(values, sums, L, l - 1, k));
  return s;
}

// The first index i whose running sum values[0] + ... + values[i] reaches `threshold` (>= or, if
// strict, >), the running sum taken down the levels: from the single top entry, within the
// current entry's children add each child's sum to the running sum c while c + child stays
// below the threshold, and descend into the first child that reaches it (or the last child, when
// none does, which makes the result n - 1 when the total falls short). At most kSumBlock steps
// per level; the same additions on every backend.
static VIREO_HD inline int64_t level_search(const float* values, const double* sums, const SumLevels& L, double threshold,
                                     bool strict) {
  double c = 0.0;
  int64_t j = 0;
  for (int l = L.count; l >= 1; --l) {
    const int64_t a = j * kSumBlock, b = a + kSumBlock < L.size[l - 1] ? a + kSumBlock : L.size[l - 1];
    j = b - 1;
    for (int64_t k = a; k < b - 1; ++k) {
      const double t = pm::add(c, level_entry(values, sums, L, l - 1, k));
      if (strict ? t > threshold : t >= threshold) {
        j = k;
        break;
      }
      c = t;
    }
  }
  return j;
}

// Sort key of a logit for candidate order: ascending key = descending logit (-0 and +0 equal;
// NaNs sort as the bit patterns say, so the order stays total and identical everywhere).
static VIREO_HD inline uint32_t sample_order_key(float x) {
  uint32_t b = x == 0.0f ? 0u : pm::float_bits(x);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // ascending with x
  return ~b;
}

// The number of candidates after top-k.
static VIREO_HD inline int64_t sample_candidates(const SampleRowArgs& a, int64_t vocab) {
  return a.top_k > 0 && a.top_k < vocab ? int64_t(a.top_k) : vocab;
}

// The unnormalized weight of the candidate with logit x, the best candidate's logit being x0:
// exp(x / T - x0 / T), with 1 / T rounded to float once.
static VIREO_HD inline float sample_weight(float x, float x0, float inv_t) {
  return pm::exp(pm::sub(pm::mul(x, inv_t), pm::mul(x0, inv_t)));
}

// The logit a sort key stands for: the inverse of sample_order_key, except that 0 comes back as
// +0 for -0 too (the two weigh the same in sample_weight: a difference with a zero is exact).
static VIREO_HD inline float sample_order_logit(uint32_t key) {
  const uint32_t b = ~key;
  return pm::bits_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
}

// Reusable host buffers for sample_row.
struct SampleWorkspace {
  std::vector<uint64_t> keys;                  // (sample_order_key << 32) | id (partial sorts)
  std::vector<uint32_t> radix_keys[2];         // sample_order_key (radix sort passes)
  std::vector<int32_t> radix_ids[2];
  std::vector<int32_t> ids;                    // candidates, best first
  std::vector<uint32_t> order_keys;            // their sample_order_key (so their logits, in order)
  std::vector<float> prob;                     // their probabilities
  std::vector<double> sums;                    // SumLevels storage
};

// ws.ids = the first n (1 <= n <= vocab) candidates of logits[0..vocab) in candidate order:
// ascending sample_order_key, ties by ascending id (the order of sorting key << 32 | id), and
// ws.order_keys their keys.
void sample_candidate_order(const float* logits, int64_t vocab, int64_t n, SampleWorkspace& ws);

// prob[i] = sample_weight(logit of keys[i], logit of keys[0], inv_t) for i < n (keys: candidate
// order's sample_order_key). allow_fma = false runs the portable build even where the CPU has FMA
// instructions (the same bits: for tests).
void sample_candidate_weights(const uint32_t* keys, int64_t n, float inv_t, float* prob, bool allow_fma = true);

// The distribution sample_row draws from: the kept candidates ws.ids[0..keep) in candidate
// order with their probabilities ws.prob[0..keep) (normalized before top-p and min-p cut the
// list), `levels` their sums in ws.sums, and `mass` the kept probabilities' total (the draw's).
// Candidate i is drawn with probability ws.prob[i] / mass. Temperature 0, or one candidate,
// keeps the best with probability 1.
struct WarpedCandidates {
  int64_t keep = 0;
  SumLevels levels;
  double mass = 0.0;
};
WarpedCandidates sample_warp(const float* logits, int64_t vocab, const SampleRowArgs& a, SampleWorkspace& ws);
// The token sample_row draws with `uniform` from the candidates sample_warp left in ws.
int32_t sample_draw(const WarpedCandidates& w, double uniform, const SampleWorkspace& ws);

// The reference: the token sampled from logits[0..vocab) (host memory).
int32_t sample_row(const float* logits, int64_t vocab, const SampleRowArgs& a, SampleWorkspace& ws);

}  // namespace vireo
