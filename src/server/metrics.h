#pragma once
// Server counters and latency histograms, rendered in the Prometheus text format (version 0.0.4).
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/scheduler.h"

namespace vireo::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  void render(std::string& out, const std::string& name, const std::string& help) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;    // upper bounds, ascending; +Inf is implied
  std::vector<uint64_t> counts_;  // per bucket (not cumulative)
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();
  void request(int http_status);                 // one answered request
  void finished(const std::string& reason);      // stop, length, cancelled, error
  void prompt_tokens(int64_t n) { prompt_tokens_ += uint64_t(n); }
  void generated_tokens(int64_t n) { generated_tokens_ += uint64_t(n); }
  void ttft(double seconds) { ttft_.observe(seconds); }
  void itl(double seconds) { itl_.observe(seconds); }
  // The exposition, with the scheduler's gauges (null while loading).
  std::string render(const SchedulerStats* s) const;

 private:
  mutable std::mutex mu_;
  std::map<int, uint64_t> by_status_;
  std::map<std::string, uint64_t> by_reason_;
  std::atomic<uint64_t> prompt_tokens_{0}, generated_tokens_{0};
  Histogram ttft_, itl_;
};

}  // namespace vireo::server
