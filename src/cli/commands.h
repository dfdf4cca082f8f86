#pragma once
// The vireo subcommands. Each registers its flags on a CLI11 app and returns the function that
// runs it; errors are thrown as vireo::Error and printed by main.
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace vireo::cli {

using Action = std::function<int()>;

Action add_run(CLI::App& app);
Action add_logits(CLI::App& app);
Action add_info(CLI::App& app);
Action add_bench(CLI::App& app);

// "1,2,3" -> ids; `flag` names the option in errors.
std::vector<int32_t> parse_id_list(const std::string& s, const std::string& flag);

}  // namespace vireo::cli
