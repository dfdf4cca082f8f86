#pragma once
// The values a Jinja template computes with. Chat templates are written against Python's jinja2, so
// every value behaves like the Python object jinja2 would see: None, bool, int, float, str, list,
// dict (insertion-ordered), a namespace() object, a callable, or jinja2's Undefined. Printing,
// comparison, truthiness and JSON dumping follow Python's rules, because the rendered prompt must
// match transformers' apply_chat_template byte for byte.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace vireo::jinja {

class Value;
struct ObjectData;
struct Function;

using Array = std::vector<Value>;

class Value {
 public:
  enum class Type : uint8_t { undefined, none, boolean, integer, floating, string, array, object, function };

  Value() = default;  // undefined
  Value(bool b) : type_(Type::boolean), b_(b) {}
  Value(int v) : type_(Type::integer), i_(v) {}
  Value(int64_t v) : type_(Type::integer), i_(v) {}
  Value(double v) : type_(Type::floating), f_(v) {}
  Value(std::string s) : type_(Type::string), s_(std::move(s)) {}
  Value(const char* s) : type_(Type::string), s_(s) {}
  Value(Array a) : type_(Type::array), a_(std::make_shared<const Array>(std::move(a))) {}
  Value(std::shared_ptr<ObjectData> o) : type_(Type::object), o_(std::move(o)) {}
  Value(std::shared_ptr<const Function> f) : type_(Type::function), fn_(std::move(f)) {}

  // `hint` says why the value is undefined ("'dict object' has no attribute 'x'"), for errors.
  static Value undefined(std::string hint) {
    Value v;
    v.s_ = std::move(hint);
    return v;
  }
  static Value none() {
    Value v;
    v.type_ = Type::none;
    return v;
  }
  // A tuple prints as ('a', 1) rather than ['a', 1]; otherwise it is a list.
  static Value tuple(Array a) {
    Value v(std::move(a));
    v.b_ = true;
    return v;
  }
  // What jinja2's select/map/... filters return: a one-pass generator, which Python treats as
  // always true, without len(), not reversible and not JSON-serializable. Iterates like a list.
  static Value generator(Array a) {
    Value v(std::move(a));
    v.gen_ = true;
    return v;
  }

  Type type() const { return type_; }
  bool is_undefined() const { return type_ == Type::undefined; }
  bool is_none() const { return type_ == Type::none; }
  bool is_bool() const { return type_ == Type::boolean; }
  bool is_int() const { return type_ == Type::integer; }
  bool is_float() const { return type_ == Type::floating; }
  bool is_number() const { return type_ == Type::integer || type_ == Type::floating; }
  bool is_string() const { return type_ == Type::string; }
  bool is_array() const { return type_ == Type::array; }
  bool is_tuple() const { return type_ == Type::array && b_; }
  bool is_generator() const { return type_ == Type::array && gen_; }
  bool is_object() const { return type_ == Type::object; }
  bool is_function() const { return type_ == Type::function; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return i_; }
  double as_float() const { return f_; }
  // A number as a double (bools count as 0/1, as in Python).
  double as_double() const { return type_ == Type::floating ? f_ : static_cast<double>(i_ + (type_ == Type::boolean && b_)); }
  const std::string& as_string() const { return s_; }
  const std::string& undefined_hint() const { return s_; }
  const Array& as_array() const { return *a_; }
  ObjectData& as_object() const { return *o_; }
  const std::shared_ptr<ObjectData>& object_ptr() const { return o_; }
  const Function& as_function() const { return *fn_; }
  const void* identity() const;  // for `is sameas` on containers

 private:
  Type type_ = Type::undefined;
  bool b_ = false;  // the bool, or "this array is a tuple"
  bool gen_ = false;  // this array is a generator
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;  // the string, or the undefined hint
  std::shared_ptr<const Array> a_;
  std::shared_ptr<ObjectData> o_;
  std::shared_ptr<const Function> fn_;
};

// A dict keeps insertion order (Python 3.7+), which tojson and items() expose. Chat-template dicts
// are small, so a vector with linear lookup beats a hash map.
struct ObjectData {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;  // namespace() objects are the only mutable ones (`set ns.x = ...`)

  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value v);
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct Function {
  std::string name;
  std::function<Value(CallArgs&)> call;
};

Value make_object(std::vector<std::pair<std::string, Value>> items = {});
Value from_json(const nlohmann::ordered_json& j);

// Python semantics.
bool truthy(const Value& v);
bool equals(const Value& a, const Value& b);
// <0, 0, >0; throws vireo::Error for types Python cannot order.
int compare(const Value& a, const Value& b);
std::string to_str(const Value& v);   // str(v); Undefined prints as ""
std::string repr(const Value& v);     // repr(v)
std::string float_repr(double d);     // repr(float)
std::string type_name(const Value& v);  // Python's type name, for error messages

struct JsonOptions {
  int indent = -1;  // <0: single line
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::string item_sep;  // empty: Python's default for the indent mode
  std::string key_sep;
};
// json.dumps(v, ...) as transformers' tojson filter calls it.
std::string to_json(const Value& v, const JsonOptions& opts);

// UTF-8 helpers: Python strings index by code point.
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
size_t utf8_length(std::string_view s);
bool is_py_space(char32_t c);  // str.isspace()

}  // namespace vireo::jinja
