#pragma once
// GlmDsaModel: the forward pass of the GLM-DSA family (spec §3), written once against Backend.
#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "cache/mla_cache.h"
#include "experts/expert_store.h"
#include "io/safetensors.h"
#include "model/glm_dsa/config.h"
#include "model/glm_dsa/weights.h"

namespace vireo {

enum class AttentionPath : uint8_t {
  Auto,           // per sequence, whichever path costs fewer multiply-adds (see choose_path)
  Reconstructed,  // expand latents through kv_b (prefill)
  Absorbed,       // attend over latents directly (decode)
};

// The expert store's view of a model: which layers are MoE and the experts' shapes.
ExpertStoreParams expert_store_params(const GlmDsaConfig& c);

// One sequence's share of a batched forward step.
struct BatchItem {
  int row = 0;                      // cache row (the sequence)
  const int32_t* tokens = nullptr;  // [T] new tokens, at positions cache.length(row) ..
  int64_t T = 0;
  float* logits = nullptr;          // host: [T, vocab] if all_logits, else [1, vocab] (last token); may be null
  bool all_logits = false;
  // all_logits without `logits`: the rows handed over as lm_head makes them, a slice at a time
  // (host [n, vocab]: rows [first, first + n) of the item's T, valid during the call), so that
  // neither the caller nor the model holds [T, vocab] (see GlmDsaModel::set_logit_rows).
  std::function<void(int64_t first, int64_t n, const float* rows)> rows_out;
  // Host, same rows as logits: tokens chosen on the backend, so no logits need copying back: the
  // argmax of each row, or with `sample` (host, one per row) Backend::sample_rows' draws.
  int32_t* token = nullptr;
  const SampleRowArgs* sample = nullptr;
  // Pipelined decoding (GlmDsaModel::queue_step): the one token is the pick of the step before
  // (same cache row, one sequence), read from backend memory, `tokens` unused; and this step's
  // pick is queued for reading back (Backend::queue_read_i32) instead of waited for in `token`.
  bool token_from_pick = false;
  bool queue_pick = false;
  // With queue_pick, greedy (no sample, no logits), one token of one sequence: this many decode
  // steps back to back (a chunk), each on the pick of the one before, their picks read back in
  // one queued read (GlmDsaModel::queue_step's `steps`).
  int steps = 1;
  // Keep every row's final-norm hidden state (the main model's h_t) in backend memory for
  // GlmDsaModel::mtp_forward, until the next forward: all of a batch's items or none, not queued,
  // not a chunk. Such a step runs eagerly (never from a recording).
  bool keep_hidden = false;
};

// One cache row's part of a batched MTP pass (GlmDsaModel::mtp_forward_batch).
struct MtpItem {
  int row = 0;                    // cache row, one the last forward kept hidden rows of
  int64_t first = 0;              // the first of this row's kept hidden rows to read
  int64_t T = 0;                  // rows read, at positions pos0 .. pos0 + T - 1
  const int32_t* next = nullptr;  // host [T]: the token that followed each row's position
  int64_t pos0 = 0;               // the position of hidden row `first` (checked)
  float* logits = nullptr;        // host: [T, vocab] if all_logits, else the last row's; may be null
  bool all_logits = false;
  int32_t* draft = nullptr;  // host: the argmax of the same rows; may be null
};

class GlmDsaModel {
 public:
  // Loads config, maps the checkpoint and binds the weights. `experts` may be null: then every
  // routed expert is bound resident from the checkpoint.
  static std::unique_ptr<GlmDsaModel> load(const std::string& dir, Backend& backend,
                                           std::unique_ptr<ExpertStore> experts = nullptr);

  // Builds a model over an already opened checkpoint (e.g. an in-memory synthetic one).
  static std::unique_ptr<GlmDsaModel> create(GlmDsaConfig config, std::unique_ptr<Checkpoint> ck, Backend& backend,
                                             std::unique_ptr<ExpertStore> experts = nullptr);

  const GlmDsaConfig& config() const { return config_; }
  const GlmDsaWeights& weights() const { return weights_; }
  const Checkpoint& checkpoint() const { return *checkpoint_; }
  ExpertStore& experts() { return *experts_; }
  Backend& backend() { return backend_; }
  MlaCacheShape cache_shape() const;

  // Runs tokens[0..T) at positions cache.length(row) .. +T through the model, appending their
  // entries to cache row `row`. Writes logits for every token ([T, vocab]) when all_logits, else
  // for the last token only ([1, vocab]); `logits` is host memory.
  void forward(const int32_t* tokens, int64_t T, MlaCache& cache, int row, float* logits,
               bool all_logits = false, AttentionPath path = AttentionPath::Auto);
  // One step over several sequences (distinct cache rows) at once: every matrix product runs
  // over all items' tokens together and each MoE layer runs the union of their experts once;
  // attention and DSA selection run per item over its own row. Auto picks the absorbed path for
  // items with T == 1 and the reconstructed path otherwise.
  void forward_batch(const std::vector<BatchItem>& items, MlaCache& cache, AttentionPath path = AttentionPath::Auto);

  // Pipelined decoding of one sequence: queue_step runs one decode step at the end of cache row
  // `row` on `token` (host), or with token == nullptr on the pick of the step queued before it,
  // which stays in backend memory; it picks the next token on the backend (argmax, or
  // Backend::sample_rows with *sample) and returns without waiting. take_step waits for the
  // oldest queued step and returns its pick. With the next step queued before this one's pick is
  // read, the host's work between steps (a recorded step's launch included: 67-92 us of an
  // 8-layer FP8 step on an H200) overlaps the step before.
  // With steps > 1 (greedy only: sample must be null) it queues a chunk of that many steps, each
  // on the pick of the one before: on a backend that records, one recording (one CUDA graph
  // launch) runs the whole chunk, so the GPU's idle between steps (the graph's start, the read of
  // the pick and the positions' copy: ~16 us of an H200 step) comes once a chunk; take_step then
  // returns the chunk's picks one by one. At most Backend::kMaxQueuedReads chunks (or single
  // steps) are queued at a time, each of at most Backend::kMaxQueuedRead steps.
  // Returns the steps queued: `steps`, or fewer where a recorded chunk would cross a context bound
  // at which one step at a time changes recordings (the caller queues the rest next).
  int queue_step(const int32_t* token, MlaCache& cache, int row, const SampleRowArgs* sample = nullptr, int steps = 1);
  int32_t take_step();
  // Picks queued and not yet taken (every step of every queued chunk).
  int queued_steps() const {
    int n = int(taken_picks_.size());
    for (int k : queued_chunks_) n += k;
    return n;
  }
  // Positions the rope table kept across steps holds (at most the largest cache capacity seen, or
  // the furthest position asked for where that is larger).
  int64_t rope_table_positions() const { return rope_rows_; }

  // As forward(), returning the next token chosen on the backend (no logits copied): the argmax
  // when `sample` is null, else the draw Backend::sample_rows makes with *sample.
  int32_t forward_next(const int32_t* tokens, int64_t T, MlaCache& cache, int row, const SampleRowArgs* sample,
                       AttentionPath path = AttentionPath::Auto);
  int32_t forward_greedy(const int32_t* tokens, int64_t T, MlaCache& cache, int row,
                         AttentionPath path = AttentionPath::Auto) {
    return forward_next(tokens, T, cache, row, nullptr, path);
  }

  // Decode steps (every item one token) on a backend that can record ops run from a recording
  // (a CUDA graph) made once per batch of cache rows: one launch per step instead of hundreds.
  // On by default; off runs every op eagerly (same results: tests compare the two).
  void set_recording(bool on) { recording_enabled_ = on; }
  // A recorded greedy one-token step of one sequence ends with its argmax inside the recording
  // (on, the default; VIREO_ARGMAX_IN_STEP=0 turns it off) or the host launches it after the step
  // (off). The same picks either way.
  void set_argmax_in_step(bool on) { argmax_in_step_on_ = on; }
  // Steps run from a recording since construction (for tests and bench).
  int64_t recorded_steps_run() const { return recorded_runs_; }
  // Host seconds spent in forward_batch since reset_host_times (bench): before the step's ops are
  // launched (validation, the inputs and their copies), launching them (a recording's replay, or
  // every op of an eager step), and after (the picks and logits copied back: with a token read
  // back, the wait for the GPU's step).
  struct HostTimes {
    double before_launch_s = 0, launch_s = 0, after_launch_s = 0;
    int64_t steps = 0;
  };
  const HostTimes& host_times() const { return host_times_; }
  void reset_host_times() { host_times_ = {}; }
  // Bench: the most recently used recorded step (not a streaming store's, which reads ids back),
  // replayed `n` times back to back with its inputs as they are (the same tokens and positions),
  // each followed by its greedy pick, then waited for: a step's GPU time without the host's work
  // between steps. Returns the decode steps run (n times the recording's chunk of steps), 0 when
  // no such step has been recorded.
  int64_t replay_latest(int n);

  // The MTP layer (bound where enable_mtp(config) ran before the model was built): for the hidden
  // rows [first, first + T) kept by the last forward (BatchItem::keep_hidden: the main model's
  // final-norm states h_t of cache row `row`) and the tokens that followed them (next, host [T]),
  // runs u = eh_proj([enorm(embed(next)) ; hnorm(h)]) through the MTP decoder layer at positions
  // pos0 .. pos0 + T - 1 (those of the h rows: at most the main model's length), writing the MTP
  // layer's own entries of the cache row (its length is the caller's to keep: the entries past it
  // are overwritten as it goes), then shared_head.norm and the main lm_head. Writes the logits
  // (host: [T, vocab] if all_logits, else the last row's) and/or `draft` (host: the argmax of
  // the same rows, each the MTP's guess for the token after the row's next); with neither, only the
  // cache entries (no head). The hidden rows stay valid.
  void mtp_forward(int64_t first, int64_t T, const int32_t* next, MlaCache& cache, int row, int64_t pos0, float* logits,
                   bool all_logits, int32_t* draft);
  // The same for several cache rows in one pass (each row's results equal its own mtp_forward's),
  // `first` indexing the rows the last forward kept of that item's cache row.
  void mtp_forward_batch(const std::vector<MtpItem>& items, MlaCache& cache);
  bool has_mtp() const { return config_.mtp_layers > 0; }

  // The most rows of logits a step holds in backend memory (0, the default: every row it asks
  // for). A step asking for more (a prompt chunk's rows for prompt_logprobs) runs lm_head over
  // them in slices of `rows`, each copied out (or handed to BatchItem::rows_out) before the next:
  // a server's memory plan counts `rows` rows, whatever its prompts ask (cli/cmd_serve.cpp).
  void set_logit_rows(int64_t rows);
  // The rows of logits the model's buffer holds now (it grows to the largest slice a step made).
  int64_t logit_buffer_rows() const;

  // The path AttentionPath::Auto takes for T new tokens after pos0 cached ones.
  AttentionPath choose_path(int64_t T, int64_t pos0) const;

  // Bytes the forward pass reads per decoded token: the dense spine's matrices that every token
  // uses plus experts_per_token routed experts per MoE layer (embedding: one row).
  size_t active_weight_bytes_per_token() const { return active_bytes_; }
  // The bytes of weights one decode token at n_keys keys (itself included) reads: as above, less
  // the indexer's query product and head weights where DSA is dense (n_keys <= index_topk: the
  // selection would be every causal key, forward skips them and runs only the key product).
  size_t decode_weight_bytes(int64_t n_keys) const;

 private:
  GlmDsaModel(GlmDsaConfig config, std::unique_ptr<Checkpoint> ck, Backend& backend);
  // Per-item bookkeeping of a batched step.
  struct Segment {
    int row;
    int64_t offset, T, pos0;  // rows [offset, offset + T) of the step's token matrix
    AttentionPath path;
    bool all_logits = false;
    const int32_t* pos0_dev = nullptr;  // pos0 in backend memory (recorded steps), else null
  };
  // A recorded decode step for one batch of cache rows, valid while no scratch buffer (ours or
  // the backend's) has been reallocated since it was recorded.
  // A streamed MoE layer of a recorded step, run between two recorded pieces (moe_streamed).
  struct StreamStage {
    int layer;
    const float* xn;
    const int32_t* ids;
    const float* weights;
    float* out;
  };
  // With a streaming store the recording is in pieces, split after each MoE layer's router:
  // replay runs pieces[0], stages[0], pieces[1], ...
  struct RecordedStep {
    std::vector<std::unique_ptr<RecordedOps>> pieces;
    std::vector<StreamStage> stages;
    uint64_t model_gen = 0, backend_gen = 0;
    int steps = 1;        // decode steps a replay runs (a chunk: queue_step's `steps`)
    bool warmed = false;  // an eager run at these sizes has allocated every buffer
    uint64_t last_use = 0;
  };
  bool can_record_step(const std::vector<Segment>& segs, int64_t N) const;
  void run_recorded(std::vector<Segment>& segs, int64_t N, MlaCache& cache, const int32_t* ids, float* logits,
                    int steps);
  // run_step, or with steps > 1 (one token of one sequence) that many steps back to back, step j
  // on pick slot j and picking into slot (j + 1) % steps (picks: scratch_i32(8)).
  void run_steps(std::vector<Segment>& segs, int64_t N, MlaCache& cache, const int32_t* ids, float* logits, int steps);
  // Embedding, layers, final norm and lm_head for one step: logits [rows asked for, vocab].
  void run_step(const std::vector<Segment>& segs, int64_t N, MlaCache& cache, const int32_t* ids, float* logits);
  // lm_head over `n` final-norm rows in backend memory ([n, hidden]) in slices of at most
  // logit_rows_ rows (one slice when unbounded), each into scratch slot 3, then emit(lg, a, b)
  // for rows [a, b) (lg: row a's logits) before the next slice overwrites them.
  void head_slices(const float* rows, int64_t n, const std::function<void(const float*, int64_t, int64_t)>& emit);
  void rope_table(int64_t pos0, int64_t T, float* cos_sin) const;  // host [T, rope/2, 2]
  // rope_host_ and rope_dev_ then hold positions [0, end) at least, [0, max(end, cap)) at most.
  void grow_rope_table(int64_t end, int64_t cap);
  void attention(int layer, const float* xn, int64_t N, const std::vector<Segment>& segs, MlaCache& cache,
                 float* out);
  void moe(int layer, const float* xn, int64_t N, float* out);
  // Routed experts grouped by expert (the union of the step's experts, one product each), then
  // the shared expert; with a streaming store, compute overlaps the experts' transfers.
  // `prepared`: the step's expert union (ascending), already asked of the store by the caller;
  // `host_ids`: the step's ids [N, top_k], already read back by the caller (the experts' row
  // counts then come from them, not from a second round trip).
  void moe_grouped(int layer, const float* xn, int64_t N, const int32_t* ids, const float* weights, float* out,
                   const std::vector<const ExpertWeights*>* prepared = nullptr,
                   const std::vector<int32_t>* host_ids = nullptr);
  // Few tokens, a streaming store (streams_fused): the expert ids come back to the host and the
  // store makes those experts ready; when all are already in slots they run by id in the
  // backend's fused launches from a bank pointing at their slots (as resident experts run), else
  // moe_grouped runs what is ready while the rest is copied.
  void moe_streamed(int layer, const float* xn, int64_t N, const int32_t* ids, const float* weights, float* out);
  bool streams_fused(int layer, int64_t N) const;  // moe() of `layer` takes moe_streamed
  void replay(RecordedStep& r, int64_t N);
  void moe_bank(int layer, const float* xn, int64_t N, const int32_t* ids, const float* weights,
                const ExpertBank& bank, float* out);
  RouterArgs router_args(const LayerWeights& L) const;
  void prefetch_next(int layer, const float* h, int64_t N);  // next layer's router -> experts_->prefetch
  // Scratch slots scratch_slot and scratch_slot + 1 hold the gate and up products. The MoE paths'
  // shared expert uses its own pair (kMoeMlpSlot), apart from the dense layers' (see replay()).
  static constexpr int kMoeMlpSlot = 41;
  // The kept final-norm hidden rows (BatchItem::keep_hidden) and mtp_forward's own buffers.
  static constexpr int kHiddenSlot = 70, kMtpInputSlot = 71, kMtpIdsSlot = 70, kMtpPickSlot = 71;
  void gate_up(const float* x, int64_t T, const Weight& gate, const Weight& up, float* g, float* u);
  void mlp(const MlpWeights& w, const float* x, int64_t T, float* out, int scratch_slot = 20);
  float* scratch(int slot, size_t n);
  int32_t* scratch_i32(int slot, size_t n);
  // The pick buffer (scratch_i32 slot 8): one sequence's step reads its token here and picks
  // into it; a chunk's steps use one slot each. Never smaller than Backend::kMaxQueuedRead, so a
  // chunk does not reallocate it under the pick a following step reads.
  int32_t* pick_slots(size_t n) { return scratch_i32(8, std::max(n, Backend::kMaxQueuedRead)); }
  void upload_weights();
  void make_fused_banks();
  const float* vec(const std::vector<float>& host) const;  // backend copy of a norm vector

  GlmDsaConfig config_;
  std::unique_ptr<Checkpoint> checkpoint_;
  Backend& backend_;
  GlmDsaWeights weights_;
  std::unique_ptr<ExpertStore> experts_;
  std::vector<ExpertBank> fused_banks_;  // [layer]: the store's bank (+ the shared expert), see moe()
  // [layer]: with a streaming store, the bank moe_streamed last ran: entries of the experts
  // it used point at their slots; the others are stale (never read: no id selects them).
  std::vector<ExpertBank> streamed_banks_;
  std::vector<float> inv_freq_;  // [rope/2]
  // active_weight_bytes_per_token, counted once at load (checkpoint lookups a layer; the bench asks
  // for it a decode step).
  size_t active_bytes_ = 0;
  size_t count_active_weight_bytes() const;
  float* cos_sin_ = nullptr;     // backend copy of this step's rope table [N, rope/2, 2]
  const int32_t* step_pos_ = nullptr;  // a recorded step's positions in backend memory [sequences]
  // The rope table of positions [0, rope_rows_) [position, rope/2, 2], and its backend copy.
  std::vector<float> rope_host_;
  std::shared_ptr<float> rope_dev_;
  int64_t rope_rows_ = 0;
  // The last step's pick in backend memory when it ran one sequence (null otherwise), and where.
  const int32_t* last_pick_ = nullptr;
  uint64_t last_pick_cache_ = 0;
  int last_pick_row_ = -1;
  bool argmax_in_step_on_;       // set_argmax_in_step (model.cpp: the default)
  bool argmax_in_step_ = false;  // this step's run_step (and its recording) ends with its pick
  int32_t* step_pick_ = nullptr;     // where run_step's argmax goes (argmax_in_step_)
  bool keep_hidden_ = false;         // this step's run_step keeps its hidden rows (kHiddenSlot)
  int64_t logit_rows_ = 0;           // set_logit_rows
  // This step's run_step stops before lm_head (the rows come in slices: head_slices) and leaves
  // its final-norm rows at head_rows_ ([rows asked for, hidden] in backend memory).
  bool defer_head_ = false;
  const float* head_rows_ = nullptr;
  std::vector<float> host_rows_;  // a slice of rows on its way to BatchItem::rows_out
  // The rows the last forward kept (kHiddenSlot), one entry a cache row: none when empty.
  struct KeptRows {
    int row = 0;
    int64_t offset = 0, T = 0, pos0 = 0;  // rows [offset, offset + T) of the slot, from position pos0
  };
  std::vector<KeptRows> hidden_kept_;
  uint64_t hidden_cache_ = 0;        // ... of this cache
  std::deque<int> queued_chunks_;    // queue_step's reads not yet taken: steps in each
  std::deque<int32_t> taken_picks_;  // picks of a chunk read back and not yet returned by take_step
  std::vector<std::shared_ptr<float>> scratch_;
  std::vector<size_t> scratch_size_;
  std::vector<std::shared_ptr<int32_t>> scratch_i32_;
  std::vector<size_t> scratch_i32_size_;
  std::map<const void*, std::shared_ptr<float>> vectors_;  // host norm vector -> backend copy
  uint64_t scratch_gen_ = 0;   // bumped whenever a scratch buffer is reallocated
  bool recording_ = false;     // ops are being recorded: scratch must not grow
  RecordedStep* recording_into_ = nullptr;  // where moe() puts the pieces while recording
  bool recording_enabled_ = true;
  // (cache id, rows, bound on every row's length, whether it ends with the argmax, steps) -> its recording
  std::map<std::tuple<uint64_t, std::vector<int>, int64_t, bool, int>, RecordedStep> recorded_;
  // A recorded step's launches are sized for rows of up to this many keys (their lengths come at
  // run time): the smallest of the backend's short-context bound, the indexer's top-k, the powers
  // of two from twice the larger of those, and the cache's capacity that holds the step, so that
  // short contexts get launches sized for them (short-context kernels; at most index_topk keys
  // DSA is dense), and long ones launches sized within 2x of their keys.
  int64_t step_bound_ = 0;  // 0: the cache's capacity
  int64_t step_bound(const MlaCache& cache) const;
  // The smallest of the bounds above that holds rows of `longest` keys.
  int64_t keys_bound(int64_t longest, const MlaCache& cache) const;
  // The bound a one-token step after pos0 cached keys is recorded for.
  int64_t one_step_bound(int64_t pos0, const MlaCache& cache) const { return keys_bound(pos0 + 1, cache); }
  int chunk_steps_run_ = 1;  // the steps forward_batch's last chunk ran (queue_step's result)
  uint64_t step_clock_ = 0;
  int64_t recorded_runs_ = 0;
  HostTimes host_times_;
};

}  // namespace vireo
