#include "model/glm_dsa/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace vireo {

namespace {

RopeKind rope_kind(RopeStyle s) { return s == RopeStyle::Interleaved ? RopeKind::Interleaved : RopeKind::HalfSplit; }

// inv_freq as transformers computes it in float32 (default and YaRN rope), spec §3.4.
std::vector<float> compute_inv_freq(const GlmDsaConfig& c) {
  const int64_t dim = c.qk_rope_dim, half = dim / 2;
  const float base = float(c.rope.theta);
  std::vector<float> pos_freq(static_cast<size_t>(half)), inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    pos_freq[size_t(i)] = std::pow(base, float(2 * i) / float(dim));
    inv[size_t(i)] = 1.0f / pos_freq[size_t(i)];
  }
  if (!c.rope.yarn) return inv;
  const RopeConfig& r = c.rope;
  auto correction_dim = [&](double rot) {
    return (double(dim) * std::log(r.original_max_position / (rot * 2 * M_PI))) / (2 * std::log(r.theta));
  };
  double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(dim - 1));
  if (low == high) high += 0.001;  // as transformers: avoid a zero-width ramp
  for (int64_t i = 0; i < half; ++i) {
    float ramp = (float(i) - float(low)) / float(high - low);
    ramp = std::clamp(ramp, 0.0f, 1.0f);
    const float extrapolation = 1.0f - ramp;
    const float inter = 1.0f / (float(r.factor) * pos_freq[size_t(i)]);
    inv[size_t(i)] = inter * (1.0f - extrapolation) + inv[size_t(i)] * extrapolation;
  }
  return inv;
}

}  // namespace

GlmDsaModel::GlmDsaModel(GlmDsaConfig config, std::unique_ptr<Checkpoint> ck, Backend& backend)
    : config_(std::move(config)), checkpoint_(std::move(ck)), backend_(backend) {}

std::unique_ptr<GlmDsaModel> GlmDsaModel::load(const std::string& dir, Backend& backend,
                                               std::unique_ptr<ExpertStore> experts) {
  GlmDsaConfig config = load_glm_dsa_config(dir);
  return create(std::move(config), Checkpoint::open(dir), backend, std::move(experts));
}

std::unique_ptr<GlmDsaModel> GlmDsaModel::create(GlmDsaConfig config, std::unique_ptr<Checkpoint> ck,
                                                 Backend& backend, std::unique_ptr<ExpertStore> experts) {
  std::unique_ptr<GlmDsaModel> m(new GlmDsaModel(std::move(config), std::move(ck), backend));
  const GlmDsaConfig& c = m->config_;
  m->weights_ = bind_glm_dsa_weights(*m->checkpoint_, c);
  if (experts) {
    m->experts_ = std::move(experts);
  } else {
    std::vector<bool> moe_layers;
    for (bool d : c.layer_dense) moe_layers.push_back(!d);
    m->experts_ = std::make_unique<ResidentExpertStore>(*m->checkpoint_, moe_layers, c.n_routed_experts,
                                                        c.hidden_size, c.moe_intermediate_size);
  }
  m->inv_freq_ = compute_inv_freq(c);
  return m;
}

MlaCacheShape GlmDsaModel::cache_shape() const {
  MlaCacheShape s;
  s.n_layers = config_.num_layers;
  s.kv_dim = config_.kv_cache_dim();
  s.index_dim = config_.has_indexer ? config_.index_head_dim : 0;
  for (int l = 0; l < config_.num_layers; ++l)
    s.has_index.push_back(config_.has_indexer && config_.indexer_full[size_t(l)]);
  return s;
}

size_t GlmDsaModel::active_weight_bytes_per_token() {
  const GlmDsaConfig& c = config_;
  // Every dense matrix is read once per token, except the embedding table (one row).
  size_t n = weights_.dense_bytes - weights_.embed.nbytes() + weights_.embed.nbytes() / size_t(c.vocab_size);
  if (weights_.lm_head.w.data == weights_.embed.w.data) n += weights_.lm_head.nbytes();  // tied
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.layer_dense[size_t(l)]) continue;
    const ExpertWeights* e = experts_->prepare(l, {0})[0];  // all experts of a layer have one size
    n += size_t(c.experts_per_token) * e->nbytes();
  }
  return n;
}

float* GlmDsaModel::scratch(int slot, size_t n) {
  if (static_cast<size_t>(slot) >= scratch_.size()) {
    scratch_.resize(static_cast<size_t>(slot) + 1);
    scratch_size_.resize(static_cast<size_t>(slot) + 1, 0);
  }
  if (scratch_size_[size_t(slot)] < n) {
    scratch_[size_t(slot)] = backend_.alloc_f32(n);
    scratch_size_[size_t(slot)] = n;
  }
  return scratch_[size_t(slot)].get();
}

void GlmDsaModel::rope_table(int64_t pos0, int64_t T, float* cs) const {
  const int64_t half = config_.qk_rope_dim / 2;
  const float af = float(config_.rope.attention_factor);
  for (int64_t t = 0; t < T; ++t) {
    const float pos = float(pos0 + t);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq_[size_t(i)];
      cs[(t * half + i) * 2] = float(std::cos(double(angle))) * af;
      cs[(t * half + i) * 2 + 1] = float(std::sin(double(angle))) * af;
    }
  }
}

void GlmDsaModel::forward(const int32_t* tokens, int64_t T, MlaCache& cache, int row, float* logits,
                          bool all_logits, AttentionPath path) {
  const GlmDsaConfig& c = config_;
  const int64_t D = c.hidden_size;
  const int64_t pos0 = cache.length(row);
  if (T <= 0) fail("forward: no tokens");
  if (pos0 + T > cache.capacity())
    fail("context full: ", pos0 + T, " tokens exceed the context capacity of ", cache.capacity());
  for (int64_t t = 0; t < T; ++t)
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size)
      fail("token id ", tokens[t], " is out of range (vocab size ", c.vocab_size, ")");
  if (path == AttentionPath::Auto) path = T == 1 ? AttentionPath::Absorbed : AttentionPath::Reconstructed;

  float* h = scratch(0, size_t(T * D));    // residual stream [T, D]
  float* xn = scratch(1, size_t(T * D));   // normed input    [T, D]
  float* out = scratch(2, size_t(T * D));  // sublayer output [T, D]
  backend_.embed(weights_.embed, tokens, T, h);
  cache.set_length(row, pos0 + T);  // entries for the new positions are written layer by layer
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = weights_.layers[size_t(l)];
    backend_.rms_norm(h, D, T, D, L.attn_norm.data(), float(c.rms_norm_eps), xn, D);
    attention(l, xn, T, cache, row, pos0, path, out);
    backend_.add(h, out, T * D);
    backend_.rms_norm(h, D, T, D, L.ffn_norm.data(), float(c.rms_norm_eps), xn, D);
    if (L.dense) mlp(L.mlp, xn, T, out);
    else moe(l, xn, T, out);
    backend_.add(h, out, T * D);
  }
  const int64_t first = all_logits ? 0 : T - 1, n_out = T - first;
  backend_.rms_norm(h + first * D, D, n_out, D, weights_.final_norm.data(), float(c.rms_norm_eps), xn, D);
  float* lg = scratch(3, size_t(n_out * c.vocab_size));
  backend_.matmul(xn, n_out, weights_.lm_head, lg);
  backend_.copy_to_host(logits, lg, size_t(n_out * c.vocab_size));
}

void GlmDsaModel::attention(int layer, float* xn, int64_t T, MlaCache& cache, int row, int64_t pos0,
                            AttentionPath path, float* out) {
  const GlmDsaConfig& c = config_;
  const AttentionWeights& a = weights_.layers[size_t(layer)].attn;
  const int64_t H = c.n_heads, nope = c.qk_nope_dim, rope = c.qk_rope_dim, qw = c.qk_head_dim();
  const int64_t L = c.kv_lora_rank, kvw = c.kv_cache_dim(), half = rope / 2;
  const float eps_lora = 1e-6f;  // the oracle's q_a_layernorm / kv_a_layernorm ignore rms_norm_eps

  float* cs = scratch(10, size_t(T * half * 2));
  rope_table(pos0, T, cs);

  // Queries: [T, H, nope + rope].
  float* q = scratch(11, size_t(T * H * qw));
  float* q_resid = nullptr;
  if (c.q_lora_rank > 0) {
    float* qa = scratch(12, size_t(T * c.q_lora_rank));
    q_resid = scratch(13, size_t(T * c.q_lora_rank));
    backend_.matmul(xn, T, a.q_a_proj, qa);
    backend_.rms_norm(qa, c.q_lora_rank, T, c.q_lora_rank, a.q_a_norm.data(), eps_lora, q_resid, c.q_lora_rank);
    backend_.matmul(q_resid, T, a.q_b_proj, q);
  } else {
    backend_.matmul(xn, T, a.q_proj, q);
  }
  backend_.rope(q, T, H, H * qw, qw, nope, rope, cs, rope_kind(c.mla_rope_style));

  // This step's cache entries [latent | k_rope], written straight into the cache row.
  float* kv_row = cache.kv(layer, row);
  float* kva = scratch(14, size_t(T * kvw));
  backend_.matmul(xn, T, a.kv_a_proj, kva);
  float* entry = kv_row + pos0 * kvw;
  backend_.rms_norm(kva, kvw, T, L, a.kv_a_norm.data(), eps_lora, entry, kvw);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(entry + t * kvw + L, kva + t * kvw + L, size_t(rope) * sizeof(float));
  backend_.rope(entry, T, 1, kvw, kvw, L, rope, cs, rope_kind(c.mla_rope_style));

  // DSA: this layer's own top-k selection, or the previous full layer's.
  KeySelection sel;
  if (c.has_indexer) {
    const int64_t topk = c.index_topk;
    if (a.has_indexer) {
      const int64_t nI = c.index_n_heads, d = c.index_head_dim;
      float* qi = scratch(15, size_t(T * nI * d));
      backend_.matmul(q_resid, T, a.idx_wq_b, qi);
      backend_.rope(qi, T, nI, nI * d, d, 0, rope, cs, rope_kind(c.indexer_rope_style));
      float* kraw = scratch(16, size_t(T * d));
      backend_.matmul(xn, T, a.idx_wk, kraw);
      float* keys = cache.index_keys(layer, row);
      backend_.layer_norm(kraw, T, d, a.idx_k_norm_w.data(), a.idx_k_norm_b.data(), 1e-6f, keys + pos0 * d);
      backend_.rope(keys + pos0 * d, T, 1, d, d, 0, rope, cs, rope_kind(c.indexer_rope_style));
      float* wts = scratch(17, size_t(T * nI));
      backend_.matmul(xn, T, a.idx_weights_proj, wts);
      backend_.scale(wts, float(1.0 / std::sqrt(double(nI))), T * nI);
      selected_.resize(static_cast<size_t>(T * topk));
      selected_count_.resize(static_cast<size_t>(T));
      IndexerArgs ia;
      ia.q = qi;
      ia.weights = wts;
      ia.keys = keys;
      ia.T = T;
      ia.n_heads = nI;
      ia.head_dim = d;
      ia.n_keys = pos0 + T;
      ia.pos0 = pos0;
      ia.topk = topk;
      ia.scale = float(1.0 / std::sqrt(double(d)));
      ia.selected = selected_.data();
      ia.counts = selected_count_.data();
      backend_.indexer_select(ia);
    }
    sel.keys = selected_.data();
    sel.counts = selected_count_.data();
    sel.stride = topk;
  }

  float* o = scratch(18, size_t(T * H * c.v_head_dim));
  MlaAttentionArgs ma;
  ma.q = q;
  ma.T = T;
  ma.n_heads = H;
  ma.qk_nope = nope;
  ma.qk_rope = rope;
  ma.v_dim = c.v_head_dim;
  ma.kv_lora = L;
  ma.kv = kv_row;
  ma.n_keys = pos0 + T;
  ma.pos0 = pos0;
  ma.kv_b = &a.kv_b_proj;
  ma.scale = float(c.attention_scale());
  ma.selection = sel;
  ma.absorbed = path == AttentionPath::Absorbed;
  ma.out = o;
  backend_.mla_attention(ma);
  backend_.matmul(o, T, a.o_proj, out);
}

void GlmDsaModel::mlp(const MlpWeights& w, const float* x, int64_t T, float* out) {
  const int64_t I = w.gate.out();
  float* g = scratch(20, size_t(T * I));
  float* u = scratch(21, size_t(T * I));
  backend_.matmul(x, T, w.gate, g);
  backend_.matmul(x, T, w.up, u);
  backend_.swiglu(g, u, g, T * I);
  backend_.matmul(g, T, w.down, out);
}

void GlmDsaModel::moe(int layer, const float* xn, int64_t T, float* out) {
  const GlmDsaConfig& c = config_;
  const LayerWeights& L = weights_.layers[size_t(layer)];
  const int64_t D = c.hidden_size, K = c.experts_per_token, I = c.moe_intermediate_size;
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  std::vector<float> wts(static_cast<size_t>(T * K));
  RouterArgs ra;
  ra.gate = &L.router;
  ra.bias = L.router_bias.data();
  ra.n_experts = c.n_routed_experts;
  ra.n_group = c.n_group;
  ra.topk_group = c.topk_group;
  ra.top_k = int(K);
  ra.norm_topk_prob = c.norm_topk_prob;
  ra.routed_scaling_factor = float(c.routed_scaling_factor);
  backend_.moe_route(xn, T, ra, ids.data(), wts.data());

  // One pass per distinct expert over the tokens routed to it (the expert union), in ascending
  // expert order as the oracle accumulates.
  std::vector<std::vector<int32_t>> tokens_of(static_cast<size_t>(c.n_routed_experts));
  std::vector<std::vector<float>> weight_of(static_cast<size_t>(c.n_routed_experts));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      tokens_of[size_t(ids[size_t(t * K + k)])].push_back(int32_t(t));
      weight_of[size_t(ids[size_t(t * K + k)])].push_back(wts[size_t(t * K + k)]);
    }
  std::vector<int> used;
  for (int e = 0; e < c.n_routed_experts; ++e)
    if (!tokens_of[size_t(e)].empty()) used.push_back(e);
  std::vector<const ExpertWeights*> ew = experts_->prepare(layer, used);

  std::fill(out, out + T * D, 0.0f);
  float* xs = scratch(22, size_t(T * D));
  float* g = scratch(23, size_t(T * I));
  float* u = scratch(24, size_t(T * I));
  float* y = scratch(25, size_t(T * D));
  for (size_t i = 0; i < used.size(); ++i) {
    const auto& toks = tokens_of[size_t(used[i])];
    const int64_t m = int64_t(toks.size());
    backend_.gather_rows(xn, toks.data(), m, D, xs);
    backend_.matmul(xs, m, ew[i]->gate, g);
    backend_.matmul(xs, m, ew[i]->up, u);
    backend_.swiglu(g, u, g, m * I);
    backend_.matmul(g, m, ew[i]->down, y);
    backend_.scatter_add_rows(out, toks.data(), weight_of[size_t(used[i])].data(), y, m, D);
  }
  if (L.has_shared) {
    float* s = scratch(26, size_t(T * D));
    mlp(L.shared, xn, T, s);
    backend_.add(out, s, T * D);
  }
}

}  // namespace vireo
