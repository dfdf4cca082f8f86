// `vireo run` and `vireo logits`.
#include <algorithm>
#include <cstdio>
#include <memory>

#include <fstream>
#include <optional>
#include <sstream>

#include "backend/cuda/cuda_backend.h"
#include "cli/commands.h"
#include "cli/text_model.h"
#include "io/json_file.h"
#include "io/npy.h"
#include "model/glm_dsa/model.h"
#include "runtime/generate.h"

namespace vireo::cli {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int32_t> parse_id_list(const std::string& s, const std::string& flag) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string tok = s.substr(i, j - i);
    while (!tok.empty() && tok.front() == ' ') tok.erase(tok.begin());
    while (!tok.empty() && tok.back() == ' ') tok.pop_back();
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(tok, &used);
    } catch (...) {
      used = 0;
    }
    if (tok.empty() || used != tok.size() || v < 0 || v > INT32_MAX)
      fail(flag, ": '", tok, "' is not a token id (expected a comma-separated list like 1,2,3)");
    ids.push_back(int32_t(v));
    i = j + 1;
  }
  if (ids.empty()) fail(flag, ": no token ids");
  return ids;
}

void add_sampling_flags(CLI::App& app, SamplingParams& s) {
  app.add_option("--temp", s.temperature, "Sampling temperature (0: greedy)");
  app.add_option("--top-k", s.top_k, "Keep the k most likely tokens (0: off)");
  app.add_option("--top-p", s.top_p, "Nucleus sampling mass (1: off)");
  app.add_option("--min-p", s.min_p, "Drop tokens below min_p x the top probability (0: off)");
  app.add_option("--seed", s.seed, "Sampling seed");
}

Action add_run(CLI::App& app) {
  struct Opts {
    std::string model, prompt_ids, prompt, prompt_file;
    int64_t n = 64;
    int decode_steps = GenerateOptions{}.decode_steps;
    SamplingParams s;
    bool ignore_eos = false, chat = false, mtp = false;
    StreamingFlags sf;
    std::string device = "cpu";
    std::string math = "exact";  // --math: CUDA prefill products
    PrefillChunkFlag chunk;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--model,-m", o->model, "Model directory (config.json + safetensors)")->required();
  auto* ids_opt = app.add_option("--prompt-ids", o->prompt_ids, "Prompt as comma-separated token ids (prints ids)");
  auto* text_opt = app.add_option("-p,--prompt", o->prompt, "Prompt text (streams text)");
  auto* file_opt = app.add_option("--prompt-file", o->prompt_file, "Read the prompt text from a file");
  ids_opt->excludes(text_opt)->excludes(file_opt);
  text_opt->excludes(file_opt);
  app.add_flag("--chat", o->chat, "Apply the model's chat template to the prompt as one user message");
  app.add_option("-n,--max-tokens", o->n, "Tokens to generate at most")->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  add_sampling_flags(app, o->s);
  app.add_flag("--ignore-eos", o->ignore_eos, "Do not stop at end-of-sequence tokens");
  CLI::Option* decode_steps = add_decode_steps_flag(app, o->decode_steps);
  add_mtp_flag(app, o->mtp);
  add_streaming_flags(app, o->sf);
  add_prefill_chunk_flag(app, o->chunk);
  add_device_flag(app, o->device, o->math);
  return [o, decode_steps]() {
    validate_sampling(o->s);
    check_mtp_flag(o->mtp, decode_steps);
    const int64_t chunk = resolve_prefill_chunk(o->chunk, o->sf);
    const bool text_mode = o->prompt_ids.empty();
    if (text_mode && o->prompt.empty() && o->prompt_file.empty())
      fail("run needs a prompt: --prompt TEXT, --prompt-file FILE or --prompt-ids 1,2,3");
    if (!text_mode && o->chat) fail("--chat needs a text prompt (--prompt or --prompt-file)");
    std::optional<TextModel> text;
    std::vector<int32_t> prompt;
    if (text_mode) {
      std::string body = o->prompt;
      if (!o->prompt_file.empty()) {
        if (!file_exists(o->prompt_file)) fail("--prompt-file: cannot open ", o->prompt_file);
        body = read_text_file(o->prompt_file);
      }
      text = TextModel::load(o->model, o->chat);
      if (o->chat) prompt = text->chat_prompt(nlohmann::ordered_json::array({{{"role", "user"}, {"content", body}}}));
      else prompt = to_i32(text->tokenizer.encode(body, true));
      if (prompt.empty()) fail("the prompt encodes to no tokens");
    } else {
      prompt = parse_id_list(o->prompt_ids, "--prompt-ids");
    }
    check_device_flags(o->device, o->math, o->sf);
    // The program and its shared libraries (CUDA's are large) are resident before any weight is:
    // --stats reports the peak against this baseline.
    const uint64_t rss_before_load = current_rss_bytes();
    auto backend = make_cli_backend(o->device, o->math);
    const int64_t P = int64_t(prompt.size());
    // --mtp: each decode step verifies two tokens (two rows of logits).
    const int64_t step = std::max<int64_t>(chunk > 0 ? std::min(chunk, P) : P, o->mtp ? 2 : 1);
    LoadedModel lm = load_model(o->model, *backend, o->sf, P + o->n, 1, step, o->mtp ? 2 : 0, o->mtp);
    auto& model = lm.model;
    ExpertStoreStats last = model->experts().stats();
    for (int32_t id : prompt)
      if (id >= model->config().vocab_size)
        fail("--prompt-ids: token id ", id, " is out of range (vocab size ", model->config().vocab_size, ")");
    MlaCache cache(*backend, model->cache_shape(), 1, int64_t(prompt.size()) + o->n);
    GenerateOptions opt;
    opt.max_new_tokens = o->n;
    opt.sampling = o->s;
    opt.stop_at_eos = !o->ignore_eos;
    opt.prefill_chunk = chunk;
    // --stats reports each token's own step: one step a chunk.
    opt.decode_steps = o->sf.stats ? 1 : o->decode_steps;
    opt.mtp_drafts = o->mtp;
    bool first = true;
    std::optional<DecodeStream> stream;
    if (text) stream.emplace(text->tokenizer, true);
    GenerateResult r = generate(*model, cache, 0, prompt, opt, [&](int32_t id) {
      if (stream) std::fputs(stream->step(uint32_t(id)).c_str(), stdout);
      else std::printf(first ? "%d" : ",%d", id);
      std::fflush(stdout);
      first = false;
      if (o->sf.stats) {  // counters of the forward step that produced this token
        const ExpertStoreStats now = model->experts().stats();
        std::fprintf(stderr, "token %d: %s\n", id, stats_line(now - last).c_str());
        last = now;
      }
      return true;
    });
    if (stream) std::fputs(stream->finish().c_str(), stdout);
    std::printf("\n");
    std::fflush(stdout);  // the text ends before the timing line on stderr
    const int64_t decoded = int64_t(r.tokens.size()) - 1;
    std::fprintf(stderr, "prompt: %lld tokens in %.3f s (%.1f tok/s); generated: %zu tokens, %.1f tok/s%s\n",
                 (long long)r.prompt_tokens, r.prefill_seconds, double(r.prompt_tokens) / r.prefill_seconds,
                 r.tokens.size(), decoded > 0 ? double(decoded) / r.decode_seconds : 0.0,
                 r.stopped_at_eos ? " (stopped at EOS)" : "");
    if (o->mtp)
      std::fprintf(stderr, "MTP drafts: %lld of %lld kept (%.1f%%), %.2f tokens a decode step\n", (long long)r.accepted,
                   (long long)r.drafted, r.drafted ? 100.0 * double(r.accepted) / double(r.drafted) : 0.0,
                   r.drafted ? double(decoded) / double(r.drafted) : 0.0);
    if (o->sf.stats)
      std::fprintf(stderr, "experts total: %s\npeak RSS: %llu bytes (%llu before loading the model)\n",
                   stats_line(model->experts().stats()).c_str(), (unsigned long long)peak_rss_bytes(),
                   (unsigned long long)rss_before_load);
    return 0;
  };
}

Action add_logits(CLI::App& app) {
  struct Opts {
    std::string model, tokens, out, mode = "prefill";
    StreamingFlags sf;
    std::string device = "cpu";
    std::string math = "exact";  // --math: CUDA prefill products
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--model,-m", o->model, "Model directory")->required();
  app.add_option("--tokens", o->tokens, "Comma-separated token ids")->required();
  app.add_option("--mode", o->mode, "prefill: the whole sequence at once (reconstructed attention); "
                                    "decode: one token at a time through the cache (absorbed attention)")
      ->check(CLI::IsMember({"prefill", "decode"}));
  app.add_option("--out,-o", o->out, "Output .npy file (float32 [T, vocab])")->required();
  add_streaming_flags(app, o->sf);
  add_device_flag(app, o->device, o->math);
  return [o]() {
    std::vector<int32_t> ids = parse_id_list(o->tokens, "--tokens");
    check_device_flags(o->device, o->math, o->sf);
    auto backend = make_cli_backend(o->device, o->math);
    // One step of every token (prefill) or one at a time (decode), all of them with logits: the
    // backend's [T, vocab] and the host copy below (RAM, which a --memory-budget covers).
    const int64_t T = int64_t(ids.size());
    const bool prefill = o->mode == "prefill";
    LoadedModel lm = load_model(o->model, *backend, o->sf, T, 1, prefill ? T : 1,
                                (prefill ? T : 1) + (o->device == "cpu" ? T : 0));
    auto& model = lm.model;
    const int64_t V = model->config().vocab_size;
    for (int32_t id : ids)
      if (id >= V) fail("--tokens: token id ", id, " is out of range (vocab size ", V, ")");
    MlaCache cache(*backend, model->cache_shape(), 1, T);
    std::vector<float> logits(size_t(T * V));
    if (prefill) {
      model->forward(ids.data(), T, cache, 0, logits.data(), true, AttentionPath::Reconstructed);
    } else {
      for (int64_t t = 0; t < T; ++t)
        model->forward(&ids[size_t(t)], 1, cache, 0, logits.data() + t * V, false, AttentionPath::Absorbed);
    }
    write_npy_f32(o->out, logits.data(), {T, V});
    std::fprintf(stderr, "wrote %s [%lld, %lld]\n", o->out.c_str(), (long long)T, (long long)V);
    if (o->sf.stats) std::fprintf(stderr, "experts total: %s\n", stats_line(model->experts().stats()).c_str());
    return 0;
  };
}

}  // namespace vireo::cli
