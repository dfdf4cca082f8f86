#pragma once
// A fixed pool of worker threads for data-parallel loops. parallel_for splits [0, n) into one
// contiguous chunk per thread (the caller's thread takes chunk 0), so results never depend on
// scheduling: every element is computed by exactly one thread in a fixed order.
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace vireo {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // fn(begin, end, thread_index) over a partition of [0, n). Chunks are multiples of `grain`
  // (except the last), so kernels can keep aligned blocks together.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                    int64_t grain = 1);

  // The process-wide pool; its size is set once (default: hardware threads, or VIREO_THREADS).
  static ThreadPool& global();
  static void set_global_threads(int n);

 private:
  void worker(int index);
  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0, job_grain_ = 1;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace vireo
