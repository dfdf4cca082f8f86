// Lexer and parser. Both follow jinja2's own (lexer.py, parser.py) closely, because whitespace
// handling (trim_blocks, lstrip_blocks, `-`/`+` markers) and operator precedence decide the exact
// bytes a chat template produces.
#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "text/jinja_ast.h"

namespace vireo::jinja {

std::string Program::location(size_t pos) const {
  auto it = std::upper_bound(line_starts.begin(), line_starts.end(), pos);
  size_t line = static_cast<size_t>(it - line_starts.begin());  // 1-based
  size_t col = pos - line_starts[line - 1] + 1;
  return str(name, ":", line, ":", col);
}

namespace {

enum class Tok { data, block_begin, block_end, var_begin, var_end, name, string, integer, floating, op, eof };

struct Token {
  Tok type;
  std::string text;
  int64_t ival = 0;
  double fval = 0;
  size_t pos = 0;
};

const char* tok_desc(Tok t) {
  switch (t) {
    case Tok::data: return "template data";
    case Tok::block_begin: return "begin of statement block";
    case Tok::block_end: return "end of statement block";
    case Tok::var_begin: return "begin of print statement";
    case Tok::var_end: return "end of print statement";
    case Tok::name: return "name";
    case Tok::string: return "string";
    case Tok::integer: return "integer";
    case Tok::floating: return "float";
    case Tok::op: return "operator";
    case Tok::eof: return "end of template";
  }
  return "?";
}

std::string describe(const Token& t) {
  if (t.type == Tok::name || t.type == Tok::op) return "'" + t.text + "'";
  if (t.type == Tok::string) return "string";
  if (t.type == Tok::integer || t.type == Tok::floating) return "number";
  return tok_desc(t.type);
}

// Length of `s` without trailing Python whitespace (str.rstrip()).
size_t py_rstrip_len(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    std::u32string cp = utf8_decode(s.substr(start, end - start));
    if (cp.size() != 1 || !is_py_space(cp[0])) break;
    end = start;
  }
  return end;
}

bool all_py_space(std::string_view s) {
  if (s.empty()) return false;
  for (char32_t c : utf8_decode(s))
    if (!is_py_space(c)) return false;
  return true;
}

size_t skip_py_space(std::string_view s, size_t pos) {
  while (pos < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[pos]);
    if (c < 0x80) {
      if (!is_py_space(c)) break;
      ++pos;
      continue;
    }
    size_t len = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    std::u32string cp = utf8_decode(s.substr(pos, len));
    if (cp.size() != 1 || !is_py_space(cp[0])) break;
    pos += len;
  }
  return pos;
}

bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || (c >= '0' && c <= '9'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

class Lexer {
 public:
  Lexer(const Program& prog) : prog_(prog), s_(prog.source) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < s_.size()) {
      size_t tag = find_tag(pos);
      if (tag == std::string::npos) {
        push(Tok::data, s_.substr(pos), pos);
        break;
      }
      std::string_view text(s_.data() + pos, tag - pos);
      char kind = s_[tag + 1];  // '%', '{' or '#'
      size_t raw_end = kind == '%' ? match_raw_begin(tag) : 0;
      char sign = s_.size() > tag + 2 && (s_[tag + 2] == '-' || s_[tag + 2] == '+') ? s_[tag + 2] : 0;
      text = strip_text(text, sign, kind != '{', line_starting);
      if (!text.empty()) push(Tok::data, std::string(text), pos);
      size_t body = tag + 2 + (sign ? 1 : 0);
      if (raw_end) {
        pos = lex_raw(raw_end, line_starting);
      } else if (kind == '#') {
        pos = lex_comment(tag, body, line_starting);
      } else {
        pos = lex_tag(tag, body, kind == '%', line_starting);
      }
    }
    tokens_.push_back(Token{Tok::eof, "", 0, 0, s_.size()});
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void error(size_t pos, const std::string& msg) { fail(prog_.location(pos), ": ", msg); }

  void push(Tok t, std::string text, size_t pos) { tokens_.push_back(Token{t, std::move(text), 0, 0, pos}); }

  size_t find_tag(size_t pos) const {
    while (true) {
      size_t p = s_.find('{', pos);
      if (p == std::string::npos || p + 1 >= s_.size()) return std::string::npos;
      char c = s_[p + 1];
      if (c == '%' || c == '{' || c == '#') return p;
      pos = p + 1;
    }
  }

  // jinja2's data handling before a tag: `-` strips all whitespace; otherwise lstrip_blocks
  // removes spaces between a line start and a block or comment tag.
  std::string_view strip_text(std::string_view text, char sign, bool is_block, bool line_starting) const {
    if (sign == '-') return text.substr(0, py_rstrip_len(text));
    if (sign != '+' && is_block) {
      size_t nl = text.rfind('\n');
      size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting) && all_py_space(text.substr(l_pos))) return text.substr(0, l_pos);
    }
    return text;
  }

  // `{%[-+]?\s*raw\s*(-%}\s*|%})` at `tag`: returns the offset after it, or 0.
  size_t match_raw_begin(size_t tag) const {
    size_t p = tag + 2;
    if (p < s_.size() && (s_[p] == '-' || s_[p] == '+')) ++p;
    p = skip_py_space(s_, p);
    if (s_.compare(p, 3, "raw") != 0) return 0;
    p = skip_py_space(s_, p + 3);
    if (s_.compare(p, 3, "-%}") == 0) return skip_py_space(s_, p + 3);
    if (s_.compare(p, 2, "%}") == 0) return p + 2;
    return 0;
  }

  // Block end at p: returns offset after it (with trim_blocks' newline or `-`'s whitespace), or 0.
  size_t match_block_end(size_t p, char closer) const {
    if (s_.compare(p, 1, "+") == 0 && p + 2 < s_.size() + 0 && s_[p + 1] == closer && s_[p + 2] == '}' &&
        closer != '}')
      return p + 3;
    if (p + 2 < s_.size() && s_[p] == '-' && s_[p + 1] == closer && s_[p + 2] == '}') return skip_py_space(s_, p + 3);
    if (p + 1 < s_.size() && s_[p] == closer && s_[p + 1] == '}') {
      size_t e = p + 2;
      if (closer != '}' && e < s_.size() && s_[e] == '\n') ++e;  // trim_blocks (not for {{ }})
      return e;
    }
    return 0;
  }

  size_t lex_comment(size_t tag, size_t body, bool& line_starting) {
    size_t q = s_.find("#}", body);
    if (q == std::string::npos) error(tag, "missing end of comment tag");
    size_t end;
    if (q > body && s_[q - 1] == '+') end = q + 2;
    else if (q > body && s_[q - 1] == '-') end = skip_py_space(s_, q + 2);
    else end = q + 2 + (q + 2 < s_.size() && s_[q + 2] == '\n');
    line_starting = s_[end - 1] == '\n';
    return end;
  }

  size_t lex_raw(size_t start, bool& line_starting) {
    line_starting = s_[start - 1] == '\n';
    size_t p = start;
    while (true) {
      size_t q = s_.find("{%", p);
      if (q == std::string::npos) error(start, "missing end of raw directive");
      size_t r = q + 2;
      char sign = 0;
      if (r < s_.size() && (s_[r] == '-' || s_[r] == '+')) sign = s_[r++];
      r = skip_py_space(s_, r);
      if (s_.compare(r, 6, "endraw") == 0) {
        size_t e = match_block_end(skip_py_space(s_, r + 6), '%');
        if (e) {
          std::string_view text(s_.data() + start, q - start);
          text = strip_text(text, sign, true, line_starting);
          if (!text.empty()) push(Tok::data, std::string(text), start);
          line_starting = s_[e - 1] == '\n';
          return e;
        }
      }
      p = q + 2;
    }
  }

  size_t lex_tag(size_t tag, size_t p, bool block, bool& line_starting) {
    push(block ? Tok::block_begin : Tok::var_begin, "", tag);
    std::vector<char> balance;
    while (true) {
      if (p >= s_.size()) error(tag, block ? "unexpected end of template, expected '%}'" : "unexpected end of template, expected '}}'");
      if (balance.empty()) {
        size_t e = match_block_end(p, block ? '%' : '}');
        if (e) {
          push(block ? Tok::block_end : Tok::var_end, "", p);
          line_starting = s_[e - 1] == '\n';
          return e;
        }
      }
      char c = s_[p];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v') {
        ++p;
        continue;
      }
      if (is_digit(c)) {
        p = lex_number(p);
        continue;
      }
      if (is_name_start(c)) {
        size_t e = p;
        while (e < s_.size() && is_name_char(s_[e])) ++e;
        push(Tok::name, s_.substr(p, e - p), p);
        p = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        p = lex_string(p);
        continue;
      }
      static const char* ops2[] = {"//", "**", "==", "!=", ">=", "<="};
      std::string op;
      for (const char* o : ops2)
        if (s_.compare(p, 2, o) == 0) op = o;
      if (op.empty() && std::strchr("+-/*%~[](){}><=.:|,;", c) && c != 0) op = std::string(1, c);
      if (op.empty()) error(p, str("unexpected char '", c, "'"));
      if (op == "(" || op == "[" || op == "{") {
        balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
      } else if (op == ")" || op == "]" || op == "}") {
        if (balance.empty()) error(p, "unexpected '" + op + "'");
        if (balance.back() != op[0]) error(p, str("unexpected '", op, "', expected '", balance.back(), "'"));
        balance.pop_back();
      }
      push(Tok::op, op, p);
      p += op.size();
    }
  }

  size_t lex_number(size_t p) {
    size_t start = p;
    auto digits = [&](size_t q) {
      size_t e = q;
      while (e < s_.size() && (is_digit(s_[e]) || (s_[e] == '_' && e + 1 < s_.size() && is_digit(s_[e + 1]) && e > q))) ++e;
      return e;
    };
    size_t e = digits(p);
    bool is_float = false;
    if (e + 1 < s_.size() && s_[e] == '.' && is_digit(s_[e + 1])) {
      e = digits(e + 1);
      is_float = true;
    }
    if (e < s_.size() && (s_[e] == 'e' || s_[e] == 'E')) {
      size_t q = e + 1;
      if (q < s_.size() && (s_[q] == '+' || s_[q] == '-')) ++q;
      if (q < s_.size() && is_digit(s_[q])) {
        e = digits(q);
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = start; i < e; ++i)
      if (s_[i] != '_') text += s_[i];
    Token t{is_float ? Tok::floating : Tok::integer, text, 0, 0, start};
    if (is_float) {
      t.fval = std::strtod(text.c_str(), nullptr);
    } else {
      // jinja2 reads `0(_?0)*` or `[1-9]...`: a leading zero stands alone.
      if (text.size() > 1 && text[0] == '0') {
        size_t z = start;
        while (z < e && (s_[z] == '0' || s_[z] == '_')) ++z;
        e = z;
        text = "0";
      }
      errno = 0;
      t.ival = static_cast<int64_t>(std::strtoull(text.c_str(), nullptr, 10));
      if (text.size() > 18) error(start, "integer literal too large");
    }
    tokens_.push_back(std::move(t));
    return e;
  }

  // Python string literal, unescaped the way jinja2 does (unicode-escape).
  size_t lex_string(size_t p) {
    char q = s_[p];
    size_t i = p + 1;
    std::string out;
    while (true) {
      if (i >= s_.size()) error(p, "unterminated string");
      char c = s_[i];
      if (c == q) break;
      if (c != '\\') {
        out += c;
        ++i;
        continue;
      }
      if (i + 1 >= s_.size()) error(p, "unterminated string");
      char e = s_[i + 1];
      i += 2;
      auto hex = [&](int n) -> char32_t {
        if (i + n > s_.size()) error(p, "truncated \\x escape");
        char32_t v = 0;
        for (int k = 0; k < n; ++k) {
          char h = s_[i + k];
          int d = is_digit(h) ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
          if (d < 0) error(p, "truncated escape in string");
          v = v * 16 + d;
        }
        i += n;
        return v;
      };
      switch (e) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x': out += utf8_encode(std::u32string(1, hex(2))); break;
        case 'u': out += utf8_encode(std::u32string(1, hex(4))); break;
        case 'U': {
          char32_t v = hex(8);
          if (v > 0x10ffff) error(p, "illegal Unicode character in string");
          out += utf8_encode(std::u32string(1, v));
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            char32_t v = e - '0';
            for (int k = 0; k < 2 && i < s_.size() && s_[i] >= '0' && s_[i] <= '7'; ++k) v = v * 8 + (s_[i++] - '0');
            out += utf8_encode(std::u32string(1, v));
          } else {
            out += '\\';  // unknown escapes stay as written, as in Python
            out += e;
          }
      }
    }
    push(Tok::string, out, p);
    return i + 1;
  }

  const Program& prog_;
  const std::string& s_;
  std::vector<Token> tokens_;
};

// --- Parser --------------------------------------------------------------------------------------

class Parser {
 public:
  Parser(const Program& prog, std::vector<Token> tokens) : prog_(prog), t_(std::move(tokens)) {}

  Body parse_all() {
    Body body = subparse({});
    return body;
  }

 private:
  [[noreturn]] void error(size_t pos, const std::string& msg) { fail(prog_.location(pos), ": ", msg); }
  [[noreturn]] void error_here(const std::string& msg) { error(cur().pos, msg); }

  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  void advance() {
    if (i_ + 1 < t_.size()) ++i_;
  }
  bool is_op(const char* op) const { return cur().type == Tok::op && cur().text == op; }
  bool is_name(const char* n) const { return cur().type == Tok::name && cur().text == n; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    advance();
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    advance();
    return true;
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) error_here(str("expected '", op, "', got ", describe(cur())));
  }
  void expect(Tok t) {
    if (cur().type != t) error_here(str("expected ", tok_desc(t), ", got ", describe(cur())));
    advance();
  }
  std::string expect_name() {
    if (cur().type != Tok::name) error_here(str("expected a name, got ", describe(cur())));
    std::string n = cur().text;
    advance();
    return n;
  }

  static ExprPtr node(ExprKind k, size_t pos) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->pos = pos;
    return e;
  }
  static StmtPtr stmt(StmtKind k, size_t pos) {
    auto s = std::make_unique<Stmt>();
    s->kind = k;
    s->pos = pos;
    return s;
  }

  struct DepthGuard {
    Parser& p;
    DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > 200) p.error_here("template nested too deeply");
    }
    ~DepthGuard() { --p.depth_; }
  };

  // Statements until a block tag whose name is in `ends`; leaves the cursor on that name.
  Body subparse(const std::vector<std::string>& ends) {
    DepthGuard g(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      switch (t.type) {
        case Tok::eof:
          if (!ends.empty()) {
            std::string all;
            for (const auto& e : ends) all += (all.empty() ? "'" : " or '") + e + "'";
            error(t.pos, "unexpected end of template, expected " + all);
          }
          return body;
        case Tok::data: {
          auto s = stmt(StmtKind::text, t.pos);
          s->text = t.text;
          body.push_back(std::move(s));
          advance();
          break;
        }
        case Tok::var_begin: {
          auto s = stmt(StmtKind::print, t.pos);
          advance();
          s->expr = parse_tuple(true, {});
          expect(Tok::var_end);
          body.push_back(std::move(s));
          break;
        }
        case Tok::block_begin: {
          advance();
          if (cur().type == Tok::name && std::find(ends.begin(), ends.end(), cur().text) != ends.end()) return body;
          body.push_back(parse_statement());
          break;
        }
        default: error(t.pos, "unexpected " + describe(t));
      }
    }
  }

  // After `{% name ... %}` body: consume `{% end... %}` (cursor on the end name).
  void end_block() {
    advance();
    expect(Tok::block_end);
  }

  StmtPtr parse_statement() {
    if (cur().type != Tok::name) error_here("tag name expected, got " + describe(cur()));
    const std::string tag = cur().text;
    size_t pos = cur().pos;
    advance();
    if (tag == "if") return parse_if(pos);
    if (tag == "for") return parse_for(pos);
    if (tag == "set") return parse_set(pos);
    if (tag == "macro") return parse_macro(pos);
    if (tag == "call") return parse_call_block(pos);
    if (tag == "filter") return parse_filter_block(pos);
    if (tag == "with") return parse_with(pos);
    if (tag == "generation") {  // transformers' assistant-mask tag: renders its body unchanged
      auto s = stmt(StmtKind::scope, pos);
      expect(Tok::block_end);
      s->body = subparse({"endgeneration"});
      end_block();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) error(pos, "'" + tag + "' outside of a loop");
      expect(Tok::block_end);
      return stmt(tag == "break" ? StmtKind::break_ : StmtKind::continue_, pos);
    }
    static const char* unsupported[] = {"include", "import", "from", "extends", "block", "do", "autoescape", "trans"};
    for (const char* u : unsupported)
      if (tag == u) error(pos, "unsupported tag '" + tag + "'");
    error(pos, "unknown tag '" + tag + "'");
  }

  StmtPtr parse_if(size_t pos) {
    auto s = stmt(StmtKind::if_, pos);
    while (true) {
      ExprPtr cond = parse_tuple(false, {});
      expect(Tok::block_end);
      Body body = subparse({"elif", "else", "endif"});
      s->branches.emplace_back(std::move(cond), std::move(body));
      if (is_name("elif")) {
        advance();
        continue;
      }
      if (is_name("else")) {
        advance();
        expect(Tok::block_end);
        s->else_body = subparse({"endif"});
      }
      end_block();
      return s;
    }
  }

  StmtPtr parse_for(size_t pos) {
    auto s = stmt(StmtKind::for_, pos);
    s->target = parse_assign_target(false, {"in"});
    if (!skip_name("in")) error_here("expected 'in', got " + describe(cur()));
    s->expr = parse_tuple(false, {"recursive"});
    if (skip_name("if")) s->cond = parse_expression(true);
    if (is_name("recursive")) error_here("recursive for loops are not supported");
    expect(Tok::block_end);
    ++loop_depth_;
    s->body = subparse({"endfor", "else"});
    --loop_depth_;
    if (is_name("else")) {
      advance();
      expect(Tok::block_end);
      s->else_body = subparse({"endfor"});
    }
    end_block();
    return s;
  }

  StmtPtr parse_set(size_t pos) {
    ExprPtr target = parse_assign_target(true, {});
    if (skip_op("=")) {
      auto s = stmt(StmtKind::set, pos);
      s->target = std::move(target);
      s->expr = parse_tuple(true, {});
      expect(Tok::block_end);
      return s;
    }
    auto s = stmt(StmtKind::set_block, pos);
    s->target = std::move(target);
    parse_filter_chain(s->filters);
    expect(Tok::block_end);
    s->body = subparse({"endset"});
    end_block();
    return s;
  }

  void parse_filter_chain(std::vector<ExprPtr>& out) {
    while (skip_op("|")) out.push_back(parse_filter(nullptr));
  }

  void parse_params(std::vector<MacroParam>& params) {
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      MacroParam p;
      p.name = expect_name();
      if (skip_op("=")) p.default_value = parse_expression(true);
      else if (!params.empty() && params.back().default_value) error_here("non-default argument follows default argument");
      params.push_back(std::move(p));
    }
    advance();
  }

  StmtPtr parse_macro(size_t pos) {
    auto s = stmt(StmtKind::macro, pos);
    s->text = expect_name();
    parse_params(s->params);
    expect(Tok::block_end);
    int saved = loop_depth_;
    loop_depth_ = 0;
    size_t first = i_;
    s->body = subparse({"endmacro"});
    scan_special_names(first, i_, *s);
    loop_depth_ = saved;
    end_block();
    return s;
  }

  // jinja2 decides from a macro's body whether it takes varargs, kwargs and caller.
  void scan_special_names(size_t from, size_t to, Stmt& s) const {
    for (size_t k = from; k < to; ++k) {
      if (t_[k].type != Tok::name) continue;
      if (k > 0 && t_[k - 1].type == Tok::op && t_[k - 1].text == ".") continue;
      if (t_[k].text == "varargs") s.uses_varargs = true;
      if (t_[k].text == "kwargs") s.uses_kwargs = true;
      if (t_[k].text == "caller") s.uses_caller = true;
    }
  }

  StmtPtr parse_call_block(size_t pos) {
    auto s = stmt(StmtKind::call_block, pos);
    if (is_op("(")) parse_params(s->params);
    s->expr = parse_expression(true);
    if (s->expr->kind != ExprKind::call) error(s->expr->pos, "expected call");
    expect(Tok::block_end);
    int saved = loop_depth_;
    loop_depth_ = 0;
    size_t first = i_;
    s->body = subparse({"endcall"});
    scan_special_names(first, i_, *s);
    loop_depth_ = saved;
    end_block();
    return s;
  }

  StmtPtr parse_filter_block(size_t pos) {
    auto s = stmt(StmtKind::filter_block, pos);
    s->filters.push_back(parse_filter(nullptr));
    parse_filter_chain(s->filters);
    expect(Tok::block_end);
    s->body = subparse({"endfilter"});
    end_block();
    return s;
  }

  StmtPtr parse_with(size_t pos) {
    auto s = stmt(StmtKind::with, pos);
    while (cur().type != Tok::block_end) {
      if (!s->assignments.empty()) expect_op(",");
      std::string name = expect_name();
      expect_op("=");
      s->assignments.emplace_back(name, parse_expression(true));
    }
    expect(Tok::block_end);
    s->body = subparse({"endwith"});
    end_block();
    return s;
  }

  // Assignment targets: a name, a tuple of names, or (for set) namespace.attr.
  ExprPtr parse_assign_target(bool with_namespace, const std::vector<std::string>& extra_end) {
    size_t pos = cur().pos;
    if (with_namespace && cur().type == Tok::name && peek().type == Tok::op && peek().text == ".") {
      auto obj = node(ExprKind::name, pos);
      obj->name = cur().text;
      advance();
      advance();
      auto e = node(ExprKind::getattr, pos);
      e->name = expect_name();
      e->args.push_back(std::move(obj));
      return e;
    }
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        is_tuple = true;
        if (is_tuple_end(extra_end)) break;
      }
      if (cur().type != Tok::name) error_here("can't assign to " + describe(cur()));
      auto n = node(ExprKind::name, cur().pos);
      n->name = cur().text;
      if (n->name == "true" || n->name == "false" || n->name == "none" || n->name == "True" || n->name == "False" || n->name == "None")
        error_here("can't assign to " + n->name);
      advance();
      items.push_back(std::move(n));
      if (!is_op(",")) break;
    }
    if (!is_tuple) return std::move(items[0]);
    auto t = node(ExprKind::tuple, pos);
    t->args = std::move(items);
    return t;
  }

  bool is_tuple_end(const std::vector<std::string>& extra_end) const {
    if (cur().type == Tok::var_end || cur().type == Tok::block_end || cur().type == Tok::eof) return true;
    if (is_op(")")) return true;
    if (cur().type == Tok::name)
      for (const auto& e : extra_end)
        if (cur().text == e) return true;
    return false;
  }

  ExprPtr parse_tuple(bool with_condexpr, const std::vector<std::string>& extra_end, bool explicit_parens = false) {
    size_t pos = cur().pos;
    std::vector<ExprPtr> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      args.push_back(parse_expression(with_condexpr));
      if (is_op(",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parens) error_here("expected an expression, got " + describe(cur()));
    }
    auto t = node(ExprKind::tuple, pos);
    t->args = std::move(args);
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    DepthGuard g(*this);
    size_t pos = cur().pos;
    ExprPtr e = parse_or();
    while (skip_name("if")) {
      auto c = node(ExprKind::cond, pos);
      c->args.push_back(parse_or());
      c->args.push_back(std::move(e));
      c->args.push_back(skip_name("else") ? parse_condexpr() : nullptr);
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(ExprKind k, size_t pos, ExprPtr a, ExprPtr b, std::string name = {}) {
    auto e = node(k, pos);
    e->name = std::move(name);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  ExprPtr parse_or() {
    size_t pos = cur().pos;
    ExprPtr e = parse_and();
    while (skip_name("or")) e = binary(ExprKind::or_, pos, std::move(e), parse_and());
    return e;
  }
  ExprPtr parse_and() {
    size_t pos = cur().pos;
    ExprPtr e = parse_not();
    while (skip_name("and")) e = binary(ExprKind::and_, pos, std::move(e), parse_not());
    return e;
  }
  ExprPtr parse_not() {
    DepthGuard g(*this);
    if (is_name("not")) {
      size_t pos = cur().pos;
      advance();
      auto e = node(ExprKind::not_, pos);
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    size_t pos = cur().pos;
    ExprPtr first = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> rest;
    while (true) {
      if (cur().type == Tok::op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" ||
                                    cur().text == ">" || cur().text == ">=")) {
        ops.push_back(cur().text);
        advance();
      } else if (is_name("in")) {
        ops.push_back("in");
        advance();
      } else if (is_name("not") && peek().type == Tok::name && peek().text == "in") {
        ops.push_back("notin");
        advance();
        advance();
      } else {
        break;
      }
      rest.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto e = node(ExprKind::compare, pos);
    e->args.push_back(std::move(first));
    for (auto& r : rest) e->args.push_back(std::move(r));
    e->ops = std::move(ops);
    return e;
  }
  ExprPtr parse_math1() {
    size_t pos = cur().pos;
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().text;
      advance();
      e = binary(ExprKind::binop, pos, std::move(e), parse_concat(), op);
    }
    return e;
  }
  ExprPtr parse_concat() {
    size_t pos = cur().pos;
    ExprPtr e = parse_math2();
    if (!is_op("~")) return e;
    auto c = node(ExprKind::concat, pos);
    c->args.push_back(std::move(e));
    while (skip_op("~")) c->args.push_back(parse_math2());
    return c;
  }
  ExprPtr parse_math2() {
    size_t pos = cur().pos;
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().text;
      advance();
      e = binary(ExprKind::binop, pos, std::move(e), parse_pow(), op);
    }
    return e;
  }
  ExprPtr parse_pow() {
    size_t pos = cur().pos;
    ExprPtr e = parse_unary(true);
    while (skip_op("**")) e = binary(ExprKind::binop, pos, std::move(e), parse_unary(true), "**");
    return e;
  }
  ExprPtr parse_unary(bool with_filter) {
    DepthGuard g(*this);
    size_t pos = cur().pos;
    ExprPtr e;
    if (skip_op("-")) {
      e = node(ExprKind::neg, pos);
      e->args.push_back(parse_unary(false));
    } else if (skip_op("+")) {
      e = node(ExprKind::pos, pos);
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    DepthGuard g(*this);
    const Token& t = cur();
    size_t pos = t.pos;
    switch (t.type) {
      case Tok::name: {
        auto e = node(ExprKind::literal, pos);
        if (t.text == "true" || t.text == "True") e->value = Value(true);
        else if (t.text == "false" || t.text == "False") e->value = Value(false);
        else if (t.text == "none" || t.text == "None") e->value = Value::none();
        else {
          e->kind = ExprKind::name;
          e->name = t.text;
        }
        advance();
        return e;
      }
      case Tok::string: {
        std::string s;
        while (cur().type == Tok::string) {  // adjacent literals concatenate
          s += cur().text;
          advance();
        }
        auto e = node(ExprKind::literal, pos);
        e->value = Value(std::move(s));
        return e;
      }
      case Tok::integer: {
        auto e = node(ExprKind::literal, pos);
        e->value = Value(t.ival);
        advance();
        return e;
      }
      case Tok::floating: {
        auto e = node(ExprKind::literal, pos);
        e->value = Value(t.fval);
        advance();
        return e;
      }
      case Tok::op:
        if (t.text == "(") {
          advance();
          ExprPtr e = parse_tuple(true, {}, true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          advance();
          auto e = node(ExprKind::list, pos);
          while (!is_op("]")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("]")) break;
            e->args.push_back(parse_expression(true));
          }
          advance();
          return e;
        }
        if (t.text == "{") {
          advance();
          auto e = node(ExprKind::dict, pos);
          while (!is_op("}")) {
            if (!e->args.empty()) expect_op(",");
            if (is_op("}")) break;
            e->args.push_back(parse_expression(true));
            expect_op(":");
            e->args.push_back(parse_expression(true));
          }
          advance();
          return e;
        }
        break;
      default: break;
    }
    error(pos, "unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".") || is_op("[")) e = parse_subscript(std::move(e));
      else if (is_op("(")) e = parse_call(std::move(e));
      else return e;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        advance();
        e = parse_filter(std::move(e));
      } else if (is_name("is")) {
        e = parse_test(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj) {
    size_t pos = cur().pos;
    if (skip_op(".")) {
      if (cur().type == Tok::name) {
        auto e = node(ExprKind::getattr, pos);
        e->name = cur().text;
        e->args.push_back(std::move(obj));
        advance();
        return e;
      }
      if (cur().type == Tok::integer) {
        auto e = node(ExprKind::getitem, pos);
        e->args.push_back(std::move(obj));
        auto k = node(ExprKind::literal, cur().pos);
        k->value = Value(cur().ival);
        e->args.push_back(std::move(k));
        advance();
        return e;
      }
      error_here("expected name or number, got " + describe(cur()));
    }
    expect_op("[");
    std::vector<ExprPtr> parts;
    while (!is_op("]")) {
      if (!parts.empty()) {
        expect_op(",");
        if (is_op("]")) error_here("unexpected ']' after ',' in a subscript");  // (as jinja2)
      }
      parts.push_back(parse_subscribed());
    }
    advance();
    ExprPtr index;
    if (parts.size() == 1) {
      index = std::move(parts[0]);
    } else {
      if (parts.empty()) error(pos, "expected an index");
      // A slice has no value of its own here (slice(null, a, b, c) takes its object from the
      // subscript), so one inside a tuple index cannot be evaluated.
      for (const ExprPtr& p : parts)
        if (p->kind == ExprKind::slice) error(p->pos, "a slice inside a tuple subscript (x[a, b:c]) is not supported");
      index = node(ExprKind::tuple, pos);
      index->args = std::move(parts);
    }
    if (index->kind == ExprKind::slice) {  // parse_subscribed built slice(null, a, b, c)
      index->args[0] = std::move(obj);
      return index;
    }
    auto e = node(ExprKind::getitem, pos);
    e->args.push_back(std::move(obj));
    e->args.push_back(std::move(index));
    return e;
  }

  ExprPtr parse_subscribed() {
    size_t pos = cur().pos;
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (!is_op(":")) return start;
    }
    advance();
    auto s = node(ExprKind::slice, pos);
    s->args.push_back(nullptr);
    s->args.push_back(std::move(start));
    ExprPtr stop, step;
    if (!is_op("]") && !is_op(",") && !is_op(":")) stop = parse_expression(true);
    if (skip_op(":")) {
      if (!is_op("]") && !is_op(",")) step = parse_expression(true);
    }
    s->args.push_back(std::move(stop));
    s->args.push_back(std::move(step));
    return s;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) {
        expect_op(",");
        if (is_op(")")) break;
      }
      first = false;
      if (is_op("*") || is_op("**")) error_here("*args and **kwargs in calls are not supported");
      if (cur().type == Tok::name && peek().type == Tok::op && peek().text == "=") {
        std::string key = cur().text;
        advance();
        advance();
        e.kwargs.emplace_back(key, parse_expression(true));
      } else {
        if (!e.kwargs.empty()) error_here("positional argument follows keyword argument");
        e.args.push_back(parse_expression(true));
      }
    }
    advance();
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto e = node(ExprKind::call, cur().pos);
    e->args.push_back(std::move(callee));
    parse_call_args(*e);
    return e;
  }

  std::string dotted_name() {
    std::string n = expect_name();
    while (is_op(".") && peek().type == Tok::name) {
      advance();
      n += "." + cur().text;
      advance();
    }
    return n;
  }

  ExprPtr parse_filter(ExprPtr subject) {
    size_t pos = cur().pos;
    auto e = node(ExprKind::filter, pos);
    e->name = dotted_name();
    if (!has_filter(e->name)) error(pos, "no filter named '" + e->name + "'");
    e->args.push_back(std::move(subject));
    if (is_op("(")) parse_call_args(*e);
    return e;
  }

  ExprPtr parse_test(ExprPtr subject) {
    advance();  // 'is'
    bool negated = skip_name("not");
    size_t pos = cur().pos;
    auto e = node(ExprKind::test, pos);
    e->name = dotted_name();
    if (!has_test(e->name)) error(pos, "no test named '" + e->name + "'");
    e->args.push_back(std::move(subject));
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((cur().type == Tok::name || cur().type == Tok::string || cur().type == Tok::integer ||
                cur().type == Tok::floating || is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) error_here("you cannot chain multiple tests with is");
      e->args.push_back(parse_postfix(parse_primary()));
    }
    if (!negated) return e;
    auto n = node(ExprKind::not_, pos);
    n->args.push_back(std::move(e));
    return n;
  }

  const Program& prog_;
  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

std::shared_ptr<Program> parse_template(const std::string& source, const std::string& name) {
  auto prog = std::make_shared<Program>();
  prog->name = name;
  // jinja2 reads \r\n and \r as \n, and (keep_trailing_newline=False) drops one final newline.
  std::string& s = prog->source;
  s.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      s += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      s += source[i];
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();
  prog->line_starts.push_back(0);
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == '\n') prog->line_starts.push_back(i + 1);
  std::vector<Token> tokens = Lexer(*prog).run();
  prog->body = Parser(*prog, std::move(tokens)).parse_all();
  return prog;
}

}  // namespace vireo::jinja
