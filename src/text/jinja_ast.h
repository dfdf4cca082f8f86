#pragma once
// The parsed form of a template: a tree of statements holding expressions. Internal to the jinja
// engine (jinja_parse.cpp builds it, jinja.cpp evaluates it).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_value.h"

namespace vireo::jinja {

struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

enum class ExprKind {
  literal,   // value
  name,      // name
  list,      // args
  tuple,     // args
  dict,      // args: key, value, key, value, ...
  getattr,   // args[0].name
  getitem,   // args[0][args[1]]
  slice,     // args[0][args[1]:args[2]:args[3]] (null parts are omitted bounds)
  call,      // args[0](args[1..], kwargs)
  filter,    // args[0] | name(args[1..], kwargs); args[0] is null inside filter blocks
  test,      // args[0] is [not] name(args[1..], kwargs)
  not_,      // not args[0]
  neg,       // -args[0]
  pos,       // +args[0]
  binop,     // args[0] <name> args[1], name in + - * / // % **
  and_,      // args[0] and args[1]
  or_,       // args[0] or args[1]
  compare,   // args[0] ops[0] args[1] ops[1] args[2] ...
  cond,      // args[1] if args[0] else args[2] (args[2] may be null)
  concat,    // args[0] ~ args[1] ~ ...
};

struct Expr {
  ExprKind kind;
  size_t pos = 0;  // byte offset in the normalized source, for error locations
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  bool negated = false;
};

enum class StmtKind { text, print, if_, for_, set, set_block, macro, call_block, filter_block, with, break_, continue_, scope };

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: no default
};

struct Stmt {
  StmtKind kind;
  size_t pos = 0;
  std::string text;      // text; macro name
  ExprPtr expr;          // print value; for iterable; set value; call_block call
  ExprPtr target;        // for/set target (name, tuple of names, or getattr on a namespace)
  ExprPtr cond;          // for filter
  std::vector<std::pair<ExprPtr, Body>> branches;  // if/elif conditions and bodies
  Body body;
  Body else_body;
  std::vector<ExprPtr> filters;  // set_block / filter_block: filter chain (args[0] null)
  std::vector<MacroParam> params;  // macro, call_block (caller's params)
  std::vector<std::pair<std::string, ExprPtr>> assignments;  // with
  bool uses_varargs = false, uses_kwargs = false, uses_caller = false;
};

struct Program {
  std::string name;
  std::string source;              // normalized (\r\n -> \n)
  std::vector<size_t> line_starts;  // offsets of each line's first byte
  Body body;

  std::string location(size_t pos) const;  // "name:line:col"
};

// Parses a template; throws vireo::Error naming the location.
std::shared_ptr<Program> parse_template(const std::string& source, const std::string& name);

// Whether a filter or test of this name exists (the parser rejects unknown ones up front, as
// jinja2 does when it compiles a template).
bool has_filter(const std::string& name);
bool has_test(const std::string& name);

}  // namespace vireo::jinja
