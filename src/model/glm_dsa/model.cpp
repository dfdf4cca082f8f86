#include "model/glm_dsa/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "core/env.h"

namespace vireo {

namespace {

// A recorded greedy one-token step of one sequence ends with the argmax of its logits row inside the
// recording (after lm_head, as programmatic launches), written where a following step reads its
// token (scratch_i32(8)); the host then launches no argmax of its own. The recordings are keyed by
// it: a sampled or logits-only step replays one without the argmax (none is computed only to be
// overwritten or left unread). H200, fp8 8 layers: the GPU's idle between
// two queued steps 12.5 -> 8.0 us (the pick's two kernels ran after the graph, with no overlap);
// +0.3 to +1.0 points at context 0 in four calls, even at 4096 (BENCHMARKS "Session 51").
// VIREO_ARGMAX_IN_STEP=0 (or GlmDsaModel::set_argmax_in_step(false)): the argmax after the step.
bool argmax_in_step_default() { return env_switch("VIREO_ARGMAX_IN_STEP"); }

// Recorded steps past the fixed context bounds are sized for the next power of two of the
// longest row's keys (from twice the largest fixed bound), not for the cache's capacity: the
// indexer's scores launch a block per 64 keys of the bound and the top-k spreads the bound's
// keys over its threads, so a server's --context 202752 would otherwise pay, at 4096 cached,
// for launches 50 times too wide. VIREO_POW2_BOUNDS=0: the capacity (before session 55).
bool pow2_bounds() {
  static const bool on = env_switch("VIREO_POW2_BOUNDS");
  return on;
}

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

ExpertStoreParams expert_store_params(const GlmDsaConfig& c) {
  ExpertStoreParams p;
  p.n_layers = c.bound_layers();  // the MTP layer's experts, where it is bound, come from the same store
  for (int l = 0; l < c.bound_layers(); ++l)
    if (!c.layer_dense[size_t(l)]) p.moe_layers.push_back(l);
  p.n_experts = c.n_routed_experts;
  p.top_k = c.experts_per_token;
  p.hidden = c.hidden_size;
  p.moe_intermediate = c.moe_intermediate_size;
  return p;
}

GlmDsaModel::GlmDsaModel(GlmDsaConfig config, std::unique_ptr<Checkpoint> ck, Backend& backend)
    : config_(std::move(config)),
      checkpoint_(std::move(ck)),
      backend_(backend),
      argmax_in_step_on_(argmax_in_step_default()) {}

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
    m->experts_ = std::make_unique<ResidentExpertStore>(*m->checkpoint_, expert_store_params(c));
  }
  m->inv_freq_ = compute_inv_freq(c);
  m->active_bytes_ = m->count_active_weight_bytes();
  m->upload_weights();
  m->experts_->upload(backend);
  m->make_fused_banks();
  return m;
}

// Appends the layer's shared expert to a bank of its routed experts when it has a routed
// expert's shape and dtype: moe_experts then runs it in the same launches (weight 1, summed last,
// where `out += shared(x)` would add it).
static void add_shared_expert(const LayerWeights& L, ExpertBank& bank) {
  auto same = [](const Weight& a, const Weight& b) {
    return a.w.dtype == b.w.dtype && a.out() == b.out() && a.in() == b.in();
  };
  if (L.has_shared && same(L.shared.gate, bank.gate[0]) && same(L.shared.up, bank.up[0]) &&
      same(L.shared.down, bank.down[0])) {
    bank.gate.push_back(L.shared.gate);
    bank.up.push_back(L.shared.up);
    bank.down.push_back(L.shared.down);
    bank.n_shared = 1;
  }
}

// A resident store's bank of a layer plus the layer's shared expert (add_shared_expert).
void GlmDsaModel::make_fused_banks() {
  fused_banks_.assign(size_t(config_.bound_layers()), ExpertBank{});
  for (int l = 0; l < config_.bound_layers(); ++l) {
    const ExpertBank* bank = experts_->bank(l);
    if (!bank) continue;
    fused_banks_[size_t(l)] = *bank;
    add_shared_expert(weights_.layers[size_t(l)], fused_banks_[size_t(l)]);
  }
}

MlaCacheShape GlmDsaModel::cache_shape() const {
  MlaCacheShape s;
  s.n_layers = config_.bound_layers();  // the MTP layer keeps its own entries beside the main stack's
  s.kv_dim = config_.kv_cache_dim();
  s.index_dim = config_.has_indexer ? config_.index_head_dim : 0;
  for (int l = 0; l < config_.bound_layers(); ++l)
    s.has_index.push_back(config_.has_indexer && config_.indexer_full[size_t(l)]);
  return s;
}

size_t GlmDsaModel::count_active_weight_bytes() const {
  const GlmDsaConfig& c = config_;
  // Every dense matrix is read once per token, except the embedding table (one row).
  size_t n = weights_.dense_bytes - weights_.embed.nbytes() + weights_.embed.nbytes() / size_t(c.vocab_size);
  if (weights_.lm_head.w.data == weights_.embed.w.data) n += weights_.lm_head.nbytes();  // tied
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.layer_dense[size_t(l)]) continue;
    // All experts of a layer have one size: count expert 0's stored bytes (block scales included)
    // from the checkpoint index, without asking the store (which may have to read it).
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.0.";
    size_t one = 0;
    for (const char* m : {"gate_proj", "up_proj", "down_proj"})
      for (const char* t : {".weight", ".weight_scale_inv"})
        if (const TensorInfo* info = checkpoint_->find(p + m + t)) one += info->nbytes;
    n += size_t(c.experts_per_token) * one;
  }
  return n;
}

size_t GlmDsaModel::decode_weight_bytes(int64_t n_keys) const {
  size_t n = active_weight_bytes_per_token();
  if (!config_.has_indexer || n_keys > config_.index_topk) return n;
  for (int l = 0; l < config_.num_layers; ++l) {
    const AttentionWeights& a = weights_.layers[size_t(l)].attn;
    if (a.has_indexer) n -= a.idx_wq_b.nbytes() + a.idx_weights_proj.nbytes();
  }
  return n;
}

float* GlmDsaModel::scratch(int slot, size_t n) {
  if (size_t(slot) >= scratch_.size()) {
    scratch_.resize(size_t(slot) + 1);
    scratch_size_.resize(size_t(slot) + 1, 0);
  }
  if (scratch_size_[size_t(slot)] < n) {
    VIREO_ASSERT(!recording_);  // a recorded step must find every buffer already allocated
    ++scratch_gen_;
    scratch_[size_t(slot)] = backend_.alloc_f32(n);
    scratch_size_[size_t(slot)] = n;
  }
  return scratch_[size_t(slot)].get();
}

int32_t* GlmDsaModel::scratch_i32(int slot, size_t n) {
  if (size_t(slot) >= scratch_i32_.size()) {
    scratch_i32_.resize(size_t(slot) + 1);
    scratch_i32_size_.resize(size_t(slot) + 1, 0);
  }
  if (scratch_i32_size_[size_t(slot)] < n) {
    VIREO_ASSERT(!recording_);
    ++scratch_gen_;
    scratch_i32_[size_t(slot)] = backend_.alloc_i32(n);
    scratch_i32_size_[size_t(slot)] = n;
  }
  return scratch_i32_[size_t(slot)].get();
}

const float* GlmDsaModel::vec(const std::vector<float>& host) const {
  auto it = vectors_.find(host.data());
  VIREO_ASSERT(it != vectors_.end());
  return it->second.get();
}

void GlmDsaModel::upload_weights() {
  auto up = [&](Weight& w) {
    if (!w.w.empty()) w = backend_.upload_weight(w);
  };
  auto v = [&](const std::vector<float>& x) {
    if (x.empty() || vectors_.count(x.data())) return;
    auto buf = backend_.alloc_f32(x.size());
    backend_.copy_from_host(buf.get(), x.data(), x.size());
    vectors_[x.data()] = buf;
  };
  const bool tied = weights_.lm_head.w.data == weights_.embed.w.data;
  up(weights_.embed);
  if (tied) weights_.lm_head = weights_.embed;
  else up(weights_.lm_head);
  v(weights_.final_norm);
  if (config_.mtp_layers > 0) {
    up(weights_.mtp.eh_proj);
    for (const std::vector<float>* x : {&weights_.mtp.enorm, &weights_.mtp.hnorm, &weights_.mtp.head_norm}) v(*x);
  }
  for (LayerWeights& L : weights_.layers) {
    v(L.attn_norm);
    v(L.ffn_norm);
    AttentionWeights& a = L.attn;
    // The layer input's products of one dtype side by side: on a GPU at prefill one GEMM instead
    // of three small ones (block-aligned in this order: q_a's and the keys' rows are multiples of
    // 128; an FP8 checkpoint keeps the keys in bf16, and they then go alone).
    {
      std::vector<Weight*> side;
      for (Weight* w : {&a.q_a_proj, &a.q_proj, &a.idx_wk, &a.kv_a_proj})
        if (!w->w.empty() && (side.empty() || w->w.dtype == side[0]->w.dtype)) side.push_back(w);
      backend_.upload_weights_adjacent(side.data(), int(side.size()));
    }
    for (Weight* w : {&a.q_a_proj, &a.q_b_proj, &a.q_proj, &a.kv_a_proj, &a.kv_b_proj, &a.o_proj, &a.idx_wq_b,
                      &a.idx_wk, &a.idx_weights_proj, &L.mlp.gate, &L.mlp.up, &L.mlp.down, &L.router,
                      &L.shared.gate, &L.shared.up, &L.shared.down})
      up(*w);
    for (const std::vector<float>* x : {&a.q_a_norm, &a.kv_a_norm, &a.idx_k_norm_w, &a.idx_k_norm_b, &L.router_bias})
      v(*x);
  }
}

void GlmDsaModel::rope_table(int64_t pos0, int64_t T, float* cs) const {
  const int64_t half = config_.qk_rope_dim / 2;
  const float af = float(config_.rope.attention_factor);
  for (int64_t t = 0; t < T; ++t) {
    // As the oracle: the angle is a float32 product, cos/sin of it scaled by attention_factor.
    const float pos = float(pos0 + t);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq_[size_t(i)];
      cs[(t * half + i) * 2] = float(std::cos(double(angle))) * af;
      cs[(t * half + i) * 2 + 1] = float(std::sin(double(angle))) * af;
    }
  }
}

// Why a table kept across steps: cos and sin of every (position, frequency) pair cost ~0.8 us a
// position on the host (64 double-precision calls), 0.4 ms for a 512-token prompt and 3.7 ms for
// 4096, all of it before the step's first kernel, with the GPU idle. The table grows in steps of
// at least half its size, so a long context computes each position once and uploads a few times,
// but never past the cache's capacity (`cap`, or end where that is larger), so that it holds at
// most a position per cache position: what the memory plan counts (cli/cmd_plan.cpp).
void GlmDsaModel::grow_rope_table(int64_t end, int64_t cap) {
  if (end <= rope_rows_) return;
  const int64_t half = config_.qk_rope_dim / 2;
  const int64_t rows =
      std::min(std::max({(end + 4095) / 4096 * 4096, rope_rows_ + rope_rows_ / 2}), std::max(end, cap));
  rope_host_.resize(size_t(rows * half * 2));
  rope_table(rope_rows_, rows - rope_rows_, &rope_host_[size_t(rope_rows_ * half * 2)]);
  // The old copy goes first, so that the two never add up (freeing backend memory waits for the
  // work queued on it: a queued step may still read the old rows). Until the new one exists the
  // table counts as empty, so that an allocation that throws leaves no rows without a copy.
  rope_rows_ = 0;
  rope_dev_.reset();
  rope_dev_ = backend_.alloc_f32(rope_host_.size());
  backend_.copy_from_host(rope_dev_.get(), rope_host_.data(), rope_host_.size());
  rope_rows_ = rows;
}

// Multiply-adds per head of the two attention paths for T new queries after pos0 cached keys
// (each query sees at most index_topk keys under DSA):
//   reconstructed: every key's latent through kv_b once, (nope + v) x kv_lora per key, then
//                  (qk + v) per query-key pair;
//   absorbed:      W_UK and W_UV per query, (nope + v) x kv_lora, then (2 kv_lora + rope) per
//                  query-key pair.
// From an empty cache the reconstructed path wins for any T > 1 on these models; appending a
// short chunk to a long cache (a chat turn, a server's chunked prefill) the absorbed path does,
// since it never re-expands the cached keys. Both compute the same function (tests compare them).
AttentionPath GlmDsaModel::choose_path(int64_t T, int64_t pos0) const {
  if (T == 1) return AttentionPath::Absorbed;
  const GlmDsaConfig& c = config_;
  const double n_keys = double(pos0 + T), L = double(c.kv_lora_rank), hw = double(c.qk_nope_dim + c.v_head_dim);
  double pairs = 0;  // query-key pairs attended
  for (int64_t t = 0; t < T; ++t) {
    const double causal = double(pos0 + t + 1);
    pairs += c.has_indexer ? std::min(causal, double(c.index_topk)) : causal;
  }
  const double reconstructed = n_keys * hw * L + pairs * double(c.qk_head_dim() + c.v_head_dim);
  const double absorbed = double(T) * hw * L + pairs * (2 * L + double(c.qk_rope_dim));
  return absorbed < reconstructed ? AttentionPath::Absorbed : AttentionPath::Reconstructed;
}

void GlmDsaModel::forward(const int32_t* tokens, int64_t T, MlaCache& cache, int row, float* logits,
                          bool all_logits, AttentionPath path) {
  BatchItem item;
  item.row = row;
  item.tokens = tokens;
  item.T = T;
  item.logits = logits;
  item.all_logits = all_logits;
  forward_batch({item}, cache, path);
}

int GlmDsaModel::queue_step(const int32_t* token, MlaCache& cache, int row, const SampleRowArgs* sample, int steps) {
  if (int(queued_chunks_.size()) >= Backend::kMaxQueuedReads)
    fail("queue_step: ", queued_chunks_.size(), " steps (or chunks of steps) already queued");
  BatchItem item;
  item.row = row;
  item.tokens = token;
  item.T = 1;
  item.token_from_pick = token == nullptr;
  item.queue_pick = true;
  item.sample = sample;
  item.steps = steps;
  forward_batch({item}, cache, AttentionPath::Absorbed);
  queued_chunks_.push_back(chunk_steps_run_);
  return chunk_steps_run_;
}

int32_t GlmDsaModel::take_step() {
  if (taken_picks_.empty()) {
    if (queued_chunks_.empty()) fail("take_step: no step is queued");
    const int k = queued_chunks_.front();
    // A chunk's step j picked into slot (j + 1) % k of the pick buffer (run_steps).
    std::vector<int32_t> slots(static_cast<size_t>(k));
    backend_.take_read_i32(slots.data(), size_t(k));
    queued_chunks_.pop_front();
    for (int j = 0; j < k; ++j) taken_picks_.push_back(slots[size_t((j + 1) % k)]);
  }
  const int32_t token = taken_picks_.front();
  taken_picks_.pop_front();
  return token;
}

int32_t GlmDsaModel::forward_next(const int32_t* tokens, int64_t T, MlaCache& cache, int row,
                                  const SampleRowArgs* sample, AttentionPath path) {
  BatchItem item;
  item.row = row;
  item.tokens = tokens;
  item.T = T;
  int32_t next = -1;
  item.token = &next;
  item.sample = sample;
  forward_batch({item}, cache, path);
  return next;
}

void GlmDsaModel::forward_batch(const std::vector<BatchItem>& items, MlaCache& cache, AttentionPath path) {
  using clock = std::chrono::steady_clock;
  const auto t_enter = clock::now();
  const GlmDsaConfig& c = config_;
  const int64_t V = c.vocab_size, half = c.qk_rope_dim / 2;
  if (items.empty()) fail("forward: empty batch");
  // A chunk of steps (BatchItem::steps): K one-token steps of one sequence in one launch.
  int K = items[0].steps;
  for (const BatchItem& it : items)
    if (it.steps < 1 || it.steps > int(Backend::kMaxQueuedRead))
      fail("forward: steps must be 1 to ", Backend::kMaxQueuedRead, ", got ", it.steps);
  if (K > 1 && (items.size() != 1 || items[0].T != 1 || !items[0].queue_pick || items[0].sample || items[0].logits ||
                items[0].token))
    fail("forward: a chunk of ", K, " steps runs one greedy token of one sequence, queued (queue_step, no sampling)");
  const bool keep_hidden = items[0].keep_hidden;
  for (const BatchItem& it : items) {
    if (it.keep_hidden != keep_hidden) fail("forward: keep_hidden is set on all of a batch's items or none");
    if (it.keep_hidden && (K != 1 || it.queue_pick || it.token_from_pick))
      fail("forward: keep_hidden steps are not queued and not in a chunk");
  }
  // Validate everything before touching the cache, so a bad request leaves no trace.
  std::vector<Segment> segs;
  int64_t N = 0, n_out = 0;
  for (const BatchItem& it : items) {
    if (it.row < 0 || it.row >= cache.rows()) fail("forward: cache row ", it.row, " out of range");
    for (const Segment& s : segs)
      if (s.row == it.row) fail("forward: cache row ", it.row, " appears twice in one batch");
    if (it.T <= 0) fail("forward: no tokens");
    const int64_t pos0 = cache.length(it.row);
    if (pos0 + it.T + it.steps - 1 > cache.capacity())
      fail("context full: ", pos0 + it.T + it.steps - 1, " tokens exceed the context capacity of ", cache.capacity());
    if (it.token_from_pick) {
      if (items.size() != 1 || it.T != 1)
        fail("forward: a step fed the previous step's pick runs one token of one sequence");
      if (!last_pick_ || last_pick_ != pick_slots(1) || last_pick_cache_ != cache.id() || last_pick_row_ != it.row)
        fail("forward: no pick of the previous step of cache row ", it.row, " to feed (queue_step needs a token)");
    } else {
      for (int64_t t = 0; t < it.T; ++t)
        if (it.tokens[t] < 0 || it.tokens[t] >= V)
          fail("token id ", it.tokens[t], " is out of range (vocab size ", V, ")");
    }
    if (it.sample)
      for (int64_t k = 0; k < (it.all_logits ? it.T : 1); ++k) validate_sample_row_args(it.sample[k], k);
    if (it.rows_out && (!it.all_logits || it.logits))
      fail("forward: rows_out takes every row's logits (all_logits) instead of `logits`");
    AttentionPath p = path;
    if (p == AttentionPath::Auto) p = choose_path(it.T, pos0);
    Segment s{it.row, N, it.T, pos0, p};
    s.all_logits = it.all_logits;
    segs.push_back(s);
    N += it.T;
    n_out += it.all_logits ? it.T : 1;
  }

  // The step's inputs in backend memory: token ids and the rope table. One sequence's rows
  // read the table's own backend copy at their positions; a recorded step (whose launches keep
  // the address they were recorded with) and a batch of several sequences get their rows copied
  // into scratch.
  std::vector<int32_t> ids_host(static_cast<size_t>(N));
  int64_t end = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].token_from_pick)
      std::copy(items[i].tokens, items[i].tokens + items[i].T, ids_host.begin() + segs[i].offset);
    end = std::max(end, segs[i].pos0 + segs[i].T + K - 1);
  }
  // A one-token step of one sequence reads its id from the pick buffer (slot 8), where the step
  // before it left its pick: a step fed that pick needs no copy at all (this and the one upload
  // below took the idle GPU between two queued steps from 26.1 to 21.8 us, H200), and a step recorded
  // with host tokens reads the same address, so one recording serves both. Its own pick
  // overwrites the id only after the embedding lookup has read it (stream order).
  // (A chunk's K steps each pick into a slot of their own: the buffer holds K picks.)
  const size_t n_picks = size_t(std::max<int64_t>(n_out, K));
  int32_t* ids = N == 1 ? pick_slots(n_picks) : scratch_i32(6, size_t(N));
  if (!items[0].token_from_pick) backend_.copy_from_host_i32(ids, ids_host.data(), ids_host.size());
  grow_rope_table(end, cache.capacity());
  // (A step keeping its hidden rows runs eagerly: its recording would be another step's.)
  const bool recorded = !keep_hidden && can_record_step(segs, N);
  if (recorded && K > 1) {
    // A recorded chunk stops where one step at a time would change recordings (a context bound:
    // the short-context kernels' keys, or DSA's top-k, dense up to it): every step of it then
    // runs the launches its own one-step recording would, and queue_step reports the steps it took.
    K = int(std::min<int64_t>(K, one_step_bound(segs[0].pos0, cache) - segs[0].pos0));
    // A step with streamed MoE layers is recorded in pieces around their host round trips: there
    // a chunk is one step (a graph launch a piece either way).
    for (int l = 0; l < c.num_layers; ++l)
      if (!c.layer_dense[size_t(l)] && !experts_->bank(l)) K = 1;
  }
  chunk_steps_run_ = K;
  if (segs.size() == 1 && !recorded) {
    cos_sin_ = rope_dev_.get() + segs[0].pos0 * half * 2;
  } else if (recorded) {
    // A recorded step's positions (pos0 of each sequence, which its launches read at run time)
    // and rope rows travel in one host-to-device copy: [positions, padded to 16 bytes | rows].
    // (Two small copies were two idle gaps of 1-3 us each between steps at B = 1, H200.) A
    // chunk's K steps of one sequence: K positions and K rows, step j reading the j-th of each.
    const size_t n_at = K > 1 ? size_t(K) : segs.size();
    const size_t npos = (n_at + 3) / 4 * 4, ncs = size_t((N + K - 1) * half * 2);
    std::vector<int32_t> in_host(npos + ncs, 0);
    for (size_t i = 0; i < n_at; ++i) in_host[i] = int32_t(K > 1 ? segs[0].pos0 + int64_t(i) : segs[i].pos0);
    for (const Segment& s : segs)
      std::memcpy(in_host.data() + npos + size_t(s.offset * half * 2), rope_host_.data() + s.pos0 * half * 2,
                  size_t((s.T + K - 1) * half * 2) * sizeof(float));
    int32_t* in_dev = scratch_i32(7, in_host.size());
    backend_.copy_from_host_i32(in_dev, in_host.data(), in_host.size());
    step_pos_ = in_dev;
    cos_sin_ = reinterpret_cast<float*>(in_dev + npos);
  } else {
    std::vector<float> cs_host(static_cast<size_t>(N * half * 2));
    for (const Segment& s : segs)
      std::copy_n(rope_host_.begin() + s.pos0 * half * 2, s.T * half * 2, cs_host.begin() + s.offset * half * 2);
    cos_sin_ = scratch(4, size_t(N * half * 2));
    backend_.copy_from_host(cos_sin_, cs_host.data(), cs_host.size());
  }
  // More rows of logits than the model may hold (set_logit_rows): lm_head runs after the step,
  // a slice at a time (head_slices); never a recorded step's (its rows are a decode batch's).
  const bool sliced = logit_rows_ > 0 && n_out > logit_rows_;
  VIREO_ASSERT(!sliced || (!recorded && K == 1));
  float* lg = scratch(3, size_t((sliced ? logit_rows_ : n_out) * V));
  bool any_token = false;
  for (const BatchItem& it : items) any_token = any_token || it.token || it.queue_pick;
  int32_t* chosen = any_token ? pick_slots(n_picks) : nullptr;  // before a recording is checked
  // Entries are written layer by layer (a chunk's eager steps set each step's length as they go).
  for (const Segment& s : segs) cache.set_length(s.row, s.pos0 + s.T + K - 1);

  // A chunk's steps each end with their argmax (the next step's token), recorded or not.
  argmax_in_step_ = K > 1 || (argmax_in_step_on_ && recorded && N == 1 && (items[0].token || items[0].queue_pick) &&
                              !items[0].sample);
  const auto t_launch = clock::now();
  hidden_kept_.clear();  // the rows a step kept are valid until the next step
  keep_hidden_ = keep_hidden;
  defer_head_ = sliced;
  if (recorded) run_recorded(segs, N, cache, ids, lg, K);
  else run_steps(segs, N, cache, ids, lg, K);
  keep_hidden_ = false;
  defer_head_ = false;
  if (keep_hidden) {
    for (const Segment& s : segs) hidden_kept_.push_back({s.row, s.offset, s.T, s.pos0});
    hidden_cache_ = cache.id();
  }
  const auto t_launched = clock::now();
  const bool picked = argmax_in_step_;
  argmax_in_step_ = false;

  // Rows [a, b) of the step's logits, at lg: each item's part of them copied out and picked from.
  const auto emit = [&](const float* lg_a, int64_t a, int64_t b) {
    int64_t r = 0;
    for (const BatchItem& it : items) {
      const int64_t n = it.all_logits ? it.T : 1, lo = std::max(r, a), hi = std::min(r + n, b);
      if (lo < hi) {
        const float* rows = lg_a + (lo - a) * V;
        const size_t count = size_t((hi - lo) * V);
        if (it.logits) backend_.copy_to_host(it.logits + (lo - r) * V, rows, count);
        if (it.rows_out) {
          host_rows_.resize(std::max(host_rows_.size(), count));
          backend_.copy_to_host(host_rows_.data(), rows, count);
          it.rows_out(lo - r, hi - lo, host_rows_.data());
        }
        if ((it.token || it.queue_pick) && it.sample)
          backend_.sample_rows(rows, hi - lo, V, it.sample + (lo - r), chosen + lo);
        else if ((it.token || it.queue_pick) && !picked) backend_.argmax_rows(rows, hi - lo, V, chosen + lo);
      }
      r += n;
    }
  };
  if (sliced) head_slices(head_rows_, n_out, emit);
  else emit(lg, 0, n_out);
  int64_t r = 0;
  for (const BatchItem& it : items) {
    const int64_t n = it.all_logits ? it.T : 1;
    if (it.queue_pick) backend_.queue_read_i32(chosen + r, size_t(n * K));
    else if (it.token) backend_.copy_to_host_i32(it.token, chosen + r, size_t(n));
    r += n;
  }
  // What a following step may take as its token (BatchItem::token_from_pick): this one's pick,
  // when it ran one sequence.
  last_pick_ = items.size() == 1 && chosen ? chosen : nullptr;
  last_pick_cache_ = cache.id();
  last_pick_row_ = items[0].row;
  const auto secs = [](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  host_times_.before_launch_s += secs(t_enter, t_launch);
  host_times_.launch_s += secs(t_launch, t_launched);
  host_times_.after_launch_s += secs(t_launched, clock::now());
  ++host_times_.steps;
}

int64_t GlmDsaModel::keys_bound(int64_t longest, const MlaCache& cache) const {
  int64_t bound = cache.capacity();
  int64_t fixed = 0;
  for (int64_t b : {backend_.short_context_keys(), config_.has_indexer ? config_.index_topk : int64_t(0)}) {
    if (b > 0 && longest <= b) bound = std::min(bound, b);
    fixed = std::max(fixed, b);
  }
  if (pow2_bounds() && fixed > 0)
    for (int64_t b = 2 * fixed; b < bound; b *= 2)
      if (longest <= b) return b;
  return bound;
}

int64_t GlmDsaModel::step_bound(const MlaCache& cache) const {
  return step_bound_ > 0 ? step_bound_ : cache.capacity();
}

bool GlmDsaModel::can_record_step(const std::vector<Segment>& segs, int64_t N) const {
  if (!recording_enabled_ || !backend_.can_record() || experts_->wants_prefetch()) return false;
  for (const Segment& s : segs)
    if (s.T != 1 || s.path != AttentionPath::Absorbed) return false;
  // Every MoE layer must run its experts by id on the backend: grouping them on the host would
  // need a round trip per expert in the middle of the step. A streaming store's layers need one
  // round trip each (their expert ids): the recording is split there.
  if (!backend_.prefers_moe_experts(N)) return false;
  for (int l = 0; l < config_.num_layers; ++l)
    if (!config_.layer_dense[size_t(l)] && !experts_->bank(l) && !streams_fused(l, N)) return false;
  return true;
}

bool GlmDsaModel::streams_fused(int layer, int64_t N) const {
  // Every id of the step may be a distinct expert: the store must be able to hold them all.
  return !experts_->bank(layer) && backend_.prefers_moe_experts(N) &&
         experts_->max_experts_per_prepare() >= size_t(N * config_.experts_per_token);
}

// A stage may grow scratch its path has not used at this N yet (the fused launches after grouped
// ones, say). That is safe for the pieces still to replay: the MoE paths' scratch is theirs alone
// (model slots 22-28, 40 and kMoeMlpSlot's pair; in the backend, moe_experts' buffer, and at
// N <= 8 the grouped path's products are GEMVs with no scratch). The next step sees the new
// generation and records again.
void GlmDsaModel::replay(RecordedStep& r, int64_t N) {
  for (size_t i = 0; i < r.pieces.size(); ++i) {
    r.pieces[i]->replay();
    if (i < r.stages.size()) {
      const StreamStage& st = r.stages[i];
      moe_streamed(st.layer, st.xn, N, st.ids, st.weights, st.out);
    }
  }
  recorded_runs_ += r.steps;
}

int64_t GlmDsaModel::replay_latest(int n) {
  RecordedStep* latest = nullptr;
  int64_t rows = 0;
  bool picks = false;  // the recording ends with its argmax
  for (auto& [key, r] : recorded_)
    if (!r.pieces.empty() && r.stages.empty() && (!latest || r.last_use > latest->last_use)) {
      latest = &r;
      rows = int64_t(std::get<1>(key).size());
      picks = std::get<3>(key);
    }
  if (!latest) return 0;
  const int64_t V = config_.vocab_size;
  float* lg = scratch(3, size_t(rows * V));  // as forward_batch: one logits row and pick a sequence
  int32_t* chosen = pick_slots(size_t(rows));
  for (int i = 0; i < n; ++i) {
    replay(*latest, rows);
    if (!picks) backend_.argmax_rows(lg, rows, V, chosen);
  }
  int32_t first = 0;
  backend_.copy_to_host_i32(&first, chosen, 1);  // waits for the replays
  return int64_t(n) * latest->steps;
}

// Recorded steps read their positions from backend memory (pos0 of each sequence); everything
// else they touch (weights, cache rows, scratch) stays at the addresses it was recorded with.
// The first step of a batch shape runs eagerly (it allocates the buffers), the second records,
// later ones replay. Reallocated scratch (a longer prefill in between, say) invalidates.
void GlmDsaModel::run_recorded(std::vector<Segment>& segs, int64_t N, MlaCache& cache, const int32_t* ids,
                               float* logits, int steps) {
  std::vector<int> rows;
  for (const Segment& s : segs) rows.push_back(s.row);
  const int32_t* pos = step_pos_;  // uploaded by forward_batch with the rope rows
  VIREO_ASSERT(pos);
  int64_t longest = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    segs[i].pos0_dev = pos + i;
    longest = std::max(longest, segs[i].pos0 + segs[i].T + steps - 1);
  }
  step_bound_ = keys_bound(longest, cache);

  RecordedStep& r = recorded_[{cache.id(), rows, step_bound_, argmax_in_step_, steps}];
  r.last_use = ++step_clock_;
  const bool same_buffers = r.model_gen == scratch_gen_ && r.backend_gen == backend_.scratch_generation();
  if (!r.pieces.empty() && same_buffers) {
    replay(r, N);
    return;
  }
  if (!r.warmed || !same_buffers) {
    r.pieces.clear();
    r.stages.clear();
    run_steps(segs, N, cache, ids, logits, steps);
    r.warmed = true;
    r.model_gen = scratch_gen_;
    r.backend_gen = backend_.scratch_generation();
    return;
  }
  // Bound the number of recordings kept (each holds device resources): drop the least recent.
  const size_t kMaxRecordings = 8;
  size_t n_ops = 0;
  for (const auto& [k, v] : recorded_) n_ops += v.pieces.empty() ? 0 : 1;
  if (n_ops >= kMaxRecordings) {
    auto oldest = recorded_.end();
    for (auto it = recorded_.begin(); it != recorded_.end(); ++it)
      if (!it->second.pieces.empty() && (oldest == recorded_.end() || it->second.last_use < oldest->second.last_use))
        oldest = it;
    if (oldest != recorded_.end()) recorded_.erase(oldest);
  }
  RecordedStep& rec = recorded_[{cache.id(), rows, step_bound_, argmax_in_step_, steps}];
  rec.steps = steps;
  recording_ = true;
  recording_into_ = &rec;
  backend_.begin_recording();
  try {
    run_steps(segs, N, cache, ids, logits, steps);
  } catch (...) {
    recording_ = false;
    recording_into_ = nullptr;
    backend_.end_recording();
    rec.pieces.clear();
    rec.stages.clear();
    throw;
  }
  recording_ = false;
  recording_into_ = nullptr;
  rec.pieces.push_back(backend_.end_recording());
  VIREO_ASSERT(rec.model_gen == scratch_gen_ && rec.backend_gen == backend_.scratch_generation());
  replay(rec, N);
}

void GlmDsaModel::run_steps(std::vector<Segment>& segs, int64_t N, MlaCache& cache, const int32_t* ids, float* lg,
                            int steps) {
  if (steps == 1) {
    step_pick_ = argmax_in_step_ ? pick_slots(1) : nullptr;  // (one sequence: forward_batch made it)
    run_step(segs, N, cache, ids, lg);
    return;
  }
  int32_t* picks = pick_slots(size_t(steps));
  // One sequence, one token a step. Recorded (positions in backend memory) step j reads the j-th
  // of the chunk's positions and rope rows that forward_batch uploaded; eager, its host position.
  // Step j reads its token from pick slot j and picks into slot (j + 1) % steps: the chunk's last
  // pick lands in slot 0, where a following chunk's first step reads it (take_step reorders).
  Segment& s = segs[0];
  const Segment at = s;
  float* cs = cos_sin_;
  const int64_t half = config_.qk_rope_dim / 2;
  for (int j = 0; j < steps; ++j) {
    s.pos0 = at.pos0 + j;
    if (at.pos0_dev) {
      s.pos0_dev = at.pos0_dev + j;
      cos_sin_ = cs + j * half * 2;
    } else {
      cos_sin_ = rope_dev_.get() + s.pos0 * half * 2;
      cache.set_length(s.row, s.pos0 + 1);
    }
    step_pick_ = picks + (j + 1) % steps;
    run_step(segs, N, cache, picks + j, lg);
  }
  s = at;
  cos_sin_ = cs;
  cache.set_length(s.row, at.pos0 + steps);
}

void GlmDsaModel::run_step(const std::vector<Segment>& segs, int64_t N, MlaCache& cache, const int32_t* ids,
                           float* lg) {
  const GlmDsaConfig& c = config_;
  const int64_t D = c.hidden_size;
  float* h = scratch(0, size_t(N * D));    // residual stream [N, D]
  float* xn = scratch(1, size_t(N * D));   // normed input    [N, D]
  float* out = scratch(2, size_t(N * D));  // sublayer output [N, D]
  const float eps = float(c.rms_norm_eps);
  backend_.embed_rms_norm(weights_.embed, ids, N, vec(weights_.layers[0].attn_norm), eps, h, xn);
  // Each residual add is fused with the norm that follows it (the next sublayer's input).
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = weights_.layers[size_t(l)];
    attention(l, xn, N, segs, cache, out);
    backend_.add_rms_norm(h, out, N, D, vec(L.ffn_norm), eps, xn);
    if (experts_->wants_prefetch()) prefetch_next(l, h, N);
    if (L.dense) mlp(L.mlp, xn, N, out);
    else moe(l, xn, N, out);
    if (l + 1 < c.num_layers)
      backend_.add_rms_norm(h, out, N, D, vec(weights_.layers[size_t(l) + 1].attn_norm), eps, xn);
  }

  // The last layer's residual add, the final norm and lm_head only for the rows whose logits
  // were asked for (a prompt's last row: the add over every row was 11 us of a 512-token prefill
  // on an H200, 73 us at 4096).
  if (keep_hidden_) {  // every row's final-norm state kept for mtp_forward
    float* hidden = scratch(kHiddenSlot, size_t(N * D));
    backend_.add_rms_norm(h, out, N, D, vec(weights_.final_norm), eps, hidden);
    if (segs.size() == 1) {
      const int64_t first = segs[0].all_logits ? 0 : N - 1;
      head_rows_ = hidden + first * D;
      if (!defer_head_) backend_.matmul(head_rows_, N - first, weights_.lm_head, lg);
      return;
    }
    int64_t r = 0;  // the rows whose logits were asked for, side by side
    for (const Segment& s : segs) {
      const int64_t first = s.all_logits ? 0 : s.T - 1, n = s.T - first;
      backend_.copy_rows(xn + r * D, D, hidden + (s.offset + first) * D, D, n, D);
      r += n;
    }
    head_rows_ = xn;
    if (!defer_head_) backend_.matmul(xn, r, weights_.lm_head, lg);
    return;
  }
  int64_t r = 0;
  for (const Segment& s : segs) {
    const int64_t first = s.all_logits ? 0 : s.T - 1, n = s.T - first;
    backend_.add_rms_norm(h + (s.offset + first) * D, out + (s.offset + first) * D, n, D, vec(weights_.final_norm), eps,
                          xn + r * D);
    r += n;
  }
  head_rows_ = xn;
  if (defer_head_) return;
  backend_.matmul(xn, r, weights_.lm_head, lg);
  if (argmax_in_step_) backend_.argmax_rows(lg, 1, c.vocab_size, step_pick_);
}

void GlmDsaModel::head_slices(const float* rows, int64_t n,
                              const std::function<void(const float*, int64_t, int64_t)>& emit) {
  const int64_t D = config_.hidden_size, slice = logit_rows_ > 0 ? std::min(n, logit_rows_) : n;
  float* lg = scratch(3, size_t(slice * config_.vocab_size));
  for (int64_t a = 0; a < n; a += slice) {
    const int64_t b = std::min(n, a + slice);
    backend_.matmul(rows + a * D, b - a, weights_.lm_head, lg);
    emit(lg, a, b);
  }
}

void GlmDsaModel::set_logit_rows(int64_t rows) {
  if (rows < 0) fail("logit rows: must be 0 (no bound) or positive, got ", rows);
  logit_rows_ = rows;
}

int64_t GlmDsaModel::logit_buffer_rows() const {
  return scratch_size_.size() > 3 ? int64_t(scratch_size_[3] / size_t(config_.vocab_size)) : 0;
}

void GlmDsaModel::mtp_forward(int64_t first, int64_t T, const int32_t* next, MlaCache& cache, int row, int64_t pos0,
                              float* logits, bool all_logits, int32_t* draft) {
  MtpItem it;
  it.row = row;
  it.first = first;
  it.T = T;
  it.next = next;
  it.pos0 = pos0;
  it.logits = logits;
  it.all_logits = all_logits;
  it.draft = draft;
  mtp_forward_batch({it}, cache);
}

void GlmDsaModel::mtp_forward_batch(const std::vector<MtpItem>& items, MlaCache& cache) {
  const GlmDsaConfig& c = config_;
  const int64_t D = c.hidden_size, V = c.vocab_size, half = c.qk_rope_dim / 2;
  const float eps = float(c.rms_norm_eps);
  if (c.mtp_layers < 1) fail("mtp_forward: the model was loaded without its MTP layer (enable_mtp)");
  if (items.empty()) fail("mtp_forward: empty batch");
  // Validate everything before a buffer is touched.
  std::vector<const KeptRows*> kept;
  std::vector<Segment> segs;
  int64_t N = 0, n_out = 0, end = 0;
  for (const MtpItem& it : items) {
    const int row = it.row;
    const int64_t first = it.first, T = it.T, pos0 = it.pos0;
    if (T <= 0) fail("mtp_forward: no tokens");
    const KeptRows* k = nullptr;
    if (hidden_cache_ == cache.id())
      for (const KeptRows& r : hidden_kept_)
        if (r.row == row) k = &r;
    if (!k) fail("mtp_forward: the last forward of cache row ", row, " kept no hidden states (BatchItem::keep_hidden)");
    for (const Segment& s : segs)
      if (s.row == row) fail("mtp_forward: cache row ", row, " appears twice in one batch");
    if (first < 0 || first + T > k->T)
      fail("mtp_forward: hidden rows [", first, ", ", first + T, ") asked of the ", k->T, " the last forward kept");
    // The MTP entry at position t reads h_t: the main model must have run position t already.
    if (pos0 < 0 || pos0 + T > cache.length(row))
      fail("mtp_forward: MTP positions [", pos0, ", ", pos0 + T, ") past the ", cache.length(row),
           " the main model has run in cache row ", row);
    if (pos0 != k->pos0 + first)
      fail("mtp_forward: hidden row ", first, " is position ", k->pos0 + first, ", not ", pos0,
           " (the MTP entry at a position reads that position's hidden state)");
    for (int64_t t = 0; t < T; ++t)
      if (it.next[t] < 0 || it.next[t] >= V) fail("token id ", it.next[t], " is out of range (vocab size ", V, ")");
    kept.push_back(k);
    Segment s{row, N, T, pos0, choose_path(T, pos0)};
    s.all_logits = it.all_logits;
    segs.push_back(s);
    N += T;
    if (it.logits || it.draft) n_out += it.all_logits ? T : 1;
    end = std::max(end, pos0 + T);
  }
  const MtpWeights& m = weights_.mtp;
  const int l = c.num_layers;
  const LayerWeights& L = weights_.layers[size_t(l)];

  // [enorm(embed(next)) ; hnorm(h)], h read before any buffer of a step is reused.
  float* cat = scratch(kMtpInputSlot, size_t(N * 2 * D));
  const float* hidden = scratch_[size_t(kHiddenSlot)].get();
  std::vector<int32_t> ids_host(static_cast<size_t>(N));
  for (size_t i = 0; i < items.size(); ++i) {
    const Segment& s = segs[i];
    backend_.rms_norm(hidden + (kept[i]->offset + items[i].first) * D, D, s.T, D, vec(m.hnorm), eps,
                      cat + s.offset * 2 * D + D, 2 * D);
    std::copy_n(items[i].next, s.T, ids_host.begin() + s.offset);
  }
  int32_t* ids = scratch_i32(kMtpIdsSlot, size_t(N));
  backend_.copy_from_host_i32(ids, ids_host.data(), size_t(N));
  float* h = scratch(0, size_t(N * D));    // residual stream [N, D]
  float* xn = scratch(1, size_t(N * D));   // normed input    [N, D]
  float* out = scratch(2, size_t(N * D));  // sublayer output [N, D]
  backend_.embed(weights_.embed, ids, N, h);
  backend_.rms_norm(h, D, N, D, vec(m.enorm), eps, cat, 2 * D);
  backend_.matmul(cat, N, m.eh_proj, h);

  // One decoder layer at the positions of h, its own entries of each cache row.
  grow_rope_table(end, cache.capacity());
  if (segs.size() == 1) {
    cos_sin_ = rope_dev_.get() + segs[0].pos0 * half * 2;
  } else {
    std::vector<float> cs_host(static_cast<size_t>(N * half * 2));
    for (const Segment& s : segs)
      std::copy_n(rope_host_.begin() + s.pos0 * half * 2, s.T * half * 2, cs_host.begin() + s.offset * half * 2);
    cos_sin_ = scratch(4, size_t(N * half * 2));
    backend_.copy_from_host(cos_sin_, cs_host.data(), cs_host.size());
  }
  backend_.rms_norm(h, D, N, D, vec(L.attn_norm), eps, xn, D);
  attention(l, xn, N, segs, cache, out);
  backend_.add_rms_norm(h, out, N, D, vec(L.ffn_norm), eps, xn);
  if (L.dense) mlp(L.mlp, xn, N, out);
  else moe(l, xn, N, out);

  // shared_head.norm and lm_head for the rows asked for, side by side (none for an item that
  // only writes its cache entries: a prompt chunk before the last).
  if (n_out == 0) return;
  int64_t r = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].logits && !items[i].draft) continue;
    const Segment& s = segs[i];
    const int64_t r0 = s.all_logits ? 0 : s.T - 1, n = s.T - r0;
    backend_.add_rms_norm(h + (s.offset + r0) * D, out + (s.offset + r0) * D, n, D, vec(m.head_norm), eps, xn + r * D);
    r += n;
  }
  bool any_draft = false;
  for (const MtpItem& it : items) any_draft = any_draft || it.draft;
  int32_t* pick = any_draft ? scratch_i32(kMtpPickSlot, size_t(n_out)) : nullptr;
  head_slices(xn, n_out, [&](const float* lg, int64_t a, int64_t b) {
    if (any_draft) backend_.argmax_rows(lg, b - a, V, pick + a);
    int64_t r = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].logits && !items[i].draft) continue;
      const int64_t n = items[i].all_logits ? segs[i].T : 1, lo = std::max(r, a), hi = std::min(r + n, b);
      if (items[i].logits && lo < hi)
        backend_.copy_to_host(items[i].logits + (lo - r) * V, lg + (lo - a) * V, size_t((hi - lo) * V));
      r += n;
    }
  });
  r = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].logits && !items[i].draft) continue;
    const int64_t n = items[i].all_logits ? segs[i].T : 1;
    if (items[i].draft) backend_.copy_to_host_i32(items[i].draft, pick + r, size_t(n));
    r += n;
  }
}

void GlmDsaModel::attention(int layer, const float* xn, int64_t N, const std::vector<Segment>& segs,
                            MlaCache& cache, float* out) {
  const GlmDsaConfig& c = config_;
  const AttentionWeights& a = weights_.layers[size_t(layer)].attn;
  const int64_t H = c.n_heads, nope = c.qk_nope_dim, rope = c.qk_rope_dim, qw = c.qk_head_dim();
  const int64_t L = c.kv_lora_rank, kvw = c.kv_cache_dim();
  const float eps_lora = 1e-6f;  // the oracle's q_a_layernorm / kv_a_layernorm ignore rms_norm_eps
  const float* cs = cos_sin_;
  const int64_t cs_stride = rope;  // floats of rope table per token

  const bool own_indexer = c.has_indexer && a.has_indexer;
  const int64_t nI = c.index_n_heads, d = c.index_head_dim;
  float* q = scratch(11, size_t(N * H * qw));                                  // [N, H, nope + rope]
  float* qa = c.q_lora_rank > 0 ? scratch(12, size_t(N * c.q_lora_rank)) : nullptr;
  float* kva = scratch(14, size_t(N * kvw));                                   // [N, latent | k_rope]
  float* kraw = own_indexer ? scratch(16, size_t(N * d)) : nullptr;
  float* wts = own_indexer ? scratch(17, size_t(N * nI)) : nullptr;
  // Recorded steps size their launches for the longest row: the real length comes at run time.
  auto bound_pos0 = [&](const Segment& s) { return s.pos0_dev ? step_bound(cache) - s.T : s.pos0; };

  // DSA: this layer's own top-k selection, or the previous full layer's (kept in scratch slot 0
  // of the i32 pool, [N, topk], until the next full layer overwrites it).
  // Where no query of the step can have more than index_topk keys, the top-k would select every
  // causal key (in ascending order, as the attention walks them unselected): the attention runs
  // dense, with the same arithmetic, and the indexer only appends this step's keys.
  const int64_t topk = c.index_topk;
  bool dense_dsa = true;
  for (const Segment& s : segs) dense_dsa = dense_dsa && bound_pos0(s) + s.T <= topk;
  int32_t* selected = nullptr;
  int32_t* counts = nullptr;
  if (c.has_indexer && !dense_dsa) {
    selected = scratch_i32(0, size_t(N * topk));
    counts = scratch_i32(1, size_t(N));
  }

  // The products of xn: the queries (or their low-rank part), this step's cache entries and the
  // indexer's keys and head weights, as one call (one launch per weight dtype on a GPU at decode).
  // Where DSA is dense the head weights are not needed, and where the branch below runs beside
  // the queries' work the indexer's key product goes to it, which is then the short side: an FP8
  // checkpoint keeps it in bf16, a GEMV launch of its own (4.7 us a GLM-5 layer on the H200).
  // Where the branch runs in order (a GPU's prefill) the key product stays here, sharing x's
  // conversion with q_a and kv_a.
  const bool index_products_here = own_indexer && (!dense_dsa || !backend_.branches_beside(N));
  {
    const Weight* ws[4] = {qa ? &a.q_a_proj : &a.q_proj, &a.kv_a_proj, &a.idx_wk, &a.idx_weights_proj};
    float* ys[4] = {qa ? qa : q, kva, kraw, wts};
    backend_.matmul_many(xn, N, ws, ys, !index_products_here ? 2 : dense_dsa ? 3 : 4);
  }

  // This step's cache entries [latent | k_rope], written straight into each sequence's row.
  auto append_cache_entries = [&] {
    for (const Segment& s : segs)
      backend_.mla_cache_append(kva + s.offset * kvw, s.T, L, rope, vec(a.kv_a_norm), eps_lora,
                                cs + s.offset * cs_stride, rope_kind(c.mla_rope_style), cache.kv(layer, s.row), s.pos0,
                                s.pos0_dev);
  };
  auto append_index_keys = [&] {
    for (const Segment& s : segs)
      backend_.index_key_append(kraw + s.offset * d, s.T, d, vec(a.idx_k_norm_w), vec(a.idx_k_norm_b), 1e-6f, rope,
                                cs + s.offset * cs_stride, rope_kind(c.indexer_rope_style),
                                cache.index_keys(layer, s.row), s.pos0, s.pos0_dev);
  };
  // Where the indexer selects and its branch runs beside the queries' work (a GPU's decode), the
  // branch starts here with both cache appends (beside the q_a norm), the indexer's query product
  // runs next on the main side in blocks that leave half of each SM free, the branch continues
  // after it (RoPE, scores, top-k), and q_b starts early beside it (it reads only q_resid) in the
  // same half-SM blocks, walking its rows. Before (session 40's trace), q_b's blocks filled every
  // SM and the branch's kernels were dispatched only as they drained: the query product ran after
  // q_b, not beside it. H200, 8 layers fp8: +1.2 points at 4096 cached (BENCHMARKS, session 41).
  const bool queries_first = own_indexer && qa && !dense_dsa && backend_.branches_beside(N);
  if (queries_first) {
    Backend::BranchScope branch(backend_, N);
    append_index_keys();
    append_cache_entries();
  }

  float* q_resid = nullptr;
  float* qi = own_indexer ? scratch(15, size_t(N * nI * d)) : nullptr;  // the indexer's queries
  if (qa) {
    q_resid = scratch(13, size_t(N * c.q_lora_rank));
    backend_.rms_norm(qa, c.q_lora_rank, N, c.q_lora_rank, vec(a.q_a_norm), eps_lora, q_resid, c.q_lora_rank);
  }
  if (queries_first) backend_.matmul_launched(q_resid, N, a.idx_wq_b, qi, Backend::ProductLaunch::HalfSm);
  // A branch: the whole indexer (its keys, head weights, queries, scores and top-k) needs nothing
  // of the queries' work (q_b, this step's cache entries, RoPE, absorption), which runs beside it.
  // The indexer's query product is its own GEMV here, not one launch with q_b: its chain of small
  // latency-bound kernels then overlaps q_b's weight stream instead of waiting for it (H200, 8
  // layers, bf16 decode: +1.5 points at context 0). The cache append runs on the shorter side: the
  // main one when the indexer selects in order (a CPU; queries_first above on a GPU), the branch
  // when DSA is dense (the branch is then the key product and the key append).
  if (own_indexer) {
    VIREO_ASSERT(q_resid);  // the indexer's queries come from the low-rank query (config checks)
    Backend::BranchScope branch(backend_, N,
                                queries_first ? Backend::BranchScope::Continue : Backend::BranchScope::Begin);
    if (!index_products_here) backend_.matmul(xn, N, a.idx_wk, kraw);
    if (!queries_first) append_index_keys();
    if (dense_dsa) {
      append_cache_entries();  // the branch is the short side here
    } else {
      if (!queries_first) backend_.matmul(q_resid, N, a.idx_wq_b, qi);
      backend_.rope(qi, N, nI, nI * d, d, 0, rope, cs, rope_kind(c.indexer_rope_style));
      for (const Segment& s : segs) {
        IndexerArgs ia;
        ia.q = qi + s.offset * nI * d;
        ia.weights = wts + s.offset * nI;
        ia.keys = cache.index_keys(layer, s.row);
        ia.T = s.T;
        ia.n_heads = nI;
        ia.head_dim = d;
        ia.pos0 = bound_pos0(s);
        ia.n_keys = ia.pos0 + s.T;
        ia.pos0_dev = s.pos0_dev;
        ia.topk = topk;
        ia.scale = float(1.0 / std::sqrt(double(d)));
        ia.weight_scale = float(1.0 / std::sqrt(double(nI)));
        ia.selected = selected + s.offset * topk;
        ia.counts = counts + s.offset;
        backend_.indexer_select(ia);
      }
    }
  }
  if (qa)
    backend_.matmul_launched(q_resid, N, a.q_b_proj, q,
                             queries_first ? Backend::ProductLaunch::Early : Backend::ProductLaunch::InOrder);
  if (!(own_indexer && dense_dsa) && !queries_first) append_cache_entries();

  float* o = scratch(18, size_t(N * H * c.v_head_dim));
  std::vector<MlaAttentionArgs> mas;
  for (const Segment& s : segs) {
    MlaAttentionArgs ma;
    ma.q = q + s.offset * H * qw;
    ma.T = s.T;
    ma.n_heads = H;
    ma.qk_nope = nope;
    ma.qk_rope = rope;
    ma.v_dim = c.v_head_dim;
    ma.kv_lora = L;
    ma.kv = cache.kv(layer, s.row);
    ma.pos0 = bound_pos0(s);
    ma.n_keys = ma.pos0 + s.T;
    ma.pos0_dev = s.pos0_dev;
    ma.kv_b = &a.kv_b_proj;
    ma.scale = float(c.attention_scale());
    if (selected) ma.selection = KeySelection{selected + s.offset * topk, counts + s.offset, topk};
    ma.absorbed = s.path == AttentionPath::Absorbed;
    ma.out = o + s.offset * H * c.v_head_dim;
    mas.push_back(ma);
  }
  // One segment's queries rotated and absorbed while the branch selects its keys (two would need
  // a buffer each); the rotation inside the absorption's launch on a GPU (one kernel fewer on the
  // queries' chain: +0.3-0.5 points at context 0, session 41).
  if (mas.size() == 1) {
    VIREO_ASSERT(mas[0].q == q);  // (one segment: offset 0)
    backend_.mla_rope_absorb_queries(q, cs, rope_kind(c.mla_rope_style), mas[0]);
  } else {
    backend_.rope(q, N, H, H * qw, qw, nope, rope, cs, rope_kind(c.mla_rope_style));
  }
  backend_.join_branch();
  for (const MlaAttentionArgs& ma : mas) backend_.mla_attention(ma);
  backend_.matmul(o, N, a.o_proj, out);
}

// g = x gate^T, u = x up^T as one matmul_many: a backend converts the shared input once.
void GlmDsaModel::gate_up(const float* x, int64_t T, const Weight& gate, const Weight& up, float* g, float* u) {
  const Weight* ws[2] = {&gate, &up};
  float* ys[2] = {g, u};
  backend_.matmul_many(x, T, ws, ys, 2);
}

void GlmDsaModel::mlp(const MlpWeights& w, const float* x, int64_t T, float* out, int scratch_slot) {
  const int64_t I = w.gate.out();
  float* g = scratch(scratch_slot, size_t(T * I));
  float* u = scratch(scratch_slot + 1, size_t(T * I));
  gate_up(x, T, w.gate, w.up, g, u);
  backend_.swiglu(g, u, g, T * I);
  backend_.matmul(g, T, w.down, out);
}

RouterArgs GlmDsaModel::router_args(const LayerWeights& L) const {
  const GlmDsaConfig& c = config_;
  RouterArgs ra;
  ra.gate = &L.router;
  ra.bias = vec(L.router_bias);
  ra.n_experts = c.n_routed_experts;
  ra.n_group = c.n_group;
  ra.topk_group = c.topk_group;
  ra.top_k = c.experts_per_token;
  ra.norm_topk_prob = c.norm_topk_prob;
  ra.routed_scaling_factor = float(c.routed_scaling_factor);
  return ra;
}

void GlmDsaModel::moe(int layer, const float* xn, int64_t N, float* out) {
  const GlmDsaConfig& c = config_;
  const LayerWeights& L = weights_.layers[size_t(layer)];
  const int64_t K = c.experts_per_token;
  int32_t* ids_dev = scratch_i32(2, size_t(N * K));
  float* wts_dev = scratch(27, size_t(N * K));
  if (experts_->bank(layer) && backend_.runs_moe_bank(N, int(K), fused_banks_[size_t(layer)])) {
    // Every expert resident, and few tokens (or a backend that groups many on its own, a GPU's
    // prefill): run them by id on the backend, nothing read back (the shared expert too, when it
    // fits the bank). The shared expert's first products need no
    // routing: a branch beside the router, whose small kernels leave memory bandwidth idle (H200,
    // 8 layers, bf16 decode: +0.8-1.0 points at 4096 cached; fp8 unchanged; session 15).
    const ExpertBank& bank = fused_banks_[size_t(layer)];
    {
      Backend::BranchScope branch(backend_, N);
      backend_.moe_shared_gate_up(xn, N, int(K), bank);
    }
    backend_.moe_route(xn, N, router_args(L), ids_dev, wts_dev);
    backend_.join_branch();
    moe_bank(layer, xn, N, ids_dev, wts_dev, bank, out);
    return;
  }
  backend_.moe_route(xn, N, router_args(L), ids_dev, wts_dev);
  if (streams_fused(layer, N)) {
    if (recording_) {
      // The stage reads the ids back, which a recording cannot: end the piece here; the replay
      // runs the stage between this piece and the next.
      recording_into_->pieces.push_back(backend_.end_recording());
      recording_into_->stages.push_back({layer, xn, ids_dev, wts_dev, out});
      backend_.begin_recording();
    } else {
      moe_streamed(layer, xn, N, ids_dev, wts_dev, out);
    }
    return;
  }
  moe_grouped(layer, xn, N, ids_dev, wts_dev, out);  // the shared expert included
}

// Why the fused launches when every expert is in a slot: moe_grouped runs ~7 ops per expert,
// each launched by the host, and with most experts in slots the host's launches set the pace
// (H200, 4 layers x 64 FP8 experts, all in slots: 5.06 ms a token against ~1.5 ms resident).
// Why moe_grouped while copies are in flight: it runs the experts already in slots and the
// shared expert while the misses are still copying, where the fused launches would wait for the
// last copy first.
void GlmDsaModel::moe_streamed(int layer, const float* xn, int64_t N, const int32_t* ids_dev, const float* wts_dev,
                               float* out) {
  const GlmDsaConfig& c = config_;
  std::vector<int32_t> ids(static_cast<size_t>(N * c.experts_per_token));
  backend_.copy_to_host_i32(ids.data(), ids_dev, ids.size());
  std::vector<int> used(ids.begin(), ids.end());
  std::sort(used.begin(), used.end());
  used.erase(std::unique(used.begin(), used.end()), used.end());
  VIREO_ASSERT(used.size() <= experts_->max_experts_per_prepare());  // streams_fused
  const std::vector<const ExpertWeights*> ew = experts_->prepare_async(layer, used);
  bool all_ready = true;
  for (size_t i = 0; i < ew.size(); ++i) all_ready = all_ready && experts_->ready(i);
  if (!all_ready) {
    moe_grouped(layer, xn, N, ids_dev, wts_dev, out, &ew, &ids);
    return;
  }
  for (size_t i = 0; i < ew.size(); ++i) experts_->await(i);

  if (streamed_banks_.empty()) streamed_banks_.resize(size_t(c.num_layers));
  ExpertBank& bank = streamed_banks_[size_t(layer)];
  if (bank.gate.empty()) {
    // Every entry must be a valid expert of the bank's shape: start them all at the first one.
    const ExpertWeights& first = *ew[0];
    bank.gate.assign(size_t(c.n_routed_experts), first.gate);
    bank.up.assign(size_t(c.n_routed_experts), first.up);
    bank.down.assign(size_t(c.n_routed_experts), first.down);
    add_shared_expert(weights_.layers[size_t(layer)], bank);
  }
  for (size_t i = 0; i < used.size(); ++i) {
    bank.gate[size_t(used[i])] = ew[i]->gate;
    bank.up[size_t(used[i])] = ew[i]->up;
    bank.down[size_t(used[i])] = ew[i]->down;
  }
  moe_bank(layer, xn, N, ids_dev, wts_dev, bank, out);
}

// The routed experts by id from `bank`, then the shared expert when the bank does not hold it.
void GlmDsaModel::moe_bank(int layer, const float* xn, int64_t N, const int32_t* ids_dev, const float* wts_dev,
                           const ExpertBank& bank, float* out) {
  const LayerWeights& L = weights_.layers[size_t(layer)];
  const int64_t D = config_.hidden_size;
  backend_.moe_experts(xn, N, ids_dev, wts_dev, config_.experts_per_token, bank, out);
  if (L.has_shared && bank.n_shared == 0) {
    float* s = scratch(26, size_t(N * D));
    mlp(L.shared, xn, N, s, kMoeMlpSlot);
    backend_.add(out, s, N * D);
  }
}

void GlmDsaModel::moe_grouped(int layer, const float* xn, int64_t N, const int32_t* ids_dev, const float* wts_dev,
                              float* out, const std::vector<const ExpertWeights*>* prepared,
                              const std::vector<int32_t>* host_ids) {
  const GlmDsaConfig& c = config_;
  const LayerWeights& L = weights_.layers[size_t(layer)];
  const int64_t D = c.hidden_size, K = c.experts_per_token, I = c.moe_intermediate_size;
  // Tokens grouped by expert on the backend (stable: each expert's tokens ascending, the order in
  // which scatter_add_rows accumulates). The host reads back only the n_experts + 1 offsets: which
  // experts this step uses (the store needs them) and their row counts (the matmuls need them).
  const int E = c.n_routed_experts;
  int32_t* offsets_dev = scratch_i32(3, size_t(E + 1));
  int32_t* token_of = scratch_i32(5, size_t(N * K));
  float* weight_of = scratch(28, size_t(N * K));
  backend_.moe_group(ids_dev, wts_dev, N, int(K), E, offsets_dev, token_of, weight_of);
  std::vector<int32_t> offsets(static_cast<size_t>(E + 1), 0);
  if (host_ids) {
    // The same counts moe_group makes, from the ids the host already holds: no second wait for
    // the device in this layer (a streamed layer with copies in flight).
    VIREO_ASSERT(host_ids->size() == size_t(N * K));
    for (int32_t id : *host_ids) {
      if (id < 0 || id >= E) fail("moe: expert id ", id, " out of range [0, ", E, ")");
      ++offsets[size_t(id) + 1];
    }
    for (int e = 0; e < E; ++e) offsets[size_t(e) + 1] += offsets[size_t(e)];
  } else {
    backend_.copy_to_host_i32(offsets.data(), offsets_dev, offsets.size());
  }

  // One pass per distinct expert over the tokens routed to it (the expert union of the whole
  // step), in ascending expert order as the oracle accumulates.
  std::vector<int> used;
  for (int e = 0; e < E; ++e)
    if (offsets[size_t(e) + 1] > offsets[size_t(e)]) used.push_back(e);
  backend_.fill(out, 0.0f, N * D);
  float* xs = scratch(22, size_t(N * D));
  // gate and up in one buffer, up after gate: a backend may run the two products as one batch.
  const int64_t gu_width = L.has_shared ? std::max(I, L.shared.gate.out()) : I;
  float* g = scratch(23, size_t(2 * N * gu_width));
  float* u = g + N * gu_width;
  float* y = scratch(25, size_t(N * D));
  auto run_expert = [&](const ExpertWeights* e, int expert, float* rows) {
    const int64_t at = offsets[size_t(expert)], m = offsets[size_t(expert) + 1] - at;
    backend_.expert_rows(xn, token_of + at, m, e->gate, e->up, e->down, xs, g, u, rows);
  };
  // The shared expert is added last, as the oracle sums: routed experts in ascending id order,
  // then the shared expert. With every expert resident it is the last (dense) job of the last
  // run, which a backend may compute with the routed ones (CUDA's grouped products). A streaming
  // store runs it first instead, into its own buffer, while the first routed experts are still
  // on their way. The same ops either way (Backend::dense_expert_add), so the same bits.
  const bool shared_in_run = L.has_shared && experts_->bank(layer) != nullptr && !prepared;
  float* shared = L.has_shared && !shared_in_run ? scratch(26, size_t(N * D)) : nullptr;
  // A streaming store may hold fewer experts than the union: ask for it in chunks, in expert
  // order. Experts already in memory that come after one still loading run first, their rows
  // kept (up to max(N, 64) rows) until their turn in the ascending-order sum; the others run as
  // their bytes arrive.
  const size_t chunk = std::max<size_t>(1, experts_->max_experts_per_prepare());
  const int64_t early_cap = std::min<int64_t>(N * K, std::max<int64_t>(N, 64));
  float* early = nullptr;
  for (size_t c0 = 0; c0 < used.size(); c0 += chunk) {
    const size_t n = std::min(chunk, used.size() - c0);
    // `prepared`: the caller has already asked for the whole union (one chunk).
    VIREO_ASSERT(!prepared || (c0 == 0 && n == used.size() && prepared->size() == n));
    const std::vector<const ExpertWeights*> ew =
        prepared ? *prepared
                 : experts_->prepare_async(layer, std::vector<int>(used.begin() + long(c0), used.begin() + long(c0 + n)));
    if (c0 == 0 && shared) mlp(L.shared, xn, N, shared, kMoeMlpSlot);
    std::vector<float*> rows(n, nullptr);
    int64_t early_rows = 0;
    bool behind_a_miss = false;
    for (size_t i = 0; i < n; ++i) {
      if (!experts_->ready(i)) {
        behind_a_miss = true;
        continue;
      }
      const int e = used[c0 + i];
      const int64_t m = offsets[size_t(e) + 1] - offsets[size_t(e)];
      if (!behind_a_miss || early_rows + m > early_cap) continue;
      if (!early) early = scratch(40, size_t(early_cap * D));
      experts_->await(i);
      rows[i] = early + early_rows * D;
      early_rows += m;
      run_expert(ew[i], e, rows[i]);
    }
    // The rest in ascending order: runs of experts go to the backend as one experts_add (which
    // may compute them concurrently); a run is handed over before the host waits for an expert
    // still loading, and before an early expert's rows are added in their turn.
    std::vector<Backend::ExpertJob> run;
    auto flush = [&] {
      if (!run.empty()) backend_.experts_add(xn, token_of, weight_of, run.data(), int(run.size()), xs, g, u, y, out);
      run.clear();
    };
    for (size_t i = 0; i < n; ++i) {
      const int e = used[c0 + i];
      const int64_t at = offsets[size_t(e)], m = offsets[size_t(e) + 1] - at;
      if (rows[i]) {
        flush();
        backend_.scatter_add_rows(out, token_of + at, weight_of + at, rows[i], m, D);
        continue;
      }
      if (!experts_->ready(i)) flush();
      experts_->await(i);
      run.push_back({&ew[i]->gate, &ew[i]->up, &ew[i]->down, at, m});
    }
    if (shared_in_run && c0 + n >= used.size())
      run.push_back({&L.shared.gate, &L.shared.up, &L.shared.down, 0, N, true});
    flush();
  }
  if (shared_in_run && used.empty()) {
    const Backend::ExpertJob dense{&L.shared.gate, &L.shared.up, &L.shared.down, 0, N, true};
    backend_.experts_add(xn, token_of, weight_of, &dense, 1, xs, g, u, y, out);
  }
  if (shared) {
    if (used.empty()) mlp(L.shared, xn, N, shared, kMoeMlpSlot);
    backend_.add(out, shared, N * D);
  }
}

// Guesses layer+1's experts from this layer's post-attention residual (layer+1's FFN norm and
// router on it) and hands the guess to the store, so their reads overlap this layer's MoE.
void GlmDsaModel::prefetch_next(int layer, const float* h, int64_t N) {
  const GlmDsaConfig& c = config_;
  const int next = layer + 1;
  if (next >= c.num_layers || c.layer_dense[size_t(next)]) return;
  const LayerWeights& L = weights_.layers[size_t(next)];
  const int64_t D = c.hidden_size, K = c.experts_per_token;
  float* xn = scratch(29, size_t(N * D));
  backend_.rms_norm(h, D, N, D, vec(L.ffn_norm), float(c.rms_norm_eps), xn, D);
  int32_t* ids_dev = scratch_i32(4, size_t(N * K));
  float* wts_dev = scratch(30, size_t(N * K));
  backend_.moe_route(xn, N, router_args(L), ids_dev, wts_dev);
  std::vector<int32_t> ids(static_cast<size_t>(N * K));
  backend_.copy_to_host_i32(ids.data(), ids_dev, ids.size());
  std::vector<int> guess(ids.begin(), ids.end());
  std::sort(guess.begin(), guess.end());
  guess.erase(std::unique(guess.begin(), guess.end()), guess.end());
  experts_->prefetch(next, guess);
}

}  // namespace vireo
