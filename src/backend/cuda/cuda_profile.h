#pragma once
// Op-level GPU profile of the CUDA backend (`vireo bench --profile`). When on, every Backend op
// (and a few named pieces inside ops) is bracketed with CUDA events; the outermost op first waits
// for the stream to drain, so its time is its own (launch latency included, queueing excluded).
// Times, calls and FLOPs accumulate per key (op name, matmul dtype/shape/path). Off by default:
// then a scope is one predictable branch and nothing is recorded or synchronized.
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backend/cuda/cuda_internal.h"

namespace vireo::cuda {

class OpProfiler {
 public:
  struct Stat {
    double ms = 0, flops = 0;
    int64_t calls = 0;
    int depth = 0;  // 0: a top-level op; > 0: a piece inside one (its time is in its parent's too)
  };

  ~OpProfiler() {
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }
  bool on() const { return on_; }
  void set_on(bool on) { on_ = on; }
  void clear() { stats_.clear(); }
  const std::map<std::string, Stat>& stats() const { return stats_; }

  void begin(cudaStream_t st, std::string key) {
    if (open_.empty()) VIREO_CUDA_CHECK(cudaStreamSynchronize(st));
    Open o;
    o.key = open_.empty() ? std::move(key) : open_.back().key + " / " + key;
    o.start = event();
    VIREO_CUDA_CHECK(cudaEventRecord(o.start, st));
    open_.push_back(std::move(o));
  }
  void add_flops(double f) {
    if (!open_.empty()) open_.back().flops += f;
  }
  void end(cudaStream_t st) {
    Open o = std::move(open_.back());
    open_.pop_back();
    cudaEvent_t stop = event();
    VIREO_CUDA_CHECK(cudaEventRecord(stop, st));
    VIREO_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    VIREO_CUDA_CHECK(cudaEventElapsedTime(&ms, o.start, stop));
    Stat& s = stats_[o.key];
    s.ms += ms;
    s.flops += o.flops;
    s.calls += 1;
    s.depth = int(open_.size());
    pool_.push_back(o.start);
    pool_.push_back(stop);
  }

 private:
  struct Open {
    std::string key;
    cudaEvent_t start = nullptr;
    double flops = 0;
  };
  cudaEvent_t event() {
    if (!pool_.empty()) {
      cudaEvent_t e = pool_.back();
      pool_.pop_back();
      return e;
    }
    cudaEvent_t e;
    VIREO_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
  bool on_ = false;
  std::vector<Open> open_;
  std::vector<cudaEvent_t> pool_;
  std::map<std::string, Stat> stats_;
};

}  // namespace vireo::cuda
