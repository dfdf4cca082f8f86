#pragma once
// Op-level GPU profile of the CUDA backend (`vireo bench --profile`). When on, every Backend op
// (and a few named pieces inside ops) is bracketed with CUDA events. Two modes:
// - synced (the default): the outermost op first waits for the stream to drain, so its time is
//   its own (launch latency and the host's work inside the op included, queueing excluded);
// - queued: nothing waits; the events are read at flush(). An op's time then starts where the
//   stream reached it, so the ops and the gaps between them add up to the GPU's timeline, and
//   a gap is time the GPU sat idle waiting for the host to queue the next op (a sync, a
//   host-side plan, launch overhead): what the synced mode's times cannot show.
// Times, calls and FLOPs accumulate per key (op name, matmul dtype/shape/path). Off by default:
// then a scope is one predictable branch and nothing is recorded or synchronized.
#include <cuda_runtime.h>

#include <algorithm>
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
    double idle_before_ms = 0;  // queued, top-level ops: the GPU idle right before them (the host late)
  };

  ~OpProfiler() {
    for (const Done& d : done_) {
      cudaEventDestroy(d.start);
      cudaEventDestroy(d.stop);
    }
    if (have_last_stop_) cudaEventDestroy(last_stop_);
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }
  bool on() const { return on_; }
  void set_on(bool on, bool queued = false) {
    flush();
    on_ = on;
    queued_ = on && queued;
  }
  void clear() {
    flush();
    stats_.clear();
    idle_ms_ = 0;
    if (have_last_stop_) pool_.push_back(last_stop_);
    have_last_stop_ = false;
  }
  const std::map<std::string, Stat>& stats() const { return stats_; }
  bool queued() const { return queued_; }
  // Queued mode: the GPU's idle time between consecutive top-level ops so far.
  double idle_ms() const { return idle_ms_; }

  // Reads every queued op's events (waiting for the last) into the stats.
  void flush() {
    if (done_.empty()) return;
    VIREO_CUDA_CHECK(cudaEventSynchronize(done_.back().stop));
    for (Done& d : done_) {
      if (d.depth == 0) {
        if (have_last_stop_) {
          const double idle = std::max(0.0f, elapsed(last_stop_, d.start));
          idle_ms_ += idle;
          stats_[d.key].idle_before_ms += idle;
          pool_.push_back(last_stop_);
        }
        last_stop_ = d.stop;
        have_last_stop_ = true;
      }
      add(d.key, elapsed(d.start, d.stop), d.flops, d.depth);
      pool_.push_back(d.start);
      if (d.depth != 0) pool_.push_back(d.stop);
    }
    done_.clear();
  }

  void begin(cudaStream_t st, std::string key) {
    if (open_.empty() && !queued_) VIREO_CUDA_CHECK(cudaStreamSynchronize(st));
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
    if (queued_) {
      done_.push_back({std::move(o.key), o.start, stop, o.flops, int(open_.size())});
      return;
    }
    VIREO_CUDA_CHECK(cudaEventSynchronize(stop));
    add(o.key, elapsed(o.start, stop), o.flops, int(open_.size()));
    pool_.push_back(o.start);
    pool_.push_back(stop);
  }

 private:
  struct Open {
    std::string key;
    cudaEvent_t start = nullptr;
    double flops = 0;
  };
  struct Done {  // a queued op's events, not yet read
    std::string key;
    cudaEvent_t start = nullptr, stop = nullptr;
    double flops = 0;
    int depth = 0;
  };
  static float elapsed(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    VIREO_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
  void add(const std::string& key, double ms, double flops, int depth) {
    Stat& s = stats_[key];
    s.ms += ms;
    s.flops += flops;
    s.calls += 1;
    s.depth = depth;
  }
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
  bool on_ = false, queued_ = false;
  std::vector<Open> open_;
  std::vector<Done> done_;
  cudaEvent_t last_stop_ = nullptr;  // queued: the last top-level op's stop event read
  bool have_last_stop_ = false;
  double idle_ms_ = 0;
  std::vector<cudaEvent_t> pool_;
  std::map<std::string, Stat> stats_;
};

}  // namespace vireo::cuda
