// Text commands: `vireo tokenize`, `vireo detokenize`, `vireo chat`, `vireo perplexity`.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>

#include "backend/cuda/cuda_backend.h"
#include "cli/commands.h"
#include "cli/text_model.h"
#include "io/json_file.h"
#include "model/glm_dsa/model.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"

namespace vireo::cli {

namespace {

std::string json_string(const std::string& s) { return Json(s).dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace

Action add_tokenize(CLI::App& app) {
  struct Opts {
    std::string model, text;
    bool add_special = false, jsonl = false;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--model,-m", o->model, "Model directory (reads tokenizer.json)")->required();
  app.add_option("text", o->text, "Text to encode (prints ids and pieces)");
  app.add_flag("--add-special", o->add_special, "Add the post-processor's special tokens (BOS/EOS)");
  app.add_flag("--jsonl", o->jsonl, "Read one JSON string per stdin line; print one JSON array of ids per line");
  return [o]() {
    TextModel tm = TextModel::load(o->model);
    if (o->jsonl) {
      std::string line;
      int64_t n = 0;
      while (std::getline(std::cin, line)) {
        ++n;
        Json j;
        try {
          j = Json::parse(line);
        } catch (const Json::exception&) {
          fail("stdin line ", n, ": not valid JSON (expected one JSON string per line)");
        }
        if (!j.is_string()) fail("stdin line ", n, ": expected a JSON string, found ", j.type_name());
        Json ids = tm.tokenizer.encode(j.get<std::string>(), o->add_special);
        std::cout << ids.dump() << '\n';
      }
      return 0;
    }
    auto ids = tm.tokenizer.encode(o->text, o->add_special);
    for (uint32_t id : ids)
      std::cout << id << '\t' << json_string(tm.tokenizer.id_to_token(id).value_or("")) << '\n';
    return 0;
  };
}

Action add_detokenize(CLI::App& app) {
  struct Opts {
    std::string model, ids;
    bool skip_special = false;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--model,-m", o->model, "Model directory (reads tokenizer.json)")->required();
  app.add_option("ids", o->ids, "Comma-separated token ids")->required();
  app.add_flag("--skip-special", o->skip_special, "Leave out special tokens");
  return [o]() {
    TextModel tm = TextModel::load(o->model);
    std::vector<uint32_t> ids;
    for (int32_t id : parse_id_list(o->ids, "ids")) {
      if (size_t(id) >= tm.tokenizer.vocab_size())
        fail("ids: token id ", id, " is out of range (vocabulary size ", tm.tokenizer.vocab_size(), ")");
      ids.push_back(uint32_t(id));
    }
    std::cout << tm.tokenizer.decode(ids, o->skip_special) << '\n';
    return 0;
  };
}

Action add_chat(CLI::App& app) {
  struct Opts {
    std::string model, system;
    int64_t n = 512, context = 4096;
    int decode_steps = GenerateOptions{}.decode_steps;
    SamplingParams s;
    StreamingFlags sf;
    std::string device = "cpu";
    std::string math = "exact";  // --math: CUDA prefill products
    PrefillChunkFlag chunk;
    bool mtp = false;
    std::string thinking = "auto";
    std::vector<std::string> stops;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--model,-m", o->model, "Model directory")->required();
  app.add_option("--system", o->system, "System message");
  app.add_option("--stop", o->stops,
                 "Stop each reply at this text (repeatable): the reply ends just before it, as the server's stop "
                 "strings and run --stop");
  add_thinking_flag(app, o->thinking);
  app.add_option("-n,--max-tokens", o->n, "Tokens per reply at most")->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  app.add_option("--context", o->context, "Context length in tokens")->check(CLI::Range(int64_t(16), int64_t(1) << 22));
  add_sampling_flags(app, o->s);
  add_streaming_flags(app, o->sf);
  add_prefill_chunk_flag(app, o->chunk);
  CLI::Option* decode_steps = add_decode_steps_flag(app, o->decode_steps);
  add_mtp_flag(app, o->mtp);
  add_device_flag(app, o->device, o->math);
  return [o, decode_steps]() {
    validate_sampling(o->s);
    check_mtp_flag(o->mtp, decode_steps, &o->s);
    const int64_t chunk = resolve_prefill_chunk(o->chunk, o->sf);
    check_device_flags(o->device, o->math, o->sf);
    std::erase_if(o->stops, [](const std::string& s) { return s.empty(); });
    TextModel tm = TextModel::load(o->model, true);
    auto backend = make_cli_backend(o->device, o->math);
    // A turn's new tokens are prefilled in chunks (or at once: up to the whole context).
    auto model = load_model(o->model, *backend, o->sf, o->context, 1,
                            std::max<int64_t>(chunk > 0 ? std::min(chunk, o->context) : o->context, o->mtp ? 2 : 1),
                            o->mtp ? 2 : 0, o->mtp)
                     .model;
    MlaCache cache(*backend, model->cache_shape(), 1, o->context);
    const bool tty = ::isatty(0);
    const nlohmann::ordered_json template_args = thinking_args(o->thinking);
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    auto reset = [&]() {
      messages = nlohmann::ordered_json::array();
      if (!o->system.empty()) messages.push_back({{"role", "system"}, {"content", o->system}});
      cache.reset(0);
    };
    reset();
    std::vector<int32_t> cached;  // the tokens whose entries are in the cache, in order
    if (tty) std::fprintf(stderr, "vireo chat: /reset starts over, /exit or Ctrl-D quits\n");
    std::string line;
    for (;;) {
      if (tty) std::fputs("> ", stdout), std::fflush(stdout);
      if (!std::getline(std::cin, line)) break;
      if (line == "/exit") break;
      if (line == "/reset") {
        reset();
        cached.clear();
        std::puts("(conversation reset)");
        continue;
      }
      if (line.empty()) continue;
      messages.push_back({{"role", "user"}, {"content", line}});
      std::vector<int32_t> prompt = tm.chat_prompt(messages, template_args);
      // Reuse the cache for the longest common prefix with what it already holds.
      size_t common = 0;
      while (common < cached.size() && common < prompt.size() && cached[common] == prompt[common]) ++common;
      if (common == prompt.size()) --common;  // at least one token must be fed to get logits
      // --mtp: the MTP layer's entry at the last kept position took the token that followed it in
      // the last turn, which may differ now: that position runs again (its main entry is the same).
      if (o->mtp && common > 0) --common;
      cache.trim(0, int64_t(common));
      cached.resize(common);
      std::vector<int32_t> fresh(prompt.begin() + long(common), prompt.end());
      const int64_t room = o->context - int64_t(prompt.size());
      if (room < 1) {
        std::puts("(context full: /reset to start over)");
        messages.erase(messages.size() - 1);
        continue;
      }
      GenerateOptions opt;
      opt.max_new_tokens = std::min(o->n, room);
      opt.sampling = o->s;
      opt.prefill_chunk = chunk;
      opt.decode_steps = o->decode_steps;
      opt.mtp_drafts = o->mtp;
      opt.history = cached;  // the earlier turns, for --repetition-penalty
      // The reply kept is the text before a stop string; the next turn's prompt, rendered from
      // it, parts from the cache where the tokens generated past it begin.
      ChatReply reply(tm, prompt, o->stops);
      GenerateResult r = generate(*model, cache, 0, fresh, opt, [&](int32_t id) {
        reply.token(id);
        return !reply.stopped();
      });
      reply.finish();
      cached.insert(cached.end(), fresh.begin(), fresh.end());
      cached.insert(cached.end(), r.tokens.begin(), r.tokens.end() - (r.tokens.empty() ? 0 : 1));
      messages.push_back({{"role", "assistant"}, {"content", reply.content()}});
      if (!reply.reasoning().empty()) messages.back()["reasoning_content"] = reply.reasoning();
      if (tty)
        std::fprintf(stderr, "[%zu tokens, %.1f tok/s]\n", r.tokens.size(),
                     r.tokens.size() > 1 ? double(r.tokens.size() - 1) / r.decode_seconds : 0.0);
    }
    return 0;
  };
}

Action add_perplexity(CLI::App& app) {
  struct Opts {
    std::string model, file;
    int64_t context = 0, chunk = 256;
    StreamingFlags sf;
    std::string device = "cpu";
    std::string math = "exact";  // --math: CUDA prefill products
    bool mtp = false;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--model,-m", o->model, "Model directory")->required();
  app.add_option("--file,-f", o->file, "Text file to score")->required();
  app.add_flag("--mtp", o->mtp,
               "Also score the MTP layer's drafts: how often its guess for token t+2 (from t's hidden state and "
               "token t+1) equals the main model's greedy token there (what run --mtp would keep)");
  app.add_option("--context", o->context, "Window length in tokens (default: max_position_embeddings, at most 4096)")
      ->check(CLI::Range(int64_t(2), int64_t(1) << 22));
  app.add_option("--chunk", o->chunk, "Tokens per forward step (a window is scored in chunks of this many)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20))
      ->capture_default_str();
  add_streaming_flags(app, o->sf);
  add_device_flag(app, o->device, o->math);
  return [o]() {
    if (!file_exists(o->file)) fail("--file: cannot open ", o->file);
    check_device_flags(o->device, o->math, o->sf);
    TextModel tm = TextModel::load(o->model);
    const std::vector<int32_t> ids = to_i32(tm.tokenizer.encode(read_text_file(o->file), false));
    if (ids.size() < 2) fail(o->file, ": fewer than 2 tokens, nothing to score");
    const int64_t window =
        o->context ? o->context : std::min<int64_t>(load_glm_dsa_config(o->model).max_position_embeddings, 4096);
    auto backend = make_cli_backend(o->device, o->math);
    // Steps of `chunk` tokens with logits for all of them: the backend's [chunk, vocab] and, on the
    // CPU (where a --memory-budget counts it), the host copy scored below.
    const int64_t step = std::min(o->chunk, window);
    auto model =
        load_model(o->model, *backend, o->sf, window, 1, step, step + (o->device == "cpu" ? step : 0), o->mtp).model;
    const int64_t V = model->config().vocab_size;
    // Non-overlapping windows, each scored from its own start: token t of a window is predicted
    // from tokens before it in that window.
    const int64_t n = int64_t(ids.size()), n_windows = (n + window - 1) / window;
    MlaCache cache(*backend, model->cache_shape(), 1, window);
    std::vector<float> logits(static_cast<size_t>(o->chunk * V));
    double nll = 0;
    int64_t scored = 0, drafts = 0, kept = 0;
    std::vector<int32_t> main_pick, mtp_pick;  // --mtp: a window's greedy tokens and drafts by position
    for (int64_t w = 0; w < n_windows; ++w) {
      const int64_t begin = w * window, end = std::min(n, begin + window);
      cache.reset(0);
      main_pick.assign(size_t(end - begin), -1);
      mtp_pick.assign(size_t(end - begin), -1);
      for (int64_t c = begin; c < end; c += o->chunk) {
        const int64_t T = std::min(o->chunk, end - c);
        BatchItem item;
        item.tokens = &ids[size_t(c)];
        item.T = T;
        item.logits = logits.data();
        item.all_logits = true;
        item.keep_hidden = o->mtp;
        model->forward_batch({item}, cache);
        if (o->mtp) {
          // The MTP entry at each position that has a next token in the window: its draft for
          // the position after that.
          const int64_t rows = std::min(T, end - 1 - c);
          for (int64_t t = 0; t < T; ++t) main_pick[size_t(c - begin + t)] = argmax(&logits[size_t(t * V)], V);
          if (rows > 0)
            model->mtp_forward(0, rows, &ids[size_t(c + 1)], cache, 0, c - begin, nullptr, true,
                               &mtp_pick[size_t(c - begin)]);
        }
        for (int64_t t = 0; t < T; ++t) {
          const int64_t target = c + t + 1;
          if (target >= end) break;
          const float* l = &logits[size_t(t * V)];
          float mx = l[0];
          for (int64_t v = 1; v < V; ++v) mx = std::max(mx, l[v]);
          double sum = 0;
          for (int64_t v = 0; v < V; ++v) sum += std::exp(double(l[v]) - mx);
          nll += std::log(sum) + mx - l[ids[size_t(target)]];
          ++scored;
        }
        std::fprintf(stderr, "\r[%lld/%lld tokens] perplexity so far %.4f", (long long)std::min(c + T, n), (long long)n,
                     std::exp(nll / double(std::max<int64_t>(scored, 1))));
        std::fflush(stderr);
      }
      // The draft at t (for t + 2) against the main model's greedy token for t + 2 (its pick at t + 1).
      for (int64_t t = 0; t + 2 < end - begin && o->mtp; ++t) {
        ++drafts;
        kept += mtp_pick[size_t(t)] == main_pick[size_t(t + 1)];
      }
    }
    std::fprintf(stderr, "\n");
    std::printf("tokens %lld, scored %lld, windows %lld of %lld tokens\nmean NLL %.6f\nperplexity %.6f\n",
                (long long)n, (long long)scored, (long long)n_windows, (long long)window, nll / double(scored),
                std::exp(nll / double(scored)));
    if (o->mtp)
      std::printf(
          "MTP drafts kept %lld of %lld (%.2f%%): the MTP layer's guess for t + 2 equals the main model's "
          "greedy token there\n",
          (long long)kept, (long long)drafts, drafts ? 100.0 * double(kept) / double(drafts) : 0.0);
    return 0;
  };
}

}  // namespace vireo::cli
