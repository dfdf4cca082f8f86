#include "text/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace vireo::jinja {

const void* Value::identity() const {
  if (a_) return a_.get();
  if (o_) return o_.get();
  if (fn_) return fn_.get();
  return nullptr;
}

const Value* ObjectData::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void ObjectData::set(const std::string& key, Value v) {
  for (auto& [k, old] : items)
    if (k == key) {
      old = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

Value make_object(std::vector<std::pair<std::string, Value>> items) {
  auto o = std::make_shared<ObjectData>();
  o->items = std::move(items);
  return Value(std::move(o));
}

Value from_json(const nlohmann::ordered_json& j) {
  using T = nlohmann::ordered_json::value_t;
  switch (j.type()) {
    case T::null: return Value::none();
    case T::boolean: return Value(j.get<bool>());
    case T::number_integer: return Value(j.get<int64_t>());
    case T::number_unsigned: return Value(static_cast<int64_t>(j.get<uint64_t>()));
    case T::number_float: return Value(j.get<double>());
    case T::string: return Value(j.get<std::string>());
    case T::array: {
      Array a;
      a.reserve(j.size());
      for (const auto& e : j) a.push_back(from_json(e));
      return Value(std::move(a));
    }
    case T::object: {
      std::vector<std::pair<std::string, Value>> items;
      items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) items.emplace_back(it.key(), from_json(it.value()));
      return make_object(std::move(items));
    }
    default: return Value::none();
  }
}

bool truthy(const Value& v) {
  switch (v.type()) {
    case Value::Type::undefined:
    case Value::Type::none: return false;
    case Value::Type::boolean: return v.as_bool();
    case Value::Type::integer: return v.as_int() != 0;
    case Value::Type::floating: return v.as_float() != 0.0;
    case Value::Type::string: return !v.as_string().empty();
    case Value::Type::array: return v.is_generator() || !v.as_array().empty();
    case Value::Type::object: return v.as_object().is_namespace || !v.as_object().items.empty();
    case Value::Type::function: return true;
  }
  return false;
}

static bool numeric(const Value& v) { return v.is_number() || v.is_bool(); }

bool equals(const Value& a, const Value& b) {
  if (numeric(a) && numeric(b)) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    int64_t x = a.is_bool() ? a.as_bool() : a.as_int();
    int64_t y = b.is_bool() ? b.as_bool() : b.as_int();
    return x == y;
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Value::Type::undefined:
    case Value::Type::none: return true;
    case Value::Type::string: return a.as_string() == b.as_string();
    case Value::Type::array: {
      if (a.is_tuple() != b.is_tuple()) return false;
      const Array& x = a.as_array();
      const Array& y = b.as_array();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!equals(x[i], y[i])) return false;
      return true;
    }
    case Value::Type::object: {
      const ObjectData& x = a.as_object();
      const ObjectData& y = b.as_object();
      if (x.is_namespace || y.is_namespace) return &x == &y;
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* w = y.find(k);
        if (!w || !equals(v, *w)) return false;
      }
      return true;
    }
    case Value::Type::function: return a.identity() == b.identity();
    default: return false;
  }
}

int compare(const Value& a, const Value& b) {
  if (numeric(a) && numeric(b)) {
    if (a.is_float() || b.is_float()) {
      double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    int64_t x = a.is_bool() ? a.as_bool() : a.as_int();
    int64_t y = b.is_bool() ? b.as_bool() : b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    // UTF-8 byte order is code point order, which is Python's string order.
    int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_array() && b.is_array() && a.is_tuple() == b.is_tuple()) {
    const Array& x = a.as_array();
    const Array& y = b.as_array();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equals(x[i], y[i])) continue;
      return compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  fail("'<' not supported between instances of '", type_name(a), "' and '", type_name(b), "'");
}

std::string type_name(const Value& v) {
  switch (v.type()) {
    case Value::Type::undefined: return "Undefined";
    case Value::Type::none: return "NoneType";
    case Value::Type::boolean: return "bool";
    case Value::Type::integer: return "int";
    case Value::Type::floating: return "float";
    case Value::Type::string: return "str";
    case Value::Type::array: return v.is_generator() ? "generator" : v.is_tuple() ? "tuple" : "list";
    case Value::Type::object: return v.as_object().is_namespace ? "Namespace" : "dict";
    case Value::Type::function: return "function";
  }
  return "?";
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout: fixed notation when the decimal exponent
  // lies in (-4, 16], scientific otherwise.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), std::fabs(d), std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  size_t e = sci.find('e');
  std::string digits;
  for (size_t i = 0; i < e; ++i)
    if (sci[i] != '.') digits += sci[i];
  int exp10 = std::stoi(sci.substr(e + 1));
  int decpt = exp10 + 1;
  std::string out = d < 0 ? "-" : "";
  int nd = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(-decpt, '0') + digits;
    } else if (decpt >= nd) {
      out += digits + std::string(decpt - nd, '0') + ".0";
    } else {
      out += digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out += digits.substr(0, 1);
    if (nd > 1) out += "." + digits.substr(1);
    int x = decpt - 1;
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", x < 0 ? '-' : '+', x < 0 ? -x : x);
    out += eb;
  }
  return out;
}

// --- UTF-8 ---------------------------------------------------------------------------------------

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) {
      out.push_back(c);  // invalid byte: keep it as a code point rather than fail
      ++i;
      continue;
    }
    char32_t cp = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
    bool ok = true;
    for (int k = 1; k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0) != 0x80) ok = false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    if (!ok) {
      out.push_back(c);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

static void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xc0) != 0x80;
  return n;
}

bool is_py_space(char32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f ||
         c == 0x3000;
}

// --- str() and repr() ----------------------------------------------------------------------------

static bool py_printable(char32_t c) {
  if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f)) return false;
  if ((c >= 0x205f && c <= 0x2064) || c == 0x3000 || c == 0xfeff) return false;
  if (c >= 0xe000 && c <= 0xf8ff) return false;
  return true;
}

static std::string repr_string(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : utf8_decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!py_printable(c)) {
      char buf[16];
      if (c < 0x100) std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      else std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      append_utf8(out, c);
    }
  }
  out += quote;
  return out;
}

static std::string repr_impl(const Value& v, bool top_str);

static std::string repr_dict(const ObjectData& o) {
  std::string out = "{";
  bool first = true;
  for (const auto& [k, val] : o.items) {
    if (!first) out += ", ";
    first = false;
    out += repr_string(k) + ": " + repr_impl(val, false);
  }
  return out + "}";
}

static std::string repr_impl(const Value& v, bool top_str) {
  switch (v.type()) {
    case Value::Type::undefined: return top_str ? "" : "Undefined";
    case Value::Type::none: return "None";
    case Value::Type::boolean: return v.as_bool() ? "True" : "False";
    case Value::Type::integer: return std::to_string(v.as_int());
    case Value::Type::floating: return float_repr(v.as_float());
    case Value::Type::string: return top_str ? v.as_string() : repr_string(v.as_string());
    case Value::Type::array: {
      if (v.is_generator()) return "<generator object>";
      const Array& a = v.as_array();
      std::string out = v.is_tuple() ? "(" : "[";
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += ", ";
        out += repr_impl(a[i], false);
      }
      if (v.is_tuple() && a.size() == 1) out += ",";
      return out + (v.is_tuple() ? ")" : "]");
    }
    case Value::Type::object:
      if (v.as_object().is_namespace) return "<Namespace " + repr_dict(v.as_object()) + ">";
      return repr_dict(v.as_object());
    case Value::Type::function: return "<function " + v.as_function().name + ">";
  }
  return "";
}

std::string to_str(const Value& v) { return repr_impl(v, true); }
std::string repr(const Value& v) { return repr_impl(v, false); }

// --- json.dumps ----------------------------------------------------------------------------------

static void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  auto hex4 = [&](unsigned x) {
    char buf[16];
    std::snprintf(buf, sizeof(buf), "\\u%04x", x);
    out += buf;
  };
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          hex4(c);
        } else if (ensure_ascii && c > 0x7f) {
          if (c >= 0x10000) {
            char32_t v = c - 0x10000;
            hex4(0xd800 | (v >> 10));
            hex4(0xdc00 | (v & 0x3ff));
          } else {
            hex4(c);
          }
        } else {
          append_utf8(out, c);
        }
    }
  }
  out += '"';
}

static void json_impl(std::string& out, const Value& v, const JsonOptions& o, int level) {
  const std::string item_sep = !o.item_sep.empty() ? o.item_sep : (o.indent >= 0 ? "," : ", ");
  const std::string key_sep = !o.key_sep.empty() ? o.key_sep : ": ";
  auto newline = [&](int lvl) {
    if (o.indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(o.indent) * lvl, ' ');
  };
  switch (v.type()) {
    case Value::Type::none: out += "null"; return;
    case Value::Type::boolean: out += v.as_bool() ? "true" : "false"; return;
    case Value::Type::integer: out += std::to_string(v.as_int()); return;
    case Value::Type::floating: {
      double d = v.as_float();
      if (std::isnan(d)) out += "NaN";
      else if (std::isinf(d)) out += d < 0 ? "-Infinity" : "Infinity";
      else out += float_repr(d);
      return;
    }
    case Value::Type::string: json_string(out, v.as_string(), o.ensure_ascii); return;
    case Value::Type::array: {
      if (v.is_generator()) fail("Object of type generator is not JSON serializable");
      const Array& a = v.as_array();
      if (a.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += item_sep;
        newline(level + 1);
        json_impl(out, a[i], o, level + 1);
      }
      newline(level);
      out += ']';
      return;
    }
    case Value::Type::object: {
      const ObjectData& obj = v.as_object();
      if (obj.is_namespace) fail("Object of type Namespace is not JSON serializable");
      if (obj.items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : obj.items) items.push_back(&kv);
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        newline(level + 1);
        json_string(out, items[i]->first, o.ensure_ascii);
        out += key_sep;
        json_impl(out, items[i]->second, o, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
    case Value::Type::undefined: fail("Object of type Undefined is not JSON serializable");
    case Value::Type::function: fail("Object of type function is not JSON serializable");
  }
}

std::string to_json(const Value& v, const JsonOptions& opts) {
  std::string out;
  json_impl(out, v, opts, 0);
  return out;
}

}  // namespace vireo::jinja
