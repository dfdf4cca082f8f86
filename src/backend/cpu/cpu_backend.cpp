// The CPU reference backend. Straightforward loops in f32 (f64 only where a reduction is long and
// the oracle's order is unknowable anyway), parallel over independent rows/heads on the global
// thread pool. Every op's result is independent of the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend/backend.h"
#include "core/thread_pool.h"

namespace vireo {

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// y[c] += a * x[c] for c < n, four lanes at a time: each element's multiply and add as the scalar
// loop does them (the same bits). -O2 left these loops scalar, a load, multiply, add and store an
// element (aliasing): the absorbed attention's weighted sum of latents was one of its hot spots.
inline void axpy(float* __restrict y, const float* __restrict x, float a, int64_t n) {
  typedef float v4 __attribute__((vector_size(16)));
  const v4 av = {a, a, a, a};
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) {
    v4 xv, yv;
    std::memcpy(&xv, x + c, sizeof xv);
    std::memcpy(&yv, y + c, sizeof yv);
    yv = yv + av * xv;
    std::memcpy(y + c, &yv, sizeof yv);
  }
  for (; c < n; ++c) y[c] += a * x[c];
}

// out[k] = dot(q, rows[k], n) for k < 8, each in dot()'s order: eight chains in registers.
inline void dots8(const float* q, const float* const* rows, int64_t n, float* out) {
  const float *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3], *r4 = rows[4], *r5 = rows[5], *r6 = rows[6],
              *r7 = rows[7];
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
  for (int64_t c = 0; c < n; ++c) {
    const float x = q[c];
    s0 += x * r0[c];
    s1 += x * r1[c];
    s2 += x * r2[c];
    s3 += x * r3[c];
    s4 += x * r4[c];
    s5 += x * r5[c];
    s6 += x * r6[c];
    s7 += x * r7[c];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3, out[4] = s4, out[5] = s5, out[6] = s6, out[7] = s7;
}

// s[i] = (dot(qa, ka(u), na) + dot(qb, kb(u), nb)) * scale for the n keys u = list[i] (or i), each
// sum in dot()'s order, so the same bits as one key at a time, but eight keys' chains interleaved:
// one key's dot is a chain of dependent adds, latency-bound. (GLM-5 shapes, 2 layers, a 1.5k-token
// cache, 2 cores: the attention was over a third of a decode step, these sums and axpy's its hot
// spots; with both, decode 4.7 -> 6.2 tok/s, BENCHMARKS "The CPU attention's inner loops".)
template <class KeyA, class KeyB>
void key_scores(const float* qa, int64_t na, const float* qb, int64_t nb, KeyA ka, KeyB kb, const int32_t* list,
                int64_t n, float scale, float* s) {
  constexpr int kKeys = 8;
  int64_t i = 0;
  for (; i + kKeys <= n; i += kKeys) {
    const float* ra[kKeys];
    const float* rb[kKeys];
    for (int k = 0; k < kKeys; ++k) {
      const int64_t u = list ? list[i + k] : i + k;
      ra[k] = ka(u);
      rb[k] = kb(u);
    }
    float sa[kKeys], sb[kKeys];
    dots8(qa, ra, na, sa);
    dots8(qb, rb, nb, sb);
    for (int k = 0; k < kKeys; ++k) s[i + k] = (sa[k] + sb[k]) * scale;
  }
  for (; i < n; ++i) {
    const int64_t u = list ? list[i] : i;
    s[i] = (dot(qa, ka(u), na) + dot(qb, kb(u), nb)) * scale;
  }
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int64_t moe_experts_max_tokens) : moe_experts_max_tokens_(moe_experts_max_tokens) {}
  const char* name() const override { return "cpu"; }
  ThreadPool& pool() { return ThreadPool::global(); }

  std::shared_ptr<float> alloc_f32(size_t n) override {
    size_t bytes = (std::max<size_t>(n, 1) * sizeof(float) + 63) / 64 * 64;
    float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (!p) fail("out of memory allocating ", bytes, " bytes of activations");
    std::memset(p, 0, bytes);
    return std::shared_ptr<float>(p, [](float* q) { std::free(q); });
  }
  std::shared_ptr<int32_t> alloc_i32(size_t n) override {
    auto f = alloc_f32(n);  // same size and alignment
    return std::shared_ptr<int32_t>(f, reinterpret_cast<int32_t*>(f.get()));
  }
  void copy_to_host(float* dst, const float* src, size_t n) override { std::memcpy(dst, src, n * 4); }
  void copy_from_host(float* dst, const float* src, size_t n) override { std::memcpy(dst, src, n * 4); }
  void copy_to_host_i32(int32_t* dst, const int32_t* src, size_t n) override { std::memcpy(dst, src, n * 4); }
  void copy_from_host_i32(int32_t* dst, const int32_t* src, size_t n) override { std::memcpy(dst, src, n * 4); }
  void copy_rows(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t n) override {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ds, src + r * ss, size_t(n) * sizeof(float));
  }
  void fill(float* y, float v, int64_t n) override { std::fill(y, y + n, v); }

  void embed(const Weight& table, const int32_t* ids, int64_t T, float* out) override {
    const int64_t n = table.in();
    for (int64_t t = 0; t < T; ++t) {
      if (ids[t] < 0 || ids[t] >= table.out())
        fail("token id ", ids[t], " is out of range (vocab size ", table.out(), ")");
      cpu_dequantize_row(table, ids[t], out + t * n);
    }
  }

  void rms_norm(const float* x, int64_t xs, int64_t T, int64_t n, const float* w, float eps, float* y,
                int64_t ys) override {
    for (int64_t t = 0; t < T; ++t) {
      const float* xr = x + t * xs;
      float* yr = y + t * ys;
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
      float inv = 1.0f / std::sqrt(float(ss / double(n)) + eps);
      for (int64_t i = 0; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
    }
  }

  void layer_norm(const float* x, int64_t T, int64_t n, const float* w, const float* b, float eps,
                  float* y) override {
    for (int64_t t = 0; t < T; ++t) {
      const float* xr = x + t * n;
      float* yr = y + t * n;
      double mean = 0, var = 0;
      for (int64_t i = 0; i < n; ++i) mean += xr[i];
      mean /= double(n);
      for (int64_t i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean);
      var /= double(n);
      float inv = float(1.0 / std::sqrt(var + eps));
      for (int64_t i = 0; i < n; ++i) yr[i] = float(xr[i] - mean) * inv * w[i] + b[i];
    }
  }

  void matmul(const float* x, int64_t T, const Weight& w, float* y) override { cpu_matmul(x, T, w, y, pool()); }

  void rope(float* x, int64_t T, int64_t H, int64_t ts, int64_t hs, int64_t offset, int64_t width,
            const float* cs, RopeKind kind) override {
    const int64_t half = width / 2;
    std::vector<float> tmp(static_cast<size_t>(width));
    for (int64_t t = 0; t < T; ++t) {
      const float* c = cs + t * width;  // [half, 2] (cos, sin)
      for (int64_t h = 0; h < H; ++h) {
        float* v = x + t * ts + h * hs + offset;
        if (kind == RopeKind::Interleaved) {
          for (int64_t i = 0; i < half; ++i) {
            float a = v[2 * i], b = v[2 * i + 1], co = c[2 * i], si = c[2 * i + 1];
            tmp[size_t(i)] = a * co - b * si;
            tmp[size_t(half + i)] = b * co + a * si;
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            float a = v[i], b = v[half + i], co = c[2 * i], si = c[2 * i + 1];
            tmp[size_t(i)] = a * co - b * si;
            tmp[size_t(half + i)] = b * co + a * si;
          }
        }
        std::memcpy(v, tmp.data(), size_t(width) * 4);
      }
    }
  }

  void add(float* y, const float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] += x[i];
  }
  void scale(float* y, float s, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] *= s;
  }
  void swiglu(const float* gate, const float* up, float* out, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
  }

  void mla_cache_append(const float* kva, int64_t T, int64_t L, int64_t rope_w, const float* norm_w, float eps,
                        const float* cs, RopeKind kind, float* cache, int64_t pos0, const int32_t* pos0_dev) override {
    const int64_t kvw = L + rope_w;
    float* entry = cache + (pos0_dev ? *pos0_dev : pos0) * kvw;
    rms_norm(kva, kvw, T, L, norm_w, eps, entry, kvw);
    copy_rows(entry + L, kvw, kva + L, kvw, T, rope_w);
    rope(entry, T, 1, kvw, kvw, L, rope_w, cs, kind);
  }
  void index_key_append(const float* k, int64_t T, int64_t d, const float* w, const float* b, float eps,
                        int64_t rope_w, const float* cs, RopeKind kind, float* keys, int64_t pos0,
                        const int32_t* pos0_dev) override {
    float* dst = keys + (pos0_dev ? *pos0_dev : pos0) * d;
    layer_norm(k, T, d, w, b, eps, dst);
    rope(dst, T, 1, d, d, 0, rope_w, cs, kind);
  }

  void mla_attention(const MlaAttentionArgs& args) override {
    MlaAttentionArgs a = args;
    if (a.pos0_dev) {  // host memory here: resolve the run-time position
      a.pos0 = *a.pos0_dev;
      a.n_keys = a.pos0 + a.T;
    }
    if (a.absorbed) attention_absorbed(a);
    else attention_reconstructed(a);
  }

  void moe_experts(const float* x, int64_t N, const int32_t* ids, const float* weights, int top_k,
                   const ExpertBank& bank, float* out) override {
    const int64_t D = bank.down.empty() ? 0 : bank.down[0].out(), I = bank.gate.empty() ? 0 : bank.gate[0].out();
    std::vector<float> g(static_cast<size_t>(I)), u(static_cast<size_t>(I)), y(static_cast<size_t>(D));
    const int64_t n_routed = int64_t(bank.gate.size()) - bank.n_shared;
    std::fill(out, out + N * D, 0.0f);
    for (int64_t t = 0; t < N; ++t)
      for (int k = 0; k < top_k + bank.n_shared; ++k) {
        const int32_t e = k < top_k ? ids[t * top_k + k] : int32_t(n_routed + (k - top_k));
        if (e < 0 || (k < top_k && e >= n_routed))
          fail("moe_experts: expert id ", e, " out of range [0, ", n_routed, ")");
        cpu_matmul(x + t * D, 1, bank.gate[size_t(e)], g.data(), pool());
        cpu_matmul(x + t * D, 1, bank.up[size_t(e)], u.data(), pool());
        swiglu(g.data(), u.data(), g.data(), I);
        cpu_matmul(g.data(), 1, bank.down[size_t(e)], y.data(), pool());
        const float s = k < top_k ? weights[t * top_k + k] : 1.0f;
        float* o = out + t * D;
        for (int64_t j = 0; j < D; ++j) o[j] += s * y[size_t(j)];
      }
  }

  bool prefers_moe_experts(int64_t N) const override { return N <= moe_experts_max_tokens_; }

  void argmax_rows(const float* x, int64_t rows, int64_t n, int32_t* out) override {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * n;
      int64_t best = 0;
      for (int64_t i = 1; i < n; ++i)
        if (xr[i] > xr[best]) best = i;
      out[r] = int32_t(best);
    }
  }

  void sample_rows(const float* x, int64_t rows, int64_t n, const SampleRowArgs* args, int32_t* out) override {
    for (int64_t r = 0; r < rows; ++r) validate_sample_row_args(args[r], r);
    // Rows over the threads (a batch's sampled rows: ~2 ms each at GLM-5's vocabulary), each
    // thread with its own buffers; a row's token does not depend on which thread draws it.
    if (int(sample_ws_.size()) < pool().size()) sample_ws_.resize(size_t(pool().size()));
    pool().parallel_for(rows, [&](int64_t b, int64_t e, int thread) {
      for (int64_t r = b; r < e; ++r) out[r] = sample_row(x + r * n, n, args[r], sample_ws_[size_t(thread)]);
    });
  }

  // Each key's score is its heads' w_j * relu(dot(q_j, k) * scale) summed in head order, each dot
  // in dot()'s order (the exact CUDA kernel reproduces these bits), eight keys' chains at a time.
  // Decode (fewer rows than threads) splits a row's keys over the threads; prefill splits rows.
  void indexer_select(const IndexerArgs& args) override {
    IndexerArgs a = args;
    if (a.pos0_dev) {
      a.pos0 = *a.pos0_dev;
      a.n_keys = a.pos0 + a.T;
    }
    auto score_keys = [&a](int64_t t, int64_t u0, int64_t u1, float* score) {
      const float* qt = a.q + t * a.n_heads * a.head_dim;
      const float* wt = a.weights + t * a.n_heads;
      const int64_t hd = a.head_dim;
      int64_t u = u0;
      for (; u + 8 <= u1; u += 8) {
        const float* rows[8];
        for (int k = 0; k < 8; ++k) rows[k] = a.keys + (u + k) * hd;
        float s[8] = {0, 0, 0, 0, 0, 0, 0, 0}, d[8];
        for (int64_t j = 0; j < a.n_heads; ++j) {
          dots8(qt + j * hd, rows, hd, d);
          const float w = wt[j] * a.weight_scale;
          for (int k = 0; k < 8; ++k) s[k] += w * std::max(d[k] * a.scale, 0.0f);
        }
        std::copy(s, s + 8, score + u);
      }
      for (; u < u1; ++u) {
        const float* k = a.keys + u * hd;
        float s = 0;
        for (int64_t j = 0; j < a.n_heads; ++j) {
          float d = dot(qt + j * hd, k, hd) * a.scale;
          const float w = wt[j] * a.weight_scale;
          s += w * std::max(d, 0.0f);
        }
        score[u] = s;
      }
    };
    // The top-k of the row's causal scores: higher first, equal scores by lower position (one strict
    // order, so the set nth_element leaves first is the one set), written in ascending position.
    auto select = [&a](int64_t t, const float* score, std::vector<int32_t>& order) {
      const int64_t n_causal = a.pos0 + t + 1;
      order.resize(size_t(n_causal));
      std::iota(order.begin(), order.end(), 0);
      std::nth_element(order.begin(), order.begin() + (a.topk - 1), order.end(),
                       [&](int32_t x, int32_t y) { return score[x] != score[y] ? score[x] > score[y] : x < y; });
      int32_t* sel = a.selected + t * a.topk;
      std::copy(order.begin(), order.begin() + a.topk, sel);
      std::sort(sel, sel + a.topk);
      a.counts[t] = int32_t(a.topk);
    };
    auto dense = [&a](int64_t t) {  // every causal key: sparse equals dense
      const int64_t n_causal = a.pos0 + t + 1;
      if (n_causal > a.topk) return false;
      for (int64_t u = 0; u < n_causal; ++u) a.selected[t * a.topk + u] = int32_t(u);
      a.counts[t] = int32_t(n_causal);
      return true;
    };
    if (a.T < pool().size()) {
      std::vector<float> score(static_cast<size_t>(a.n_keys));
      std::vector<int32_t> order;
      for (int64_t t = 0; t < a.T; ++t) {
        if (dense(t)) continue;
        pool().parallel_for(
            a.pos0 + t + 1, [&](int64_t b, int64_t e, int) { score_keys(t, b, e, score.data()); }, 64);
        select(t, score.data(), order);
      }
      return;
    }
    pool().parallel_for(a.T, [&](int64_t b, int64_t e, int) {
      std::vector<float> score(static_cast<size_t>(a.n_keys));
      std::vector<int32_t> order;
      for (int64_t t = b; t < e; ++t) {
        if (dense(t)) continue;
        score_keys(t, 0, a.pos0 + t + 1, score.data());
        select(t, score.data(), order);
      }
    });
  }

  void moe_route(const float* x, int64_t T, const RouterArgs& a, int32_t* ids, float* weights) override {
    const int E = a.n_experts, G = a.n_group, per_group = E / G;
    std::vector<float> logits(static_cast<size_t>(T * E));
    cpu_matmul(x, T, *a.gate, logits.data(), pool());
    std::vector<float> p(static_cast<size_t>(E)), choice(static_cast<size_t>(E)), gscore(static_cast<size_t>(G));
    std::vector<int> order(static_cast<size_t>(std::max(E, G)));
    for (int64_t t = 0; t < T; ++t) {
      for (int e = 0; e < E; ++e) {
        p[size_t(e)] = 1.0f / (1.0f + std::exp(-logits[size_t(t * E + e)]));
        choice[size_t(e)] = p[size_t(e)] + (a.bias ? a.bias[e] : 0.0f);
      }
      if (G > 1) {
        for (int g = 0; g < G; ++g) {  // group score: sum of its top-2 selection scores
          float m1 = -INFINITY, m2 = -INFINITY;
          for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
            float v = choice[size_t(e)];
            if (v > m1) { m2 = m1; m1 = v; } else if (v > m2) { m2 = v; }
          }
          gscore[size_t(g)] = per_group >= 2 ? m1 + m2 : m1;
        }
        std::iota(order.begin(), order.begin() + G, 0);
        std::stable_sort(order.begin(), order.begin() + G,
                         [&](int x, int y) { return gscore[size_t(x)] > gscore[size_t(y)]; });
        std::vector<bool> keep(static_cast<size_t>(G), false);
        for (int i = 0; i < a.topk_group; ++i) keep[size_t(order[size_t(i)])] = true;
        for (int e = 0; e < E; ++e)
          if (!keep[size_t(e / per_group)]) choice[size_t(e)] = -INFINITY;
      }
      std::iota(order.begin(), order.begin() + E, 0);
      // Highest selection score first; ties: lower expert id.
      std::stable_sort(order.begin(), order.begin() + E,
                       [&](int x, int y) { return choice[size_t(x)] > choice[size_t(y)]; });
      int32_t* id = ids + t * a.top_k;
      for (int k = 0; k < a.top_k; ++k) id[k] = order[size_t(k)];
      std::sort(id, id + a.top_k);
      float sum = 0;
      for (int k = 0; k < a.top_k; ++k) sum += p[size_t(id[k])];
      float* w = weights + t * a.top_k;
      for (int k = 0; k < a.top_k; ++k) {
        float v = p[size_t(id[k])];
        if (a.norm_topk_prob) v /= (sum + 1e-20f);
        w[k] = v * a.routed_scaling_factor;
      }
    }
  }

  void moe_group(const int32_t* ids, const float* weights, int64_t N, int top_k, int n_experts, int32_t* offsets,
                 int32_t* token_of, float* weight_of) override {
    const int64_t S = N * top_k;
    std::fill(offsets, offsets + n_experts + 1, 0);
    for (int64_t i = 0; i < S; ++i) {
      if (ids[i] < 0 || ids[i] >= n_experts) fail("moe_group: expert id ", ids[i], " out of range [0, ", n_experts, ")");
      ++offsets[ids[i] + 1];
    }
    for (int e = 0; e < n_experts; ++e) offsets[e + 1] += offsets[e];
    std::vector<int32_t> next(offsets, offsets + n_experts);
    for (int64_t i = 0; i < S; ++i) {  // slots in order: stable
      const int32_t at = next[size_t(ids[i])]++;
      token_of[at] = int32_t(i / top_k);
      weight_of[at] = weights[i];
    }
  }

  void gather_rows(const float* x, const int32_t* index, int64_t m, int64_t n, float* rows) override {
    for (int64_t i = 0; i < m; ++i) std::memcpy(rows + i * n, x + int64_t(index[i]) * n, size_t(n) * 4);
  }
  void scatter_add_rows(float* y, const int32_t* index, const float* s, const float* rows, int64_t m,
                        int64_t n) override {
    for (int64_t i = 0; i < m; ++i) {
      float* yr = y + int64_t(index[i]) * n;
      const float* r = rows + i * n;
      axpy(yr, r, s[i], n);
    }
  }

 private:
  std::vector<SampleWorkspace> sample_ws_;  // sample_rows' buffers a thread, reused across calls
  int64_t moe_experts_max_tokens_ = 0;

  // Keys query t attends to: the selection, or every causal key.
  static int64_t keys_for(const MlaAttentionArgs& a, int64_t t, const int32_t** list) {
    if (a.selection.keys) {
      *list = a.selection.keys + t * a.selection.stride;
      return a.selection.counts[t];
    }
    *list = nullptr;
    return a.pos0 + t + 1;
  }

  static void softmax_inplace(float* s, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
    float sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - m);
      sum += s[i];
    }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }

  // Reconstructed path: expand every key's latent through kv_b into per-head k_nope and v, then
  // ordinary attention with key = [k_nope | k_rope].
  void attention_reconstructed(const MlaAttentionArgs& a) {
    const int64_t H = a.n_heads, nope = a.qk_nope, rope = a.qk_rope, vd = a.v_dim, L = a.kv_lora;
    const int64_t N = a.n_keys, kvw = L + rope, qw = nope + rope, hw = nope + vd;
    std::vector<float> latent(static_cast<size_t>(N * L));
    for (int64_t u = 0; u < N; ++u) std::memcpy(&latent[size_t(u * L)], a.kv + u * kvw, size_t(L) * 4);
    std::vector<float> kvx(static_cast<size_t>(N * H * hw));  // [N, H, nope + v]
    cpu_matmul(latent.data(), N, *a.kv_b, kvx.data(), pool());
    pool().parallel_for(a.T * H, [&](int64_t b, int64_t e, int) {
      std::vector<float> s(static_cast<size_t>(N));
      for (int64_t th = b; th < e; ++th) {
        const int64_t t = th / H, h = th % H;
        const float* q = a.q + (t * H + h) * qw;
        const int32_t* list;
        const int64_t n = keys_for(a, t, &list);
        key_scores(
            q, nope, q + nope, rope, [&](int64_t u) { return &kvx[size_t((u * H + h) * hw)]; },
            [&](int64_t u) { return a.kv + u * kvw + L; }, list, n, a.scale, s.data());
        softmax_inplace(s.data(), n);
        float* o = a.out + (t * H + h) * vd;
        std::fill(o, o + vd, 0.0f);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t u = list ? list[i] : i;
          const float* v = &kvx[size_t((u * H + h) * hw + nope)];
          const float p = s[size_t(i)];
          axpy(o, v, p, vd);
        }
      }
    });
  }

  // Absorbed path: fold W_UK into the query and W_UV after the weighted sum, so attention runs
  // directly over the cached latents (MQA with one kv_lora + rope wide key head).
  void attention_absorbed(const MlaAttentionArgs& a) {
    const int64_t H = a.n_heads, nope = a.qk_nope, rope = a.qk_rope, vd = a.v_dim, L = a.kv_lora;
    const int64_t kvw = L + rope, qw = nope + rope, hw = nope + vd;
    pool().parallel_for(H, [&](int64_t hb, int64_t he, int) {
      std::vector<float> wrow(static_cast<size_t>(8 * L)), qlat(static_cast<size_t>(L)), olat(static_cast<size_t>(L)),
          s(static_cast<size_t>(a.n_keys));
      std::vector<float> w_uk(static_cast<size_t>(nope * L));
      for (int64_t h = hb; h < he; ++h) {
        for (int64_t i = 0; i < nope; ++i) cpu_dequantize_row(*a.kv_b, h * hw + i, &w_uk[size_t(i * L)]);
        for (int64_t t = 0; t < a.T; ++t) {
          const float* q = a.q + (t * H + h) * qw;
          std::fill(qlat.begin(), qlat.end(), 0.0f);
          for (int64_t i = 0; i < nope; ++i) {  // q_lat = W_UK^T q_nope
            const float qi = q[i];
            const float* wr = &w_uk[size_t(i * L)];
            axpy(qlat.data(), wr, qi, L);
          }
          const int32_t* list;
          const int64_t n = keys_for(a, t, &list);
          key_scores(
              qlat.data(), L, q + nope, rope, [&](int64_t u) { return a.kv + u * kvw; },
              [&](int64_t u) { return a.kv + u * kvw + L; }, list, n, a.scale, s.data());
          softmax_inplace(s.data(), n);
          std::fill(olat.begin(), olat.end(), 0.0f);
          for (int64_t i = 0; i < n; ++i) {
            const int64_t u = list ? list[i] : i;
            const float* kv = a.kv + u * kvw;
            const float p = s[size_t(i)];
            axpy(olat.data(), kv, p, L);
          }
          float* o = a.out + (t * H + h) * vd;
          int64_t j = 0;
          for (; j + 8 <= vd; j += 8) {  // o = W_UV o_lat, eight rows at a time (dots8: the same sums)
            const float* rows[8];
            for (int k = 0; k < 8; ++k) {
              cpu_dequantize_row(*a.kv_b, h * hw + nope + j + k, &wrow[size_t(k * L)]);
              rows[k] = &wrow[size_t(k * L)];
            }
            dots8(olat.data(), rows, L, o + j);
          }
          for (; j < vd; ++j) {
            cpu_dequantize_row(*a.kv_b, h * hw + nope + j, wrow.data());
            o[j] = dot(wrow.data(), olat.data(), L);
          }
        }
      }
    });
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int64_t moe_experts_max_tokens) {
  return std::make_unique<CpuBackend>(moe_experts_max_tokens);
}

}  // namespace vireo
