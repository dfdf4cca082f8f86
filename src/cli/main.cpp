// vireo: exact inference for the GLM-5 / DeepSeek-V3.2 family.
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "core/thread_pool.h"

int main(int argc, char** argv) {
  CLI::App app{"vireo: exact inference for GLM-5 / DeepSeek-V3.2 mixture-of-experts models"};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("--threads", threads, "Worker threads (default: all cores, or $VIREO_THREADS)")
      ->check(CLI::Range(1, 1024));
  std::vector<std::pair<CLI::App*, vireo::cli::Action>> commands;
  auto add = [&](const char* name, const char* help, vireo::cli::Action (*fn)(CLI::App&)) {
    CLI::App* sub = app.add_subcommand(name, help);
    commands.emplace_back(sub, fn(*sub));
  };
  add("run", "Generate tokens from a prompt", vireo::cli::add_run);
  add("logits", "Write teacher-forced logits [T, vocab] as a float32 .npy", vireo::cli::add_logits);
  add("info", "Describe a checkpoint: architecture, parameters, bytes, layer schedule", vireo::cli::add_info);
  add("bench", "Measure prefill and decode speed (checkpoint or synthetic GLM-5 shapes)", vireo::cli::add_bench);
  add("tokenize", "Encode text with the model's tokenizer", vireo::cli::add_tokenize);
  add("detokenize", "Decode token ids to text", vireo::cli::add_detokenize);
  add("chat", "Interactive multi-turn chat with the model's chat template", vireo::cli::add_chat);
  add("perplexity", "Perplexity of a text file", vireo::cli::add_perplexity);
  add("plan", "Print the memory plan for a model under a budget", vireo::cli::add_plan);
  add("serve", "Serve the OpenAI API (chat and completions, streaming) with continuous batching",
      vireo::cli::add_serve);
  add("synth", "Write a random checkpoint with real GLM-5 layer shapes", vireo::cli::add_synth);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --help-all
    // One line, as every other error: what CLI11 found wrong, and where the flags are listed.
    std::string where = "vireo";
    for (auto& [sub, action] : commands)
      if (sub->parsed()) where += " " + sub->get_name();
    std::fprintf(stderr, "vireo: error: %s (%s --help lists the flags)\n", e.what(), where.c_str());
    return e.get_exit_code();
  }
  try {
    if (threads > 0) vireo::ThreadPool::set_global_threads(threads);
    for (auto& [sub, action] : commands)
      if (sub->parsed()) return action();
  } catch (const vireo::Error& e) {
    std::fprintf(stderr, "vireo: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "vireo: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vireo: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
