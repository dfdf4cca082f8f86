#include "io/json_file.h"

#include <fstream>
#include <sstream>
#include <sys/stat.h>

#include "core/error.h"

namespace vireo {

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

Json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open file");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return Json::parse(ss.str());
  } catch (const Json::exception& e) {  // (parse_error, or out_of_range for a number past double's range)
    std::string what = e.what();
    // nlohmann's message starts with "[json.exception.parse_error.101] parse error at line..."
    auto pos = what.find("] ");
    fail(path, ": malformed JSON: ", pos == std::string::npos ? what : what.substr(pos + 2));
  }
}

}  // namespace vireo
