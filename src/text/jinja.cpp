// The evaluator: walks the parsed template with Python/jinja2 semantics, plus the builtin filters,
// tests, globals and the Python str/dict methods that chat templates call.
#include "text/jinja.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <ctime>
#include <map>

#include "core/error.h"
#include "text/jinja_ast.h"

namespace vireo::jinja {

namespace {

// A located error already carries "name:line:col: "; inner frames must not prefix it again.
struct LocatedError : Error {
  using Error::Error;
};
// raise_exception("msg"): the template's own message, passed through untouched.
struct RaisedError : Error {
  using Error::Error;
};

constexpr size_t kMaxOutput = size_t(64) << 20;  // guards against runaway templates
constexpr int kMaxCallDepth = 100;  // recursive macros (nested JSON schemas) stay far below
constexpr int64_t kMaxRange = 100000;  // jinja2's sandbox limit

std::atomic<int64_t> g_live_scopes{0};

struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  Scope() { ++g_live_scopes; }
  ~Scope() { --g_live_scopes; }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get())
      for (const auto& [k, v] : s->vars)
        if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars)
      if (k == name) {
        old = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};
using ScopePtr = std::shared_ptr<Scope>;

Value make_function(std::string name, std::function<Value(CallArgs&)> fn) {
  auto f = std::make_shared<Function>();
  f->name = std::move(name);
  f->call = std::move(fn);
  return Value(std::shared_ptr<const Function>(std::move(f)));
}

// Reads a builtin's arguments by position or keyword, as Python binds them.
struct Args {
  CallArgs& a;
  const char* fname;
  Value get(size_t idx, const char* name, Value def = Value()) const {
    if (idx < a.positional.size()) return a.positional[idx];
    for (const auto& [k, v] : a.keyword)
      if (k == name) return v;
    return def;
  }
  bool has(size_t idx, const char* name) const {
    if (idx < a.positional.size()) return true;
    for (const auto& [k, v] : a.keyword)
      if (k == name) return true;
    return false;
  }
  void max_positional(size_t n) const {
    if (a.positional.size() > n) fail(fname, "() takes at most ", n, " positional argument(s)");
  }
};

int64_t to_int(const Value& v) {
  if (v.is_bool()) return v.as_bool();
  if (v.is_int()) return v.as_int();
  fail("'", type_name(v), "' object cannot be interpreted as an integer");
}

const std::string& need_string(const Value& v, const char* what) {
  if (!v.is_string()) fail(what, " must be str, not ", type_name(v));
  return v.as_string();
}

// Iterating a value the way Python's iter() does.
Array iterate(const Value& v) {
  switch (v.type()) {
    case Value::Type::undefined: return {};
    case Value::Type::array: return v.as_array();
    case Value::Type::string: {
      Array out;
      for (char32_t c : utf8_decode(v.as_string())) out.emplace_back(utf8_encode(std::u32string(1, c)));
      return out;
    }
    case Value::Type::object: {
      if (v.as_object().is_namespace) break;
      Array out;
      for (const auto& kv : v.as_object().items) out.emplace_back(kv.first);
      return out;
    }
    default: break;
  }
  fail("'", type_name(v), "' object is not iterable");
}

int64_t py_len(const Value& v) {
  switch (v.type()) {
    case Value::Type::undefined: return 0;
    case Value::Type::string: return static_cast<int64_t>(utf8_length(v.as_string()));
    case Value::Type::array:
      if (v.is_generator()) break;
      return static_cast<int64_t>(v.as_array().size());
    case Value::Type::object:
      if (!v.as_object().is_namespace) return static_cast<int64_t>(v.as_object().items.size());
      break;
    default: break;
  }
  fail("object of type '", type_name(v), "' has no len()");
}

// --- Python str methods --------------------------------------------------------------------------

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::u32string cs = utf8_decode(s);
  std::u32string set;
  bool ws = chars.is_none() || chars.is_undefined();
  if (!ws) set = utf8_decode(need_string(chars, "strip arg"));
  auto strip_it = [&](char32_t c) { return ws ? is_py_space(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = cs.size();
  if (left)
    while (b < e && strip_it(cs[b])) ++b;
  if (right)
    while (e > b && strip_it(cs[e - 1])) --e;
  return utf8_encode(std::u32string_view(cs).substr(b, e - b));
}

Array py_split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  Array out;
  if (sep.is_none() || sep.is_undefined()) {
    // Whitespace split: runs of whitespace separate, no empty strings.
    std::u32string cs = utf8_decode(s);
    std::vector<std::u32string> parts;
    if (!from_right) {
      size_t i = 0;
      while (i < cs.size()) {
        while (i < cs.size() && is_py_space(cs[i])) ++i;
        if (i >= cs.size()) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          size_t e = cs.size();
          while (e > i && is_py_space(cs[e - 1])) --e;
          parts.push_back(cs.substr(i, e - i));
          break;
        }
        size_t j = i;
        while (j < cs.size() && !is_py_space(cs[j])) ++j;
        parts.push_back(cs.substr(i, j - i));
        i = j;
      }
    } else {
      size_t i = cs.size();
      while (i > 0) {
        while (i > 0 && is_py_space(cs[i - 1])) --i;
        if (i == 0) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          size_t b = 0;
          while (b < i && is_py_space(cs[b])) ++b;
          parts.push_back(cs.substr(b, i - b));
          break;
        }
        size_t j = i;
        while (j > 0 && !is_py_space(cs[j - 1])) --j;
        parts.push_back(cs.substr(j, i - j));
        i = j;
      }
      std::reverse(parts.begin(), parts.end());
    }
    for (auto& p : parts) out.emplace_back(utf8_encode(p));
    return out;
  }
  const std::string& d = need_string(sep, "separator");
  if (d.empty()) fail("empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t pos = 0;
    while (true) {
      size_t q = (maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit) ? std::string::npos : s.find(d, pos);
      if (q == std::string::npos) {
        parts.push_back(s.substr(pos));
        break;
      }
      parts.push_back(s.substr(pos, q - pos));
      pos = q + d.size();
    }
  } else {
    size_t end = s.size();
    while (true) {
      size_t q = std::string::npos;
      if (!(maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit) && end >= d.size())
        q = s.rfind(d, end - d.size());
      if (q == std::string::npos) {
        parts.push_back(s.substr(0, end));
        break;
      }
      parts.push_back(s.substr(q + d.size(), end - q - d.size()));
      end = q;
    }
    std::reverse(parts.begin(), parts.end());
  }
  for (auto& p : parts) out.emplace_back(std::move(p));
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement around every code point.
    std::u32string cs = utf8_decode(s);
    int64_t n = 0;
    for (size_t i = 0; i <= cs.size(); ++i) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      if (i < cs.size()) out += utf8_encode(std::u32string(1, cs[i]));
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (true) {
    size_t q = (count >= 0 && n >= count) ? std::string::npos : s.find(old, pos);
    if (q == std::string::npos) break;
    out.append(s, pos, q - pos);
    out += repl;
    pos = q + old.size();
    ++n;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::string ascii_upper(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
  return s;
}
std::string ascii_lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
  return s;
}
std::string py_capitalize(const std::string& s) {
  std::string out = ascii_lower(s);
  if (!out.empty() && out[0] >= 'a' && out[0] <= 'z') out[0] = static_cast<char>(out[0] - 32);
  return out;
}
// str.title(): a letter after a non-letter is upper-cased, other letters lower-cased.
std::string py_title(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    bool lower = c >= 'a' && c <= 'z', upper = c >= 'A' && c <= 'Z';
    if (lower || upper) {
      c = prev_cased ? static_cast<char>(std::tolower(c)) : static_cast<char>(std::toupper(c));
      prev_cased = true;
    } else {
      prev_cased = static_cast<unsigned char>(c) >= 0x80 && prev_cased;
    }
  }
  return out;
}

bool starts_or_ends(const std::string& s, const Value& arg, bool start) {
  auto one = [&](const Value& p) {
    const std::string& x = need_string(p, start ? "startswith arg" : "endswith arg");
    if (x.size() > s.size()) return false;
    return start ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (arg.is_array()) {
    for (const Value& p : arg.as_array())
      if (one(p)) return true;
    return false;
  }
  return one(arg);
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::vector<std::string> lines;
  std::u32string cs = utf8_decode(s);
  size_t start = 0;
  for (size_t i = 0; i < cs.size(); ++i) {
    char32_t c = cs[i];
    bool brk = c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == 0x1c || c == 0x1d || c == 0x1e ||
               c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) continue;
    size_t end = i;
    if (c == '\r' && i + 1 < cs.size() && cs[i + 1] == '\n') ++i;
    lines.push_back(utf8_encode(cs.substr(start, (keepends ? i + 1 : end) - start)));
    start = i + 1;
  }
  if (start < cs.size()) lines.push_back(utf8_encode(cs.substr(start)));
  return lines;
}


bool is_num(const Value& v);

// Python's printf-style `fmt % args` (s, r, d, i, f, F, e, E, g, x, X, o, c, %), with flags,
// width and precision. Chat templates rarely use it, but jinja2 allows it, so it must not differ.
std::string percent_format(const std::string& fmt, const Value& args) {
  Array positional;
  const ObjectData* mapping = nullptr;
  if (args.is_tuple()) positional = args.as_array();
  else if (args.is_object() && !args.as_object().is_namespace) mapping = &args.as_object();
  else positional.push_back(args);
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) fail("incomplete format");
    Value arg;
    if (fmt[i] == '(') {
      size_t close = fmt.find(')', i);
      if (close == std::string::npos) fail("incomplete format key");
      if (!mapping) fail("format requires a mapping");
      const Value* v = mapping->find(fmt.substr(i + 1, close - i - 1));
      if (!v) fail("format key ", fmt.substr(i + 1, close - i - 1), " not found");
      arg = *v;
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::strchr("-+ 0#", fmt[i]) && fmt[i]) flags += fmt[i++];
    int width = 0, precision = -1;
    while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') width = std::min(width * 10 + (fmt[i++] - '0'), 10000);
    if (i < fmt.size() && fmt[i] == '.') {
      precision = 0;
      ++i;
      while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') precision = std::min(precision * 10 + (fmt[i++] - '0'), 1000);
    }
    if (i >= fmt.size()) fail("incomplete format");
    char conv = fmt[i];
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (arg.is_undefined() && !mapping) {
      if (next >= positional.size()) fail("not enough arguments for format string");
      arg = positional[next++];
    }
    std::string body;
    bool numeric = false;
    switch (conv) {
      case 's': body = to_str(arg); break;
      case 'r': case 'a': body = repr(arg); break;
      case 'c': body = arg.is_string() ? arg.as_string() : utf8_encode(std::u32string(1, static_cast<char32_t>(to_int(arg)))); break;
      case 'd': case 'i': case 'u': case 'x': case 'X': case 'o': {
        if (!is_num(arg)) fail("%", conv, " format: a real number is required, not ", type_name(arg));
        int64_t n = arg.is_float() ? static_cast<int64_t>(arg.as_float()) : to_int(arg);
        char buf[64];
        uint64_t mag = n < 0 ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
        std::snprintf(buf, sizeof(buf), conv == 'x' ? "%llx" : conv == 'X' ? "%llX" : conv == 'o' ? "%llo" : "%llu",
                      static_cast<unsigned long long>(mag));
        body = std::string(n < 0 ? "-" : (flags.find('+') != std::string::npos ? "+" : flags.find(' ') != std::string::npos ? " " : "")) + buf;
        numeric = true;
        break;
      }
      case 'f': case 'F': case 'e': case 'E': case 'g': case 'G': {
        if (!is_num(arg)) fail("must be real number, not ", type_name(arg));
        char spec[16];
        std::snprintf(spec, sizeof(spec), "%%%s.%d%c", flags.find('+') != std::string::npos ? "+" : flags.find(' ') != std::string::npos ? " " : "",
                      precision < 0 ? 6 : precision, conv);
        std::vector<char> buf(1100 + 32);
        std::snprintf(buf.data(), buf.size(), spec, arg.as_double());
        body = buf.data();
        numeric = true;
        break;
      }
      default: fail("unsupported format character '", conv, "'");
    }
    if (conv == 's' || conv == 'r' || conv == 'a') {
      if (precision >= 0) body = utf8_encode(utf8_decode(body).substr(0, precision));
    }
    int len = static_cast<int>(utf8_length(body));
    if (len < width) {
      if (flags.find('-') != std::string::npos) body += std::string(width - len, ' ');
      else if (numeric && flags.find('0') != std::string::npos) {
        size_t sign = (!body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ')) ? 1 : 0;
        body.insert(sign, std::string(width - len, '0'));
      } else body = std::string(width - len, ' ') + body;
    }
    out += body;
  }
  if (!mapping && next < positional.size()) fail("not all arguments converted during string formatting");
  return out;
}

// str.format with {}, {0}, {name}, !r/!s conversions and {{ }} escapes (no format specs).
std::string brace_format(const std::string& fmt, CallArgs& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
        out += '}';
        ++i;
        continue;
      }
      fail("single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    size_t close = fmt.find('}', i);
    if (close == std::string::npos) fail("single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    i = close;
    char conversion = 0;
    if (size_t bang = field.find('!'); bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 0;
      field = field.substr(0, bang);
    }
    if (field.find(':') != std::string::npos) fail("format specs in str.format are not supported");
    Value v;
    if (field.empty()) {
      if (auto_index >= a.positional.size()) fail("Replacement index ", auto_index, " out of range for positional args tuple");
      v = a.positional[auto_index++];
    } else if (std::all_of(field.begin(), field.end(), [](char d) { return d >= '0' && d <= '9'; })) {
      size_t k = std::stoul(field.substr(0, 6));
      if (k >= a.positional.size()) fail("Replacement index ", k, " out of range for positional args tuple");
      v = a.positional[k];
    } else {
      bool found = false;
      for (const auto& [name, val] : a.keyword)
        if (name == field) {
          v = val;
          found = true;
        }
      if (!found) fail("KeyError: '", field, "'");
    }
    out += conversion == 'r' ? repr(v) : to_str(v);
  }
  return out;
}

Value string_method(const std::string& s, const std::string& name) {
  auto m = [&](auto fn) { return make_function("str." + name, [s, fn](CallArgs& a) -> Value { return fn(s, Args{a, "str method"}); }); };
  if (name == "startswith" || name == "endswith") {
    bool start = name == "startswith";
    return m([start](const std::string& s, Args a) -> Value { return starts_or_ends(s, a.get(0, "prefix"), start); });
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    bool l = name != "rstrip", r = name != "lstrip";
    return m([l, r](const std::string& s, Args a) -> Value { return py_strip(s, a.get(0, "chars", Value::none()), l, r); });
  }
  if (name == "split" || name == "rsplit") {
    bool right = name == "rsplit";
    return m([right](const std::string& s, Args a) -> Value {
      return py_split(s, a.get(0, "sep", Value::none()), to_int(a.get(1, "maxsplit", Value(-1))), right);
    });
  }
  if (name == "format") return m([](const std::string& s, Args a) -> Value { return brace_format(s, a.a); });
  if (name == "upper") return m([](const std::string& s, Args) -> Value { return ascii_upper(s); });
  if (name == "lower") return m([](const std::string& s, Args) -> Value { return ascii_lower(s); });
  if (name == "title") return m([](const std::string& s, Args) -> Value { return py_title(s); });
  if (name == "capitalize") return m([](const std::string& s, Args) -> Value { return py_capitalize(s); });
  if (name == "replace")
    return m([](const std::string& s, Args a) -> Value {
      return py_replace(s, need_string(a.get(0, "old"), "replace arg"), need_string(a.get(1, "new"), "replace arg"),
                        to_int(a.get(2, "count", Value(-1))));
    });
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    bool right = name[0] == 'r';
    bool raise = name.find("index") != std::string::npos;
    return m([right, raise](const std::string& s, Args a) -> Value {
      const std::string sub = need_string(a.get(0, "sub"), "find arg");  // (a copy: get() returns a temporary)
      size_t q = right ? s.rfind(sub) : s.find(sub);
      if (q == std::string::npos) {
        if (raise) fail("substring not found");
        return Value(-1);
      }
      return Value(static_cast<int64_t>(utf8_length(std::string_view(s).substr(0, q))));
    });
  }
  if (name == "count")
    return m([](const std::string& s, Args a) -> Value {
      const std::string sub = need_string(a.get(0, "sub"), "count arg");  // (a copy: get() returns a temporary)
      if (sub.empty()) return Value(static_cast<int64_t>(utf8_length(s) + 1));
      int64_t n = 0;
      for (size_t q = s.find(sub); q != std::string::npos; q = s.find(sub, q + sub.size())) ++n;
      return Value(n);
    });
  if (name == "join")
    return m([](const std::string& s, Args a) -> Value {
      std::string out;
      bool first = true;
      for (const Value& v : iterate(a.get(0, "iterable"))) {
        if (!first) out += s;
        first = false;
        out += need_string(v, "sequence item");
      }
      return out;
    });
  if (name == "splitlines")
    return m([](const std::string& s, Args a) -> Value {
      Array out;
      for (auto& l : py_splitlines(s, truthy(a.get(0, "keepends", Value(false))))) out.emplace_back(std::move(l));
      return out;
    });
  auto all_of = [&](auto pred) {
    return m([pred](const std::string& s, Args) -> Value {
      if (s.empty()) return false;
      for (char c : s)
        if (!pred(static_cast<unsigned char>(c))) return false;
      return true;
    });
  };
  if (name == "isdigit") return all_of([](unsigned char c) { return c >= '0' && c <= '9'; });
  if (name == "isalpha") return all_of([](unsigned char c) { return std::isalpha(c) != 0; });
  if (name == "isalnum") return all_of([](unsigned char c) { return std::isalnum(c) != 0; });
  if (name == "isspace")
    return m([](const std::string& s, Args) -> Value {
      if (s.empty()) return false;
      for (char32_t c : utf8_decode(s))
        if (!is_py_space(c)) return false;
      return true;
    });
  if (name == "isupper" || name == "islower") {
    bool up = name == "isupper";
    return m([up](const std::string& s, Args) -> Value {
      bool cased = false;
      for (char c : s) {
        if (std::islower(static_cast<unsigned char>(c))) {
          if (up) return false;
          cased = true;
        } else if (std::isupper(static_cast<unsigned char>(c))) {
          if (!up) return false;
          cased = true;
        }
      }
      return cased;
    });
  }
  return Value::undefined("'str object' has no attribute '" + name + "'");
}

Value dict_method(const Value& obj, const std::string& name) {
  auto data = obj.object_ptr();
  if (name == "items")
    return make_function("dict.items", [data](CallArgs&) -> Value {
      Array out;
      for (const auto& [k, v] : data->items) out.push_back(Value::tuple({Value(k), v}));
      return out;
    });
  if (name == "keys")
    return make_function("dict.keys", [data](CallArgs&) -> Value {
      Array out;
      for (const auto& kv : data->items) out.emplace_back(kv.first);
      return out;
    });
  if (name == "values")
    return make_function("dict.values", [data](CallArgs&) -> Value {
      Array out;
      for (const auto& kv : data->items) out.push_back(kv.second);
      return out;
    });
  if (name == "get")
    return make_function("dict.get", [data](CallArgs& a) -> Value {
      Args args{a, "get"};
      Value key = args.get(0, "key");
      if (key.is_string())
        if (const Value* v = data->find(key.as_string())) return *v;
      return args.get(1, "default", Value::none());
    });
  return Value();
}

bool is_dict_method(const std::string& name) {
  return name == "items" || name == "keys" || name == "values" || name == "get";
}

// obj.name: Python attribute first (methods), then item, as jinja2's getattr does.
Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.type()) {
    case Value::Type::undefined:
      fail(obj.undefined_hint().empty() ? "undefined value" : obj.undefined_hint(), ", cannot read its attribute '", name, "'");
    case Value::Type::object: {
      const ObjectData& o = obj.as_object();
      if (!o.is_namespace && is_dict_method(name)) return dict_method(obj, name);
      if (const Value* v = o.find(name)) return *v;
      return Value::undefined(str("'", o.is_namespace ? "Namespace" : "dict object", "' has no attribute '", name, "'"));
    }
    case Value::Type::string: return string_method(obj.as_string(), name);
    default: return Value::undefined(str("'", type_name(obj), " object' has no attribute '", name, "'"));
  }
}

// Python index normalization; returns false when out of range.
bool norm_index(int64_t& i, int64_t n) {
  if (i < 0) i += n;
  return i >= 0 && i < n;
}

// obj[key]: item first, then attribute (jinja2's getitem).
Value get_item(const Value& obj, const Value& key) {
  switch (obj.type()) {
    case Value::Type::undefined:
      fail(obj.undefined_hint().empty() ? "undefined value" : obj.undefined_hint(), ", cannot read its item ", repr(key));
    case Value::Type::array:
      if (key.is_int() || key.is_bool()) {
        int64_t i = to_int(key);
        if (!norm_index(i, static_cast<int64_t>(obj.as_array().size())))
          return Value::undefined(str("'", type_name(obj), " object' has no element ", to_int(key)));
        return obj.as_array()[i];
      }
      break;
    case Value::Type::string:
      if (key.is_int() || key.is_bool()) {
        std::u32string cs = utf8_decode(obj.as_string());
        int64_t i = to_int(key);
        if (!norm_index(i, static_cast<int64_t>(cs.size())))
          return Value::undefined(str("'str object' has no element ", to_int(key)));
        return Value(utf8_encode(cs.substr(i, 1)));
      }
      break;
    case Value::Type::object:
      if (key.is_string() && !obj.as_object().is_namespace) {
        if (const Value* v = obj.as_object().find(key.as_string())) return *v;
        if (is_dict_method(key.as_string())) return dict_method(obj, key.as_string());
        return Value::undefined(str("'dict object' has no attribute '", key.as_string(), "'"));
      }
      break;
    default: break;
  }
  if (key.is_string()) return get_attr(obj, key.as_string());
  return Value::undefined(str("'", type_name(obj), " object' has no element ", repr(key)));
}

Value slice(const Value& obj, const Value& vstart, const Value& vstop, const Value& vstep) {
  auto opt = [](const Value& v) { return v.is_none() || v.is_undefined(); };
  int64_t step = opt(vstep) ? 1 : to_int(vstep);
  if (step == 0) fail("slice step cannot be zero");
  auto run = [&](int64_t n, auto&& emit) {
    int64_t start, stop;
    auto clamp = [&](const Value& v, int64_t def) {
      if (opt(v)) return def;
      int64_t i = to_int(v);
      if (i < 0) i += n;
      if (step > 0) return std::clamp<int64_t>(i, 0, n);
      return std::clamp<int64_t>(i, -1, n - 1);
    };
    start = clamp(vstart, step > 0 ? 0 : n - 1);
    stop = clamp(vstop, step > 0 ? n : -1);
    if (step > 0)
      for (int64_t i = start; i < stop; i += step) emit(i);
    else
      for (int64_t i = start; i > stop; i += step) emit(i);
  };
  if (obj.is_string()) {
    std::u32string cs = utf8_decode(obj.as_string()), out;
    run(static_cast<int64_t>(cs.size()), [&](int64_t i) { out.push_back(cs[i]); });
    return Value(utf8_encode(out));
  }
  if (obj.is_array()) {
    const Array& a = obj.as_array();
    Array out;
    run(static_cast<int64_t>(a.size()), [&](int64_t i) { out.push_back(a[i]); });
    return obj.is_tuple() ? Value::tuple(std::move(out)) : Value(std::move(out));
  }
  if (obj.is_undefined()) fail(obj.undefined_hint().empty() ? "undefined value" : obj.undefined_hint(), " cannot be sliced");
  fail("'", type_name(obj), "' object is not subscriptable");
}

// --- arithmetic ----------------------------------------------------------------------------------

bool is_num(const Value& v) { return v.is_number() || v.is_bool(); }

[[noreturn]] void bad_operands(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail(a.undefined_hint().empty() ? "undefined value" : a.undefined_hint(), " in '", op, "'");
  if (b.is_undefined()) fail(b.undefined_hint().empty() ? "undefined value" : b.undefined_hint(), " in '", op, "'");
  fail("unsupported operand type(s) for ", op, ": '", type_name(a), "' and '", type_name(b), "'");
}

Value repeat(const Value& seq, int64_t n) {
  if (seq.is_string()) {
    if (n <= 0) return Value("");
    if (seq.as_string().size() * static_cast<size_t>(n) > kMaxOutput) fail("string repetition too large");
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += seq.as_string();
    return out;
  }
  Array out;
  if (n > 0 && seq.as_array().size() * static_cast<size_t>(n) > kMaxOutput) fail("list repetition too large");
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.as_array().begin(), seq.as_array().end());
  return seq.is_tuple() ? Value::tuple(std::move(out)) : Value(std::move(out));
}

int64_t wrap_add(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b)); }
int64_t wrap_sub(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b)); }
int64_t wrap_mul(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b)); }

Value binop(const std::string& op, const Value& a, const Value& b) {
  if (is_num(a) && is_num(b)) {
    bool fl = a.is_float() || b.is_float();
    double x = a.as_double(), y = b.as_double();
    int64_t i = fl ? 0 : to_int(a), j = fl ? 0 : to_int(b);
    if (op == "+") return fl ? Value(x + y) : Value(wrap_add(i, j));
    if (op == "-") return fl ? Value(x - y) : Value(wrap_sub(i, j));
    if (op == "*") return fl ? Value(x * y) : Value(wrap_mul(i, j));
    if (op == "/") {
      if (y == 0) fail("division by zero");
      return Value(x / y);
    }
    if (op == "//" || op == "%") {
      if (fl ? y == 0 : j == 0) fail(op == "//" ? "integer division or modulo by zero" : "modulo by zero");
      if (fl) {
        double m = std::fmod(x, y);
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        return op == "%" ? Value(m) : Value(std::floor((x - m) / y + 0.5 - 0.5));
      }
      if (i == INT64_MIN && j == -1) return op == "%" ? Value(int64_t(0)) : Value(i);
      int64_t q = i / j, r = i % j;
      if (r != 0 && ((r < 0) != (j < 0))) {
        --q;
        r += j;
      }
      return op == "%" ? Value(r) : Value(q);
    }
    if (op == "**") {
      if (!fl && j >= 0) {
        int64_t r = 1;
        for (int64_t k = 0; k < j && k < 64; ++k) r = wrap_mul(r, i);
        return Value(r);
      }
      if (x == 0 && y < 0) fail("zero cannot be raised to a negative power");
      return Value(std::pow(x, y));
    }
  }
  if (op == "+") {
    if (a.is_string() && b.is_string()) return Value(a.as_string() + b.as_string());
    if (a.is_array() && b.is_array() && a.is_tuple() == b.is_tuple()) {
      Array out = a.as_array();
      out.insert(out.end(), b.as_array().begin(), b.as_array().end());
      return a.is_tuple() ? Value::tuple(std::move(out)) : Value(std::move(out));
    }
  }
  if (op == "%" && a.is_string()) return percent_format(a.as_string(), b);
  if (op == "*") {
    if ((a.is_string() || a.is_array()) && (b.is_int() || b.is_bool())) return repeat(a, to_int(b));
    if ((b.is_string() || b.is_array()) && (a.is_int() || a.is_bool())) return repeat(b, to_int(a));
  }
  bad_operands(op, a, b);
}

bool contains(const Value& container, const Value& item) {
  switch (container.type()) {
    case Value::Type::undefined: return false;
    case Value::Type::string:
      if (!item.is_string()) fail("'in <string>' requires string as left operand, not ", type_name(item));
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Type::array:
      for (const Value& v : container.as_array())
        if (equals(v, item)) return true;
      return false;
    case Value::Type::object:
      if (container.as_object().is_namespace) break;
      return item.is_string() && container.as_object().find(item.as_string()) != nullptr;
    default: break;
  }
  fail("argument of type '", type_name(container), "' is not iterable");
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// --- the interpreter -----------------------------------------------------------------------------

enum class Flow { normal, break_, continue_ };

class Interp;
using FilterFn = Value (*)(Interp&, const Value&, Args&);
using TestFn = bool (*)(Interp&, const Value&, Args&);
const std::map<std::string, FilterFn>& filters();
const std::map<std::string, TestFn>& tests();

class Interp {
 public:
  explicit Interp(const Program& prog) : prog_(prog) {}

  std::string run(const nlohmann::ordered_json& context) {
    // A macro keeps the scope it was defined in (its closure) and is itself a value in that
    // scope: a reference cycle, so without this every render that defined a macro leaked its
    // scopes and everything in them (255 KB over the GLM-5 template's goldens; LeakSanitizer).
    // Once the render is over (or has failed) nothing can call a macro: empty every scope it made.
    struct ReleaseScopes {
      std::vector<std::weak_ptr<Scope>>& made;
      ~ReleaseScopes() {
        for (auto& w : made)
          if (ScopePtr s = w.lock()) {
            s->vars.clear();
            s->parent.reset();
          }
        made.clear();
      }
    } release{scopes_};
    auto globals = child(nullptr);
    install_globals(*globals);
    auto root = child(globals);
    if (context.is_object())
      for (auto it = context.begin(); it != context.end(); ++it) root->set(it.key(), from_json(it.value()));
    std::string out;
    sink_ = &out;
    exec_body(prog_.body, root);
    return out;
  }

  Value call_filter(const std::string& name, const Value& subject, CallArgs& args) {
    auto it = filters().find(name);
    VIREO_ASSERT(it != filters().end());
    Args a{args, name.c_str()};
    return it->second(*this, subject, a);
  }
  bool call_test(const std::string& name, const Value& subject, CallArgs& args) {
    auto it = tests().find(name);
    if (it == tests().end()) fail("no test named '", name, "'");
    Args a{args, name.c_str()};
    return it->second(*this, subject, a);
  }
  Value call(const Value& callee, CallArgs& args) {
    if (callee.is_function()) return callee.as_function().call(args);
    if (callee.is_undefined()) fail(callee.undefined_hint().empty() ? "undefined value" : callee.undefined_hint(), " is not callable");
    fail("'", type_name(callee), "' object is not callable");
  }

 private:
  void emit(const std::string& s) {
    if (sink_->size() + s.size() > kMaxOutput) fail("template output exceeds ", kMaxOutput, " bytes");
    *sink_ += s;
  }

  [[noreturn]] void locate(size_t pos, const Error& e) {
    if (dynamic_cast<const LocatedError*>(&e) || dynamic_cast<const RaisedError*>(&e)) throw;
    throw LocatedError(prog_.location(pos) + ": " + e.what());
  }

  void install_globals(Scope& g) {
    g.set("raise_exception", make_function("raise_exception", [](CallArgs& a) -> Value {
            Value msg = Args{a, "raise_exception"}.get(0, "message");
            throw RaisedError(to_str(msg));
          }));
    g.set("strftime_now", make_function("strftime_now", [](CallArgs& a) -> Value {
            std::string fmt = need_string(Args{a, "strftime_now"}.get(0, "format"), "format");
            std::time_t t = std::time(nullptr);
            std::tm tm{};
            localtime_r(&t, &tm);
            char buf[256];
            size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
            return std::string(buf, n);
          }));
    g.set("namespace", make_function("namespace", [](CallArgs& a) -> Value {
            auto o = std::make_shared<ObjectData>();
            o->is_namespace = true;
            for (const Value& p : a.positional) {
              if (!p.is_object()) fail("namespace() positional argument must be a mapping");
              for (const auto& [k, v] : p.as_object().items) o->set(k, v);
            }
            for (const auto& [k, v] : a.keyword) o->set(k, v);
            for (const auto& kv : o->items)
              if (!kv.first.empty() && kv.first[0] == '_') fail("chat templates cannot store underscore-prefixed attributes on a namespace");
            return Value(std::move(o));
          }));
    g.set("dict", make_function("dict", [](CallArgs& a) -> Value {
            auto o = std::make_shared<ObjectData>();
            for (const Value& p : a.positional) {
              if (p.is_object()) {
                for (const auto& [k, v] : p.as_object().items) o->set(k, v);
              } else {
                for (const Value& kv : iterate(p)) {
                  if (!kv.is_array() || kv.as_array().size() != 2 || !kv.as_array()[0].is_string())
                    fail("dict() needs (key, value) pairs");
                  o->set(kv.as_array()[0].as_string(), kv.as_array()[1]);
                }
              }
            }
            for (const auto& [k, v] : a.keyword) o->set(k, v);
            return Value(std::move(o));
          }));
    g.set("range", make_function("range", [](CallArgs& a) -> Value {
            int64_t start = 0, stop, step = 1;
            if (a.positional.size() == 1) {
              stop = to_int(a.positional[0]);
            } else if (a.positional.size() == 2 || a.positional.size() == 3) {
              start = to_int(a.positional[0]);
              stop = to_int(a.positional[1]);
              if (a.positional.size() == 3) step = to_int(a.positional[2]);
            } else {
              fail("range expected 1 to 3 arguments");
            }
            if (step == 0) fail("range() arg 3 must not be zero");
            Array out;
            for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
              if (static_cast<int64_t>(out.size()) >= kMaxRange) fail("range too big, max is ", kMaxRange);
              out.emplace_back(i);
            }
            return out;
          }));
  }

  // --- statements ---

  Flow exec_body(const Body& body, const ScopePtr& scope) {
    for (const auto& s : body) {
      Flow f;
      try {
        f = exec(*s, scope);
      } catch (const Error& e) {
        locate(s->pos, e);
      }
      if (f != Flow::normal) return f;
    }
    return Flow::normal;
  }

  Flow exec(const Stmt& s, const ScopePtr& scope) {
    switch (s.kind) {
      case StmtKind::text: emit(s.text); return Flow::normal;
      case StmtKind::print: emit(to_str(eval(*s.expr, scope))); return Flow::normal;
      case StmtKind::if_:
        for (const auto& [cond, body] : s.branches)
          if (truthy(eval(*cond, scope))) return exec_body(body, scope);
        return exec_body(s.else_body, scope);
      case StmtKind::for_: return exec_for(s, scope);
      case StmtKind::set: assign(*s.target, eval(*s.expr, scope), scope); return Flow::normal;
      case StmtKind::set_block: {
        Value v = capture(s.body, child(scope));
        v = apply_filters(s.filters, v, scope);
        assign(*s.target, v, scope);
        return Flow::normal;
      }
      case StmtKind::filter_block: {
        Value v = capture(s.body, child(scope));
        emit(to_str(apply_filters(s.filters, v, scope)));
        return Flow::normal;
      }
      case StmtKind::macro: scope->set(s.text, make_macro(s, s.text, scope)); return Flow::normal;
      case StmtKind::call_block: {
        const Expr& call = *s.expr;
        Value callee = eval(*call.args[0], scope);
        CallArgs args = eval_args(call, scope);
        args.keyword.emplace_back("caller", make_macro(s, "caller", scope));
        emit(to_str(this->call(callee, args)));
        return Flow::normal;
      }
      case StmtKind::with: {
        auto inner = child(scope);
        for (const auto& [name, e] : s.assignments) inner->set(name, eval(*e, scope));
        return exec_body(s.body, inner);
      }
      case StmtKind::scope: return exec_body(s.body, scope);
      case StmtKind::break_: return Flow::break_;
      case StmtKind::continue_: return Flow::continue_;
    }
    return Flow::normal;
  }

  Value capture(const Body& body, const ScopePtr& scope) {
    std::string buf;
    std::string* saved = sink_;
    sink_ = &buf;
    try {
      exec_body(body, scope);
    } catch (...) {
      sink_ = saved;
      throw;
    }
    sink_ = saved;
    return Value(std::move(buf));
  }

  Value apply_filters(const std::vector<ExprPtr>& chain, Value v, const ScopePtr& scope) {
    for (const auto& f : chain) {
      CallArgs args = eval_args(*f, scope, 1);
      v = call_filter(f->name, v, args);
    }
    return v;
  }

  void assign(const Expr& target, const Value& v, const ScopePtr& scope) {
    if (target.kind == ExprKind::name) {
      scope->set(target.name, v);
    } else if (target.kind == ExprKind::tuple) {
      Array items = iterate(v);
      if (items.size() != target.args.size())
        fail(items.size() < target.args.size() ? "not enough" : "too many", " values to unpack (expected ", target.args.size(),
             ", got ", items.size(), ")");
      for (size_t i = 0; i < items.size(); ++i) assign(*target.args[i], items[i], scope);
    } else if (target.kind == ExprKind::getattr) {
      Value ns = eval(*target.args[0], scope);
      if (!ns.is_object() || !ns.as_object().is_namespace) fail("cannot assign attribute on non-namespace object");
      if (!target.name.empty() && target.name[0] == '_') fail("chat templates cannot store underscore-prefixed attributes on a namespace");
      ns.as_object().set(target.name, v);
    } else {
      fail("cannot assign to this target");
    }
  }

  Flow exec_for(const Stmt& s, const ScopePtr& scope) {
    Array items = iterate(eval(*s.expr, scope));
    if (s.cond) {  // `for x in xs if cond`: filtered before loop.* is computed
      Array kept;
      for (const Value& item : items) {
        auto tmp = child(scope);
        assign(*s.target, item, tmp);
        if (truthy(eval(*s.cond, tmp))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec_body(s.else_body, child(scope));
    const int64_t n = static_cast<int64_t>(items.size());
    auto last_changed = std::make_shared<Value>();
    for (int64_t i = 0; i < n; ++i) {
      auto body_scope = child(scope);
      assign(*s.target, items[i], body_scope);
      auto loop = std::make_shared<ObjectData>();
      loop->items = {{"index", Value(i + 1)},
                     {"index0", Value(i)},
                     {"revindex", Value(n - i)},
                     {"revindex0", Value(n - i - 1)},
                     {"first", Value(i == 0)},
                     {"last", Value(i == n - 1)},
                     {"length", Value(n)},
                     {"depth", Value(1)},
                     {"depth0", Value(0)},
                     {"previtem", i > 0 ? items[i - 1] : Value::undefined("there is no previous item")},
                     {"nextitem", i + 1 < n ? items[i + 1] : Value::undefined("there is no next item")}};
      loop->items.emplace_back("cycle", make_function("loop.cycle", [i](CallArgs& a) -> Value {
                                 if (a.positional.empty()) fail("no items for cycling given");
                                 return a.positional[i % a.positional.size()];
                               }));
      loop->items.emplace_back("changed", make_function("loop.changed", [last_changed](CallArgs& a) -> Value {
                                 Value now(a.positional);
                                 if (!last_changed->is_undefined() && equals(*last_changed, now)) return false;
                                 *last_changed = now;
                                 return true;
                               }));
      body_scope->set("loop", Value(std::move(loop)));
      Flow f = exec_body(s.body, body_scope);
      if (f == Flow::break_) break;
    }
    return Flow::normal;
  }

  Value make_macro(const Stmt& s, const std::string& name, const ScopePtr& closure) {
    const Stmt* def = &s;
    return make_function(name, [this, def, name, closure](CallArgs& a) -> Value {
      if (depth_ >= kMaxCallDepth) fail("maximum macro recursion depth exceeded");
      auto scope = child(closure);
      const auto& params = def->params;
      Array extra;
      for (size_t i = 0; i < a.positional.size(); ++i) {
        if (i < params.size()) scope->set(params[i].name, a.positional[i]);
        else if (def->uses_varargs) extra.push_back(a.positional[i]);
        else fail("macro '", name, "' takes not more than ", params.size(), " argument(s)");
      }
      std::vector<std::pair<std::string, Value>> extra_kw;
      Value caller;
      for (const auto& [k, v] : a.keyword) {
        bool is_param = false;
        for (size_t i = 0; i < params.size(); ++i)
          if (params[i].name == k) {
            if (i < a.positional.size()) fail("macro '", name, "' got multiple values for argument '", k, "'");
            scope->set(k, v);
            is_param = true;
          }
        if (is_param) continue;
        if (k == "caller" && def->uses_caller) caller = v;
        else if (def->uses_kwargs) extra_kw.emplace_back(k, v);
        else fail("macro '", name, "' takes no keyword argument '", k, "'");
      }
      for (size_t i = a.positional.size(); i < params.size(); ++i) {
        bool given = false;
        for (const auto& kv : a.keyword) given |= kv.first == params[i].name;
        if (given) continue;
        scope->set(params[i].name, params[i].default_value ? eval(*params[i].default_value, scope)
                                                           : Value::undefined("parameter '" + params[i].name + "' was not provided"));
      }
      if (def->uses_varargs) scope->set("varargs", Value::tuple(std::move(extra)));
      if (def->uses_kwargs) scope->set("kwargs", make_object(std::move(extra_kw)));
      if (def->uses_caller) scope->set("caller", caller);
      ++depth_;
      struct Dec {
        int& d;
        ~Dec() { --d; }
      } dec{depth_};
      return capture(def->body, scope);
    });
  }

  // --- expressions ---

  CallArgs eval_args(const Expr& e, const ScopePtr& scope, size_t first = 1) {
    CallArgs a;
    for (size_t i = first; i < e.args.size(); ++i) a.positional.push_back(eval(*e.args[i], scope));
    for (const auto& [k, v] : e.kwargs) a.keyword.emplace_back(k, eval(*v, scope));
    return a;
  }

 public:
  Value eval(const Expr& e, const ScopePtr& scope) {
    try {
      return eval_impl(e, scope);
    } catch (const Error& err) {
      locate(e.pos, err);
    }
  }

 private:
  Value eval_impl(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case ExprKind::literal: return e.value;
      case ExprKind::name: {
        if (const Value* v = scope->find(e.name)) return *v;
        return Value::undefined("'" + e.name + "' is undefined");
      }
      case ExprKind::list:
      case ExprKind::tuple: {
        Array a;
        for (const auto& x : e.args) a.push_back(eval(*x, scope));
        return e.kind == ExprKind::tuple ? Value::tuple(std::move(a)) : Value(std::move(a));
      }
      case ExprKind::dict: {
        std::vector<std::pair<std::string, Value>> items;
        auto o = std::make_shared<ObjectData>();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value k = eval(*e.args[i], scope);
          if (!k.is_string()) fail("dict literal keys must be strings here, got ", type_name(k));
          o->set(k.as_string(), eval(*e.args[i + 1], scope));
        }
        return Value(std::move(o));
      }
      case ExprKind::getattr: return get_attr(eval(*e.args[0], scope), e.name);
      case ExprKind::getitem: return get_item(eval(*e.args[0], scope), eval(*e.args[1], scope));
      case ExprKind::slice: {
        Value obj = eval(*e.args[0], scope);
        auto part = [&](size_t i) { return e.args[i] ? eval(*e.args[i], scope) : Value::none(); };
        return slice(obj, part(1), part(2), part(3));
      }
      case ExprKind::call: {
        Value callee = eval(*e.args[0], scope);
        CallArgs a = eval_args(e, scope);
        return call(callee, a);
      }
      case ExprKind::filter: {
        Value subject = eval(*e.args[0], scope);
        CallArgs a = eval_args(e, scope);
        return call_filter(e.name, subject, a);
      }
      case ExprKind::test: {
        Value subject = eval(*e.args[0], scope);
        CallArgs a = eval_args(e, scope);
        return Value(call_test(e.name, subject, a));
      }
      case ExprKind::not_: return Value(!truthy(eval(*e.args[0], scope)));
      case ExprKind::neg:
      case ExprKind::pos: {
        Value v = eval(*e.args[0], scope);
        if (v.is_float()) return Value(e.kind == ExprKind::neg ? -v.as_float() : v.as_float());
        if (v.is_int() || v.is_bool()) return Value(e.kind == ExprKind::neg ? wrap_sub(0, to_int(v)) : to_int(v));
        fail("bad operand type for unary ", e.kind == ExprKind::neg ? "-" : "+", ": '", type_name(v), "'");
      }
      case ExprKind::binop: return binop(e.name, eval(*e.args[0], scope), eval(*e.args[1], scope));
      case ExprKind::and_: {
        Value a = eval(*e.args[0], scope);
        return truthy(a) ? eval(*e.args[1], scope) : a;
      }
      case ExprKind::or_: {
        Value a = eval(*e.args[0], scope);
        return truthy(a) ? a : eval(*e.args[1], scope);
      }
      case ExprKind::compare: {
        Value left = eval(*e.args[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], scope);
          const std::string& op = e.ops[i];
          bool r;
          if (op == "==") r = equals(left, right);
          else if (op == "!=") r = !equals(left, right);
          else if (op == "in") r = contains(right, left);
          else if (op == "notin") r = !contains(right, left);
          else {
            int c = compare(left, right);
            r = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
          }
          if (!r) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case ExprKind::cond:
        if (truthy(eval(*e.args[0], scope))) return eval(*e.args[1], scope);
        if (e.args[2]) return eval(*e.args[2], scope);
        return Value::undefined("the inline if-expression evaluated to false and no else section was defined");
      case ExprKind::concat: {
        std::string out;
        for (const auto& x : e.args) out += to_str(eval(*x, scope));
        return Value(std::move(out));
      }
    }
    return Value();
  }

  // A new scope under parent, remembered so that run() can empty it at the end.
  ScopePtr child(const ScopePtr& parent) {
    if (scopes_.size() >= 2 * scopes_live_ + 64) {  // forget the ones already gone (loops make many)
      std::erase_if(scopes_, [](const std::weak_ptr<Scope>& w) { return w.expired(); });
      scopes_live_ = scopes_.size();
    }
    auto s = std::make_shared<Scope>();
    s->parent = parent;
    scopes_.push_back(s);
    return s;
  }

  const Program& prog_;
  std::string* sink_ = nullptr;
  int depth_ = 0;
  std::vector<std::weak_ptr<Scope>> scopes_;
  size_t scopes_live_ = 0;
};

// --- filters -------------------------------------------------------------------------------------

// Resolves `attribute` arguments: dotted paths and integer parts, through getitem.
Value attr_path(const Value& v, const Value& attribute) {
  if (attribute.is_int()) return get_item(v, attribute);
  Value cur = v;
  const std::string& path = need_string(attribute, "attribute");
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && part.size() < 18 && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    cur = get_item(cur, numeric ? Value(static_cast<int64_t>(std::stoll(part))) : Value(part));
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

// select/reject/selectattr/rejectattr share jinja2's select_or_reject.
Value select_or_reject(Interp& in, const Value& seq, Args& a, bool by_attr, bool select) {
  size_t next = 0;
  Value attribute;
  if (by_attr) attribute = a.get(next++, "attribute");
  bool has_test = a.a.positional.size() > next;
  std::string test_name = has_test ? need_string(a.a.positional[next], "test name") : "";
  CallArgs test_args;
  for (size_t i = next + 1; i < a.a.positional.size(); ++i) test_args.positional.push_back(a.a.positional[i]);
  for (const auto& kv : a.a.keyword)
    if (kv.first != "attribute") test_args.keyword.push_back(kv);
  Array out;
  for (const Value& item : iterate(seq)) {
    Value subject = by_attr ? attr_path(item, attribute) : item;
    bool ok = has_test ? in.call_test(test_name, subject, test_args) : truthy(subject);
    if (ok == select) out.push_back(item);
  }
  return Value::generator(std::move(out));
}

Value f_length(Interp&, const Value& v, Args&) { return Value(py_len(v)); }
Value f_trim(Interp&, const Value& v, Args& a) { return py_strip(to_str(v), a.get(0, "chars", Value::none()), true, true); }
Value f_upper(Interp&, const Value& v, Args&) { return ascii_upper(to_str(v)); }
Value f_lower(Interp&, const Value& v, Args&) { return ascii_lower(to_str(v)); }
Value f_capitalize(Interp&, const Value& v, Args&) { return py_capitalize(to_str(v)); }
Value f_title(Interp&, const Value& v, Args&) { return py_title(to_str(v)); }
Value f_string(Interp&, const Value& v, Args&) { return to_str(v); }
Value f_safe(Interp&, const Value& v, Args&) { return v; }
Value f_escape(Interp&, const Value& v, Args&) { return html_escape(to_str(v)); }

Value f_tojson(Interp&, const Value& v, Args& a) {
  JsonOptions o;
  o.ensure_ascii = truthy(a.get(0, "ensure_ascii", Value(false)));
  Value indent = a.get(1, "indent", Value::none());
  if (!indent.is_none()) o.indent = static_cast<int>(to_int(indent));
  Value seps = a.get(2, "separators", Value::none());
  if (!seps.is_none()) {
    if (!seps.is_array() || seps.as_array().size() != 2) fail("separators must be a (item, key) pair");
    o.item_sep = need_string(seps.as_array()[0], "separator");
    o.key_sep = need_string(seps.as_array()[1], "separator");
    if (o.item_sep.empty() || o.key_sep.empty()) fail("empty separators are not supported");
  }
  o.sort_keys = truthy(a.get(3, "sort_keys", Value(false)));
  return to_json(v, o);
}

Value items_of(const Value& v) {
  if (v.is_undefined()) return Array{};
  if (!v.is_object() || v.as_object().is_namespace) fail("can only get item pairs from a mapping");
  Array out;
  for (const auto& [k, val] : v.as_object().items) out.push_back(Value::tuple({Value(k), val}));
  return out;
}
Value f_items(Interp&, const Value& v, Args&) { return Value::generator(items_of(v).as_array()); }

Value f_default(Interp&, const Value& v, Args& a) {
  Value def = a.get(0, "default_value", Value(""));
  bool boolean = truthy(a.get(1, "boolean", Value(false)));
  if (v.is_undefined() || (boolean && !truthy(v))) return def;
  return v;
}

Value f_join(Interp&, const Value& v, Args& a) {
  std::string sep = to_str(a.get(0, "d", Value("")));
  Value attribute = a.get(1, "attribute", Value::none());
  std::string out;
  bool first = true;
  for (const Value& item : iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += to_str(attribute.is_none() ? item : attr_path(item, attribute));
  }
  return out;
}

Value f_replace(Interp&, const Value& v, Args& a) {
  Value count = a.get(2, "count", Value::none());
  return py_replace(to_str(v), to_str(a.get(0, "old")), to_str(a.get(1, "new")), count.is_none() ? -1 : to_int(count));
}

Value f_first(Interp&, const Value& v, Args&) {
  Array items = iterate(v);
  if (items.empty()) return Value::undefined("no first item, sequence was empty");
  return items.front();
}

Value f_last(Interp&, const Value& v, Args&) {
  if (v.is_undefined()) fail(v.undefined_hint().empty() ? "undefined value" : v.undefined_hint(), " is not reversible");
  if (v.is_generator()) fail("'generator' object is not reversible");
  Array items = iterate(v);
  if (items.empty()) return Value::undefined("no last item, sequence was empty");
  return items.back();
}

Value f_list(Interp&, const Value& v, Args&) { return iterate(v); }

Value f_map(Interp& in, const Value& v, Args& a) {
  Array out;
  if (a.has(0, "attribute") && a.a.positional.empty()) {
    Value attribute = a.get(0, "attribute");
    bool has_default = a.has(99, "default");
    Value def = a.get(99, "default");
    for (const Value& item : iterate(v)) {
      Value x = attr_path(item, attribute);
      out.push_back(x.is_undefined() && has_default ? def : x);
    }
    return Value::generator(std::move(out));
  }
  if (a.a.positional.empty()) return Value::generator(iterate(v));
  std::string name = need_string(a.a.positional[0], "filter name");
  if (!has_filter(name)) fail("no filter named '", name, "'");
  CallArgs rest;
  rest.positional.assign(a.a.positional.begin() + 1, a.a.positional.end());
  rest.keyword = a.a.keyword;
  for (const Value& item : iterate(v)) {
    CallArgs copy = rest;
    out.push_back(in.call_filter(name, item, copy));
  }
  return Value::generator(std::move(out));
}

Value f_select(Interp& in, const Value& v, Args& a) { return select_or_reject(in, v, a, false, true); }
Value f_reject(Interp& in, const Value& v, Args& a) { return select_or_reject(in, v, a, false, false); }
Value f_selectattr(Interp& in, const Value& v, Args& a) { return select_or_reject(in, v, a, true, true); }
Value f_rejectattr(Interp& in, const Value& v, Args& a) { return select_or_reject(in, v, a, true, false); }

Value f_reverse(Interp&, const Value& v, Args&) {
  if (v.is_string()) {
    std::u32string cs = utf8_decode(v.as_string());
    std::reverse(cs.begin(), cs.end());
    return utf8_encode(cs);
  }
  if (v.is_generator()) fail("'generator' object is not reversible");
  Array items = iterate(v);
  std::reverse(items.begin(), items.end());
  return Value::generator(std::move(items));
}

Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return ascii_lower(v.as_string());
  return v;
}

Value f_sort(Interp&, const Value& v, Args& a) {
  bool reverse = truthy(a.get(0, "reverse", Value(false)));
  bool cs = truthy(a.get(1, "case_sensitive", Value(false)));
  Value attribute = a.get(2, "attribute", Value::none());
  Array items = iterate(v);
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    Value kx = sort_key(attribute.is_none() ? x : attr_path(x, attribute), cs);
    Value ky = sort_key(attribute.is_none() ? y : attr_path(y, attribute), cs);
    return reverse ? compare(ky, kx) < 0 : compare(kx, ky) < 0;
  });
  return items;
}

Value f_dictsort(Interp&, const Value& v, Args& a) {
  bool cs = truthy(a.get(0, "case_sensitive", Value(false)));
  std::string by = to_str(a.get(1, "by", Value("key")));
  bool reverse = truthy(a.get(2, "reverse", Value(false)));
  Array items = items_of(v).as_array();
  size_t idx = by == "value" ? 1 : 0;
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    Value kx = sort_key(x.as_array()[idx], cs), ky = sort_key(y.as_array()[idx], cs);
    return reverse ? compare(ky, kx) < 0 : compare(kx, ky) < 0;
  });
  return items;
}

Value f_unique(Interp&, const Value& v, Args& a) {
  bool cs = truthy(a.get(0, "case_sensitive", Value(false)));
  Value attribute = a.get(1, "attribute", Value::none());
  Array out, seen;
  for (const Value& item : iterate(v)) {
    Value key = sort_key(attribute.is_none() ? item : attr_path(item, attribute), cs);
    bool dup = false;
    for (const Value& s : seen) dup |= equals(s, key);
    if (dup) continue;
    seen.push_back(key);
    out.push_back(item);
  }
  return Value::generator(std::move(out));
}

Value min_max(const Value& v, Args& a, bool want_max) {
  bool cs = truthy(a.get(0, "case_sensitive", Value(false)));
  Value attribute = a.get(1, "attribute", Value::none());
  Array items = iterate(v);
  if (items.empty()) return Value::undefined(want_max ? "no largest item, sequence was empty" : "no smallest item, sequence was empty");
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = sort_key(attribute.is_none() ? items[i] : attr_path(items[i], attribute), cs);
    Value b = sort_key(attribute.is_none() ? items[best] : attr_path(items[best], attribute), cs);
    if (want_max ? compare(k, b) > 0 : compare(k, b) < 0) best = i;
  }
  return items[best];
}
Value f_max(Interp&, const Value& v, Args& a) { return min_max(v, a, true); }
Value f_min(Interp&, const Value& v, Args& a) { return min_max(v, a, false); }

Value f_sum(Interp&, const Value& v, Args& a) {
  Value attribute = a.get(0, "attribute", Value::none());
  Value total = a.get(1, "start", Value(0));
  for (const Value& item : iterate(v)) total = binop("+", total, attribute.is_none() ? item : attr_path(item, attribute));
  return total;
}

Value f_abs(Interp&, const Value& v, Args&) {
  if (v.is_float()) return Value(std::fabs(v.as_float()));
  if (v.is_int() || v.is_bool()) return Value(to_int(v) < 0 ? -to_int(v) : to_int(v));
  fail("bad operand type for abs(): '", type_name(v), "'");
}

Value f_int(Interp&, const Value& v, Args& a) {
  Value def = a.get(0, "default", Value(0));
  if (v.is_int()) return v;
  if (v.is_bool()) return Value(to_int(v));
  if (v.is_float()) return std::isfinite(v.as_float()) ? Value(static_cast<int64_t>(v.as_float())) : def;
  if (v.is_string()) {
    std::string s = py_strip(v.as_string(), Value::none(), true, true);
    std::string t;
    for (char c : s)
      if (c != '_') t += c;
    char* end = nullptr;
    errno = 0;
    long long x = std::strtoll(t.c_str(), &end, 10);
    if (!t.empty() && end && *end == 0 && errno == 0) return Value(static_cast<int64_t>(x));
    double d = std::strtod(t.c_str(), &end);
    if (!t.empty() && end && *end == 0 && std::isfinite(d)) return Value(static_cast<int64_t>(d));
  }
  return def;
}

Value f_float(Interp&, const Value& v, Args& a) {
  Value def = a.get(0, "default", Value(0.0));
  if (v.is_float()) return v;
  if (v.is_int() || v.is_bool()) return Value(v.as_double());
  if (v.is_string()) {
    std::string s = py_strip(v.as_string(), Value::none(), true, true);
    char* end = nullptr;
    double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end && *end == 0) return Value(d);
  }
  return def;
}

Value f_round(Interp&, const Value& v, Args& a) {
  int64_t precision = to_int(a.get(0, "precision", Value(0)));
  std::string method = to_str(a.get(1, "method", Value("common")));
  double x = v.as_double();
  if (!is_num(v)) fail("round() needs a number");
  double m = std::pow(10.0, static_cast<double>(precision));
  double r;
  if (method == "common") r = std::nearbyint(x * m) / m;  // Python round(): half to even
  else if (method == "ceil") r = std::ceil(x * m) / m;
  else if (method == "floor") r = std::floor(x * m) / m;
  else fail("method must be common, ceil or floor");
  return Value(r);
}

Value f_indent(Interp&, const Value& v, Args& a) {
  Value width = a.get(0, "width", Value(4));
  std::string ind = width.is_string() ? width.as_string() : std::string(static_cast<size_t>(std::max<int64_t>(0, to_int(width))), ' ');
  bool first = truthy(a.get(1, "first", Value(false)));
  bool blank = truthy(a.get(2, "blank", Value(false)));
  std::string s = to_str(v) + "\n";
  std::vector<std::string> lines = py_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind) + lines[i];
  }
  if (first) rv = ind + rv;
  return rv;
}

Value f_attr(Interp&, const Value& v, Args& a) {
  std::string name = need_string(a.get(0, "name"), "attribute name");
  if (v.is_object() && !v.as_object().is_namespace) {
    if (is_dict_method(name)) return dict_method(v, name);
    return Value::undefined("'dict object' has no attribute '" + name + "'");
  }
  return get_attr(v, name);
}

Value f_format(Interp&, const Value& v, Args& a) {
  if (!a.a.positional.empty() && !a.a.keyword.empty()) fail("can't handle positional and keyword arguments at the same time");
  if (!a.a.keyword.empty()) return percent_format(to_str(v), make_object(a.a.keyword));
  return percent_format(to_str(v), Value::tuple(a.a.positional));
}

Value f_wordcount(Interp&, const Value& v, Args&) {
  return Value(static_cast<int64_t>(py_split(to_str(v), Value::none(), -1, false).size()));
}

const std::map<std::string, FilterFn>& filters() {
  static const std::map<std::string, FilterFn> table = {
      {"abs", f_abs},         {"attr", f_attr},           {"capitalize", f_capitalize}, {"count", f_length},
      {"d", f_default},       {"default", f_default},     {"dictsort", f_dictsort},     {"e", f_escape},
      {"escape", f_escape},   {"first", f_first},         {"float", f_float},           {"format", f_format},         {"indent", f_indent},
      {"int", f_int},         {"items", f_items},         {"join", f_join},             {"last", f_last},
      {"length", f_length},   {"list", f_list},           {"lower", f_lower},           {"map", f_map},
      {"max", f_max},         {"min", f_min},             {"reject", f_reject},         {"rejectattr", f_rejectattr},
      {"replace", f_replace}, {"reverse", f_reverse},     {"round", f_round},           {"safe", f_safe},
      {"select", f_select},   {"selectattr", f_selectattr}, {"sort", f_sort},           {"string", f_string},
      {"sum", f_sum},         {"title", f_title},         {"tojson", f_tojson},         {"trim", f_trim},
      {"unique", f_unique},   {"upper", f_upper},         {"wordcount", f_wordcount},
  };
  return table;
}

// --- tests ---------------------------------------------------------------------------------------

bool t_defined(Interp&, const Value& v, Args&) { return !v.is_undefined(); }
bool t_undefined(Interp&, const Value& v, Args&) { return v.is_undefined(); }
bool t_none(Interp&, const Value& v, Args&) { return v.is_none(); }
bool t_string(Interp&, const Value& v, Args&) { return v.is_string(); }
bool t_number(Interp&, const Value& v, Args&) { return is_num(v); }
bool t_integer(Interp&, const Value& v, Args&) { return v.is_int(); }
bool t_float(Interp&, const Value& v, Args&) { return v.is_float(); }
bool t_boolean(Interp&, const Value& v, Args&) { return v.is_bool(); }
bool t_true(Interp&, const Value& v, Args&) { return v.is_bool() && v.as_bool(); }
bool t_false(Interp&, const Value& v, Args&) { return v.is_bool() && !v.as_bool(); }
bool t_mapping(Interp&, const Value& v, Args&) { return v.is_object() && !v.as_object().is_namespace; }
bool t_iterable(Interp&, const Value& v, Args&) {
  return v.is_undefined() || v.is_string() || v.is_array() || (v.is_object() && !v.as_object().is_namespace);
}
bool t_sequence(Interp&, const Value& v, Args&) { return v.is_string() || v.is_array() || (v.is_object() && !v.as_object().is_namespace); }
bool t_callable(Interp&, const Value& v, Args&) { return v.is_function(); }
bool t_odd(Interp&, const Value& v, Args&) { return (to_int(v) % 2 + 2) % 2 == 1; }
bool t_even(Interp&, const Value& v, Args&) { return to_int(v) % 2 == 0; }
bool t_divisibleby(Interp&, const Value& v, Args& a) {
  int64_t n = to_int(a.get(0, "num"));
  if (n == 0) fail("integer division or modulo by zero");
  return to_int(v) % n == 0;
}
bool t_eq(Interp&, const Value& v, Args& a) { return equals(v, a.get(0, "other")); }
bool t_ne(Interp&, const Value& v, Args& a) { return !equals(v, a.get(0, "other")); }
bool t_lt(Interp&, const Value& v, Args& a) { return compare(v, a.get(0, "other")) < 0; }
bool t_le(Interp&, const Value& v, Args& a) { return compare(v, a.get(0, "other")) <= 0; }
bool t_gt(Interp&, const Value& v, Args& a) { return compare(v, a.get(0, "other")) > 0; }
bool t_ge(Interp&, const Value& v, Args& a) { return compare(v, a.get(0, "other")) >= 0; }
bool t_in(Interp&, const Value& v, Args& a) { return contains(a.get(0, "seq"), v); }
bool t_sameas(Interp&, const Value& v, Args& a) {
  Value o = a.get(0, "other");
  if (v.type() != o.type()) return false;
  if (v.identity() || o.identity()) return v.identity() == o.identity();
  return equals(v, o);
}
bool t_lower(Interp&, const Value& v, Args&) {
  std::string s = to_str(v);
  return ascii_lower(s) == s && ascii_upper(s) != s;
}
bool t_upper(Interp&, const Value& v, Args&) {
  std::string s = to_str(v);
  return ascii_upper(s) == s && ascii_lower(s) != s;
}
bool t_escaped(Interp&, const Value&, Args&) { return false; }
bool t_filter(Interp&, const Value& v, Args&) { return v.is_string() && has_filter(v.as_string()); }
bool t_test(Interp&, const Value& v, Args&) { return v.is_string() && has_test(v.as_string()); }

const std::map<std::string, TestFn>& tests() {
  static const std::map<std::string, TestFn> table = {
      {"defined", t_defined},   {"undefined", t_undefined}, {"none", t_none},       {"string", t_string},
      {"number", t_number},     {"integer", t_integer},     {"float", t_float},     {"boolean", t_boolean},
      {"true", t_true},         {"false", t_false},         {"mapping", t_mapping}, {"iterable", t_iterable},
      {"sequence", t_sequence}, {"callable", t_callable},   {"odd", t_odd},         {"even", t_even},
      {"divisibleby", t_divisibleby}, {"eq", t_eq},         {"equalto", t_eq},      {"==", t_eq},
      {"ne", t_ne},             {"!=", t_ne},               {"lt", t_lt},           {"lessthan", t_lt},
      {"<", t_lt},              {"le", t_le},               {"<=", t_le},           {"gt", t_gt},
      {"greaterthan", t_gt},    {">", t_gt},                {"ge", t_ge},           {">=", t_ge},
      {"in", t_in},             {"sameas", t_sameas},       {"lower", t_lower},     {"upper", t_upper},
      {"escaped", t_escaped},   {"filter", t_filter},       {"test", t_test},
  };
  return table;
}

}  // namespace

bool has_filter(const std::string& name) { return filters().count(name) != 0; }
bool has_test(const std::string& name) { return tests().count(name) != 0; }

Template::Template(const std::string& source, const std::string& name) {
  try {
    program_ = parse_template(source, name);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // a bug, but a template must never take the process down
    throw Error(name + ": internal error while parsing: " + e.what());
  }
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  Interp in(*program_);
  try {
    return in.run(context);
  } catch (const RaisedError& e) {
    throw Error(e.what());
  } catch (const LocatedError& e) {
    throw Error(e.what());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(program_->name + ": internal error while rendering: " + e.what());
  }
}

int64_t live_scopes() { return g_live_scopes.load(); }

}  // namespace vireo::jinja
