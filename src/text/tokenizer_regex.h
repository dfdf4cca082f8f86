#pragma once
// A compiled regular expression with the semantics of the Oniguruma patterns that
// tokenizer.json files carry, run by PCRE2 in UTF + UCP mode with the JIT.
#include <cstddef>
#include <string>
#include <string_view>

struct pcre2_real_code_8;

namespace vireo {

class TokenizerRegex {
 public:
  // `where` names the field in error messages, e.g. "tokenizer.json: pre_tokenizer Split".
  TokenizerRegex(const std::string& pattern, const std::string& where);
  ~TokenizerRegex();
  TokenizerRegex(const TokenizerRegex&) = delete;
  TokenizerRegex& operator=(const TokenizerRegex&) = delete;

  // Finds the first match in s at or after byte `from` (s must be valid UTF-8). Returns false
  // when there is none.
  bool find(std::string_view s, std::size_t from, std::size_t& start, std::size_t& end) const;

  // Calls f(start, end) for each successive non-overlapping match, like Oniguruma's find_iter:
  // after an empty match the search resumes one character later.
  template <typename F>
  void for_each_match(std::string_view s, F&& f) const {
    std::size_t pos = 0, start = 0, end = 0;
    while (pos <= s.size() && find(s, pos, start, end)) {
      f(start, end);
      if (end > start) {
        pos = end;
      } else {
        if (end >= s.size()) break;
        pos = end + 1;
        while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) ++pos;
      }
    }
  }

  // Oniguruma's \s, \S, \w, \W differ from PCRE2's UCP ones; rewrite them as explicit classes.
  static std::string translate(const std::string& pattern, const std::string& where);

 private:
  pcre2_real_code_8* code_ = nullptr;
};

}  // namespace vireo
