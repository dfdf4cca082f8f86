// `vireo plan`, and the model loading shared by run/logits/bench under --memory-budget: the
// memory plan is computed before anything is allocated; a budget below the minimum is refused
// with the table on stderr and a one-line error.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "cache/mla_cache.h"
#include "cli/commands.h"
#include "backend/cuda/cuda_backend.h"
#include "experts/expert_layout.h"
#include "experts/streaming_store.h"
#include "model/glm_dsa/weights.h"

namespace vireo::cli {

// Activations of one step of T tokens (the model's scratch buffers, f32) plus the attention's
// buffers that grow with the keys attended, for n_keys keys per sequence (at most the context).
uint64_t estimate_scratch_bytes(const GlmDsaConfig& c, int64_t T, int64_t out_rows, int64_t n_keys, bool device) {
  const int64_t qw = c.qk_head_dim(), shared_inter = c.moe_intermediate_size * c.n_shared_experts;
  // (8 hidden-wide rows: residual, norm, output, gather, expert output, shared, prefetch norm, and
  // the rows of experts run early while others stream in; gate and up pairs of the dense MLP, the
  // routed experts and the shared expert, each its own.)
  const int64_t per_token = 8 * c.hidden_size + c.n_heads * qw + 2 * c.q_lora_rank + c.kv_cache_dim() +
                            int64_t(c.index_n_heads) * c.index_head_dim + c.index_head_dim + c.index_n_heads +
                            c.n_heads * c.v_head_dim + 2 * c.intermediate_size + 2 * c.moe_intermediate_size +
                            2 * shared_inter + c.qk_rope_dim + int64_t(c.index_topk) + 4 * c.experts_per_token;
  const int64_t H = c.n_heads, L = c.kv_lora_rank, hw = c.qk_nope_dim + c.v_head_dim, N = n_keys;
  // The reconstructed (prefill) path, both backends: every key's latent copied out of the cache
  // [N, kv_lora] and expanded through kv_b [N, H, nope + v]. Counted in f32: CUDA's --math fast
  // writes the expansion in bf16 (half of it, plus k_rope), so f32 is the bound of both modes.
  // On the CPU these are per-call vectors, freed after each layer's attention; they coexist with
  // the model's scratch, so the peak is the sum all the same.
  int64_t attn = N * L + N * H * hw;
  if (device) {
    // CUDA keeps each op's buffer at its largest size (one Scratch per use), so the paths add up:
    // DSA's key mask [T, ceil(N / 32)] u32 and the indexer's scores [T, N] f32 (the CPU scores
    // keys per thread in N-sized vectors, too small to count: 8 bytes a key a thread against
    // kv_b's H x (nope + v) x 4), and the absorbed path's (decode rows; chunks appended to a long
    // cache take it too, see choose_path): the absorbed queries [T, H, kv_lora], the split
    // partials [rows, H, splits, kv_lora + 2] and the scores [rows, H, keys rounded to
    // 32] for the rows of one pass, over at most index_topk keys under DSA.
    if (c.has_indexer) attn += T * ((N + 31) / 32) + T * N;
    const int64_t keys = c.has_indexer ? std::min<int64_t>(N, c.index_topk) : N;
    // (The partials and scores are sized for one pass of rows: at most kAbsorbedPassBytes, at least a row;
    // attention_absorbed in cuda_backend.cu.)
    const int64_t per_row = H * CudaBufferSizes::decode_splits(keys) * (L + 2) + H * ((keys + 31) / 32 * 32);
    const int64_t pass_floats = int64_t(CudaBufferSizes::kAbsorbedPassBytes) / 4;
    const int64_t rows = std::clamp<int64_t>(pass_floats / std::max<int64_t>(per_row, 1), 1, std::max<int64_t>(T, 1));
    attn += T * H * L + rows * per_row;
  }
  // The model's rope table, kept across steps (GlmDsaModel::grow_rope_table): at most a position
  // per cache position, on the host and in backend memory (counted once here; the host's copy sits
  // in RAM beside a GPU plan's device column, as small as this line).
  const int64_t rope_table = N * c.qk_rope_dim;
  return uint64_t(T * per_token + out_rows * c.vocab_size + attn + rope_table) * 4;
}

uint64_t estimate_backend_bytes(const GlmDsaConfig& c, int64_t T, bool fp8_weights) {
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size, H = c.n_heads;
  // Steps of up to 8 rows run the experts by id (cuda_decode.h's moe_experts): each row's slots'
  // gate | up and down products before they are summed, [rows, K + S, I + D] f32.
  const int64_t decode_slots = c.experts_per_token + c.n_shared_experts;
  const int64_t decode_moe = std::min<int64_t>(std::max<int64_t>(T, 1), 8) * decode_slots * (I + D) * 4;
  if (T <= 8) T = 0;  // decode-sized steps: GEMVs, no conversions, no side lanes
  const int64_t lane_ws = int64_t(CudaBufferSizes::kLtWorkspaceBytes), lanes = CudaBufferSizes::kExpertLanes,
                chunk = int64_t(CudaBufferSizes::kFp8ChunkBytes);
  // The widest product input (a conversion of T rows of it) and the largest FP8 weight (its
  // exact-mode bf16 hi + lo copy, dequantized in row chunks of at most 256 MiB).
  const int64_t in_max = std::max({D, c.q_lora_rank, c.kv_lora_rank, H * c.v_head_dim, c.intermediate_size, I});
  const int64_t w_max = std::max({H * c.qk_head_dim() * (c.q_lora_rank > 0 ? c.q_lora_rank : D), D * H * c.v_head_dim,
                                  H * (c.qk_nope_dim + c.v_head_dim) * c.kv_lora_rank, c.intermediate_size * D, I * D});
  // Main stream: x as bf16 hi + lo (T x in_max x 4 bytes), the FP8 weight copy, e4m3 x + padded
  // output (--math fast-fp8: T x (in_max + D) x ~5 bytes, counted as 8).
  int64_t main = T * in_max * 4 + T * (in_max + D) * 8 + (fp8_weights && T ? std::min(chunk, w_max * 4) : 0);
  // Each of experts_add's lanes: its workspace, and its largest job's rows (up to all T tokens
  // routed to one expert): gathered x, gate, up, the down product's rows (padded to 4), the bf16
  // hi + lo conversions, e4m3 inputs and the fast-fp8 gate | up outputs, and the FP8 expert
  // weight's bf16 copy in exact mode.
  const int64_t lane_rows = (T + 3) / 4 * 4 * (3 * D + 6 * I + 2 * std::max(D, I)) * 4;
  const int64_t lane = lane_ws + lane_rows + (fp8_weights && T ? std::min(chunk, I * D * 4) : 0);
  // And, in the fast modes with BF16 experts (and fast-fp8 with FP8 ones: their e4m3 rows and
  // scales fit in the same buffers, the f32 SwiGLU output in the down rows'), the grouped
  // products' chunk (cuda_grouped.h): gathered x and SwiGLU output in bf16, the scaled down rows
  // in f32, for up to kGroupedRows rows (or one expert's T): the routed rows and the shared
  // expert's T, with an index and a scale each. A run takes one path or the other, but one
  // process may take both (short prompts grouped, long ones with many rows an expert on the lanes).
  const int64_t rows_per_token = c.experts_per_token + (c.n_shared_experts > 0 ? 1 : 0);
  const int64_t run_rows = T * rows_per_token;
  const int64_t grouped_rows = std::min(run_rows, std::max(CudaBufferSizes::kGroupedRows, T));
  const int64_t grouped = grouped_rows * (6 * D + 2 * I + 8);
  // And a resident bank's prefill run's own buffers of the same kinds (bank_run in cuda_backend.cu).
  const int64_t bank_run = CudaBufferSizes::bank_run_bytes(T, rows_per_token, D, I, c.n_routed_experts);
  return uint64_t(main + (c.n_routed_experts > 0 ? lanes * lane + grouped + bank_run + decode_moe : 0));
}

int64_t step_tokens_for(int64_t chunk, int64_t context, int64_t batch) {
  return std::max<int64_t>(1, std::min(chunk + batch - 1, context * batch));
}

int64_t serve_logit_rows(int64_t max_batch, bool mtp) { return std::max<int64_t>((mtp ? 2 : 1) * max_batch, 64); }

namespace {

ExpertStoreOptions store_options(const StreamingFlags& f) {
  ExpertStoreOptions o;
  o.layer_floor = f.floor;
  o.direct = f.direct == "on" ? DirectIo::On : f.direct == "off" ? DirectIo::Off : DirectIo::Auto;
  o.io_threads = f.io_threads;
  // auto = off: on this CPU the predictor (48% precision) cost tokens/s at 10% and 25% budgets
  // and only broke even at 50% (BENCHMARKS.md, Expert streaming).
  o.prefetch = f.prefetch == "on";
  return o;
}

// The dense spine stays mapped and is counted as resident: ask the kernel to bring it in now.
void advise_dense_resident(const Checkpoint& ck, const ExpertStoreParams& p) {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  for (const auto& [name, t] : ck.tensors()) {
    if (name.find(".mlp.experts.") != std::string::npos || !t->data || t->nbytes == 0) continue;
    const uintptr_t b = uintptr_t(t->data) / page * page, e = uintptr_t(t->data) + t->nbytes;
    ::madvise(reinterpret_cast<void*>(b), e - b, MADV_WILLNEED);
  }
  // ... and wait for it: touch every page now, so loading (not the first tokens) pays for it.
  volatile uint8_t sink = 0;
  for (const auto& [name, t] : ck.tensors()) {
    if (name.find(".mlp.experts.") != std::string::npos || !t->data) continue;
    const uint8_t* d = static_cast<const uint8_t*>(t->data);
    for (size_t i = 0; i < t->nbytes; i += page) sink = sink + d[i];
  }
}

}  // namespace


void add_streaming_flags(CLI::App& app, StreamingFlags& f) {
  app.add_option("--memory-budget", f.budget, "Bytes of RAM for weights, cache and scratch (e.g. 8G); routed experts "
                                              "stream from disk through a pool sized to fit");
  app.add_option("--gpu-budget", f.gpu_budget, "With --device cuda: bytes of GPU memory (e.g. 24G); routed experts "
                                               "stream from host RAM into a device pool sized to fit");
  app.add_option("--direct-io", f.direct, "Expert reads with O_DIRECT: auto, on, off (off: buffered + DONTNEED)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--prefetch", f.prefetch, "Next-layer expert prediction and read-ahead: auto, on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--io-threads", f.io_threads, "Expert reads in flight")->check(CLI::Range(1, 256));
  app.add_option("--layer-floor", f.floor, "Expert slots each layer keeps (default: automatic)")->check(CLI::Range(0, 256));
  app.add_flag("--stats", f.stats, "Print expert store counters per token and in total (stderr)");
}

MemoryPlan plan_for(const Checkpoint& ck, const GlmDsaConfig& c, uint64_t budget, int64_t context, int64_t batch,
                    int64_t step_tokens, int64_t logit_rows, uint64_t gpu_budget) {
  MemoryPlanInputs in;
  in.budget = budget;
  in.gpu_budget = gpu_budget;
  {
    const GlmDsaWeights w = bind_glm_dsa_weights(ck, c);
    in.dense_bytes = w.dense_bytes + w.mtp_bytes;  // the MTP layer's, where it is bound (enable_mtp)
  }
  const ExpertStoreParams p = expert_store_params(c);
  in.n_moe_layers = int(p.moe_layers.size());
  in.n_experts = p.n_experts;
  in.top_k = p.top_k;
  if (!p.moe_layers.empty()) {
    if (!ck.files().empty()) {
      ExpertLayout layout(ck, p);
      in.expert_bytes = layout.expert_bytes();
      in.slot_bytes = layout.slot_bytes();
    } else {  // in memory: tensors packed into slots, copied rather than read
      ExpertLayout layout(ck, p, true);
      in.expert_bytes = layout.expert_bytes();
      in.slot_bytes = layout.slot_bytes();
    }
  }
  if (!p.moe_layers.empty() && gpu_budget) in.device_slot_bytes = ExpertLayout(ck, p, true).slot_bytes();
  in.in_memory = ck.files().empty();
  if (gpu_budget) in.host_available = mem_available_bytes();
  MlaCacheShape cs;
  cs.n_layers = c.bound_layers();
  cs.kv_dim = c.kv_cache_dim();
  cs.index_dim = c.has_indexer ? c.index_head_dim : 0;
  for (int l = 0; l < c.bound_layers(); ++l) cs.has_index.push_back(c.has_indexer && c.indexer_full[size_t(l)]);
  in.context = context;
  in.batch = batch;
  in.cache_bytes = uint64_t(MlaCache::bytes_per_token(cs)) * uint64_t(context) * uint64_t(batch);
  // The step the caller really runs (prompt chunks plus decode rows); a decode step has `batch` rows.
  in.step_tokens = std::max(step_tokens, batch);
  in.scratch_bytes = estimate_scratch_bytes(c, in.step_tokens, logit_rows > 0 ? logit_rows : batch, context,
                                            gpu_budget > 0);
  // --mtp: a step's hidden rows kept for the MTP layer ([T, hidden]) and its input ([T, 2 hidden]).
  if (c.mtp_layers > 0) in.scratch_bytes += 3 * uint64_t(in.step_tokens) * uint64_t(c.hidden_size) * 4;
  if (gpu_budget) {
    bool fp8 = false;
    for (const auto& [name, t] : ck.tensors()) fp8 = fp8 || t->dtype == DType::F8_E4M3;
    in.backend_bytes = estimate_backend_bytes(c, in.step_tokens, fp8);
  }
  return make_memory_plan(in);
}

LoadedModel load_model(const std::string& dir, Backend& backend, const StreamingFlags& f, int64_t context,
                       int64_t batch, int64_t step_tokens, int64_t logit_rows, bool mtp) {
  GlmDsaConfig c = load_glm_dsa_config(dir);
  if (mtp) enable_mtp(c, dir + "/config.json");
  return load_checkpoint(std::move(c), Checkpoint::open(dir), dir, backend, f, context, batch, step_tokens, logit_rows);
}

LoadedModel load_checkpoint(GlmDsaConfig c, std::unique_ptr<Checkpoint> ck, const std::string& what, Backend& backend,
                            const StreamingFlags& f, int64_t context, int64_t batch, int64_t step_tokens,
                            int64_t logit_rows) {
  LoadedModel m;
  std::unique_ptr<ExpertStore> store;
  const uint64_t budget = f.budget.empty() ? 0 : parse_byte_size(f.budget, "--memory-budget");
  if (!f.gpu_budget.empty()) {
    const uint64_t gpu = parse_byte_size(f.gpu_budget, "--gpu-budget");
    if (std::string(backend.name()) != "cuda") fail("--gpu-budget needs --device cuda");
    m.plan = plan_for(*ck, c, budget, context, batch, step_tokens, logit_rows, gpu);
    const GpuPlan& g = m.plan.g;
    if (gpu < g.minimum || g.slots < std::max(c.experts_per_token, 1)) {
      std::fputs(m.plan.table().c_str(), stderr);
      fail("--gpu-budget ", format_bytes(gpu), " is below the minimum of ", format_bytes(g.minimum), " for ", what,
           " at context ", context, " x batch ", batch, " in steps of ", m.plan.in.step_tokens, " tokens");
    }
    if (!g.fits) {
      std::fputs(m.plan.table().c_str(), stderr);
      fail("--memory-budget ", format_bytes(budget), " leaves no room for a pinned staging buffer (",
           format_bytes(m.plan.in.slot_bytes), ") besides the resident weights for ", what);
    }
#ifdef VIREO_HAVE_CUDA
    ExpertStoreOptions o = store_options(f);
    o.slots = g.slots;
    o.staging = g.staging;
    auto s = std::make_unique<DeviceExpertStore>(*ck, expert_store_params(c), o, make_cuda_transfer_link(backend));
    m.device = s.get();
    store = std::move(s);
#else
    fail("--gpu-budget: this vireo was built without CUDA (no nvcc at build time)");
#endif
  } else if (budget) {
    m.plan = plan_for(*ck, c, budget, context, batch, step_tokens, logit_rows);
    if (!m.plan.fits) {
      std::fputs(m.plan.table().c_str(), stderr);
      fail("--memory-budget ", format_bytes(budget), " is below the minimum of ", format_bytes(m.plan.minimum),
           " for ", what, " at context ", context, " x batch ", batch, " in steps of ", m.plan.in.step_tokens,
           " tokens");
    }
    ExpertStoreOptions o = store_options(f);
    o.slots = m.plan.slots;
    auto s = std::make_unique<StreamingExpertStore>(*ck, expert_store_params(c), o);
    m.streaming = s.get();
    store = std::move(s);
    advise_dense_resident(*ck, expert_store_params(c));
  }
  m.model = GlmDsaModel::create(std::move(c), std::move(ck), backend, std::move(store));
  return m;
}

void add_prefill_chunk_flag(CLI::App& app, PrefillChunkFlag& f) {
  f.opt = app.add_option("--prefill-chunk", f.value,
                         "Prompt tokens per forward step (0: the whole prompt at once; default 512 under "
                         "--memory-budget or --gpu-budget, whose plan sizes scratch for such steps, else 0)");
}

CLI::Option* add_decode_steps_flag(CLI::App& app, int& steps) {
  return app
      .add_option("--decode-steps", steps,
                  "Greedy decode steps run as one chunk (on CUDA one graph launch; the same tokens at any size, "
                  "handed over in bursts of this many; 1: a token a step)")
      ->check(CLI::Range(1, int(Backend::kMaxQueuedRead)));
}

void add_mtp_flag(CLI::App& app, bool& mtp) {
  app.add_flag("--mtp", mtp,
               "Speculative decoding: the model's MTP layer drafts the token after next, the main model keeps it "
               "where its own pick agrees (greedy: the same tokens; sampling: kept with probability min(1, p/q), "
               "the same distribution), up to two tokens a step");
}

void check_mtp_flag(bool mtp, const CLI::Option* decode_steps, const SamplingParams* sampling) {
  if (!mtp) return;
  if (decode_steps && decode_steps->count() > 0)
    fail("--decode-steps chunks plain greedy decode steps, --mtp runs a verification step at a time: give one of them");
  if (sampling && sampling->adjusts_logits())
    fail(
        "--mtp: the penalties (--repetition-penalty, --frequency-penalty, --presence-penalty) and --logit-bias need "
        "the host's pick a step, which speculative decoding does not make: give one of them");
}

int64_t resolve_prefill_chunk(const PrefillChunkFlag& f, const StreamingFlags& sf) {
  const bool budget = !sf.budget.empty() || !sf.gpu_budget.empty();
  if (!f.opt || f.opt->count() == 0) return budget ? 512 : 0;
  if (f.value < 0) fail("--prefill-chunk: ", f.value, " is negative (expected a token count, or 0 for the whole prompt)");
  if (f.value == 0 && budget)
    fail("--prefill-chunk 0 (the whole prompt in one step) cannot be planned under ",
         sf.budget.empty() ? "--gpu-budget" : "--memory-budget", ": give a chunk of at least 1 token");
  return f.value;
}

std::string stats_line(const ExpertStoreStats& s) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "requests %llu, hits %llu (%.1f%%), misses %llu, read %.3f GB (%.3f GB moved), stalled %.3f s, "
                "prefetched %llu (%llu used)",
                (unsigned long long)s.requests, (unsigned long long)s.hits, 100.0 * s.hit_rate(),
                (unsigned long long)s.misses, double(s.bytes_read) / 1e9, double(s.bytes_transferred) / 1e9,
                s.stall_seconds, (unsigned long long)s.prefetch_reads, (unsigned long long)s.prefetch_used);
  std::string out = buf;
  if (s.bytes_to_device) {
    std::snprintf(buf, sizeof buf, ", to device %.3f GB", double(s.bytes_to_device) / 1e9);
    out += buf;
  }
  if (s.host_hits) {
    std::snprintf(buf, sizeof buf, ", host tier hits %llu", (unsigned long long)s.host_hits);
    out += buf;
  }
  if (s.predicted) {
    std::snprintf(buf, sizeof buf, ", predictor precision %.1f%% recall %.1f%%",
                  100.0 * double(s.predicted_correct) / double(s.predicted),
                  s.predicted_actual ? 100.0 * double(s.predicted_correct) / double(s.predicted_actual) : 0.0);
    out += buf;
  }
  return out;
}

namespace {
uint64_t status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line))
    if (line.compare(0, n, field) == 0) return uint64_t(std::stoull(line.substr(n))) * 1024;
  return 0;
}
}  // namespace

uint64_t peak_rss_bytes() { return status_bytes("VmHWM:"); }

bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return bool(f);
}

uint64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line))
    if (line.compare(0, 13, "MemAvailable:") == 0) return uint64_t(std::stoull(line.substr(13))) * 1024;
  return 0;
}
uint64_t current_rss_bytes() { return status_bytes("VmRSS:"); }

Action add_plan(CLI::App& app) {
  struct Opts {
    std::string model, budget, gpu_budget;
    int64_t context = 4096, batch = 1, prefill_chunk = 512;
    bool mtp = false;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--model,-m", o->model, "Model directory")->required();
  app.add_flag("--mtp", o->mtp, "Plan for run/chat --mtp: the MTP layer's weights, experts and cache entries too");
  app.add_option("--memory-budget", o->budget, "RAM budget (e.g. 8G); without it every expert is resident");
  app.add_option("--gpu-budget", o->gpu_budget, "GPU memory budget (e.g. 24G): plan a device pool of expert slots");
  app.add_option("--context", o->context, "Context length per sequence")->check(CLI::Range(int64_t(1), int64_t(1) << 24));
  app.add_option("--batch", o->batch, "Sequences decoded together")->check(CLI::Range(int64_t(1), int64_t(1) << 16));
  app.add_option("--prefill-chunk", o->prefill_chunk,
                 "Prompt tokens per forward step, as run/chat/serve --prefill-chunk or perplexity --chunk (scratch "
                 "is sized for such a step plus batch - 1 decode rows)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 24))
      ->capture_default_str();
  return [o]() {
    GlmDsaConfig c = load_glm_dsa_config(o->model);
    if (o->mtp) enable_mtp(c, o->model + "/config.json");
    auto ck = Checkpoint::open(o->model);
    const uint64_t budget = o->budget.empty() ? 0 : parse_byte_size(o->budget, "--memory-budget");
    const uint64_t gpu = o->gpu_budget.empty() ? 0 : parse_byte_size(o->gpu_budget, "--gpu-budget");
    // (The rows of logits serve holds: as many as run and chat need, and more.)
    MemoryPlan p =
        plan_for(*ck, c, budget, o->context, o->batch, step_tokens_for(o->prefill_chunk, o->context, o->batch),
                 serve_logit_rows(o->batch, o->mtp), gpu);
    std::fputs(p.table().c_str(), stdout);
    if (p.gpu && gpu < p.g.minimum)
      fail("--gpu-budget ", format_bytes(gpu), " is below the minimum of ", format_bytes(p.g.minimum), " for ",
           o->model, " at context ", o->context, " x batch ", o->batch, " in steps of ", p.in.step_tokens, " tokens");
    if (p.gpu && !p.g.fits)
      fail("--memory-budget ", format_bytes(budget), " leaves no room for a pinned staging buffer (",
           format_bytes(p.in.slot_bytes), ") besides the resident weights for ", o->model);
    if (!p.gpu && budget && !p.fits)
      fail("--memory-budget ", format_bytes(budget), " is below the minimum of ", format_bytes(p.minimum), " for ",
           o->model, " at context ", o->context, " x batch ", o->batch, " in steps of ", p.in.step_tokens, " tokens");
    return 0;
  };
}

}  // namespace vireo::cli
