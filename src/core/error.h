#pragma once
// Errors are values at the edges: anything that rejects user input (a file, a tensor, a config
// field, a flag, a request) throws vireo::Error with a one-line message naming what is wrong and
// what was expected. The CLI prints it as `vireo: error: <message>` and exits non-zero.
#include <stdexcept>
#include <string>
#include <sstream>

namespace vireo {

// `s` with its control characters written as escapes (\n, \r, \t, \xHH; other bytes as they
// are, UTF-8 included): a message quoting user input (a request's role, a tensor name read from a
// file) stays one line wherever it is printed or logged.
inline std::string one_line(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c != 0x7f) {
      out += ch;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      static const char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

struct Error : std::runtime_error {
  explicit Error(const std::string& msg) : std::runtime_error(one_line(msg)) {}
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append_all(os, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<<: str("tensor ", name, ": shape ", n).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::append_all(os, args...);
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(str(args...));
}

// Internal invariant (a bug in vireo, not bad input).
#define VIREO_ASSERT(cond)                                                                 \
  do {                                                                                     \
    if (!(cond)) ::vireo::fail("internal error: ", #cond, " at ", __FILE__, ":", __LINE__); \
  } while (0)

}  // namespace vireo
