// `vireo bench`: prefill and decode speed, with achieved weight bandwidth beside the machine's
// measured memory bandwidth (the decode bound).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/membw.h"
#include "backend/cuda/cuda_backend.h"
#include "cli/commands.h"
#include "core/env.h"
#include "core/thread_pool.h"
#include "model/glm_dsa/model.h"
#include "model/glm_dsa/synthetic.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "runtime/speculative.h"

namespace vireo::cli {

void add_device_flag(CLI::App& app, std::string& device, std::string& math) {
  app.add_option("--device", device, "Where to run: cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--math", math,
                 "CUDA products of more than 8 rows (prefill, large batches) on tensor cores: exact (default: "
                 "activations split into bf16 hi + lo, f32-level accuracy, 2-3 passes), fast (activations "
                 "rounded once to bf16: one pass, ~2^-9 relative per product, as other engines run; also "
                 "batched decode's large bf16 products, decode attention past 256 keys and the indexer's decode "
                 "scores) or fast-fp8 "
                 "(fast, and FP8 weights multiply e4m3 activations, per 128 columns, as DeepSeek's reference "
                 "inference: ~2^-4 relative per activation)")
      ->check(CLI::IsMember({"exact", "fast", "fast-fp8"}));
}

namespace {
void check_math_flag(const std::string& device, const std::string& math) {
  if (math != "exact" && math != "fast" && math != "fast-fp8")
    fail("--math must be exact, fast or fast-fp8, got '", math, "'");
  // The CPU computes every product in f32: there is no fast mode to pick, and accepting the flag
  // would pretend otherwise.
  if (math != "exact" && device != "cuda") fail("--math ", math, " needs --device cuda (the CPU is always exact)");
}
}  // namespace

void check_device_flags(const std::string& device, const std::string& math, const StreamingFlags& f) {
  check_math_flag(device, math);
  if (!f.gpu_budget.empty() && device != "cuda") fail("--gpu-budget needs --device cuda");
  if (device == "cuda" && !f.budget.empty() && f.gpu_budget.empty())
    fail("--memory-budget with --device cuda bounds the host RAM of experts streamed to the GPU: add --gpu-budget");
  if (device == "cuda" && !cuda_compiled_in())
    fail("--device cuda: this vireo was built without CUDA (no nvcc at build time)");
}

#ifdef VIREO_HAVE_CUDA
CudaGemmMode gemm_mode(const std::string& math) {
  return math == "fast" ? CudaGemmMode::Bf16 : math == "fast-fp8" ? CudaGemmMode::Fp8 : CudaGemmMode::Split;
}
const char* math_name(CudaGemmMode m) {
  return m == CudaGemmMode::Bf16 ? "fast" : m == CudaGemmMode::Fp8 ? "fast-fp8" : "exact";
}
#endif

std::unique_ptr<Backend> make_cli_backend(const std::string& device, const std::string& math) {
  check_math_flag(device, math);
  auto backend = make_backend(device);
#ifdef VIREO_HAVE_CUDA
  if (device == "cuda") cuda_set_gemm_mode(*backend, gemm_mode(math));
#endif
  return backend;
}

namespace {

// The bench's decode with picks on the device queues each step before the last one's pick is
// read back, as generate() does; VIREO_QUEUED_DECODE=0 runs it one step at a time (A/B runs).
[[maybe_unused]] bool queued_decode() { return env_switch("VIREO_QUEUED_DECODE"); }

// --decode-steps as given, else VIREO_DECODE_STEPS (same-call A/B runs of tools/ab-bench.sh, whose
// variants are environments), else `given` (vireo run's default).
int decode_steps_flag(const CLI::Option* flag, int given) {
  if (flag->count() > 0) return given;
  const char* e = std::getenv("VIREO_DECODE_STEPS");
  if (!e || !*e) return given;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  if (*end || v < 1 || v > long(Backend::kMaxQueuedRead))
    fail("VIREO_DECODE_STEPS=", e, ": expected decode steps a chunk, 1 to ", Backend::kMaxQueuedRead);
  return int(v);
}

// (The bench's FLOP and byte counts below are used by the CUDA bench only.)

// Matrix-product FLOPs of one token through one layer (2 per weight), excluding kv_b, which the
// prefill path applies per key (counted with attention).
[[maybe_unused]] double layer_matmul_flops(const GlmDsaConfig& c, int l) {
  const double D = double(c.hidden_size), H = c.n_heads, qw = double(c.qk_head_dim()), L = double(c.kv_lora_rank);
  double p = 0;
  p += c.q_lora_rank > 0 ? D * double(c.q_lora_rank) + double(c.q_lora_rank) * H * qw : D * H * qw;
  p += D * (L + double(c.qk_rope_dim)) + H * double(c.v_head_dim) * D;
  if (c.has_indexer && c.indexer_full[size_t(l)])
    p += double(c.q_lora_rank) * c.index_n_heads * double(c.index_head_dim) + D * double(c.index_head_dim) +
         D * c.index_n_heads;
  if (c.layer_dense[size_t(l)]) p += 3 * D * double(c.intermediate_size);
  else
    p += D * c.n_routed_experts + 3 * D * double(c.moe_intermediate_size) * (c.experts_per_token + c.n_shared_experts);
  return 2 * p;
}

// Attention FLOPs of a T-token prefill from an empty cache: kv_b expansion of every key, scores
// and weighted values over each query's keys (DSA: at most index_topk), and the indexer scores.
[[maybe_unused]] double prefill_attention_flops(const GlmDsaConfig& c, int64_t T) {
  const double H = c.n_heads, hw = double(c.qk_nope_dim + c.v_head_dim), qw = double(c.qk_head_dim());
  double f = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    f += 2.0 * double(T) * double(c.kv_lora_rank) * H * hw;
    for (int64_t t = 0; t < T; ++t) {
      const double keys = c.has_indexer ? double(std::min<int64_t>(t + 1, c.index_topk)) : double(t + 1);
      f += 2.0 * H * keys * (qw + double(c.v_head_dim));
      if (c.has_indexer && c.indexer_full[size_t(l)] && t + 1 > c.index_topk)
        f += 2.0 * double(t + 1) * c.index_n_heads * double(c.index_head_dim);
    }
  }
  return f;
}

// Bytes of MLA cache (and indexer keys) one decode step at context `ctx` reads.
[[maybe_unused]] double decode_cache_bytes(const GlmDsaConfig& c, int64_t ctx) {
  double b = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const int64_t n = ctx + 1;
    const int64_t attended = c.has_indexer ? std::min<int64_t>(n, c.index_topk) : n;
    b += double(attended) * double(c.kv_cache_dim()) * 4;
    if (c.has_indexer && c.indexer_full[size_t(l)] && n > c.index_topk) b += double(n) * double(c.index_head_dim) * 4;
  }
  return b;
}

// Mean bytes one decode step reads over the n steps after a cache of ctx tokens: its weights
// (fewer where DSA is dense: decode_weight_bytes) and, with_cache, its MLA cache and indexer keys.
// Until session 55 the weights were active_weight_bytes_per_token at every context, which counts
// the indexer's query and head weights that a step at <= index_topk keys does not read (fp8, 8
// GLM-5 layers: 70 MB of 6.0 GB at context 0, so the % of bandwidth there read ~1.2 points high).
double mean_decode_bytes(const GlmDsaModel& m, int64_t ctx, int64_t n, bool with_cache) {
  double b = 0;
  for (int64_t i = 0; i < n; ++i)
    b += double(m.decode_weight_bytes(ctx + i + 1)) + (with_cache ? decode_cache_bytes(m.config(), ctx + i) : 0.0);
  return b / double(std::max<int64_t>(n, 1));
}

// `vireo bench --device cuda`: B=1 decode at context 0 and 4096, prefill of 512 and 4096 tokens,
// against a device-to-device copy and a cuBLASLt bf16 GEMM measured in the same run.
int bench_cuda(const std::string& dir, const std::string& synthetic, const std::string& dtype, int layers, int experts,
               int64_t n_decode, bool record, bool profile, const SamplingParams& sampling, const std::string& math,
               bool math_only, int batch, int64_t capacity, const std::string& profiler_range,
               const std::string& profile_mode, int decode_steps, int64_t context) {
#ifndef VIREO_HAVE_CUDA
  fail("--device cuda: this vireo was built without CUDA (no nvcc at build time)");
#else
  using clock = std::chrono::steady_clock;
  auto backend = make_cli_backend("cuda", math);
  const CudaGemmMode mode = gemm_mode(math);
  std::unique_ptr<GlmDsaModel> model;
  auto t0 = clock::now();
  if (!synthetic.empty()) {
    GlmDsaConfig c = glm5_synthetic_config(layers, experts);
    std::fprintf(stderr, "building synthetic glm5: %d layers x %d experts, %s weights...\n", layers, experts,
                 dtype.c_str());
    auto ck = make_synthetic_checkpoint(c, parse_weight_dtype_flag(dtype));
    model = GlmDsaModel::create(std::move(c), std::move(ck), *backend);
  } else {
    model = GlmDsaModel::load(dir, *backend);
  }
  const GlmDsaConfig& c = model->config();
  model->set_recording(record);
  // Routed experts: upload every one now, so no timed step pays for a first use.
  std::vector<int> all(size_t(c.n_routed_experts));
  for (int e = 0; e < c.n_routed_experts; ++e) all[size_t(e)] = e;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.layer_dense[size_t(l)]) continue;
    for (const ExpertWeights* e : model->experts().prepare(l, all)) {
      backend->upload_weight(e->gate);
      backend->upload_weight(e->up);
      backend->upload_weight(e->down);
    }
  }
  cuda_synchronize(*backend);
  std::fprintf(stderr, "loaded and uploaded in %.1f s; measuring copy bandwidth and GEMM peak...\n",
               std::chrono::duration<double>(clock::now() - t0).count());
  const double copy_gbs = cuda_measure_copy_gbs(*backend);
  const double gemm_tflops = cuda_measure_bf16_gemm_tflops(*backend);
  const double weights = double(model->active_weight_bytes_per_token());
  const int64_t V = c.vocab_size;
  std::vector<float> logits(static_cast<size_t>(V));
  const int64_t max_ctx = std::max<int64_t>(4096, context) + n_decode + 10;
  std::vector<int32_t> ids(static_cast<size_t>(max_ctx));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7919 + 13) % size_t(V));
  double mm_flops_per_token = 0;
  for (int l = 0; l < c.num_layers; ++l) mm_flops_per_token += layer_matmul_flops(c, l);
  const double lm_head_flops = 2.0 * double(V) * double(c.hidden_size);
  {  // warm-up: kernels loaded, cuBLASLt heuristics cached
    MlaCache warm(*backend, model->cache_shape(), 1, 80);
    model->forward(ids.data(), 64, warm, 0, logits.data(), false, AttentionPath::Reconstructed);
    model->forward(&ids[64], 1, warm, 0, logits.data(), false, AttentionPath::Absorbed);
  }
  auto secs = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  // How a decode step picks its token: greedy (argmax on the device), sampled on the device
  // (sample_rows: only the token comes back) or sampled on the host (the logits copied back,
  // Sampler::sample), the last two with --temp etc.
  enum class Pick { Greedy, SampleDevice, SampleHost };
  // gpu_us: a step's GPU time, the recorded step replayed back to back (0: not measured).
  // picks: the FNV-1a hash of the timed steps' picked ids (0: not taken). Two launch forms or
  // builds that promise the same bits must print the same hash (an A/B's check that the faster
  // variant computes what the other does).
  struct Decode {
    int64_t ctx;
    double tps, bytes;
    Pick pick;
    double gpu_us;
    uint64_t picks;
  };
  struct Prefill { int64_t T; double s, flops; const char* math; };
  std::vector<Decode> dec;
  std::vector<Prefill> pre;
  // Decode steps as `vireo run` takes them. The first two steps of a cache are untimed: the
  // first runs eagerly, the second records the graph. Greedy steps queued in chunks of
  // decode_steps (one graph a chunk) warm their chunks' recordings untimed too (each chunk size
  // twice: eager, then recorded), then the cache is trimmed back to the two steps.
  auto decode_from = [&](MlaCache& cache, int64_t ctx, Pick pick) {
    Sampler sampler(sampling);
    auto step = [&](const int32_t* token) {
      if (pick == Pick::SampleHost) {
        model->forward(token, 1, cache, 0, logits.data(), false, AttentionPath::Absorbed);
        return sampler.sample(logits.data(), V);
      }
      const SampleRowArgs a = sampler.next_row_args();
      return model->forward_next(token, 1, cache, 0, pick == Pick::Greedy ? nullptr : &a, AttentionPath::Absorbed);
    };
    for (int64_t i = 0; i < 2; ++i) step(&ids[size_t(ctx + i)]);
    ctx += 2;
    const bool queued = pick != Pick::SampleHost && queued_decode();
    const int K = queued && pick == Pick::Greedy ? decode_steps : 1;
    if (K > 1) {
      for (int64_t k : {int64_t(K), n_decode % K})
        for (int rep = 0; k > 0 && rep < 2; ++rep) {
          const int ran = model->queue_step(&ids[size_t(ctx)], cache, 0, nullptr, int(k));
          for (int j = 0; j < ran; ++j) model->take_step();
          cache.trim(0, ctx);
        }
    }
    // `ncu --profile-from-start off` sees the timed steps only (or, --profiler-range prefill, the
    // timed prefill runs only; a profiler started on its own stops at the first range's end).
    const bool in_range = profiler_range == "decode";
    if (in_range) cuda_profiler_range(*backend, true);
    auto a = clock::now();
    uint64_t picks = 0;
    // Picks on the device run as `vireo run` runs them (generate()): each step fed the pick of the
    // one before on the device, queued before that pick is read back; greedy steps in chunks of K,
    // one chunk queued ahead. (VIREO_QUEUED_DECODE=0: one step at a time on the prompt's next ids,
    // as before session 30, for A/B runs.)
    if (queued) {
      std::vector<SampleRowArgs> args;
      for (int64_t i = 0; i < n_decode; ++i) args.push_back(sampler.next_row_args());
      int64_t n_queued = 0;
      auto queue = [&](const int32_t* token) {
        const int k = int(std::min<int64_t>(K, n_decode - n_queued));
        n_queued += model->queue_step(token, cache, 0, pick == Pick::Greedy ? nullptr : &args[size_t(n_queued)], k);
      };
      queue(&ids[size_t(ctx)]);
      picks = 1469598103934665603ull;
      for (int64_t i = 0; i < n_decode; ++i) {
        if (n_queued < n_decode && model->queued_steps() <= K) queue(nullptr);
        picks = (picks ^ uint64_t(uint32_t(model->take_step()))) * 1099511628211ull;
      }
    } else {
      for (int64_t i = 0; i < n_decode; ++i) step(&ids[size_t(ctx + i)]);
    }
    const double s = secs(a, clock::now());
    if (in_range) cuda_profiler_range(*backend, false);
    const double bytes = mean_decode_bytes(*model, ctx, n_decode, true);
    // What the host's work between steps costs: the last recorded step replayed back to back.
    double gpu_us = 0;
    if (pick == Pick::Greedy && record) {
      auto b = clock::now();
      const int64_t steps = model->replay_latest(int((n_decode + K - 1) / K));
      if (steps) gpu_us = 1e6 * secs(b, clock::now()) / double(steps);
    }
    dec.push_back({ctx - 2, double(n_decode) / s, bytes, pick, gpu_us, picks});
  };
  const bool sampled = sampling.temperature != 0.0f;
  for (Pick pick : sampled ? std::vector<Pick>{Pick::Greedy, Pick::SampleDevice, Pick::SampleHost}
                           : std::vector<Pick>{Pick::Greedy}) {
    MlaCache cache(*backend, model->cache_shape(), 1, std::max(capacity, n_decode + 8));
    decode_from(cache, 0, pick);
  }
  // --batch B: B sequences decoding together from context 0, as `vireo serve` steps them
  // (forward_batch, every product over the B rows at once, greedy tokens chosen on the device),
  // two untimed steps first (eager, then recording).
  // gpu_us: the batch's recorded step replayed back to back (its GPU time); before / launch: the
  // host's time a step in forward_batch before launching the step and launching it.
  struct Batched {
    double tps, step_ms, gpu_us, before_us, launch_us;
  };
  std::vector<Batched> batched;
  if (batch > 1) {
    MlaCache cache(*backend, model->cache_shape(), batch, n_decode + 8);
    std::vector<int32_t> next(static_cast<size_t>(batch));
    auto step = [&](int64_t i) {
      std::vector<BatchItem> items(static_cast<size_t>(batch));
      for (int b = 0; b < batch; ++b) {
        BatchItem& it = items[size_t(b)];
        it.row = b;
        it.tokens = &ids[size_t((i + 101 * b) % int64_t(ids.size()))];
        it.T = 1;
        it.token = &next[size_t(b)];
      }
      model->forward_batch(items, cache, AttentionPath::Absorbed);
    };
    for (int64_t i = 0; i < 2; ++i) step(i);
    model->reset_host_times();
    auto a = clock::now();
    for (int64_t i = 0; i < n_decode; ++i) step(2 + i);
    const double s = secs(a, clock::now());
    const GlmDsaModel::HostTimes ht = model->host_times();
    double gpu_us = 0;
    auto b = clock::now();
    if (const int64_t steps = model->replay_latest(int(n_decode))) gpu_us = 1e6 * secs(b, clock::now()) / double(steps);
    const double per = 1e6 / double(std::max<int64_t>(ht.steps, 1));
    batched.push_back({double(n_decode * batch) / s, 1e3 * s / double(n_decode), gpu_us, ht.before_launch_s * per,
                       ht.launch_s * per});
  }
  // Prefill in every --math mode: one untimed run at the length first (the backend's scratch
  // buffers grow to it, and cuBLASLt picks algorithms for its shapes), then the median of 3 timed
  // runs. The decode after 4096 cached runs in the mode asked for, from the cache that mode filled.
  // A prompt ends as `vireo run` and the server end it: the first token picked on the device and
  // only it copied back (forward_next), not the vocabulary's logits (until session 20 the bench
  // copied them to pageable host memory: 74 us of a 3.4 ms prefill at 2 layers).
  auto prefill = [&](int64_t T, CudaGemmMode m, const char* name, MlaCache& cache) {
    cuda_set_gemm_mode(*backend, m);
    std::vector<double> runs;
    for (int r = 0; r < 4; ++r) {
      cache.trim(0, 0);
      const bool in_range = r > 0 && profiler_range == "prefill";
      if (in_range) cuda_profiler_range(*backend, true);
      auto a = clock::now();
      model->forward_next(ids.data(), T, cache, 0, nullptr, AttentionPath::Reconstructed);
      if (r > 0) runs.push_back(secs(a, clock::now()));
      if (in_range) cuda_profiler_range(*backend, false);
    }
    std::sort(runs.begin(), runs.end());
    pre.push_back({T, runs[1], mm_flops_per_token * double(T) + lm_head_flops + prefill_attention_flops(c, T), name});
  };
  // Every mode, the asked-for one last; fast-fp8 only where it can differ from fast (FP8 weights,
  // or a checkpoint of unknown dtype).
  // (--math-only: the asked-for one alone.)
  std::vector<CudaGemmMode> modes;
  for (CudaGemmMode m : {CudaGemmMode::Split, CudaGemmMode::Bf16, CudaGemmMode::Fp8})
    if (!math_only && m != mode && (m != CudaGemmMode::Fp8 || dtype == "fp8" || synthetic.empty())) modes.push_back(m);
  modes.push_back(mode);
  for (int64_t T : {int64_t(512), int64_t(4096)}) {
    // --capacity sizes this cache too: a server's --context sizes every sequence's, and a recorded
    // step's launches are bounded by the cache's rows past index_topk keys.
    MlaCache cache(*backend, model->cache_shape(), 1, std::max(capacity, T + n_decode + 8));
    for (CudaGemmMode m : modes) prefill(T, m, math_name(m), cache);  // the last one's cache feeds the decode
    if (T == 4096) decode_from(cache, T, Pick::Greedy);
  }
  // --context N: the decode after N cached tokens too (a long conversation's), the cache filled
  // untimed by prompts of up to 4096 tokens in the mode asked for, each on the attention path
  // `vireo run` would take for it.
  if (context > 0 && context != 4096) {
    MlaCache cache(*backend, model->cache_shape(), 1, std::max(capacity, context + n_decode + 8));
    cuda_set_gemm_mode(*backend, mode);
    for (int64_t done = 0; done < context;) {
      const int64_t n = std::min<int64_t>(4096, context - done);
      model->forward_next(&ids[size_t(done)], n, cache, 0, nullptr, model->choose_path(n, done));
      done += n;
      std::fprintf(stderr, "\rfilling the cache: %lld/%lld tokens", (long long)done, (long long)context);
    }
    std::fprintf(stderr, "\n");
    decode_from(cache, context, Pick::Greedy);
  }
  // The sampling step alone, on the last logits of the host-sampled run: sample_rows on the
  // device (with its 4-byte copy back) against the logits' copy to the host plus Sampler::sample.
  double device_sample_us = 0, copy_us = 0, host_sample_us = 0;
  if (sampled) {
    auto dev_logits = backend->alloc_f32(size_t(V));
    auto dev_token = backend->alloc_i32(1);
    backend->copy_from_host(dev_logits.get(), logits.data(), size_t(V));
    Sampler sampler(sampling);
    int32_t token = 0;
    const int runs = 50;
    auto time_us = [&](auto&& body) {
      body();  // untimed: buffers grow on the first call
      auto a = clock::now();
      for (int i = 0; i < runs; ++i) body();
      return 1e6 * secs(a, clock::now()) / runs;
    };
    device_sample_us = time_us([&] {
      const SampleRowArgs args = sampler.next_row_args();
      backend->sample_rows(dev_logits.get(), 1, V, &args, dev_token.get());
      backend->copy_to_host_i32(&token, dev_token.get(), 1);
    });
    copy_us = time_us([&] { backend->copy_to_host(logits.data(), dev_logits.get(), size_t(V)); });
    host_sample_us = time_us([&] { token = sampler.sample(logits.data(), V); });
  }
  std::string profiles;
  if (profile) {  // after the timed runs: the profile's syncs would distort them
    model->set_recording(false);  // op by op: each op timed on its own
    auto run = [&](const char* what, auto&& body) {
      cuda_set_profile(*backend, true, profile_mode == "queued");
      auto a = clock::now();
      body();
      const double ms = 1e3 * secs(a, clock::now());
      profiles += std::string("\nprofile: ") + what + "\n" + cuda_profile_report(*backend, ms);
      cuda_set_profile(*backend, false);
    };
    const int64_t steps = std::min<int64_t>(n_decode, 8);
    for (int64_t T : {int64_t(512), int64_t(4096)}) {
      MlaCache cache(*backend, model->cache_shape(), 1, T + steps + 8);
      for (CudaGemmMode m : modes) {  // the asked-for mode last: its cache feeds the decode
        cuda_set_gemm_mode(*backend, m);
        run(("prefill " + std::to_string(T) + " tokens, --math " + math_name(m)).c_str(),
            [&] {
              cache.trim(0, 0);
              model->forward_next(ids.data(), T, cache, 0, nullptr, AttentionPath::Reconstructed);
            });
      }
      if (T == 4096)
        run(("decode, " + std::to_string(steps) + " steps after 4096 cached").c_str(), [&] {
          for (int64_t i = 0; i < steps; ++i)
            model->forward(&ids[size_t(T + i)], 1, cache, 0, logits.data(), false, AttentionPath::Absorbed);
        });
    }
  }
  std::printf("model              %s\n", synthetic.empty() ? dir.c_str()
              : ("synthetic glm5, " + std::to_string(layers) + " layers x " + std::to_string(experts) +
                 " experts, " + dtype).c_str());
  std::printf("device             cuda\n");
  std::printf("copy bandwidth     %.0f GB/s (device-to-device, read + write, measured now)\n", copy_gbs);
  std::printf("bf16 GEMM peak     %.0f TFLOP/s (cuBLASLt 8192^3, measured now)\n", gemm_tflops);
  std::printf("active weights     %.3f GB per decoded token%s\n", weights / 1e9,
              c.has_indexer
                  ? (" (at most: fewer at <= " + std::to_string(c.index_topk) + " keys, where DSA is dense)").c_str()
                  : "");
  std::printf("decode steps       %s\n",
              record ? (queued_decode() ? "replayed from a recorded CUDA graph, the next one queued before "
                                          "this one's token is read back (as vireo run)"
                                        : "replayed from a recorded CUDA graph (token chosen after the replay)")
                     : "launched op by op (--no-graph)");
  if (queued_decode()) std::printf("greedy chunks      %d decode steps a launch (--decode-steps)\n", decode_steps);
  if (sampled)
    std::printf("sampling           temperature %g, top-k %d, top-p %g, min-p %g, seed %llu\n", sampling.temperature,
                sampling.top_k, sampling.top_p, sampling.min_p, (unsigned long long)sampling.seed);
  for (const Decode& d : dec)
    std::printf("decode ctx %-6lld  %-14s %8.2f tok/s  %.3f GB/token (weights + cache)  %7.0f GB/s  = %5.1f%% of copy bandwidth\n",
                (long long)d.ctx,
                d.pick == Pick::Greedy ? "greedy/device" : d.pick == Pick::SampleDevice ? "sample/device" : "sample/host",
                d.tps, d.bytes / 1e9, d.bytes * d.tps / 1e9, 100.0 * d.bytes * d.tps / 1e9 / copy_gbs);
  for (const Decode& d : dec)
    if (d.gpu_us > 0)
      std::printf(
          "decode ctx %-6lld  steps back to back: %.1f us a step against %.1f (%.1f us a step between "
          "steps: the host's work and the launch)\n",
          (long long)d.ctx, d.gpu_us, 1e6 / d.tps, 1e6 / d.tps - d.gpu_us);
  for (const Decode& d : dec)
    if (d.picks)
      std::printf(
          "decode ctx %-6lld  %-14s picks' hash %016llx (FNV-1a of the %lld ids: equal across forms "
          "that change no bits)\n",
          (long long)d.ctx, d.pick == Pick::Greedy ? "greedy/device" : "sample/device", (unsigned long long)d.picks,
          (long long)n_decode);
  for (const Batched& b : batched) {
    const double one = dec.empty() ? 0 : dec[0].tps;
    std::printf("decode ctx 0       batch %-3d %11.2f tok/s  (%.2f tok/s a sequence, %.3f ms a step: %.2fx one "
                "sequence's tok/s)\n",
                batch, b.tps, b.tps / batch, b.step_ms, one > 0 ? b.tps / one : 0.0);
    if (b.gpu_us > 0)
      std::printf(
          "decode ctx 0       batch %-3d steps back to back: %.1f us a step against %.1f (%.1f us between: "
          "the host's %.1f us before launching a step and %.1f us launching it, the picks' read-back)\n",
          batch, b.gpu_us, 1e3 * b.step_ms, 1e3 * b.step_ms - b.gpu_us, b.before_us, b.launch_us);
  }
  for (const Prefill& p : pre)
    std::printf("prefill %-6lld %-8s %8.1f tok/s  %.4f s  %7.1f TFLOP/s  = %5.1f%% of bf16 GEMM peak (median of 3)\n",
                (long long)p.T, p.math,
                double(p.T) / p.s, p.s, p.flops / p.s / 1e12, 100.0 * p.flops / p.s / 1e12 / gemm_tflops);
  if (sampled)
    std::printf("sampling alone     device: %.1f us (sample_rows, token copied back); host: %.1f us (logits copied "
                "back) + %.1f us (Sampler::sample), vocab %lld\n",
                device_sample_us, copy_us, host_sample_us, (long long)V);
  std::fputs(profiles.c_str(), stdout);
  return 0;
#endif
}

// `vireo bench --device cuda --gpu-budget X`: B = 1 decode with the routed experts streamed from
// host RAM (a pinned copy, or a host tier fed from disk) into a device pool of slots, against the
// links measured in the same run: bound time = (1 - hit) x expert bytes per token x (the share of
// misses copied from host RAM / H2D GB/s + the share read from disk / disk GB/s).
int bench_cuda_streaming(const std::string& dir, const std::string& synthetic, const std::string& dtype, int layers,
                         int experts, int64_t n_prompt, int64_t n_decode, const StreamingFlags& sf,
                         const std::string& math) {
#ifndef VIREO_HAVE_CUDA
  fail("--device cuda: this vireo was built without CUDA (no nvcc at build time)");
#else
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  auto backend = make_cli_backend("cuda", math);
  const int64_t total = n_prompt + 1 + n_decode;  // one untimed decode step loads its kernels
  auto t0 = clock::now();
  LoadedModel lm;
  if (!synthetic.empty()) {
    GlmDsaConfig c = glm5_synthetic_config(layers, experts);
    std::fprintf(stderr, "building synthetic glm5: %d layers x %d experts, %s weights...\n", layers, experts,
                 dtype.c_str());
    auto ck = make_synthetic_checkpoint(c, parse_weight_dtype_flag(dtype));
    lm = load_checkpoint(std::move(c), std::move(ck), "synthetic glm5", *backend, sf, total, 1, n_prompt);
  } else {
    lm = load_model(dir, *backend, sf, total, 1, n_prompt);  // the prompt is one step
  }
  GlmDsaModel& model = *lm.model;
  DeviceExpertStore& st = *lm.device;
  const GlmDsaConfig& c = model.config();
  cuda_synchronize(*backend);
  std::fprintf(stderr, "loaded in %.1f s; measuring pinned host-to-device bandwidth...\n", secs(t0, clock::now()));
  const double h2d_gbs = st.measure_link_gbs(size_t(1) << 30);
  // A host tier reads its misses from disk first: measured as the host streaming store measures
  // it (random experts, the same reader settings).
  double disk_gbs = 0;
  if (!st.host_copy()) {
    ExpertStoreOptions po;
    po.slots = 1;
    po.io_threads = sf.io_threads;
    po.direct = sf.direct == "on" ? DirectIo::On : sf.direct == "off" ? DirectIo::Off : DirectIo::Auto;
    disk_gbs = StreamingExpertStore(model.checkpoint(), expert_store_params(c), po).measure_read_gbs(48, 8);
  }
  std::vector<int32_t> ids(static_cast<size_t>(total));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7919 + 13) % size_t(c.vocab_size));
  std::vector<float> logits(static_cast<size_t>(c.vocab_size));
  MlaCache cache(*backend, model.cache_shape(), 1, total);
  auto t1 = clock::now();
  model.forward(ids.data(), n_prompt, cache, 0, logits.data(), false, AttentionPath::Reconstructed);
  auto t2 = clock::now();
  model.forward(&ids[size_t(n_prompt)], 1, cache, 0, logits.data(), false, AttentionPath::Absorbed);
  model.experts().reset_stats();
  auto t3 = clock::now();
  for (int64_t i = 0; i < n_decode; ++i)
    model.forward(&ids[size_t(n_prompt + 1 + i)], 1, cache, 0, logits.data(), false, AttentionPath::Absorbed);
  auto t4 = clock::now();
  const ExpertStoreStats d = model.experts().stats();
  const double decode_s = secs(t3, t4), tps = double(n_decode) / decode_s;
  const double hit = d.hit_rate();
  const double expert_bytes = double(st.layout().expert_bytes());
  const double per_token = double(c.experts_per_token) * double(lm.plan.in.n_moe_layers) * expert_bytes;
  // Misses found in host RAM (the pinned copy, or the host tier) cross only the host-to-device
  // link; the others are read from disk first, the slower link (their copies overlap the reads).
  const double from_host = st.host_copy() ? 1.0 : d.misses ? double(d.host_hits) / double(d.misses) : 0.0;
  const double disk_link = disk_gbs > 0 ? std::min(disk_gbs, h2d_gbs) : h2d_gbs;
  const double s_per_byte = from_host / (h2d_gbs * 1e9) + (1.0 - from_host) / (disk_link * 1e9);
  const double bound_tps = 1.0 / std::max((1.0 - hit) * per_token * s_per_byte, 1e-9);
  const uint64_t n_experts = uint64_t(lm.plan.total_experts());
  std::printf("model              %s\n", synthetic.empty() ? dir.c_str()
              : ("synthetic glm5, " + std::to_string(layers) + " layers x " + std::to_string(experts) +
                 " experts, " + dtype).c_str());
  std::printf("device             cuda, GPU budget %s\n", format_bytes(lm.plan.in.gpu_budget).c_str());
  std::printf("expert pool        %lld device slots of %.1f MB (%.1f%% of %llu experts), floor %d; host: %s (%.2f GB pinned)\n",
              (long long)st.slots(), double(st.slot_bytes()) / 1e6, 100.0 * double(st.slots()) / double(n_experts),
              (unsigned long long)n_experts, st.layer_floor(),
              st.host_copy() ? "pinned copy of every expert"
                             : ("host tier of " + std::to_string(st.staging_buffers()) + " pinned slots (" +
                                std::to_string(int(100.0 * double(st.staging_buffers()) / double(n_experts))) +
                                "% of experts, LRU) fed from disk").c_str(),
              double(st.pinned_bytes()) / 1e9);
  std::printf("host->device link  %.2f GB/s (pinned, 1 GiB copies, measured now)\n", h2d_gbs);
  if (disk_gbs > 0)
    std::printf("disk read          %.2f GB/s (measured now, %d threads)\n", disk_gbs, sf.io_threads);
  std::printf("prefill            %lld tokens in %.3f s\n", (long long)n_prompt, secs(t1, t2));
  std::printf("decode             %lld tokens in %.3f s: %.2f tok/s\n", (long long)n_decode, decode_s, tps);
  std::printf("decode experts     %s\n", stats_line(d).c_str());
  std::printf("decode H2D         %.2f GB/s achieved (%.3f GB per token)\n", double(d.bytes_to_device) / 1e9 / decode_s,
              double(d.bytes_to_device) / 1e9 / double(n_decode));
  if (!st.host_copy())
    std::printf("decode disk read   %.2f GB/s achieved (%.3f GB moved per token)\n",
                double(d.bytes_transferred) / 1e9 / decode_s, double(d.bytes_transferred) / 1e9 / double(n_decode));
  if (st.host_copy())
    std::printf("bound              (1 - %.3f) x %.3f GB / %.2f GB/s = %.4f s/token: %.2f tok/s; achieved %.0f%% of bound\n",
                hit, per_token / 1e9, h2d_gbs, 1.0 / bound_tps, bound_tps, 100.0 * tps / bound_tps);
  else
    std::printf("bound              (1 - %.3f) x %.3f GB x (%.3f / %.2f GB/s + %.3f / %.2f GB/s) = %.4f s/token: %.2f "
                "tok/s; achieved %.0f%% of bound (misses from the host tier / H2D + from disk / disk)\n",
                hit, per_token / 1e9, from_host, h2d_gbs, 1.0 - from_host, disk_link, 1.0 / bound_tps, bound_tps,
                100.0 * tps / bound_tps);
  return 0;
#endif
}

}  // namespace

Action add_bench(CLI::App& app) {
  struct Opts {
    std::string model, synthetic, dtype = "bf16";
    int layers = 2, experts = 16;
    int64_t prompt = 64, decode = 16, context = 0, capacity = 0;
    int batch = 1;
    int decode_steps = GenerateOptions{}.decode_steps;
    bool no_graph = false;
    std::string attention = "auto";
    StreamingFlags sf;
    std::string device = "cpu";
    std::string math = "exact";  // --math: CUDA prefill products
    bool profile = false, math_only = false, mtp = false;
    std::string profiler_range = "decode";
    std::string profile_mode = "synced";
    SamplingParams s;
  };
  auto o = std::make_shared<Opts>();
  auto* m = app.add_option("--model,-m", o->model, "Model directory");
  app.add_option("--synthetic", o->synthetic, "Random weights with real shapes instead of a checkpoint")
      ->check(CLI::IsMember({"glm5"}))
      ->excludes(m);
  app.add_option("--layers", o->layers, "Synthetic: MoE layers")->check(CLI::Range(1, 200));
  app.add_option("--experts", o->experts, "Synthetic: routed experts per layer")->check(CLI::Range(1, 256));
  app.add_option("--dtype", o->dtype, "Synthetic: weight dtype")->check(CLI::IsMember({"bf16", "fp8"}));
  auto* prompt_flag =
      app.add_option("--prompt", o->prompt, "Prefill length in tokens (CUDA without --gpu-budget: 512 and 4096)")
          ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  app.add_option("--decode", o->decode, "Decode steps to time")->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  app.add_option("--context", o->context,
                 "Tokens already in the cache (filled untimed) before the timed prefill chunk and decode steps "
                 "(CUDA: one more decode row, after this many cached tokens)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 22));
  auto* attention_flag = app.add_option("--attention", o->attention, "CPU: attention path of the timed prefill chunk")
                             ->check(CLI::IsMember({"auto", "reconstructed", "absorbed"}));
  auto* steps_flag =
      app.add_option("--decode-steps", o->decode_steps,
                     "CUDA: greedy decode steps queued as one chunk, one graph launch each (as vireo run's "
                     "--decode-steps; default: VIREO_DECODE_STEPS if set, else vireo run's default)")
          ->check(CLI::Range(1, int(Backend::kMaxQueuedRead)));
  app.add_flag("--mtp", o->mtp,
               "CPU, --model: also time generation of --decode tokens from the prompt with and without the "
               "MTP layer's drafts (vireo run --mtp), 3 rounds each: greedy (checked to give the same tokens), or "
               "sampled with --temp (the same seed)");
  app.add_flag("--no-graph", o->no_graph, "CUDA: launch decode steps op by op instead of replaying a recorded graph");
  app.add_option("--batch", o->batch,
                 "CUDA: also time decode steps of this many sequences at once (as vireo serve batches them), "
                 "beside one sequence")
      ->check(CLI::Range(1, 64));
  app.add_option("--capacity", o->capacity,
                 "CUDA: rows of the caches the decodes run in (default: the context, decode steps + 8; at least "
                 "that), as a server's --context sizes each sequence's")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 22));
  add_streaming_flags(app, o->sf);
  add_device_flag(app, o->device, o->math);
  app.add_flag("--profile", o->profile,
               "CUDA: after the timed runs, an op-level GPU profile (time per op and matmul shape) of prefill 512 "
               "and 4096 and of decode");
  app.add_option("--profile-mode", o->profile_mode,
                 "CUDA, with --profile: synced (each op waits for the one before: its own time) or queued (nothing "
                 "waits: the ops as the GPU ran them, and how long it sat idle between them waiting for the host)")
      ->check(CLI::IsMember({"synced", "queued"}));
  app.add_flag("--math-only", o->math_only,
               "CUDA: time (and profile) prefill in the --math mode only, not in every mode");
  app.add_option("--profiler-range", o->profiler_range,
                 "CUDA: what an external profiler started with --profile-from-start off (ncu, nsys) records: the "
                 "timed decode steps (decode, the default) or the timed prefill runs (prefill)")
      ->check(CLI::IsMember({"decode", "prefill"}));
  app.add_option("--temp", o->s.temperature,
                 "Decode steps sample at this temperature (0: greedy); CUDA: timed sampling on the device and on "
                 "the host, beside greedy");
  app.add_option("--top-k", o->s.top_k, "Sampled decode: keep the k most likely tokens (0: off)");
  app.add_option("--top-p", o->s.top_p, "Sampled decode: nucleus mass (1: off)");
  app.add_option("--min-p", o->s.min_p, "Sampled decode: drop tokens below min_p x the top probability (0: off)");
  app.add_option("--seed", o->s.seed, "Sampled decode: seed");
  return [o, steps_flag, prompt_flag, attention_flag]() {
    using clock = std::chrono::steady_clock;
    if (o->model.empty() && o->synthetic.empty()) fail("bench needs --model DIR or --synthetic glm5");
    validate_sampling(o->s);
    if (o->capacity > 0 && (o->device != "cuda" || !o->sf.gpu_budget.empty()))
      fail("--capacity needs --device cuda without --gpu-budget (it sizes the resident model's decode cache)");
    if (o->profiler_range != "decode" && (o->device != "cuda" || !o->sf.gpu_budget.empty()))
      fail("--profiler-range needs --device cuda without --gpu-budget (it brackets the resident model's timed runs)");
    if (o->capacity > 0 && o->capacity < o->decode + 8)
      fail("--capacity ", o->capacity, ": the context-0 decode needs at least --decode + 8 = ", o->decode + 8, " rows");
    // (Pairs of resident and streaming runs share their flags, BENCHMARKS "Expert streaming to the GPU".)
    if (o->device == "cuda" && o->sf.gpu_budget.empty() && prompt_flag->count() > 0)
      std::fprintf(stderr,
                   "note: --prompt %lld is not timed here: without --gpu-budget the CUDA bench times prompts "
                   "of 512 and 4096 tokens\n",
                   (long long)o->prompt);
    if (o->device != "cpu" && attention_flag->count() > 0)
      fail("--attention chooses the CPU bench's attention path (drop it with --device ", o->device, ")");
    if (o->device == "cuda" && !o->sf.gpu_budget.empty() && o->context > 0)
      fail("--context: the streaming bench (--gpu-budget) times its prompt from an empty cache (drop one of them)");
    check_device_flags(o->device, o->math, o->sf);
    if (o->mtp && (o->model.empty() || o->device != "cpu"))
      fail("--mtp needs --model DIR (a checkpoint with an MTP layer) and --device cpu");
    if (o->profile && o->device != "cuda") fail("--profile needs --device cuda");
    if (o->profile_mode != "synced" && !o->profile) fail("--profile-mode needs --profile");
    if (o->math_only && o->device != "cuda") fail("--math-only needs --device cuda");
    if (o->batch > 1 && (o->device != "cuda" || !o->sf.gpu_budget.empty()))
      fail("--batch needs --device cuda without --gpu-budget (batched decode is timed on the resident model)");
    if (o->device == "cuda" && !o->sf.gpu_budget.empty() && o->s.temperature != 0.0f)
      fail("--temp: sampled decode steps are not measured with --gpu-budget (drop one of them)");
    if (o->device == "cuda" && !o->sf.gpu_budget.empty())
      return bench_cuda_streaming(o->model, o->synthetic, o->dtype, o->layers, o->experts, o->prompt, o->decode, o->sf,
                                  o->math);
    if (o->device == "cuda")
      return bench_cuda(o->model, o->synthetic, o->dtype, o->layers, o->experts, o->decode, !o->no_graph, o->profile,
                        o->s, o->math, o->math_only, o->batch, o->capacity, o->profiler_range, o->profile_mode,
                        decode_steps_flag(steps_flag, o->decode_steps), o->context);
    ThreadPool& pool = ThreadPool::global();
    auto backend = make_cpu_backend();
    std::unique_ptr<GlmDsaModel> model;
    LoadedModel lm;
    auto t0 = clock::now();
    if (!o->synthetic.empty()) {
      GlmDsaConfig c = glm5_synthetic_config(o->layers, o->experts);
      std::fprintf(stderr, "building synthetic glm5: %d layers x %d experts, %s weights...\n", o->layers,
                   o->experts, o->dtype.c_str());
      auto ck = make_synthetic_checkpoint(c, parse_weight_dtype_flag(o->dtype));
      model = GlmDsaModel::create(std::move(c), std::move(ck), *backend);
    } else {
      // Steps: the cache filled in 512-token chunks, then the prompt in one.
      // (--mtp: the cache also holds the two-token steps' entries.)
      lm = load_model(o->model, *backend, o->sf, o->context + o->prompt + 2 * o->decode, 1,
                      std::max(o->prompt, std::min<int64_t>(o->context, 512)), o->mtp ? 2 : 0, o->mtp);
      model = std::move(lm.model);
    }
    std::fprintf(stderr, "loaded in %.1f s; measuring memory bandwidth...\n",
                 std::chrono::duration<double>(clock::now() - t0).count());
    const double bw = measure_memory_bandwidth_gbs(pool);
    // Streaming: the disk link as the store's reader sees it, measured in this run.
    double link_gbs = 0;
    if (lm.streaming) link_gbs = lm.streaming->measure_read_gbs(48, 8);
    // The probes' buffers (1 GiB for memory, 8 expert slots for the disk) are bench's, not the
    // model's: the peak RSS reported below starts after them (the model is loaded by now, so its
    // resident bytes are counted).
    const bool rss_after_probes = reset_peak_rss();
    const GlmDsaConfig& c = model->config();
    const int64_t C = o->context, total = C + o->prompt + o->decode;
    // After the one-token steps, --decode / 2 steps of two tokens (the form of speculative
    // decoding's verification steps, `vireo run --mtp`) continue the same cache.
    const int64_t pairs = o->decode / 2;
    std::vector<int32_t> ids(static_cast<size_t>(total + 2 * pairs));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7919 + 13) % size_t(c.vocab_size));
    MlaCache cache(*backend, model->cache_shape(), 1, total + 2 * pairs);
    std::vector<float> logits(size_t(2 * c.vocab_size));
    const double active = double(model->active_weight_bytes_per_token());
    for (int64_t done = 0; done < C;) {  // untimed: fill the cache to --context
      const int64_t n = std::min<int64_t>(512, C - done);
      model->forward(&ids[size_t(done)], n, cache, 0, logits.data());
      done += n;
      std::fprintf(stderr, "\rfilling the cache: %lld/%lld tokens", (long long)done, (long long)C);
    }
    if (C) std::fprintf(stderr, "\n");
    model->experts().reset_stats();
    auto t1 = clock::now();
    const AttentionPath path = o->attention == "absorbed"        ? AttentionPath::Absorbed
                               : o->attention == "reconstructed" ? AttentionPath::Reconstructed
                                                                 : model->choose_path(o->prompt, C);
    model->forward(&ids[size_t(C)], o->prompt, cache, 0, logits.data(), false, path);
    auto t2 = clock::now();
    const ExpertStoreStats after_prefill = model->experts().stats();
    Sampler sampler(o->s);  // with --temp: the token sampled (on the host: this is the CPU backend)
    for (int64_t i = 0; i < o->decode; ++i) {
      const SampleRowArgs a = sampler.next_row_args();
      model->forward_next(&ids[size_t(C + o->prompt + i)], 1, cache, 0, o->s.temperature != 0.0f ? &a : nullptr,
                          AttentionPath::Absorbed);
    }
    auto t3 = clock::now();
    int32_t picks[2];
    const bool sampled = o->s.temperature != 0.0f;
    const int64_t V = model->config().vocab_size;
    std::vector<float> pair_logits(sampled ? size_t(2 * V) : 0);  // --temp: the last step's rows
    for (int64_t i = 0; i < pairs; ++i) {
      BatchItem two;
      two.tokens = &ids[size_t(total + 2 * i)];
      two.T = 2;
      two.all_logits = true;
      two.token = picks;
      if (sampled && i + 1 == pairs) two.logits = pair_logits.data();
      model->forward_batch({two}, cache, AttentionPath::Absorbed);
    }
    const double pair_s = std::chrono::duration<double>(clock::now() - t3).count();
    // --temp: the host's share of a speculative-sampling round (run --mtp --temp): the main
    // model's and the draft's distributions (the two rows stand in for p and q), the verdict and
    // the bonus token's draw, timed on the last two-token step's logits; the median of 5.
    double round_ms = 0;
    if (sampled && pairs > 0) {
      Sampler s(o->s);
      SampleWorkspace ws;
      std::vector<double> p, q, times;
      for (int k = 0; k < 5; ++k) {
        const auto r0 = clock::now();
        const SampleRowArgs a = s.next_row_args();
        const int32_t draft = sample_draw(warped_distribution(&pair_logits[size_t(V)], V, a, ws, q), a.uniform, ws);
        warped_distribution(pair_logits.data(), V, a, ws, p);
        verify_draft(p, q, draft, s.next_uniform(), s.next_uniform());
        s.sample(&pair_logits[size_t(V)], V);
        times.push_back(std::chrono::duration<double, std::milli>(clock::now() - r0).count());
      }
      std::sort(times.begin(), times.end());
      round_ms = times[2];
    }
    const double prefill_s = std::chrono::duration<double>(t2 - t1).count();
    const double decode_s = std::chrono::duration<double>(t3 - t2).count();
    const double dec_tps = double(o->decode) / decode_s;
    const double dec_gbs = mean_decode_bytes(*model, C + o->prompt, o->decode, false) * dec_tps / 1e9;
    std::printf("model              %s\n", o->synthetic.empty() ? o->model.c_str()
                : ("synthetic glm5, " + std::to_string(o->layers) + " layers x " + std::to_string(o->experts) +
                   " experts, " + o->dtype).c_str());
    std::printf("threads            %d\n", pool.size());
    std::printf("memory bandwidth   %.1f GB/s (read, measured now)\n", bw);
    std::printf("active weights     %.3f GB per decoded token\n", active / 1e9);
    std::printf("context            %lld tokens cached before the timed steps\n", (long long)C);
    std::printf("prefill            %lld tokens in %.3f s: %.1f tok/s (%s attention)\n", (long long)o->prompt, prefill_s,
                double(o->prompt) / prefill_s,
                path == AttentionPath::Absorbed ? "absorbed" : "reconstructed");
    std::printf("decode             %lld tokens in %.3f s: %.2f tok/s, %.1f GB/s of weights = %.0f%% of bandwidth (%s)\n",
                (long long)o->decode, decode_s, dec_tps, dec_gbs, 100.0 * dec_gbs / bw,
                o->s.temperature != 0.0f ? "tokens sampled" : "greedy tokens");
    if (pairs > 0)
      std::printf(
          "decode, 2 a step   %lld steps of two tokens (a --mtp verification step): %.2f ms a step = %.2fx a "
          "one-token step's %.2f ms\n",
          (long long)pairs, 1e3 * pair_s / double(pairs), pair_s / double(pairs) * dec_tps, 1e3 / dec_tps);
    if (round_ms > 0)
      std::printf(
          "sampled drafts     a round's host work (--mtp with sampling: two distributions over %lld tokens, a "
          "verdict, a draw): %.2f ms\n",
          (long long)V, round_ms);
    if (o->mtp) {
      // Continuations of the bench's prompt in a fresh cache, plain and drafted in turn: greedy
      // (the same tokens, checked), or with --temp sampled (the same seed; other draws, the same
      // distribution).
      const bool sampled = o->s.temperature != 0.0f;
      const std::vector<int32_t> prompt(ids.begin() + C, ids.begin() + C + o->prompt);
      std::vector<double> tps[2];
      std::vector<int32_t> tokens[2];
      GenerateResult drafted;
      for (int round = 0; round < 3; ++round)
        for (int d = 0; d < 2; ++d) {
          MlaCache fresh(*backend, model->cache_shape(), 1, o->prompt + o->decode);
          GenerateOptions g;
          g.max_new_tokens = o->decode;
          g.stop_at_eos = false;
          g.mtp_drafts = d == 1;
          g.sampling = o->s;
          GenerateResult r = generate(*model, fresh, 0, prompt, g);
          tps[d].push_back(double(o->decode - 1) / r.decode_seconds);
          tokens[d] = r.tokens;
          if (d == 1) drafted = r;
        }
      if (!sampled && tokens[0] != tokens[1])
        fail("bench --mtp: the drafted tokens differ from plain greedy decoding's");
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      std::printf(
          "%-19s%lld tokens: %.2f tok/s plain, %.2f tok/s with MTP drafts (%.2fx; medians of 3, %s); "
          "drafts kept %lld of %lld (%.1f%%)\n",
          sampled ? "sampled generate" : "greedy generate", (long long)o->decode, median(tps[0]), median(tps[1]),
          median(tps[1]) / median(tps[0]), sampled ? "the same distribution" : "the same tokens",
          (long long)drafted.accepted, (long long)drafted.drafted,
          drafted.drafted ? 100.0 * double(drafted.accepted) / double(drafted.drafted) : 0.0);
    }
    if (lm.streaming) {
      const ExpertStoreStats d = model->experts().stats() - after_prefill;
      const double hit = d.hit_rate();
      const double expert_bytes = double(lm.streaming->layout().expert_bytes());
      const double per_token = double(c.experts_per_token) * double(lm.plan.in.n_moe_layers) * expert_bytes;
      const double bound_tps = link_gbs * 1e9 / std::max((1.0 - hit) * per_token, 1.0);
      std::printf("expert pool        %lld slots of %.1f MB (%.1f%% of experts), floor %d, %s reads, prefetch %s\n",
                  (long long)lm.streaming->slots(), double(lm.streaming->slot_bytes()) / 1e6,
                  100.0 * double(lm.streaming->slots()) / double(lm.plan.total_experts()), lm.streaming->layer_floor(),
                  lm.streaming->direct_io() ? "O_DIRECT" : "buffered+DONTNEED", o->sf.prefetch.c_str());
      std::printf("disk read          %.2f GB/s (measured now, %d threads)\n", link_gbs, o->sf.io_threads);
      std::printf("decode experts     %s\n", stats_line(d).c_str());
      std::printf("decode read        %.2f GB/s achieved (%.3f GB per token)\n",
                  double(d.bytes_transferred) / 1e9 / decode_s, double(d.bytes_transferred) / 1e9 / double(o->decode));
      std::printf("bound              (1 - %.3f) x %.3f GB / %.2f GB/s = %.3f s/token: %.3f tok/s; achieved %.0f%% of bound\n",
                  hit, per_token / 1e9, link_gbs, 1.0 / bound_tps, bound_tps, 100.0 * dec_tps / bound_tps);
      std::printf("peak RSS           %.3f GB (budget %s; %s)\n", double(peak_rss_bytes()) / 1e9, o->sf.budget.c_str(),
                  rss_after_probes ? "after loading, without the bandwidth probes"
                                   : "since start, the bandwidth probes' 1.3 GB included");
    }
    return 0;
  };
}

}  // namespace vireo::cli
