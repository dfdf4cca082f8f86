#pragma once
// Environment switches for A/B runs (the CUDA backend's kernels' forms, the bench's decode loop).
#include <cstdlib>
#include <string>

namespace vireo {

// On unless the environment sets `name` to "0".
inline bool env_switch(const char* name) {
  const char* e = std::getenv(name);
  return !(e && std::string(e) == "0");
}

}  // namespace vireo
