#pragma once
// Wall-clock intervals for counters and progress (monotonic).
#include <chrono>

namespace vireo {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace vireo
