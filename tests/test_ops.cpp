// Per-op tests of the CPU backend against naive code written out here.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>
#include <numeric>
#include <algorithm>
#include <random>

#include "backend/backend.h"

using namespace vireo;

namespace {

std::vector<float> random_vec(size_t n, uint32_t seed, float a = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-a, a);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double rel_l2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

Weight f32_weight(std::vector<float>& data, int64_t out, int64_t in) {
  Weight w;
  w.w = Tensor(data.data(), DType::F32, {out, in});
  return w;
}

}  // namespace

TEST(Ops, RmsNormMatchesFormula) {
  auto be = make_cpu_backend();
  const int64_t T = 3, n = 37;
  auto x = random_vec(static_cast<size_t>(T * n), 1), w = random_vec(static_cast<size_t>(n), 2);
  std::vector<float> y(static_cast<size_t>(T * n));
  be->rms_norm(x.data(), n, T, n, w.data(), 1e-5f, y.data(), n);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[size_t(t * n + i)]) * x[size_t(t * n + i)];
    double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(y[size_t(t * n + i)], w[size_t(i)] * x[size_t(t * n + i)] * inv, 1e-6);
  }
}

TEST(Ops, LayerNormMatchesFormula) {
  auto be = make_cpu_backend();
  const int64_t n = 32;
  auto x = random_vec(static_cast<size_t>(n), 3), w = random_vec(static_cast<size_t>(n), 4), b = random_vec(static_cast<size_t>(n), 5);
  std::vector<float> y(static_cast<size_t>(n));
  be->layer_norm(x.data(), 1, n, w.data(), b.data(), 1e-6f, y.data());
  double mean = 0, var = 0;
  for (float v : x) mean += v;
  mean /= n;
  for (float v : x) var += (v - mean) * (v - mean);
  var /= n;
  for (int64_t i = 0; i < n; ++i)
    EXPECT_NEAR(y[size_t(i)], (x[size_t(i)] - mean) / std::sqrt(var + 1e-6) * w[size_t(i)] + b[size_t(i)], 1e-5);
}

TEST(Ops, RopeInterleavedUsesOracleLayout) {
  auto be = make_cpu_backend();
  const int64_t width = 8, half = 4;
  auto x = random_vec(static_cast<size_t>(width), 6);
  std::vector<float> cs(static_cast<size_t>(width));
  for (int64_t i = 0; i < half; ++i) {
    cs[size_t(2 * i)] = std::cos(0.3f * float(i + 1));
    cs[size_t(2 * i + 1)] = std::sin(0.3f * float(i + 1));
  }
  std::vector<float> y = x;
  be->rope(y.data(), 1, 1, width, width, 0, width, cs.data(), RopeKind::Interleaved);
  for (int64_t i = 0; i < half; ++i) {
    float a = x[size_t(2 * i)], b = x[size_t(2 * i + 1)], c = cs[size_t(2 * i)], s = cs[size_t(2 * i + 1)];
    EXPECT_FLOAT_EQ(y[size_t(i)], a * c - b * s);         // rotated evens first
    EXPECT_FLOAT_EQ(y[size_t(half + i)], b * c + a * s);  // then rotated odds
  }
  std::vector<float> z = x;
  be->rope(z.data(), 1, 1, width, width, 0, width, cs.data(), RopeKind::HalfSplit);
  for (int64_t i = 0; i < half; ++i) {
    float a = x[size_t(i)], b = x[size_t(half + i)], c = cs[size_t(2 * i)], s = cs[size_t(2 * i + 1)];
    EXPECT_FLOAT_EQ(z[size_t(i)], a * c - b * s);
    EXPECT_FLOAT_EQ(z[size_t(half + i)], b * c + a * s);
  }
}

TEST(Ops, RopePreservesDotProductsOfEqualPositions) {
  // q.k after rotating both by the same angle equals q.k before: the layout is consistent.
  auto be = make_cpu_backend();
  const int64_t width = 16;
  auto q = random_vec(static_cast<size_t>(width), 7), k = random_vec(static_cast<size_t>(width), 8);
  std::vector<float> cs(static_cast<size_t>(width));
  for (int64_t i = 0; i < width / 2; ++i) {
    cs[size_t(2 * i)] = std::cos(1.7f * float(i));
    cs[size_t(2 * i + 1)] = std::sin(1.7f * float(i));
  }
  double before = 0, after = 0;
  for (int64_t i = 0; i < width; ++i) before += q[size_t(i)] * k[size_t(i)];
  for (RopeKind kind : {RopeKind::Interleaved, RopeKind::HalfSplit}) {
    auto q2 = q, k2 = k;
    be->rope(q2.data(), 1, 1, width, width, 0, width, cs.data(), kind);
    be->rope(k2.data(), 1, 1, width, width, 0, width, cs.data(), kind);
    after = 0;
    for (int64_t i = 0; i < width; ++i) after += q2[size_t(i)] * k2[size_t(i)];
    EXPECT_NEAR(before, after, 1e-5);
  }
}

// The absorbed path computes the same attention as the reconstructed path, with and without a
// key selection.
TEST(Ops, MlaAbsorbedEqualsReconstructed) {
  auto be = make_cpu_backend();
  const int64_t T = 5, H = 3, nope = 8, rope = 4, vd = 6, L = 10, N = 12, pos0 = N - T;
  auto q = random_vec(static_cast<size_t>(T * H * (nope + rope)), 10);
  auto kv = random_vec(static_cast<size_t>(N * (L + rope)), 11);
  auto wkvb = random_vec(static_cast<size_t>(H * (nope + vd) * L), 12, 0.5f);
  Weight kvb = f32_weight(wkvb, H * (nope + vd), L);
  std::vector<int32_t> sel(static_cast<size_t>(T * 4)), cnt(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {  // keys 0, 2, 4, ... up to the query's own position
    int c = 0;
    for (int64_t u = 0; u <= pos0 + t && c < 4; u += 2) sel[size_t(t * 4 + c++)] = int32_t(u);
    cnt[size_t(t)] = c;
  }
  for (bool sparse : {false, true}) {
    std::vector<float> a(static_cast<size_t>(T * H * vd)), b(static_cast<size_t>(T * H * vd));
    MlaAttentionArgs args;
    args.q = q.data();
    args.T = T;
    args.n_heads = H;
    args.qk_nope = nope;
    args.qk_rope = rope;
    args.v_dim = vd;
    args.kv_lora = L;
    args.kv = kv.data();
    args.n_keys = N;
    args.pos0 = pos0;
    args.kv_b = &kvb;
    args.scale = 0.3f;
    if (sparse) args.selection = KeySelection{sel.data(), cnt.data(), 4};
    args.out = a.data();
    be->mla_attention(args);
    args.absorbed = true;
    args.out = b.data();
    be->mla_attention(args);
    EXPECT_LT(rel_l2(b.data(), a.data(), a.size()), 1e-6) << "sparse=" << sparse;
  }
  // Naive reconstructed attention for query 0, head 0, dense.
  std::vector<float> out(static_cast<size_t>(T * H * vd));
  MlaAttentionArgs args;
  args.q = q.data(); args.T = T; args.n_heads = H; args.qk_nope = nope; args.qk_rope = rope; args.v_dim = vd;
  args.kv_lora = L; args.kv = kv.data(); args.n_keys = N; args.pos0 = pos0; args.kv_b = &kvb; args.scale = 0.3f;
  args.out = out.data();
  be->mla_attention(args);
  std::vector<double> s(static_cast<size_t>(pos0 + 1));
  double mx = -1e300, sum = 0;
  for (int64_t u = 0; u <= pos0; ++u) {
    double d = 0;
    for (int64_t i = 0; i < nope; ++i) {
      double k = 0;
      for (int64_t c = 0; c < L; ++c) k += double(wkvb[size_t(i * L + c)]) * kv[size_t(u * (L + rope) + c)];
      d += q[size_t(i)] * k;
    }
    for (int64_t i = 0; i < rope; ++i) d += double(q[size_t(nope + i)]) * kv[size_t(u * (L + rope) + L + i)];
    s[size_t(u)] = d * 0.3;
    mx = std::max(mx, s[size_t(u)]);
  }
  for (double& v : s) { v = std::exp(v - mx); sum += v; }
  for (int64_t j = 0; j < vd; ++j) {
    double o = 0;
    for (int64_t u = 0; u <= pos0; ++u) {
      double v = 0;
      for (int64_t c = 0; c < L; ++c) v += double(wkvb[size_t((nope + j) * L + c)]) * kv[size_t(u * (L + rope) + c)];
      o += s[size_t(u)] / sum * v;
    }
    EXPECT_NEAR(out[size_t(j)], o, 1e-5);
  }
}

TEST(Ops, IndexerTopkTiesPickLowerPosition) {
  auto be = make_cpu_backend();
  // One head, head_dim 1: score(u) = w * relu(q * k_u * scale). Keys chosen so that several
  // scores tie exactly, and negative products tie at zero.
  const int64_t N = 8, topk = 3;
  std::vector<float> keys = {1, 2, 2, -1, 2, 0.5f, 2, -3};
  std::vector<float> q = {1}, w = {1};
  std::vector<int32_t> sel(static_cast<size_t>(topk)), cnt(1);
  IndexerArgs a;
  a.q = q.data(); a.weights = w.data(); a.keys = keys.data();
  a.T = 1; a.n_heads = 1; a.head_dim = 1; a.n_keys = N; a.pos0 = N - 1; a.topk = topk; a.scale = 1.0f;
  a.selected = sel.data(); a.counts = cnt.data();
  be->indexer_select(a);
  ASSERT_EQ(cnt[0], 3);
  // Scores: 1,2,2,0,2,0.5,2,0. Four keys tie at 2 (positions 1,2,4,6): the lowest three win.
  EXPECT_EQ(sel, (std::vector<int32_t>{1, 2, 4}));
  // Ties at zero (relu): with q negative, every score is 0 except keys 3 and 7 (score 1 and 3):
  // then the lowest zero-score position fills the last slot.
  q = {-1};
  be->indexer_select(a);
  EXPECT_EQ(sel, (std::vector<int32_t>{0, 3, 7}));
}

namespace {

// The indexer over keys [N = pos0 + T, d] for T queries of nI heads (scale d^-1/2), into sel / cnt.
IndexerArgs indexer_args(const std::vector<float>& q, const std::vector<float>& w, const std::vector<float>& keys,
                         int64_t T, int64_t nI, int64_t d, int64_t pos0, int64_t topk, float weight_scale,
                         std::vector<int32_t>& sel, std::vector<int32_t>& cnt) {
  IndexerArgs a;
  a.q = q.data();
  a.weights = w.data();
  a.keys = keys.data();
  a.T = T;
  a.n_heads = nI;
  a.head_dim = d;
  a.n_keys = pos0 + T;
  a.pos0 = pos0;
  a.topk = topk;
  a.scale = 1.0f / std::sqrt(float(d));
  a.weight_scale = weight_scale;
  a.selected = sel.data();
  a.counts = cnt.data();
  return a;
}

}  // namespace

// weight_scale multiplies each head weight before it weighs that head's scores, the same float
// product as weights scaled beforehand: the same selection, and a negative scale reverses the
// ranking (so a backend that ignored it would choose other keys).
TEST(Ops, IndexerWeightScaleEqualsScaledWeights) {
  auto be = make_cpu_backend();
  const int64_t N = 300, T = 2, nI = 4, d = 8, topk = 40;
  auto keys = random_vec(size_t(N * d), 23), q = random_vec(size_t(T * nI * d), 24);
  auto w = random_vec(size_t(T * nI), 25);
  for (float& x : w) x = std::fabs(x) + 0.1f;  // every head counts with the same sign
  auto select = [&](const std::vector<float>& weights, float weight_scale) {
    std::vector<int32_t> sel(static_cast<size_t>(T * topk), -1), cnt(static_cast<size_t>(T));
    IndexerArgs a = indexer_args(q, weights, keys, T, nI, d, N - T, topk, weight_scale, sel, cnt);
    be->indexer_select(a);
    return sel;
  };
  for (float s : {0.5f, -0.5f}) {
    std::vector<float> scaled(w);
    for (float& x : scaled) x = x * s;
    EXPECT_EQ(select(w, s), select(scaled, 1.0f)) << "weight scale " << s;
  }
  EXPECT_NE(select(w, -0.5f), select(w, 1.0f)) << "a negative weight scale must reverse the ranking";
}

// The selection against a plain statement of it: each key's score its heads' w * relu(dot * scale)
// summed in head order, each dot a sequential sum, then the top-k by score, ties by lower
// position. The backend interleaves eight keys' sums, splits a decoding row's keys over threads
// and selects by nth_element: none of that may change a selected position (duplicated keys make
// exact ties; the scores must keep their bits for the near ones).
TEST(Ops, IndexerSelectIsThePlainSelection) {
  auto be = make_cpu_backend();
  const int64_t N = 2003, nI = 4, d = 32, topk = 64;
  auto keys = random_vec(size_t(N * d), 31), q = random_vec(size_t(8 * nI * d), 32), w = random_vec(size_t(8 * nI), 33);
  for (int64_t u = 100; u < N; u += 97)  // copies of earlier keys: equal scores
    std::copy(keys.begin() + (u - 90) * d, keys.begin() + (u - 89) * d, keys.begin() + u * d);
  for (int64_t T : {1, 5, 8}) {
    const int64_t pos0 = N - T;
    std::vector<int32_t> sel(size_t(T * topk), -1), cnt(size_t(T), -1);
    IndexerArgs a = indexer_args(q, w, keys, T, nI, d, pos0, topk, 0.5f, sel, cnt);
    be->indexer_select(a);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = pos0 + t + 1;
      std::vector<float> score(static_cast<size_t>(n));
      for (int64_t u = 0; u < n; ++u) {
        float sc = 0;
        for (int64_t j = 0; j < nI; ++j) {
          float dt = 0;
          for (int64_t i = 0; i < d; ++i) dt += q[size_t((t * nI + j) * d + i)] * keys[size_t(u * d + i)];
          sc += (w[size_t(t * nI + j)] * 0.5f) * std::max(dt * a.scale, 0.0f);
        }
        score[size_t(u)] = sc;
      }
      std::vector<int32_t> order(static_cast<size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t x, int32_t y) { return score[size_t(x)] > score[size_t(y)]; });
      std::vector<int32_t> want(order.begin(), order.begin() + topk);
      std::sort(want.begin(), want.end());
      EXPECT_EQ(std::vector<int32_t>(sel.begin() + t * topk, sel.begin() + (t + 1) * topk), want)
          << "T " << T << " row " << t;
      EXPECT_EQ(cnt[size_t(t)], topk);
    }
  }
}

TEST(Ops, IndexerSelectsAllCausalKeysBelowTopk) {
  auto be = make_cpu_backend();
  const int64_t N = 6, T = 6, d = 4, topk = 4;
  auto keys = random_vec(static_cast<size_t>(N * d), 20), q = random_vec(static_cast<size_t>(T * 2 * d), 21), w = random_vec(static_cast<size_t>(T * 2), 22);
  std::vector<int32_t> sel(static_cast<size_t>(T * topk), -1), cnt(static_cast<size_t>(T));
  IndexerArgs a;
  a.q = q.data(); a.weights = w.data(); a.keys = keys.data();
  a.T = T; a.n_heads = 2; a.head_dim = d; a.n_keys = N; a.pos0 = 0; a.topk = topk; a.scale = 0.5f;
  a.selected = sel.data(); a.counts = cnt.data();
  be->indexer_select(a);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(cnt[size_t(t)], std::min<int64_t>(t + 1, topk));
    for (int64_t i = 0; i < cnt[size_t(t)]; ++i) {
      EXPECT_LE(sel[size_t(t * topk + i)], t);  // causal
      if (i) {
        EXPECT_LT(sel[size_t(t * topk + i - 1)], sel[size_t(t * topk + i)]);  // ascending
      }
    }
  }
}

namespace {
// Router weights that make logits equal to `target` for x = e_0 (one-hot input).
struct RouterFixture {
  std::vector<float> w;
  Weight gate;
  std::vector<float> x;
  RouterFixture(const std::vector<float>& logits, int64_t hidden = 4) : w(logits.size() * size_t(hidden), 0.0f) {
    for (size_t e = 0; e < logits.size(); ++e) w[e * size_t(hidden)] = logits[e];
    gate.w = Tensor(w.data(), DType::F32, {int64_t(logits.size()), hidden});
    x.assign(static_cast<size_t>(hidden), 0.0f);
    x[0] = 1.0f;
  }
};
}  // namespace

TEST(Ops, RoutingTiesPickLowerExpertAndWeightsUseUnbiasedScores) {
  auto be = make_cpu_backend();
  RouterFixture f({0.5f, 1.0f, 1.0f, 1.0f, -2.0f, 1.0f});
  std::vector<float> bias = {0, 0, 0, 0, 0, 0};
  RouterArgs a;
  a.gate = &f.gate; a.bias = bias.data(); a.n_experts = 6; a.top_k = 2; a.routed_scaling_factor = 2.5f;
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  be->moe_route(f.x.data(), 1, a, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2}));  // four-way tie at 1.0: lowest ids
  EXPECT_NEAR(w[0], 2.5f * 0.5f, 1e-6);           // equal p -> normalized 0.5 each, scaled
  // The bias steers selection only: expert 4 chosen, but weighted by its unbiased sigmoid.
  bias = {0, 0, 0, 0, 10.0f, 0};
  be->moe_route(f.x.data(), 1, a, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 4}));
  const double p1 = 1 / (1 + std::exp(-1.0)), p4 = 1 / (1 + std::exp(2.0));
  EXPECT_NEAR(w[1], 2.5 * p4 / (p1 + p4), 1e-6);
  a.norm_topk_prob = false;
  be->moe_route(f.x.data(), 1, a, ids.data(), w.data());
  EXPECT_NEAR(w[1], 2.5 * p4, 1e-6);
}

TEST(Ops, RoutingGroupLimit) {
  auto be = make_cpu_backend();
  // 4 groups of 2. Group sums of top-2: g0 = 1+1, g1 = 3+(-5), g2 = 0.9+0.9, g3 = 1+1 (tie with g0).
  // topk_group 2 keeps g0 and g3 (g0 wins the tie with g3? both 2.0: lower group id first, so g0
  // and g3 remain as the two best since g1=-2, g2=1.8). Expert 2 (score 3) is in a dropped group.
  std::vector<float> logits = {1, 1, 3, -5, 0.9f, 0.9f, 1, 1};
  for (float& v : logits) v = std::log(1.0f / (1.0f / (0.5f + v / 10.0f) - 1.0f));  // sigmoid(v') = 0.5 + v/10
  RouterFixture f(logits);
  std::vector<float> bias(8, 0.0f);
  RouterArgs a;
  a.gate = &f.gate; a.bias = bias.data(); a.n_experts = 8; a.n_group = 4; a.topk_group = 2; a.top_k = 3;
  std::vector<int32_t> ids(3);
  std::vector<float> w(3);
  be->moe_route(f.x.data(), 1, a, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 6}));
  a.topk_group = 4;  // no limit: expert 2 is the best
  be->moe_route(f.x.data(), 1, a, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 2}));
}

namespace {
// The grouping moe() did on the host before moe_group: per expert, tokens in order of (t, k).
void naive_group(const std::vector<int32_t>& ids, const std::vector<float>& w, int64_t N, int K, int E,
                 std::vector<int32_t>& offsets, std::vector<int32_t>& tok, std::vector<float>& wt) {
  std::vector<std::vector<int32_t>> t_of(static_cast<size_t>(E));
  std::vector<std::vector<float>> w_of(static_cast<size_t>(E));
  for (int64_t t = 0; t < N; ++t)
    for (int k = 0; k < K; ++k) {
      t_of[size_t(ids[size_t(t * K + k)])].push_back(int32_t(t));
      w_of[size_t(ids[size_t(t * K + k)])].push_back(w[size_t(t * K + k)]);
    }
  offsets.assign(1, 0);
  tok.clear();
  wt.clear();
  for (int e = 0; e < E; ++e) {
    tok.insert(tok.end(), t_of[size_t(e)].begin(), t_of[size_t(e)].end());
    wt.insert(wt.end(), w_of[size_t(e)].begin(), w_of[size_t(e)].end());
    offsets.push_back(int32_t(tok.size()));
  }
}
}  // namespace

TEST(Ops, MoeGroupIsAStableCountingSortByExpert) {
  auto be = make_cpu_backend();
  struct Cfg { int64_t N; int K, E; };
  for (Cfg cfg : {Cfg{1, 8, 256}, Cfg{33, 6, 64}, Cfg{100, 4, 3}, Cfg{257, 8, 16}, Cfg{5, 1, 1}}) {
    std::mt19937 rng(uint32_t(cfg.N * 31 + cfg.E));
    std::uniform_int_distribution<int> pick(0, cfg.E - 1);
    std::vector<int32_t> ids(size_t(cfg.N * cfg.K));
    for (int32_t& v : ids) v = pick(rng);  // repeats within a token too: the op must not care
    std::vector<float> w = random_vec(ids.size(), 7);
    std::vector<int32_t> want_off, want_tok;
    std::vector<float> want_w;
    naive_group(ids, w, cfg.N, cfg.K, cfg.E, want_off, want_tok, want_w);
    std::vector<int32_t> off(size_t(cfg.E + 1), -1), tok(ids.size(), -1);
    std::vector<float> wt(ids.size(), -1.0f);
    be->moe_group(ids.data(), w.data(), cfg.N, cfg.K, cfg.E, off.data(), tok.data(), wt.data());
    EXPECT_EQ(off, want_off) << "N " << cfg.N << " E " << cfg.E;
    EXPECT_EQ(tok, want_tok) << "N " << cfg.N << " E " << cfg.E;
    EXPECT_EQ(wt, want_w) << "N " << cfg.N << " E " << cfg.E;
  }
}

// The fused routed-experts op equals the grouped composition the forward pass uses otherwise
// (moe_group, then per expert gather, gate/up, swiglu, down, scatter_add in ascending id order).
TEST(Ops, MoeExpertsEqualsGroupedExperts) {
  auto be = make_cpu_backend();
  const int64_t N = 5, D = 24, I = 12;
  const int K = 3, E = 6;
  std::vector<std::vector<float>> data;
  ExpertBank bank;
  for (int e = 0; e < E; ++e) {
    data.push_back(random_vec(size_t(I * D), 100 + e, 0.3f));
    data.push_back(random_vec(size_t(I * D), 200 + e, 0.3f));
    data.push_back(random_vec(size_t(D * I), 300 + e, 0.3f));
  }
  for (int e = 0; e < E; ++e) {
    bank.gate.push_back(f32_weight(data[size_t(3 * e)], I, D));
    bank.up.push_back(f32_weight(data[size_t(3 * e + 1)], I, D));
    bank.down.push_back(f32_weight(data[size_t(3 * e + 2)], D, I));
  }
  auto x = random_vec(size_t(N * D), 7);
  // Ascending ids per token (as the router writes them), experts shared between tokens.
  std::vector<int32_t> ids = {0, 2, 5, 1, 2, 3, 0, 1, 5, 3, 4, 5, 2, 4, 5};
  auto w = random_vec(ids.size(), 8);
  std::vector<float> fused(size_t(N * D), -1.0f);
  be->moe_experts(x.data(), N, ids.data(), w.data(), K, bank, fused.data());

  std::vector<int32_t> off(size_t(E + 1)), tok(ids.size());
  std::vector<float> wt(ids.size()), want(size_t(N * D), 0.0f);
  be->moe_group(ids.data(), w.data(), N, K, E, off.data(), tok.data(), wt.data());
  for (int e = 0; e < E; ++e) {
    const int64_t at = off[size_t(e)], m = off[size_t(e) + 1] - at;
    if (m == 0) continue;
    std::vector<float> xs(size_t(m * D)), g(size_t(m * I)), u(size_t(m * I)), y(size_t(m * D));
    be->gather_rows(x.data(), &tok[size_t(at)], m, D, xs.data());
    be->matmul(xs.data(), m, bank.gate[size_t(e)], g.data());
    be->matmul(xs.data(), m, bank.up[size_t(e)], u.data());
    be->swiglu(g.data(), u.data(), g.data(), m * I);
    be->matmul(g.data(), m, bank.down[size_t(e)], y.data());
    be->scatter_add_rows(want.data(), &tok[size_t(at)], &wt[size_t(at)], y.data(), m, D);
  }
  EXPECT_LT(rel_l2(fused.data(), want.data(), want.size()), 1e-6);
  // A shared expert appended to the bank runs for every token with weight 1, summed last.
  data.push_back(random_vec(size_t(I * D), 400, 0.3f));
  data.push_back(random_vec(size_t(I * D), 401, 0.3f));
  data.push_back(random_vec(size_t(D * I), 402, 0.3f));
  ExpertBank with_shared = bank;
  with_shared.gate.push_back(f32_weight(data[size_t(3 * E)], I, D));
  with_shared.up.push_back(f32_weight(data[size_t(3 * E + 1)], I, D));
  with_shared.down.push_back(f32_weight(data[size_t(3 * E + 2)], D, I));
  with_shared.n_shared = 1;
  std::vector<float> fused_shared(want.size());
  be->moe_experts(x.data(), N, ids.data(), w.data(), K, with_shared, fused_shared.data());
  std::vector<float> g(size_t(N * I)), u(size_t(N * I)), ys(want.size());
  be->matmul(x.data(), N, with_shared.gate[size_t(E)], g.data());
  be->matmul(x.data(), N, with_shared.up[size_t(E)], u.data());
  be->swiglu(g.data(), u.data(), g.data(), N * I);
  be->matmul(g.data(), N, with_shared.down[size_t(E)], ys.data());
  be->add(want.data(), ys.data(), N * D);
  EXPECT_LT(rel_l2(fused_shared.data(), want.data(), want.size()), 1e-6);
  ids[4] = E;  // an id out of range is refused, naming the op
  EXPECT_THROW(be->moe_experts(x.data(), N, ids.data(), w.data(), K, bank, fused.data()), Error);
}

// The fused cache appends write exactly what norm + copy + rope wrote before, at the position
// given on the host or read from backend memory.
TEST(Ops, CacheAppendsEqualComposedOps) {
  auto be = make_cpu_backend();
  const int64_t T = 3, L = 16, rope = 8, kvw = L + rope, d = 12, cap = 10, pos0 = 4;
  auto kva = random_vec(size_t(T * kvw), 30), nw = random_vec(size_t(L), 31), cs = random_vec(size_t(T * rope), 32);
  auto k = random_vec(size_t(T * d), 33), lw = random_vec(size_t(d), 34), lb = random_vec(size_t(d), 35);
  for (RopeKind kind : {RopeKind::Interleaved, RopeKind::HalfSplit}) {
    std::vector<float> want(size_t(cap * kvw), 0.0f);
    float* e = want.data() + pos0 * kvw;
    be->rms_norm(kva.data(), kvw, T, L, nw.data(), 1e-6f, e, kvw);
    be->copy_rows(e + L, kvw, kva.data() + L, kvw, T, rope);
    be->rope(e, T, 1, kvw, kvw, L, rope, cs.data(), kind);
    std::vector<float> got(want.size(), 0.0f), got_dev(want.size(), 0.0f);
    be->mla_cache_append(kva.data(), T, L, rope, nw.data(), 1e-6f, cs.data(), kind, got.data(), pos0, nullptr);
    const int32_t pos_dev = int32_t(pos0);
    be->mla_cache_append(kva.data(), T, L, rope, nw.data(), 1e-6f, cs.data(), kind, got_dev.data(), 0, &pos_dev);
    EXPECT_EQ(got, want);
    EXPECT_EQ(got_dev, want);

    std::vector<float> kwant(size_t(cap * d), 0.0f), kgot(kwant.size(), 0.0f), kgot_dev(kwant.size(), 0.0f);
    be->layer_norm(k.data(), T, d, lw.data(), lb.data(), 1e-6f, kwant.data() + pos0 * d);
    be->rope(kwant.data() + pos0 * d, T, 1, d, d, 0, rope, cs.data(), kind);
    be->index_key_append(k.data(), T, d, lw.data(), lb.data(), 1e-6f, rope, cs.data(), kind, kgot.data(), pos0,
                         nullptr);
    be->index_key_append(k.data(), T, d, lw.data(), lb.data(), 1e-6f, rope, cs.data(), kind, kgot_dev.data(), 99,
                         &pos_dev);
    EXPECT_EQ(kgot, kwant);
    EXPECT_EQ(kgot_dev, kwant);
  }
}

// Attention and the indexer with pos0 read from backend memory (a recorded decode step, whose
// host-side pos0 / n_keys are only bounds) equal the same call with the true values.
TEST(Ops, RunTimePositionsEqualHostPositions) {
  auto be = make_cpu_backend();
  const int64_t H = 2, nope = 8, rope = 4, vd = 6, L = 10, N = 9, cap = 20, nI = 2, d = 8;
  auto q = random_vec(size_t(H * (nope + rope)), 40), kv = random_vec(size_t(cap * (L + rope)), 41);
  auto wkvb = random_vec(size_t(H * (nope + vd) * L), 42, 0.5f);
  Weight kvb = f32_weight(wkvb, H * (nope + vd), L);
  const int32_t pos_dev = int32_t(N - 1);
  MlaAttentionArgs a;
  a.q = q.data(); a.T = 1; a.n_heads = H; a.qk_nope = nope; a.qk_rope = rope; a.v_dim = vd; a.kv_lora = L;
  a.kv = kv.data(); a.n_keys = N; a.pos0 = N - 1; a.kv_b = &kvb; a.scale = 0.3f; a.absorbed = true;
  std::vector<float> want(size_t(H * vd)), got(want.size(), -1.0f);
  a.out = want.data();
  be->mla_attention(a);
  a.n_keys = cap;
  a.pos0 = cap - 1;
  a.pos0_dev = &pos_dev;
  a.out = got.data();
  be->mla_attention(a);
  EXPECT_EQ(got, want);

  auto iq = random_vec(size_t(nI * d), 43), iw = random_vec(size_t(nI), 44), keys = random_vec(size_t(cap * d), 45);
  IndexerArgs ia;
  ia.q = iq.data(); ia.weights = iw.data(); ia.keys = keys.data(); ia.T = 1; ia.n_heads = nI; ia.head_dim = d;
  ia.n_keys = N; ia.pos0 = N - 1; ia.topk = 4; ia.scale = 0.5f;
  std::vector<int32_t> sel(4, -1), cnt(1, -1), sel2(4, -2), cnt2(1, -2);
  ia.selected = sel.data(); ia.counts = cnt.data();
  be->indexer_select(ia);
  ia.n_keys = cap; ia.pos0 = cap - 1; ia.pos0_dev = &pos_dev;
  ia.selected = sel2.data(); ia.counts = cnt2.data();
  be->indexer_select(ia);
  EXPECT_EQ(cnt2, cnt);
  EXPECT_EQ(sel2, sel);
}

TEST(Ops, ArgmaxRowsTakesTheLowestIndexOnTies) {
  auto be = make_cpu_backend();
  std::vector<float> x = {1, 3, 3, 2, /**/ -5, -5, -7, -6, /**/ 0, 0, 0, 9};
  std::vector<int32_t> out(3, -1);
  be->argmax_rows(x.data(), 3, 4, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{1, 0, 3}));
}
