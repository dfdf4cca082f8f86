#pragma once
// The vireo subcommands. Each registers its flags on a CLI11 app and returns the function that
// runs it; errors are thrown as vireo::Error and printed by main.
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "experts/memory_plan.h"
#include "experts/device_store.h"
#include "experts/streaming_store.h"
#include "model/glm_dsa/model.h"
#include "runtime/sampler.h"

namespace vireo::cli {

using Action = std::function<int()>;

Action add_run(CLI::App& app);
Action add_logits(CLI::App& app);
Action add_info(CLI::App& app);
Action add_bench(CLI::App& app);
Action add_tokenize(CLI::App& app);
Action add_detokenize(CLI::App& app);
Action add_chat(CLI::App& app);
Action add_perplexity(CLI::App& app);

std::string read_text_file(const std::string& path);
Action add_plan(CLI::App& app);
Action add_synth(CLI::App& app);
Action add_serve(CLI::App& app);  // cmd_serve.cpp

// Expert streaming (cmd_plan.cpp): --memory-budget and friends, shared by run, logits and bench.
struct StreamingFlags {
  std::string budget;            // empty: every expert resident
  std::string gpu_budget;        // --device cuda: device memory for weights, expert slots, cache
  std::string direct = "auto";   // O_DIRECT reads: auto, on, off
  std::string prefetch = "auto"; // next-layer prediction: auto, on, off
  int io_threads = 4;
  int floor = -1;
  bool stats = false;
};
void add_streaming_flags(CLI::App& app, StreamingFlags& f);
struct LoadedModel {
  std::unique_ptr<GlmDsaModel> model;
  MemoryPlan plan;                              // set when streaming
  StreamingExpertStore* streaming = nullptr;  // null: all experts resident in RAM (or none streamed)
  DeviceExpertStore* device = nullptr;        // --gpu-budget: experts streamed to device slots
};
// Loads `dir`; under --memory-budget (or --gpu-budget on a CUDA backend) plans first (refusing a
// budget below the minimum with the table on stderr) and streams routed experts through a pool
// sized by the plan. `step_tokens`: the most tokens the caller runs in one forward step (its
// prompt chunk plus decode rows), `logit_rows`: the most rows of logits a step produces (0: one
// per sequence); the plan's scratch is sized for that step, so the caller must not exceed it.
// `mtp`: bind the model's MTP layer too (enable_mtp), for speculative decoding.
LoadedModel load_model(const std::string& dir, Backend& backend, const StreamingFlags& f, int64_t context,
                       int64_t batch, int64_t step_tokens, int64_t logit_rows = 0, bool mtp = false);
// As load_model, for a checkpoint already open (`what` names it in errors; in-memory synthetic
// checkpoints stream to the GPU from a pinned host copy).
LoadedModel load_checkpoint(GlmDsaConfig c, std::unique_ptr<Checkpoint> ck, const std::string& what, Backend& backend,
                            const StreamingFlags& f, int64_t context, int64_t batch, int64_t step_tokens,
                            int64_t logit_rows = 0);
MemoryPlan plan_for(const Checkpoint& ck, const GlmDsaConfig& c, uint64_t budget, int64_t context, int64_t batch,
                    int64_t step_tokens, int64_t logit_rows = 0, uint64_t gpu_budget = 0);
// Bytes of activation scratch for one step of T tokens producing out_rows rows of logits, each
// sequence attending up to n_keys keys; `device`: the CUDA backend's buffers (which persist per
// op) rather than the CPU's. An upper bound of what the step allocates.
uint64_t estimate_scratch_bytes(const GlmDsaConfig& c, int64_t T, int64_t out_rows, int64_t n_keys, bool device);
// The CUDA backend's own buffers for steps of T tokens (an upper bound): conversions of product
// inputs, FP8 weight copies (exact mode), experts_add's 4 side lanes (workspace and rows) and
// its grouped products' chunk (the fast modes).
uint64_t estimate_backend_bytes(const GlmDsaConfig& c, int64_t T, bool fp8_weights);
// The largest step of a command feeding prompts in chunks of `chunk` tokens (a chunk may share
// a step with the other batch - 1 rows' decode tokens), for `batch` sequences of `context`.
int64_t step_tokens_for(int64_t chunk, int64_t context, int64_t batch);
// Rows of logits `vireo serve` holds in backend memory (GlmDsaModel::set_logit_rows): each decoding
// row's (two with --mtp), at least 64: a prompt chunk's rows for prompt_logprobs (echo) come in
// slices of this many, so the memory plan holds whatever the requests ask.
int64_t serve_logit_rows(int64_t max_batch, bool mtp);
// --prefill-chunk of run and chat: prompt tokens per forward step. Without the flag, 512 under a
// budget (the plan sizes scratch for that step) and 0 (the whole prompt in one step) without.
struct PrefillChunkFlag {
  int64_t value = 0;
  CLI::Option* opt = nullptr;
};
void add_prefill_chunk_flag(CLI::App& app, PrefillChunkFlag& f);
// --decode-steps of run and chat: greedy decode steps a chunk (GenerateOptions::decode_steps).
CLI::Option* add_decode_steps_flag(CLI::App& app, int& steps);
// --mtp (run, chat): speculative decoding with the model's MTP layer (greedy or sampled);
// check_mtp_flag refuses it beside an explicit --decode-steps (which it would ignore).
void add_mtp_flag(CLI::App& app, bool& mtp);
void check_mtp_flag(bool mtp, const CLI::Option* decode_steps, const SamplingParams* sampling = nullptr);
// The chunk to use (0: whole prompt); fails with one line naming the flag for a negative value,
// or 0 under a budget.
int64_t resolve_prefill_chunk(const PrefillChunkFlag& f, const StreamingFlags& sf);
std::string stats_line(const ExpertStoreStats& s);
uint64_t peak_rss_bytes();     // VmHWM of this process
// Starts VmHWM again from the current RSS (Linux /proc/self/clear_refs, "5"); false if refused.
bool reset_peak_rss();
uint64_t current_rss_bytes();  // VmRSS of this process
uint64_t mem_available_bytes(); // MemAvailable of /proc/meminfo (0 if unknown)

// --temp, --top-k, --top-p, --min-p, --seed (cmd_generate.cpp): run and chat sample alike.
void add_sampling_flags(CLI::App& app, SamplingParams& s);

// --device cpu|cuda and --math exact|fast (cmd_bench.cpp), and the combinations a device does not
// support yet.
void add_device_flag(CLI::App& app, std::string& device, std::string& math);
void check_device_flags(const std::string& device, const std::string& math, const StreamingFlags& f);
// The backend `device` names, with the CUDA products' math set: "exact" (the default) or "fast".
std::unique_ptr<Backend> make_cli_backend(const std::string& device, const std::string& math);

// "1,2,3" -> ids; `flag` names the option in errors.
std::vector<int32_t> parse_id_list(const std::string& s, const std::string& flag);

}  // namespace vireo::cli
