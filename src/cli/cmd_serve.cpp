// `vireo serve`: the OpenAI-compatible server. The port is bound first and /health answers 503
// while the model loads; SIGINT/SIGTERM stop it cleanly.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include <pthread.h>

#include "backend/cuda/cuda_backend.h"
#include "cli/commands.h"
#include "core/env.h"
#include "model/glm_dsa/synthetic.h"
#include "runtime/scheduler.h"
#include "server/server.h"

namespace vireo::cli {

namespace {

// The served model's text side: tokenizer.json and the chat template (chat_template.jinja, else
// tokenizer_config.json's), each optional (a fixture without them serves token-id prompts on
// /v1/completions only).
void load_text(const std::string& dir, const std::string& template_file, server::ServedModel& m) {
  namespace fs = std::filesystem;
  const fs::path tok = fs::path(dir) / "tokenizer.json";
  if (fs::exists(tok)) m.tokenizer = std::make_shared<Tokenizer>(Tokenizer::from_file(tok.string()));
  if (!m.tokenizer) {
    m.template_error = "no tokenizer.json";
  } else if (template_file.empty() && !ChatTemplate::model_dir_has_template(dir)) {
    m.template_error = "neither chat_template.jinja nor a chat_template in tokenizer_config.json";
  } else {
    try {
      m.chat_template = std::make_shared<ChatTemplate>(ChatTemplate::from_model_dir(dir, template_file));
    } catch (const Error& e) {
      m.template_error = e.what();
    }
  }
}

// --reasoning-parser's markers in the served tokenizer.
server::ThinkTokens think_tokens(const server::ServedModel& m, const std::string& parser) {
  if (!m.tokenizer) fail("--reasoning-parser ", parser, ": the model has no tokenizer.json");
  const server::ThinkTokens think = server::think_tokens_of(*m.tokenizer);
  if (!think.splits()) fail("--reasoning-parser ", parser, ": the tokenizer has no <think> and </think> tokens");
  return think;
}

// One --log-interval line: the rates over the interval, the gauges now.
std::string throughput_line(const SchedulerStats& a, const SchedulerStats& b, std::chrono::steady_clock::duration d) {
  const double secs = std::chrono::duration<double>(d).count();
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "prompt %.1f tok/s, generation %.1f tok/s, running %zu, waiting %zu, cache %.1f%% of %.1f MiB in use",
                double(b.prompt_tokens_run - a.prompt_tokens_run) / secs,
                double(b.tokens_generated - a.tokens_generated) / secs, b.running, b.waiting,
                b.cache_bytes_allocated ? 100.0 * double(b.cache_bytes_in_use) / double(b.cache_bytes_allocated) : 0.0,
                double(b.cache_bytes_allocated) / (1 << 20));
  return buf;
}

}  // namespace

Action add_serve(CLI::App& app) {
  struct Opts {
    std::string model, name, cache_budget, device = "cpu", synthetic, dtype = "bf16";
    std::string math = "exact";  // --math: CUDA prefill products
    int layers = 2, experts = 16;
    server::ServerOptions srv;
    int max_batch = 8;
    int64_t context = 0, prefill_chunk = 256;
    int decode_steps = 1;
    bool mtp = false;
    std::string prefix_reuse = "on";
    std::string reasoning_parser = "none";
    std::string chat_template;
    double log_interval = 10;
    StreamingFlags sf;
  };
  auto o = std::make_shared<Opts>();
  auto* model_opt =
      app.add_option("--model,-m", o->model, "Model directory (config.json + safetensors [+ tokenizer.json])");
  app.add_option("--synthetic", o->synthetic, "Serve random weights with real GLM-5 shapes (token-id prompts only)")
      ->check(CLI::IsMember({"glm5"}))
      ->excludes(model_opt);
  app.add_option("--layers", o->layers, "Synthetic: MoE layers")->check(CLI::Range(1, 200));
  app.add_option("--experts", o->experts, "Synthetic: routed experts per layer")->check(CLI::Range(1, 256));
  app.add_option("--dtype", o->dtype, "Synthetic: weight dtype")->check(CLI::IsMember({"bf16", "fp8"}));
  add_device_flag(app, o->device, o->math);
  app.add_option("--served-model-name", o->name, "The model id clients send (default: the directory's name)");
  app.add_option("--host", o->srv.host, "Address to listen on")->capture_default_str();
  app.add_option("--port", o->srv.port, "Port (0: any free port; the chosen one is printed)")
      ->check(CLI::Range(0, 65535))->capture_default_str();
  app.add_option("--api-key", o->srv.api_key, "Require 'Authorization: Bearer KEY' on /v1/ endpoints, /tokenize and /detokenize");
  app.add_option("--max-batch,--max-num-seqs", o->max_batch, "Sequences decoded together (cache rows; vLLM's name too)")
      ->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--context,--max-model-len", o->context,
                 "Cache positions per sequence (vLLM's --max-model-len): prompt + max_tokens must fit (default: the model's "
                 "max_position_embeddings, at most 4096)")->check(CLI::Range(int64_t(2), int64_t(1) << 24));
  app.add_option("--prefill-chunk", o->prefill_chunk,
                 "Prompt tokens run per step, interleaved with decodes; each prompt is read in chunks of this many "
                 "tokens whatever else runs (on the CPU its outputs are then the ones it gets alone, bit for bit)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20))
      ->capture_default_str();
  CLI::Option* decode_steps =
      app.add_option("--decode-steps", o->decode_steps,
                     "A lone greedy request's decode steps run as one chunk (on CUDA one graph launch), one chunk "
                     "ahead; a request arriving meanwhile waits for up to 2 x this - 1 queued steps")
          ->check(CLI::Range(1, int(Backend::kMaxQueuedRead)))
          ->capture_default_str();
  app.add_flag("--mtp", o->mtp,
               "Speculative decoding: every decoding request verifies the model's MTP layer's draft each step "
               "(greedy: the same tokens; sampling: the same distribution), up to two tokens a step");
  app.add_option("--prefix-reuse", o->prefix_reuse,
                 "A request whose prompt starts as a finished one's did reuses that row's entries for the shared "
                 "whole --prefill-chunk chunks (on the CPU the same bits as running them; off with --mtp)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app.add_option("--chat-template", o->chat_template,
                 "A Jinja chat template file used instead of the model's (its special tokens still from "
                 "tokenizer_config.json)");
  app.add_option("--reasoning-parser", o->reasoning_parser,
                 "Chat replies split at the model's </think> into message.reasoning_content and content (the "
                 "<think> / </think> special tokens of GLM-5 and DeepSeek-R1, as vLLM's parsers of these names)")
      ->check(CLI::IsMember({"none", "glm45", "deepseek_r1"}))
      ->capture_default_str();
  app.add_option("--log-interval", o->log_interval,
                 "Seconds between the throughput lines on stderr (prompt and generation tok/s, requests running "
                 "and waiting, cache in use), printed only after work; 0: none")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  app.add_option("--cache-budget", o->cache_budget,
                 "Admission budget in cache bytes (e.g. 2G) for prompt + max_tokens of running requests "
                 "(default: the whole cache, max-batch x context)");
  app.add_option("--max-body", o->srv.max_body_bytes, "Largest request body in bytes (413 above)")->capture_default_str();
  app.add_option("--http-threads", o->srv.http_threads, "HTTP handler threads (each open request holds one; "
                                                        "default: 4 x max-batch + 16)");
  add_streaming_flags(app, o->sf);
  return [o, decode_steps]() {
    if (o->model.empty() && o->synthetic.empty()) fail("serve needs --model DIR or --synthetic glm5");
    check_device_flags(o->device, o->math, o->sf);
    check_mtp_flag(o->mtp, decode_steps);
    if (o->mtp && !o->synthetic.empty()) fail("--mtp needs a checkpoint with an MTP layer (--model), not --synthetic");
    if (o->mtp) {  // refused before the server listens, as the other flags are
      GlmDsaConfig c = load_glm_dsa_config(o->model);
      enable_mtp(c, o->model + "/config.json");
    }
    if (!o->synthetic.empty() && !o->chat_template.empty())
      fail("--chat-template needs a model with a tokenizer (--model), not --synthetic");
    if (!o->synthetic.empty() && o->reasoning_parser != "none")
      fail("--reasoning-parser needs a model with a tokenizer (--model), not --synthetic");
    if (!o->synthetic.empty() && !o->sf.budget.empty()) fail("--memory-budget needs a checkpoint on disk (--model)");
    if (!o->synthetic.empty() && !o->sf.gpu_budget.empty()) fail("--gpu-budget needs a checkpoint on disk (--model)");
    // The text side first (small): a --chat-template that does not load, or a --reasoning-parser
    // the tokenizer cannot serve, is refused before the server listens.
    server::ServedModel sm;
    if (o->synthetic.empty()) {
      load_text(o->model, o->chat_template, sm);
      // A template given by name must load (the model's own may be absent: chat then answers 400).
      if (!o->chat_template.empty() && !sm.chat_template)
        fail("--chat-template ", o->chat_template, ": ", sm.template_error);
      if (o->reasoning_parser != "none") sm.think = think_tokens(sm, o->reasoning_parser);
    }
    // Signals go to a sigwait below, never to a handler racing the server's threads.
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
    std::signal(SIGPIPE, SIG_IGN);  // a vanished client is a failed write, not a dead server

    if (o->srv.http_threads <= 0) o->srv.http_threads = 4 * o->max_batch + 16;
    server::HttpServer http(o->srv);
    const int port = http.bind();
    http.start();
    const std::string what = o->synthetic.empty() ? o->model : "synthetic " + o->synthetic;
    std::fprintf(stderr, "vireo: listening on http://%s:%d (loading %s)\n", o->srv.host.c_str(), port, what.c_str());

    auto backend = make_cli_backend(o->device, o->math);
    LoadedModel lm;
    int64_t context = o->context;
    // Rows of logits a step holds (serve_logit_rows; prompt_logprobs' come in slices). On the CPU the
    // host's copies are the same memory: the model's slice on its way out and the scheduler's rows.
    const int64_t per_row = o->mtp ? 2 : 1;
    const int64_t logit_rows = serve_logit_rows(o->max_batch, o->mtp);
    const int64_t host_logit_rows = o->device == "cpu" ? logit_rows + per_row * o->max_batch : 0;
    if (!o->synthetic.empty()) {
      GlmDsaConfig c = glm5_synthetic_config(o->layers, o->experts);
      if (context == 0) context = 4096;
      auto ck = make_synthetic_checkpoint(c, parse_weight_dtype_flag(o->dtype));
      lm.model = GlmDsaModel::create(std::move(c), std::move(ck), *backend);
      sm.name = o->name.empty() ? "synthetic-" + o->synthetic : o->name;
    } else {
      if (context == 0) context = std::min<int64_t>(load_glm_dsa_config(o->model).max_position_embeddings, 4096);
      // A step: up to prefill_chunk prompt tokens besides the other rows' decode tokens (--mtp: two
      // tokens a decoding row).
      lm = load_model(o->model, *backend, o->sf, context, o->max_batch,
                      step_tokens_for(o->prefill_chunk, context, o->max_batch) + (per_row - 1) * o->max_batch,
                      logit_rows + host_logit_rows, o->mtp);
      sm.name = o->name.empty() ? std::filesystem::path(o->model).lexically_normal().filename().string() : o->name;
      if (sm.name.empty())
        sm.name = std::filesystem::path(o->model).lexically_normal().parent_path().filename().string();
    }
    lm.model->set_logit_rows(logit_rows);
    sm.context = context;
    sm.vocab = lm.model->config().vocab_size;
    SchedulerOptions so;
    so.max_batch = o->max_batch;
    so.context = context;
    so.prefill_chunk = o->prefill_chunk;
    so.pipeline = env_switch("VIREO_SERVE_PIPELINE");  // 0: every step waits for its pick (A/B runs)
    so.decode_steps = o->decode_steps;
    so.mtp_drafts = o->mtp;
    so.reuse_prefixes = o->prefix_reuse == "on";
    if (!o->cache_budget.empty()) so.cache_budget_bytes = parse_byte_size(o->cache_budget, "--cache-budget");
    Scheduler scheduler(*lm.model, *backend, so);
    http.ready(sm, scheduler);
    std::fprintf(stderr, "vireo: serving '%s' (context %lld, max batch %d, cache %.1f MiB%s%s)\n", sm.name.c_str(),
                 (long long)context, o->max_batch, double(scheduler.stats().cache_bytes_allocated) / (1 << 20),
                 sm.tokenizer ? "" : ", no tokenizer: token-id prompts only",
                 sm.chat_template ? "" : ", no chat template");
    int sig = 0;
    SchedulerStats last = scheduler.stats();
    auto last_at = std::chrono::steady_clock::now();
    for (;;) {  // a signal ends it; every --log-interval seconds with work done, a throughput line
      if (o->log_interval <= 0) {
        sigwait(&sigs, &sig);
        break;
      }
      const auto ns = int64_t(o->log_interval * 1e9);
      const timespec wait{time_t(ns / 1000000000), long(ns % 1000000000)};
      if ((sig = sigtimedwait(&sigs, nullptr, &wait)) > 0) break;
      const SchedulerStats now = scheduler.stats();
      const auto at = std::chrono::steady_clock::now();
      if (now.steps != last.steps)
        std::fprintf(stderr, "vireo: %s\n", throughput_line(last, now, at - last_at).c_str());
      last = now;
      last_at = at;
    }
    std::fprintf(stderr, "vireo: signal %d, shutting down\n", sig);
    if (!http.stop(std::chrono::seconds(2))) {
      // Idle keep-alive connections hold httplib's threads; every request is already cancelled.
      std::fprintf(stderr, "vireo: closing idle connections\n");
      std::fflush(stderr);
      std::_Exit(0);
    }
    return 0;
  };
}

}  // namespace vireo::cli
