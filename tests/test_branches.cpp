// The forward pass's branches (Backend::begin_branch) promise that the ops queued inside a branch
// and the ops queued after it, until the join, neither read what the other writes: a GPU runs the
// two sides at once, so a broken promise is a race that shows only sometimes (the CUDA test
// CudaFixtures.BranchesChangeNoBits can miss it). Here every op runs on the CPU reference through
// a backend that records, between a branch's begin and its join, the bytes each op reads and
// writes, and checks the promise at the join, deterministically, with no GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend_test_util.h"
#include "cache/mla_cache.h"
#include "io/json_file.h"
#include "model/glm_dsa/model.h"

using namespace vireo;

namespace {

const std::string kFixtures = VIREO_FIXTURES_DIR;

// A byte range an op reads or writes.
struct Span {
  const char* begin = nullptr;
  const char* end = nullptr;
};
template <typename T>
Span span(const T* p, int64_t n) {
  const char* b = reinterpret_cast<const char*>(p);
  return {b, b + (p && n > 0 ? n * int64_t(sizeof(T)) : 0)};
}
bool overlap(const Span& a, const Span& b) { return a.begin < b.end && b.begin < a.end; }

struct OpRecord {
  std::string name;
  std::vector<Span> reads, writes;
  size_t main_before = 0;  // a branch op: the main-side ops of its window queued before it (continue_branch)
};

// Runs every op on `inner` (the CPU reference); records the ops of each branch window and checks
// them at the join. Ops it has no spans for fail the test if they come inside a window.
class BranchCheckingBackend final : public Backend {
 public:
  explicit BranchCheckingBackend(std::unique_ptr<Backend> inner) : in_(std::move(inner)) {}

  enum class State { Outside, InBranch, AfterBranch };
  State state() const { return state_; }
  int windows_checked() const { return windows_; }
  // Ops of the given name seen inside a branch (between begin_branch and end_branch).
  int ops_in_branches(const std::string& name) const {
    auto it = branch_ops_.find(name);
    return it == branch_ops_.end() ? 0 : it->second;
  }
  const std::vector<std::string>& hazards() const { return hazards_; }

  const char* name() const override { return "branch-checking cpu"; }
  std::shared_ptr<float> alloc_f32(size_t n) override { return in_->alloc_f32(n); }
  std::shared_ptr<int32_t> alloc_i32(size_t n) override { return in_->alloc_i32(n); }
  void copy_to_host(float* dst, const float* src, size_t n) override {
    unchecked("copy_to_host");
    in_->copy_to_host(dst, src, n);
  }
  void copy_from_host(float* dst, const float* src, size_t n) override {
    unchecked("copy_from_host");
    in_->copy_from_host(dst, src, n);
  }
  void copy_to_host_i32(int32_t* dst, const int32_t* src, size_t n) override {
    unchecked("copy_to_host_i32");
    in_->copy_to_host_i32(dst, src, n);
  }
  void copy_from_host_i32(int32_t* dst, const int32_t* src, size_t n) override {
    unchecked("copy_from_host_i32");
    in_->copy_from_host_i32(dst, src, n);
  }
  Weight upload_weight(const Weight& w) override { return in_->upload_weight(w); }
  void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                 int64_t n) override {
    note("copy_rows", {span(src, (rows - 1) * src_stride + n)}, {span(dst, (rows - 1) * dst_stride + n)});
    in_->copy_rows(dst, dst_stride, src, src_stride, rows, n);
  }
  void fill(float* y, float v, int64_t n) override {
    note("fill", {}, {span(y, n)});
    in_->fill(y, v, n);
  }
  void embed(const Weight& table, const int32_t* ids, int64_t T, float* out) override {
    note("embed", {span(ids, T)}, {span(out, T * table.in())});
    in_->embed(table, ids, T, out);
  }
  void embed_rms_norm(const Weight& table, const int32_t* ids, int64_t T, const float* w, float eps, float* h,
                      float* y) override {
    const int64_t n = table.in();
    note("embed_rms_norm", {span(ids, T), span(w, n)}, {span(h, T * n), span(y, T * n)});
    in_->embed_rms_norm(table, ids, T, w, eps, h, y);
  }
  void rms_norm(const float* x, int64_t x_stride, int64_t T, int64_t n, const float* w, float eps, float* y,
                int64_t y_stride) override {
    note("rms_norm", {span(x, (T - 1) * x_stride + n), span(w, n)}, {span(y, (T - 1) * y_stride + n)});
    in_->rms_norm(x, x_stride, T, n, w, eps, y, y_stride);
  }
  void add_rms_norm(float* h, const float* x, int64_t T, int64_t n, const float* w, float eps, float* y) override {
    note("add_rms_norm", {span(h, T * n), span(x, T * n), span(w, n)}, {span(h, T * n), span(y, T * n)});
    in_->add_rms_norm(h, x, T, n, w, eps, y);
  }
  void layer_norm(const float* x, int64_t T, int64_t n, const float* w, const float* b, float eps, float* y) override {
    note("layer_norm", {span(x, T * n), span(w, n), span(b, n)}, {span(y, T * n)});
    in_->layer_norm(x, T, n, w, b, eps, y);
  }
  // The distinct weights the products (matmul, matmul_launched, matmul_many) read since the last
  // clear_products_read: their stored bytes, block scales included.
  size_t products_read_bytes() const {
    size_t n = 0;
    for (const auto& [data, bytes] : products_read_) n += bytes;
    return n;
  }
  void clear_products_read() { products_read_.clear(); }
  void matmul(const float* x, int64_t T, const Weight& w, float* y) override {
    products_read_[w.w.data] = w.nbytes();
    note("matmul", {span(x, T * w.in())}, {span(y, T * w.out())});
    in_->matmul(x, T, w, y);
  }
  // Early's promise: the op queued just before it (on its side) writes nothing it reads or writes.
  void matmul_launched(const float* x, int64_t T, const Weight& w, float* y, ProductLaunch launch) override {
    products_read_[w.w.data] = w.nbytes();
    OpRecord r{"matmul", {span(x, T * w.in())}, {span(y, T * w.out())}};
    if (launch == ProductLaunch::Early) {
      ++early_products_;
      if (state_ == State::InBranch) hazards_.push_back("an early product inside a branch");
      if (!last_outside_.name.empty() &&
          (any_overlap(last_outside_.writes, r.reads) || any_overlap(last_outside_.writes, r.writes)))
        hazards_.push_back("an early product touches what " + last_outside_.name + " (just before it) writes");
    }
    record(std::move(r));
    in_->matmul_launched(x, T, w, y, launch);
  }
  int early_products() const { return early_products_; }
  void matmul_many(const float* x, int64_t T, const Weight* const* ws, float* const* ys, int n) override {
    OpRecord r{"matmul_many", {}, {}};
    for (int i = 0; i < n; ++i) {
      products_read_[ws[i]->w.data] = ws[i]->nbytes();
      r.reads.push_back(span(x, T * ws[i]->in()));
      r.writes.push_back(span(ys[i], T * ws[i]->out()));
    }
    record(std::move(r));
    in_->matmul_many(x, T, ws, ys, n);
  }
  void rope(float* x, int64_t T, int64_t n_heads, int64_t token_stride, int64_t head_stride, int64_t offset,
            int64_t width, const float* cos_sin, RopeKind kind) override {
    note("rope", {span(x, T * token_stride), span(cos_sin, T * width)}, {span(x, T * token_stride)});
    in_->rope(x, T, n_heads, token_stride, head_stride, offset, width, cos_sin, kind);
  }
  void add(float* y, const float* x, int64_t n) override {
    note("add", {span(y, n), span(x, n)}, {span(y, n)});
    in_->add(y, x, n);
  }
  void scale(float* y, float s, int64_t n) override {
    note("scale", {span(y, n)}, {span(y, n)});
    in_->scale(y, s, n);
  }
  void swiglu(const float* gate, const float* up, float* out, int64_t n) override {
    note("swiglu", {span(gate, n), span(up, n)}, {span(out, n)});
    in_->swiglu(gate, up, out, n);
  }
  void mla_cache_append(const float* kva, int64_t T, int64_t L, int64_t rope, const float* norm_w, float eps,
                        const float* cos_sin, RopeKind kind, float* cache, int64_t pos0,
                        const int32_t* pos0_dev) override {
    if (pos0_dev) unchecked("mla_cache_append at run-time positions");
    note("mla_cache_append", {span(kva, T * (L + rope)), span(norm_w, L), span(cos_sin, T * rope)},
         {span(cache + pos0 * (L + rope), T * (L + rope))});
    in_->mla_cache_append(kva, T, L, rope, norm_w, eps, cos_sin, kind, cache, pos0, pos0_dev);
  }
  void index_key_append(const float* k, int64_t T, int64_t d, const float* w, const float* b, float eps, int64_t rope,
                        const float* cos_sin, RopeKind kind, float* keys, int64_t pos0,
                        const int32_t* pos0_dev) override {
    if (pos0_dev) unchecked("index_key_append at run-time positions");
    note("index_key_append", {span(k, T * d), span(w, d), span(b, d), span(cos_sin, T * rope)},
         {span(keys + pos0 * d, T * d)});
    in_->index_key_append(k, T, d, w, b, eps, rope, cos_sin, kind, keys, pos0, pos0_dev);
  }
  void mla_absorb_queries(const MlaAttentionArgs& a) override {
    note("mla_absorb_queries", {span(a.q, a.T * a.n_heads * (a.qk_nope + a.qk_rope))}, {});
    in_->mla_absorb_queries(a);
  }
  void mla_attention(const MlaAttentionArgs& a) override {
    note("mla_attention",
         {span(a.q, a.T * a.n_heads * (a.qk_nope + a.qk_rope)), span(a.kv, a.n_keys * (a.kv_lora + a.qk_rope)),
          span(a.selection.keys, a.T * a.selection.stride), span(a.selection.keys ? a.selection.counts : nullptr, a.T)},
         {span(a.out, a.T * a.n_heads * a.v_dim)});
    in_->mla_attention(a);
  }
  void indexer_select(const IndexerArgs& a) override {
    note("indexer_select",
         {span(a.q, a.T * a.n_heads * a.head_dim), span(a.weights, a.T * a.n_heads),
          span(a.keys, a.n_keys * a.head_dim)},
         {span(a.selected, a.T * a.topk), span(a.counts, a.T)});
    in_->indexer_select(a);
  }
  void moe_route(const float* x, int64_t T, const RouterArgs& a, int32_t* ids, float* weights) override {
    note("moe_route", {span(x, T * a.gate->in()), span(a.bias, a.bias ? a.n_experts : 0)},
         {span(ids, T * a.top_k), span(weights, T * a.top_k)});
    in_->moe_route(x, T, a, ids, weights);
  }
  void moe_group(const int32_t* ids, const float* weights, int64_t N, int top_k, int n_experts, int32_t* offsets,
                 int32_t* token_of, float* weight_of) override {
    unchecked("moe_group");
    in_->moe_group(ids, weights, N, top_k, n_experts, offsets, token_of, weight_of);
  }
  void moe_experts(const float* x, int64_t N, const int32_t* ids, const float* weights, int top_k,
                   const ExpertBank& bank, float* out) override {
    unchecked("moe_experts");
    in_->moe_experts(x, N, ids, weights, top_k, bank, out);
  }
  void moe_shared_gate_up(const float* x, int64_t N, int top_k, const ExpertBank& bank) override {
    // On a GPU it also writes the backend's own buffer, which only the moe_experts after the join reads.
    note("moe_shared_gate_up", {span(x, N * (bank.gate.empty() ? 0 : bank.gate[0].in()))}, {});
    in_->moe_shared_gate_up(x, N, top_k, bank);
  }
  bool prefers_moe_experts(int64_t N) const override { return in_->prefers_moe_experts(N); }
  void argmax_rows(const float* x, int64_t rows, int64_t n, int32_t* out) override {
    note("argmax_rows", {span(x, rows * n)}, {span(out, rows)});
    in_->argmax_rows(x, rows, n, out);
  }
  void sample_rows(const float* x, int64_t rows, int64_t n, const SampleRowArgs* args, int32_t* out) override {
    note("sample_rows", {span(x, rows * n)}, {span(out, rows)});
    in_->sample_rows(x, rows, n, args, out);
  }
  void gather_rows(const float* x, const int32_t* index, int64_t m, int64_t n, float* rows) override {
    unchecked("gather_rows");
    in_->gather_rows(x, index, m, n, rows);
  }
  void scatter_add_rows(float* y, const int32_t* index, const float* scale, const float* rows, int64_t m,
                        int64_t n) override {
    unchecked("scatter_add_rows");
    in_->scatter_add_rows(y, index, scale, rows, m, n);
  }

  // As a GPU's decode: branches beside the rest (the model then puts the most work in them).
  bool branches_beside(int64_t) const override { return true; }
  void begin_branch(int64_t rows) override {
    if (state_ == State::InBranch) hazards_.push_back("a branch begun inside another");
    if (state_ == State::AfterBranch) check();  // the backend joins an open branch first
    state_ = State::InBranch;
    branch_.clear();
    main_.clear();
    in_->begin_branch(rows);
  }
  // Its ops follow the main side's ops queued so far: they are checked against the later ones only.
  void continue_branch(int64_t rows) override {
    if (state_ != State::AfterBranch) return begin_branch(rows);
    state_ = State::InBranch;
    ++continued_;
    in_->continue_branch(rows);
  }
  int branches_continued() const { return continued_; }
  void end_branch() override {
    if (state_ != State::InBranch) hazards_.push_back("end_branch outside a branch");
    state_ = State::AfterBranch;
    in_->end_branch();
  }
  void join_branch() override {
    if (state_ == State::InBranch) hazards_.push_back("join_branch inside a branch");
    if (state_ == State::AfterBranch) check();
    state_ = State::Outside;
    in_->join_branch();
  }

 private:
  void note(const char* name, std::vector<Span> reads, std::vector<Span> writes) {
    record({name, std::move(reads), std::move(writes)});
  }
  void record(OpRecord r) {
    if (state_ != State::InBranch) last_outside_ = r;
    if (state_ == State::InBranch) {
      ++branch_ops_[r.name];
      r.main_before = main_.size();
      branch_.push_back(std::move(r));
    } else if (state_ == State::AfterBranch) main_.push_back(std::move(r));
  }
  static bool any_overlap(const std::vector<Span>& a, const std::vector<Span>& b) {
    for (const Span& x : a)
      for (const Span& y : b)
        if (overlap(x, y)) return true;
    return false;
  }
  void unchecked(const char* name) {
    if (state_ != State::Outside)
      hazards_.push_back(std::string(name) + " inside a branch window: the checker knows no spans for it");
  }
  // The promise: no branch op writes what a main op reads or writes, and no branch op reads what
  // a main op writes.
  void check() {
    ++windows_;
    auto any = any_overlap;
    for (const OpRecord& b : branch_)
      for (size_t j = b.main_before; j < main_.size(); ++j) {
        const OpRecord& m = main_[j];
        if (any(b.writes, m.reads) || any(b.writes, m.writes))
          hazards_.push_back("branch op " + b.name + " writes what " + m.name + " (after the branch) touches");
        if (any(b.reads, m.writes))
          hazards_.push_back("branch op " + b.name + " reads what " + m.name + " (after the branch) writes");
      }
    branch_.clear();
    main_.clear();
  }

  std::unique_ptr<Backend> in_;
  State state_ = State::Outside;
  std::vector<OpRecord> branch_, main_;
  std::vector<std::string> hazards_;
  int windows_ = 0, continued_ = 0, early_products_ = 0;
  OpRecord last_outside_;  // the last op queued outside a branch (the main side's stream order)
  std::map<std::string, int> branch_ops_;
  std::map<const void*, size_t> products_read_;
};

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += "\n  " + x;
  return s;
}

}  // namespace

// The checker itself: a main-side op that reads what the branch wrote is a hazard, one that
// touches other memory is not.
TEST(Branches, CheckerFindsAMainOpReadingWhatTheBranchWrote) {
  BranchCheckingBackend be(make_cpu_backend());
  auto a = be.alloc_f32(16), b = be.alloc_f32(16), c = be.alloc_f32(16);
  be.fill(a.get(), 1.0f, 16);
  be.fill(b.get(), 2.0f, 16);
  be.begin_branch(1);
  be.scale(a.get(), 2.0f, 16);
  be.end_branch();
  be.add(c.get(), b.get(), 16);  // independent
  be.join_branch();
  EXPECT_TRUE(be.hazards().empty()) << joined(be.hazards());
  be.begin_branch(1);
  be.scale(a.get(), 2.0f, 16);
  be.end_branch();
  be.add(c.get(), a.get() + 8, 8);  // reads half of what the branch wrote
  be.join_branch();
  ASSERT_EQ(be.hazards().size(), size_t(1));
  EXPECT_NE(be.hazards()[0].find("scale"), std::string::npos) << be.hazards()[0];
  EXPECT_EQ(be.windows_checked(), 2);
  // A continued branch's later ops follow the main ops queued before them; its earlier ops do not.
  const size_t before = be.hazards().size();
  be.begin_branch(1);
  be.scale(a.get(), 2.0f, 16);
  be.end_branch();
  be.fill(b.get(), 3.0f, 16);
  be.continue_branch(1);
  be.add(c.get(), b.get(), 16);  // reads what the main side wrote before it: allowed
  be.end_branch();
  be.join_branch();
  EXPECT_EQ(be.hazards().size(), before) << joined(be.hazards());
  be.begin_branch(1);
  be.scale(a.get(), 2.0f, 16);
  be.end_branch();
  be.fill(a.get(), 3.0f, 16);  // writes what the branch's first part writes
  be.continue_branch(1);
  be.end_branch();
  be.join_branch();
  ASSERT_EQ(be.hazards().size(), before + 2);  // scale reads and writes a
  EXPECT_NE(be.hazards().back().find("scale"), std::string::npos) << be.hazards().back();
  EXPECT_EQ(be.branches_continued(), 2);
  // An early product may not touch what the op queued just before it writes.
  const test::HostWeight w = test::make_weight(DType::F32, 4, 16, 1);
  const size_t before_early = be.hazards().size();
  be.fill(a.get(), 1.0f, 16);
  be.matmul_launched(b.get(), 1, w.w, c.get(), Backend::ProductLaunch::Early);  // reads b: allowed
  EXPECT_EQ(be.hazards().size(), before_early) << joined(be.hazards());
  be.fill(a.get(), 1.0f, 16);
  be.matmul_launched(a.get(), 1, w.w, c.get(), Backend::ProductLaunch::Early);  // reads the fill's a
  ASSERT_EQ(be.hazards().size(), before_early + 1);
  EXPECT_NE(be.hazards().back().find("fill"), std::string::npos) << be.hazards().back();
  EXPECT_EQ(be.early_products(), 2);
}

// The model's branches keep their promise in every fixture family (own indexer, shared indexer
// layers, FP8, no indexer), over a prefill, single-token decode steps (the absorbed path, experts
// by id as on a GPU) and a batched step of two sequences, and leave no branch open.
TEST(Branches, ModelBranchesTouchNothingTheOpsBesideThemTouch) {
  int continued = 0, early = 0;
  for (const char* name : {"glm_dsa_full_f32", "glm_dsa_shared_f32", "glm_dsa_fp8", "dsv32_f32", "dsv3_f32"}) {
    SCOPED_TRACE(name);
    const std::string dir = kFixtures + "/" + name;
    const auto tokens = read_json_file(dir + "/expected.json")["tokens"].get<std::vector<int32_t>>();
    ASSERT_GE(tokens.size(), size_t(24));
    BranchCheckingBackend be(make_cpu_backend(/*moe_experts_max_tokens=*/8));
    auto m = GlmDsaModel::load(dir, be);
    const int64_t V = m->config().vocab_size;
    MlaCache cache(be, m->cache_shape(), 2, 64);
    std::vector<float> lg(size_t(2 * V));
    m->forward(tokens.data(), 16, cache, 0, lg.data());
    EXPECT_EQ(be.state(), BranchCheckingBackend::State::Outside);
    for (int64_t t = 16; t < 20; ++t)
      m->forward(&tokens[size_t(t)], 1, cache, 0, lg.data(), false, AttentionPath::Absorbed);
    m->forward(tokens.data(), 8, cache, 1, lg.data());
    BatchItem i0, i1;
    i0.row = 0;
    i0.tokens = &tokens[20];
    i0.T = 1;
    i0.logits = lg.data();
    i1.row = 1;
    i1.tokens = &tokens[8];
    i1.T = 1;
    i1.logits = lg.data() + V;
    m->forward_batch({i0, i1}, cache, AttentionPath::Absorbed);
    EXPECT_EQ(be.state(), BranchCheckingBackend::State::Outside);
    EXPECT_TRUE(be.hazards().empty()) << joined(be.hazards());
    // Each of the 7 forwards opens a window on every layer with its own indexer (the indexer beside
    // the queries' work), and steps of at most 8 tokens one on every MoE layer (the shared
    // expert's gate | up beside the router).
    EXPECT_GT(be.windows_checked(), 0) << "the model no longer opens branches";
    if (m->config().has_indexer) {
      EXPECT_GE(be.ops_in_branches("indexer_select"), 7) << "the indexer's branch is gone";
    }
    if (m->config().n_shared_experts > 0 && m->config().n_routed_experts > 0) {
      EXPECT_GE(be.ops_in_branches("moe_shared_gate_up"), 5) << "the shared expert's branch is gone";
    }
    continued += be.branches_continued();
    early += be.early_products();
  }
  // Where the indexer selects (past index_topk keys) and the queries are low-rank: the appends'
  // branch continued after the indexer's query product, and q_b launched early behind it.
  EXPECT_GT(continued, 0) << "no fixture's step continued a branch";
  EXPECT_GT(early, 0) << "no fixture's step launched a product early";
}

// A decode step reads the weights GlmDsaModel::decode_weight_bytes counts for it (vireo bench's
// bytes a token): a step at index_topk keys (DSA dense: the selection would be every key) skips
// the indexer's query and head weights, the step after it (index_topk + 1 keys) reads them, and
// the two counts differ by what the two steps' products read. Without an indexer they are equal.
TEST(Branches, DecodeWeightBytesFollowWhatADecodeStepReads) {
  int sparse_read_more = 0;
  for (const char* name : {"glm_dsa_full_f32", "glm_dsa_shared_f32", "glm_dsa_fp8", "dsv32_f32", "dsv3_f32"}) {
    SCOPED_TRACE(name);
    const std::string dir = kFixtures + "/" + name;
    const auto tokens = read_json_file(dir + "/expected.json")["tokens"].get<std::vector<int32_t>>();
    BranchCheckingBackend be(make_cpu_backend(/*moe_experts_max_tokens=*/8));
    auto m = GlmDsaModel::load(dir, be);
    const int64_t topk = m->config().has_indexer ? m->config().index_topk : 8;
    ASSERT_GE(int64_t(tokens.size()), topk + 1);
    MlaCache cache(be, m->cache_shape(), 1, 64);
    std::vector<float> lg(size_t(m->config().vocab_size));
    m->forward(tokens.data(), topk - 1, cache, 0, lg.data());
    size_t read[2];
    for (int i = 0; i < 2; ++i) {  // the steps at topk and topk + 1 keys
      be.clear_products_read();
      m->forward(&tokens[size_t(topk - 1 + i)], 1, cache, 0, lg.data(), false, AttentionPath::Absorbed);
      read[i] = be.products_read_bytes();
    }
    EXPECT_EQ(int64_t(read[1]) - int64_t(read[0]),
              int64_t(m->decode_weight_bytes(topk + 1)) - int64_t(m->decode_weight_bytes(topk)));
    EXPECT_EQ(m->decode_weight_bytes(topk + 1), m->active_weight_bytes_per_token());
    if (read[1] > read[0]) ++sparse_read_more;
  }
  EXPECT_EQ(sparse_read_more, 4) << "the fixtures with an indexer should skip its weights where DSA is dense";
}
