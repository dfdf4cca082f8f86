#pragma once
// Errors are values at the edges: anything that rejects user input (a file, a tensor, a config
// field, a flag, a request) throws vireo::Error with a one-line message naming what is wrong and
// what was expected. The CLI prints it as `vireo: error: <message>` and exits non-zero.
#include <stdexcept>
#include <string>
#include <sstream>

namespace vireo {

struct Error : std::runtime_error {
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
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
