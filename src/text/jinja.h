#pragma once
// A Jinja2 engine for chat templates: the subset of Python jinja2 that real chat templates use,
// configured as transformers' apply_chat_template configures it (ImmutableSandboxedEnvironment with
// trim_blocks=True, lstrip_blocks=True, the loopcontrols extension, the {% generation %} tag, and the
// globals raise_exception, strftime_now, namespace, dict, range). Output matches jinja2 byte for
// byte; anything outside the subset is rejected at parse time with an error naming the line.
//
// Supported statements: if/elif/else, for (tuple targets, `if` filter, else, loop.*), break,
// continue, set (names, tuples, namespace attributes, block set with filters), macro (defaults,
// varargs, kwargs), call blocks (caller()), filter blocks, with, raw, generation, comments and
// whitespace control (- and +).
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace vireo::jinja {

struct Program;

class Template {
 public:
  // Parses `source`. Throws vireo::Error "<name>:<line>:<col>: <what was unexpected>" on syntax
  // errors and on constructs outside the subset (unknown tags, filters or tests).
  explicit Template(const std::string& source, const std::string& name = "template");

  // Renders with the top-level variables in `context` (a JSON object; key order is kept, as tojson
  // and items() expose it). Throws vireo::Error naming the line on runtime errors; a template's
  // raise_exception("msg") throws vireo::Error whose message is exactly "msg".
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  std::shared_ptr<const Program> program_;
};

// Variable scopes alive in this process, all renders together (a test's view: a finished render
// leaves none behind, macros and their closures included).
int64_t live_scopes();

}  // namespace vireo::jinja
