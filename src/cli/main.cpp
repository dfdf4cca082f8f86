// vireo: exact inference for the GLM-5 / DeepSeek-V3.2 family.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace {

// Edit distance between two short strings (insertions, deletions, substitutions).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// CLI11's "The following arguments were not expected: 0.8 --temperature" as one line in the
// order typed, naming the flag the user most likely meant among those of `command` and `top` (the
// top level's, which commands fall through to): one whose name the typed one starts with or is
// the start of (--temperature, --temp), or within two edits of it (--top_p, --top-p). *top_level
// tells whether that flag is the top level's.
std::string unexpected_arguments(const std::vector<std::string>& args, const CLI::App* command, const CLI::App& top,
                                 bool* top_level) {
  std::string typed;
  for (const std::string& a : args) typed += (typed.empty() ? "" : " ") + a;
  std::string flag;
  for (const std::string& a : args)
    if (a.rfind("--", 0) == 0) {
      flag = a.substr(0, a.find('='));
      break;
    }
  if (flag.empty()) return "unexpected argument" + std::string(args.size() > 1 ? "s" : "") + ": " + typed;
  std::string best;
  size_t best_cost = 3;
  for (const CLI::App* app : {command, &top}) {
    if (!app) continue;
    for (const CLI::Option* opt : app->get_options())
      for (const std::string& name : opt->get_lnames()) {
        const std::string known = "--" + name;
        const bool prefix =
            known.size() >= 5 && flag.size() >= 5 && (flag.rfind(known, 0) == 0 || known.rfind(flag, 0) == 0);
        const size_t cost = prefix ? 1 : edit_distance(flag, known);
        if (cost < best_cost) best_cost = cost, best = known, *top_level = app == &top;
      }
  }
  return "unknown flag " + flag + (best.empty() ? "" : " (did you mean " + best + "?)") +
         (typed == flag ? "" : " in '" + typed + "'");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"vireo: exact inference for GLM-5 / DeepSeek-V3.2 mixture-of-experts models"};
  app.require_subcommand(1);
  app.fallthrough();  // --threads after the command too (vireo run --threads 2 ...)
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
    // Extras: left on the command, or (fallen through) on the top level.
    const CLI::App* command = nullptr;
    for (auto& [sub, action] : commands)
      if (sub->parsed()) command = sub;
    std::vector<std::string> args = command ? command->remaining() : std::vector<std::string>{};
    if (args.empty()) args = app.remaining();
    std::string what = e.what();
    if (dynamic_cast<const CLI::ExtrasError*>(&e) && !args.empty()) {
      bool top_level = false;
      what = unexpected_arguments(args, command, app, &top_level);
      if (top_level) where = "vireo";  // vireo --help lists --threads
    }
    std::fprintf(stderr, "vireo: error: %s (%s --help lists the flags)\n", what.c_str(), where.c_str());
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
