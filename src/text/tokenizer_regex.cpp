#include "text/tokenizer_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"

namespace vireo {

namespace {
// Oniguruma (Unicode): \s = U+0009..U+000D, U+0085, Zl, Zp, Zs.
constexpr const char* kSpaceBody = "\\t\\n\\x{0B}\\f\\r\\x{85}\\p{Z}";
// Oniguruma (Unicode): \w = Letter, Mark, Decimal_Number, Connector_Punctuation.
constexpr const char* kWordBody = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";

// Match data and JIT stack are per thread: pcre2_match_data may not be shared between threads.
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchScratch() {
    data = pcre2_match_data_create(64, nullptr);
    context = pcre2_match_context_create(nullptr);
    // Long whitespace or letter runs need more than the default 32 KiB JIT stack.
    stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};
MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}
}  // namespace

std::string TokenizerRegex::translate(const std::string& p, const std::string& where) {
  std::string out;
  out.reserve(p.size() + 32);
  bool in_class = false;
  for (std::size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char n = p[i + 1];
      ++i;
      if (n == 's' || n == 'w') {
        const char* body = n == 's' ? kSpaceBody : kWordBody;
        out += in_class ? std::string(body) : "[" + std::string(body) + "]";
      } else if (n == 'S' || n == 'W') {
        if (in_class) fail(where, ": regex uses \\", n, " inside a character class (unsupported)");
        out += "[^" + std::string(n == 'S' ? kSpaceBody : kWordBody) + "]";
      } else {
        out += '\\';
        out += n;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

TokenizerRegex::TokenizerRegex(const std::string& pattern, const std::string& where) {
  std::string translated = translate(pattern, where);
  int err = 0;
  PCRE2_SIZE err_off = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                        PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
  if (!code_) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail(where, ": cannot compile regex /", pattern, "/: ", reinterpret_cast<const char*>(msg),
         " at offset ", err_off);
  }
  // Without the JIT pcre2_match still works, only slower.
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
}

TokenizerRegex::~TokenizerRegex() { pcre2_code_free(code_); }

bool TokenizerRegex::find(std::string_view s, std::size_t from, std::size_t& start,
                          std::size_t& end) const {
  MatchScratch& m = scratch();
  // Input was validated (or repaired) once at the tokenizer's edge: skip PCRE2's own UTF check.
  int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), from,
                       PCRE2_NO_UTF_CHECK, m.data, m.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    fail("tokenizer regex match failed: ", reinterpret_cast<const char*>(msg));
  }
  PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.data);
  start = ov[0];
  end = ov[1];
  return true;
}

}  // namespace vireo
