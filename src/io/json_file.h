#pragma once
// Reading JSON files with errors that name the file and the field.
#include <string>

#include <nlohmann/json.hpp>

namespace vireo {

using Json = nlohmann::json;

// Parses a JSON file; a missing file or malformed JSON throws Error naming the file.
Json read_json_file(const std::string& path);
bool file_exists(const std::string& path);

}  // namespace vireo
