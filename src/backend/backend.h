#pragma once
// The Backend interface: the coarse ops the forward pass is written against. Activations are f32
// buffers the backend allocated (host memory for the CPU backend, device memory for CUDA);
// weights are stored-dtype `Weight`s bound from the checkpoint. The CPU backend is the reference;
// every other backend is checked against it op by op.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>

#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/sampling.h"
#include "core/error.h"
#include "core/tensor.h"

namespace vireo {

enum class RopeKind : uint8_t {
  Interleaved,  // pairs (x[2i], x[2i+1]); written back as [rotated evens | rotated odds] (oracle layout)
  HalfSplit,    // pairs (x[i], x[i + r/2])
};

// Which keys each query may attend to. `keys == nullptr` means every causal key (u <= position).
struct KeySelection {
  const int32_t* keys = nullptr;    // [T, stride] positions, ascending, `counts[t]` valid
  const int32_t* counts = nullptr;  // [T]
  int64_t stride = 0;
};

struct MlaAttentionArgs {
  const float* q = nullptr;   // [T, H, qk_nope + qk_rope], rope part rotated
  int64_t T = 0, n_heads = 0, qk_nope = 0, qk_rope = 0, v_dim = 0, kv_lora = 0;
  const float* kv = nullptr;  // [N, kv_lora + qk_rope]: normalized latent | rotated k_rope
  int64_t n_keys = 0;         // N: cached keys, including these T queries' own
  int64_t pos0 = 0;           // position of query 0 (queries are pos0 .. pos0 + T - 1)
  // When set, pos0 is read at run time from backend memory ([1]) and `pos0` / `n_keys` above are
  // only upper bounds (they size the launch): a recorded decode step replays with new positions.
  const int32_t* pos0_dev = nullptr;
  const Weight* kv_b = nullptr;  // [H * (qk_nope + v_dim), kv_lora]
  float scale = 1.0f;         // sigma
  KeySelection selection;
  bool absorbed = false;      // absorbed (decode) path vs reconstructed (prefill) path
  float* out = nullptr;       // [T, H, v_dim]
};

struct IndexerArgs {
  const float* q = nullptr;        // [T, n_heads, head_dim], rope part rotated
  const float* weights = nullptr;  // [T, n_heads], as the head weights' product gives them
  const float* keys = nullptr;     // [N, head_dim]
  int64_t T = 0, n_heads = 0, head_dim = 0, n_keys = 0, pos0 = 0;
  int64_t topk = 0;
  const int32_t* pos0_dev = nullptr;  // as MlaAttentionArgs::pos0_dev (n_keys: the bound, and the row stride)
  float scale = 1.0f;              // head_dim^-1/2
  // Each head weight is first multiplied by this (one float product, as a separate scale op would
  // round it): n_heads^-1/2. Folded into the scores, where a decode step paid a kernel for it.
  float weight_scale = 1.0f;
  int32_t* selected = nullptr;     // [T, topk] key positions, ascending
  int32_t* counts = nullptr;       // [T]
};

struct RouterArgs {
  const Weight* gate = nullptr;  // [n_experts, hidden]
  const float* bias = nullptr;   // [n_experts] e_score_correction_bias (selection only)
  int n_experts = 0, n_group = 1, topk_group = 1, top_k = 0;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};

// Every routed expert of one MoE layer, resident in the backend's memory: gate/up [I, D] and
// down [D, I] per expert, one dtype and shape throughout. The forward pass can then run experts
// by id from backend memory, with no host round trip (Backend::moe_experts). A streaming store's
// bank is repointed between steps at the slots its experts occupy now: moe_experts must run
// with the entries the bank holds when it is called (a backend caching a copy updates it).
struct ExpertBank {
  std::vector<Weight> gate, up, down;  // [n_routed + n_shared]
  // The last n_shared entries are shared experts: they run for every token with weight 1, after
  // the routed ones (so their sum lands where `out += shared(x)` would put it).
  int n_shared = 0;
};

// A recorded sequence of backend ops (a CUDA graph), replayed with the arguments it was recorded
// with: the same pointers and scalars; the memory they point to may hold new values.
class RecordedOps {
 public:
  virtual ~RecordedOps() = default;
  virtual void replay() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // Scratch memory for activations (f32) and indices (i32), owned by the returned buffer.
  virtual std::shared_ptr<float> alloc_f32(size_t n) = 0;
  virtual std::shared_ptr<int32_t> alloc_i32(size_t n) = 0;
  virtual void copy_to_host(float* dst, const float* src, size_t n) = 0;
  virtual void copy_from_host(float* dst, const float* src, size_t n) = 0;
  virtual void copy_to_host_i32(int32_t* dst, const int32_t* src, size_t n) = 0;
  virtual void copy_from_host_i32(int32_t* dst, const int32_t* src, size_t n) = 0;
  // dst[0:n] = src[0:n], both backend memory, queued like an op (a decode step's input token
  // from the step before's pick, which never leaves the device). This default goes via the host.
  virtual void copy_i32(int32_t* dst, const int32_t* src, size_t n) {
    std::vector<int32_t> t(n);
    copy_to_host_i32(t.data(), src, n);
    copy_from_host_i32(dst, t.data(), n);
  }
  // Reading back without waiting (pipelined decoding): queue_read_i32 queues a copy of src[0:n]
  // (backend memory, n <= kMaxQueuedRead) behind every op queued so far and returns at once;
  // take_read_i32 waits for the oldest read still queued and writes its n values to dst. At most
  // kMaxQueuedReads reads are queued at a time. This default reads at once.
  static constexpr size_t kMaxQueuedRead = 64;
  static constexpr int kMaxQueuedReads = 8;
  virtual void queue_read_i32(const int32_t* src, size_t n) {
    check_queued_read(n);
    reads_.emplace_back(n);
    copy_to_host_i32(reads_.back().data(), src, n);
  }
  virtual void take_read_i32(int32_t* dst, size_t n) {
    if (reads_.empty()) fail("take_read_i32: no read is queued");
    if (reads_.front().size() != n) fail("take_read_i32: ", n, " values asked of a read of ", reads_.front().size());
    std::copy(reads_.front().begin(), reads_.front().end(), dst);
    reads_.erase(reads_.begin());
  }
  // Makes a checkpoint weight usable by this backend's ops (the CPU backend uses the mapped
  // bytes as they are; a GPU backend uploads them once, in their stored dtype).
  virtual Weight upload_weight(const Weight& w) { return w; }
  // upload_weight for weights that share their input (an attention layer's q_a, indexer keys and
  // kv_a): a backend may place them side by side, in this order, and then run matmul_many over
  // a run of adjacent ones as one product. Each *ws[i] is replaced by its usable form.
  virtual void upload_weights_adjacent(Weight* const* ws, int n) {
    for (int i = 0; i < n; ++i)
      if (!ws[i]->w.empty()) *ws[i] = upload_weight(*ws[i]);
  }

  // dst[r, 0:n] = src[r, 0:n] for r < rows, with row strides.
  virtual void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                         int64_t n) = 0;
  virtual void fill(float* y, float v, int64_t n) = 0;

  // out[t] = table[ids[t]] as f32; ids in backend memory, already checked to be in range.  out [T, hidden]
  virtual void embed(const Weight& table, const int32_t* ids, int64_t T, float* out) = 0;
  // y = w * x / sqrt(mean(x^2) + eps), row by row.                  x, y [T, n] (row strides)
  virtual void rms_norm(const float* x, int64_t x_stride, int64_t T, int64_t n, const float* w, float eps,
                        float* y, int64_t y_stride) = 0;
  // h = embed(table, ids), then y = rms_norm(h): a step's first two ops in one pass where the
  // backend can (the same bits as the two in turn).                 h, y [T, hidden]
  virtual void embed_rms_norm(const Weight& table, const int32_t* ids, int64_t T, const float* w, float eps, float* h,
                              float* y) {
    embed(table, ids, T, h);
    rms_norm(h, table.in(), T, table.in(), w, eps, y, table.in());
  }
  // h += x, then y = rms_norm(h) (the residual add and the next norm in one pass).  h, x, y [T, n]
  virtual void add_rms_norm(float* h, const float* x, int64_t T, int64_t n, const float* w, float eps, float* y) {
    add(h, x, T * n);
    rms_norm(h, n, T, n, w, eps, y, n);
  }
  // y = (x - mean) / sqrt(var + eps) * w + b.                       x, y [T, n]
  virtual void layer_norm(const float* x, int64_t T, int64_t n, const float* w, const float* b, float eps,
                          float* y) = 0;
  // y = x @ W^T.                                                    x [T, in], y [T, out]
  virtual void matmul(const float* x, int64_t T, const Weight& w, float* y) = 0;
  // ys[i] = x @ ws[i]^T for n weights that share the input x (one launch where the backend can).
  //   x [T, in]; ws[i] [out_i, in]; ys[i] [T, out_i]
  virtual void matmul_many(const float* x, int64_t T, const Weight* const* ws, float* const* ys, int n) {
    for (int i = 0; i < n; ++i) matmul(x, T, *ws[i], ys[i]);
  }
  // How a product may share the device with the ops queued around it (a GPU's decode step; a
  // backend that runs its ops in order ignores it). The result never changes.
  enum class ProductLaunch {
    InOrder,
    // In blocks that leave about half of each SM to the ops queued after it, which can then start
    // beside it instead of waiting for its blocks to drain.
    HalfSm,
    // Starts without waiting for the op queued just before it. Only where that op writes nothing
    // this product reads or writes, and this product's inputs were complete before that op was
    // queued (so that op's own wait for its predecessors covered them).
    Early,
  };
  virtual void matmul_launched(const float* x, int64_t T, const Weight& w, float* y, ProductLaunch launch) {
    (void)launch;
    matmul(x, T, w, y);
  }
  // Rotates x[t, h, offset : offset + width] in place by cos_sin[t] ([T, width/2, 2]).
  virtual void rope(float* x, int64_t T, int64_t n_heads, int64_t token_stride, int64_t head_stride,
                    int64_t offset, int64_t width, const float* cos_sin, RopeKind kind) = 0;
  virtual void add(float* y, const float* x, int64_t n) = 0;  // y += x
  virtual void scale(float* y, float s, int64_t n) = 0;       // y *= s
  // out = silu(gate) * up.                                          [n]
  virtual void swiglu(const float* gate, const float* up, float* out, int64_t n) = 0;
  // Appends T entries to an MLA cache row at positions pos0 .. pos0 + T - 1 (pos0 read from
  // backend memory when pos0_dev is set), fusing the norm, copy and rotation:
  //   cache[pos0 + t] = [ rms_norm(kva[t, :L]) * norm_w | rope(kva[t, L : L + rope]) ]
  //   kva [T, L + rope], cache [*, L + rope], cos_sin [T, rope/2, 2]
  virtual void mla_cache_append(const float* kva, int64_t T, int64_t L, int64_t rope, const float* norm_w, float eps,
                                const float* cos_sin, RopeKind kind, float* cache, int64_t pos0,
                                const int32_t* pos0_dev) = 0;
  // Appends T indexer keys: keys[pos0 + t] = layer_norm(k[t]) * w + b, its first `rope` dims
  // rotated.                                                         k [T, d], keys [*, d]
  virtual void index_key_append(const float* k, int64_t T, int64_t d, const float* w, const float* b, float eps,
                                int64_t rope, const float* cos_sin, RopeKind kind, float* keys, int64_t pos0,
                                const int32_t* pos0_dev) = 0;
  virtual void mla_attention(const MlaAttentionArgs& a) = 0;
  // The absorbed path's work that needs only the queries (q_nope through W_UK's rows), queued
  // ahead of the mla_attention call with the same args (so it can run while a branch selects the
  // keys). The default does nothing: mla_attention does it all. Results do not change.
  virtual void mla_absorb_queries(const MlaAttentionArgs& a) { (void)a; }
  // rope(q, ...) of the queries' rope parts (q = a.q: [T, H, qk_nope + qk_rope], each head's rope
  // part at qk_nope) and then mla_absorb_queries(a): one launch on a GPU, the same values.
  virtual void mla_rope_absorb_queries(float* q, const float* cos_sin, RopeKind kind, const MlaAttentionArgs& a) {
    const int64_t qw = a.qk_nope + a.qk_rope;
    rope(q, a.T, a.n_heads, a.n_heads * qw, qw, a.qk_nope, a.qk_rope, cos_sin, kind);
    mla_absorb_queries(a);
  }
  // A branch: the ops queued between begin_branch() and end_branch() may run concurrently with
  // the ops queued after end_branch(), until join_branch(). Neither side may read what the other
  // writes. A GPU fills SMs that a chain of small latency-bound kernels leaves idle (a decode
  // step's indexer beside its queries' absorption); the CPU runs every op in order. rows: the
  // tokens the ops work on (a backend may run large steps in order).
  virtual void begin_branch(int64_t rows) { (void)rows; }
  // A branch whose ops follow both those of the branch ended last (not yet joined) and every op
  // queued so far: a branch that waits, part way, for a product of the main side. With no branch
  // open, begin_branch.
  virtual void continue_branch(int64_t rows) { begin_branch(rows); }
  // Whether begin_branch(rows) runs its ops beside the rest (true) or in order (false).
  virtual bool branches_beside(int64_t rows) const {
    (void)rows;
    return false;
  }
  virtual void end_branch() {}
  virtual void join_branch() {}
  // begin_branch .. end_branch over a scope, so that an op that throws inside it leaves no
  // branch half open (the next begin_branch or recording joins what was queued).
  struct BranchScope {
    enum Kind { Begin, Continue };
    BranchScope(Backend& b, int64_t rows, Kind kind = Begin) : backend(b) {
      if (kind == Continue) backend.continue_branch(rows);
      else backend.begin_branch(rows);
    }
    ~BranchScope() noexcept(false) {
      if (std::uncaught_exceptions() == unwinding) {
        backend.end_branch();
        return;
      }
      try {
        backend.end_branch();
      } catch (...) {  // (already unwinding from the first error)
      }
    }
    BranchScope(const BranchScope&) = delete;
    BranchScope& operator=(const BranchScope&) = delete;
    Backend& backend;
    const int unwinding = std::uncaught_exceptions();
  };
  virtual void indexer_select(const IndexerArgs& a) = 0;
  // ids, weights [T, top_k]: chosen experts (ascending id) and their routing weights.
  virtual void moe_route(const float* x, int64_t T, const RouterArgs& a, int32_t* ids, float* weights) = 0;
  // Groups the routing of N tokens by expert: a stable counting sort of the N * top_k slots
  // (t, k) by ids[t, k] (each in [0, n_experts)). Expert e's slots are token_of / weight_of
  // [offsets[e], offsets[e + 1]), tokens ascending (order of t, then k): the order in which
  // scatter_add_rows must accumulate. Every pointer is in this backend's memory.
  //   ids, weights [N, top_k]; offsets [n_experts + 1]; token_of, weight_of [N * top_k]
  virtual void moe_group(const int32_t* ids, const float* weights, int64_t N, int top_k, int n_experts,
                         int32_t* offsets, int32_t* token_of, float* weight_of) = 0;
  // Routed experts by id, fused: for each token t and k < top_k in order, e = ids[t, k],
  //   out[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t])
  // accumulated as (0 + w0 y0) + w1 y1 + ... (the order of scatter_add_rows over ascending ids),
  // then + y_s for each of the bank's shared experts.
  // ids, weights in backend memory.           x, out [N, D]; ids, weights [N, top_k]
  virtual void moe_experts(const float* x, int64_t N, const int32_t* ids, const float* weights, int top_k,
                           const ExpertBank& bank, float* out) = 0;
  // The part of moe_experts(x, N, .., top_k, bank, ..) that reads no routing (the shared experts'
  // gate and up products), queued ahead of it so that it can run beside moe_route (in a branch);
  // the moe_experts call that follows with the same x, N, top_k and bank does the rest. The
  // default does nothing: moe_experts does it all. Results do not change.
  virtual void moe_shared_gate_up(const float* x, int64_t N, int top_k, const ExpertBank& bank) {
    (void)x, (void)N, (void)top_k, (void)bank;
  }
  // True when moe_experts is the faster way to run N tokens' experts on this backend (else the
  // forward groups tokens by expert: moe_group + one product per expert).
  virtual bool prefers_moe_experts(int64_t N) const { return false; }
  // True when moe_experts over this resident bank is the faster way to run N tokens' experts (a
  // GPU backend may group the tokens and run the bank's experts without a host round trip at
  // prefill too). The default: prefers_moe_experts.
  virtual bool runs_moe_bank(int64_t N, int top_k, const ExpertBank& bank) {
    (void)top_k, (void)bank;
    return prefers_moe_experts(N);
  }
  // Key lists up to which this backend's decode attention has short-context kernels (0: none). A
  // recorded step sized for at most this many keys takes them; the forward pass keeps a recording
  // for that bound beside the longer ones.
  virtual int64_t short_context_keys() const { return 0; }
  // out[r] = index of the largest x[r, :] (ties: the lowest index).  x [rows, n], out [rows]
  virtual void argmax_rows(const float* x, int64_t rows, int64_t n, int32_t* out) = 0;
  // out[r] = the token sample_row (backend/sampling.h, the reference) draws from x[r, :] with
  // args[r]: the same token on every backend. args in host memory (checked here), x and out in
  // backend memory.                                                 x [rows, n], out [rows]
  virtual void sample_rows(const float* x, int64_t rows, int64_t n, const SampleRowArgs* args, int32_t* out) = 0;

  // Recording: between begin_recording() and end_recording() ops are recorded, not run; replay()
  // then runs them. Nothing recorded may allocate, copy from or to the host, or wait for results.
  virtual bool can_record() const { return false; }
  virtual void begin_recording() { fail("backend ", name(), " cannot record ops"); }
  virtual std::unique_ptr<RecordedOps> end_recording() { fail("backend ", name(), " cannot record ops"); }
  // Changes whenever the backend reallocates internal scratch memory: recordings made before
  // point to freed memory and must be made again.
  virtual uint64_t scratch_generation() const { return 0; }

  // One expert's SwiGLU MLP over gathered rows (a prefill MoE layer runs one per expert used):
  //   rows[i] = down(silu(gate(x[index[i]])) * up(x[index[i]]))
  // x [*, D]; index [m]; gate, up [I, D]; down [D, I]; scratch xs [m, D], g and u [m, I]; rows
  // [m, D]. The default is the composed ops; a backend may fuse the gather and the SwiGLU into
  // the conversions its products need (CUDA's tensor-core path), with the same result.
  virtual void expert_rows(const float* x, const int32_t* index, int64_t m, const Weight& gate, const Weight& up,
                           const Weight& down, float* xs, float* g, float* u, float* rows) {
    gather_rows(x, index, m, gate.in(), xs);
    const Weight* ws[2] = {&gate, &up};
    float* ys[2] = {g, u};
    matmul_many(xs, m, ws, ys, 2);
    swiglu(g, u, g, m * gate.out());
    matmul(g, m, down, rows);
  }
  // A run of routed experts of one grouped MoE pass, each added into out in the order given:
  //   for each job j, for i in [at_j, at_j + m_j): out[index[i]] += scale[i] * expert_j(x[index[i]])
  // (index, scale: moe_group's token_of, weight_of). A dense job (only ever the last: a layer's
  // shared expert, which the oracle adds after the routed ones) takes every row of x instead:
  //   for t in [0, m): out[t] += expert(x[t])
  // The default runs expert_rows then scatter_add_rows per job on y [max m, D], and a dense job
  // as the composed MLP then add; g and u (u >= g + m I) hold any job's gate and up. A backend
  // may compute the jobs' rows concurrently into buffers of its own, as long as the additions
  // into out keep this order.
  struct ExpertJob {
    const Weight* gate = nullptr;
    const Weight* up = nullptr;
    const Weight* down = nullptr;
    int64_t at = 0, m = 0;
    bool dense = false;
  };
  virtual void experts_add(const float* x, const int32_t* index, const float* scale, const ExpertJob* jobs, int n,
                           float* xs, float* g, float* u, float* y, float* out) {
    for (int j = 0; j < n; ++j) {
      const ExpertJob& e = jobs[j];
      if (e.dense) {
        dense_expert_add(x, e, g, u, y, out);
        continue;
      }
      expert_rows(x, index + e.at, e.m, *e.gate, *e.up, *e.down, xs, g, u, y);
      scatter_add_rows(out, index + e.at, scale + e.at, y, e.m, e.gate->in());
    }
  }
  // out[t] += down(silu(gate(x[t])) * up(x[t])) for t < e.m: the ops, in order, of a model's
  // dense MLP followed by an add, so a shared expert gives the same bits in or out of a run.
  void dense_expert_add(const float* x, const ExpertJob& e, float* g, float* u, float* y, float* out) {
    const Weight* ws[2] = {e.gate, e.up};
    float* ys[2] = {g, u};
    matmul_many(x, e.m, ws, ys, 2);
    swiglu(g, u, g, e.m * e.gate->out());
    matmul(g, e.m, *e.down, y);
    add(out, y, e.m * e.gate->in());
  }
  // rows[i] = x[index[i]]                                          x [*, n], rows [m, n]
  virtual void gather_rows(const float* x, const int32_t* index, int64_t m, int64_t n, float* rows) = 0;
  // y[index[i]] += scale[i] * rows[i]                               in order of i
  virtual void scatter_add_rows(float* y, const int32_t* index, const float* scale, const float* rows, int64_t m,
                                int64_t n) = 0;

 protected:
  void check_queued_read(size_t n) const {
    if (n == 0 || n > kMaxQueuedRead) fail("queue_read_i32: ", n, " values (1 to ", kMaxQueuedRead, " a read)");
    if (queued_reads() >= kMaxQueuedReads) fail("queue_read_i32: ", kMaxQueuedReads, " reads already queued");
  }
  virtual int queued_reads() const { return int(reads_.size()); }

 private:
  std::vector<std::vector<int32_t>> reads_;  // the default queue_read_i32's values, oldest first
};

// The CPU reference backend, on the global thread pool. It groups tokens by expert
// (prefers_moe_experts is false) unless moe_experts_max_tokens > 0: then steps of up to that
// many tokens run their experts by id, as the CUDA backend's decode does (tests use this to run
// the GPU's decode paths, streamed ones included, on the CPU).
std::unique_ptr<Backend> make_cpu_backend(int64_t moe_experts_max_tokens = 0);

}  // namespace vireo
