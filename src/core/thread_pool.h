#pragma once
// A fixed pool of worker threads for data-parallel loops. parallel_for splits [0, n) into one
// contiguous chunk per thread (the caller's thread takes chunk 0), so results never depend on
// scheduling: every element is computed by exactly one thread in a fixed order.
//
// A forward step is hundreds of parallel_for calls, many of them microseconds long (a small
// model's products, norms, the attention of one token). Waking a sleeping worker through the
// kernel costs tens of microseconds on a VM, so workers and the caller spin for a while
// (kSpinMicros) on the job counter and the pending count before they sleep on the condition
// variables: the embedded demo model decoded ~170 tokens/s on 2 threads of the 2-vCPU CI VM when
// every call slept and woke, ~1700 on 1 thread.
#include <atomic>
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

  // How long a worker waits for the next job, and the caller for the workers, before sleeping.
  static constexpr int kSpinMicros = 200;

 private:
  void worker(int index);
  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;  // guards the sleeps: generation_ and pending_ change under it when a thread may sleep
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0, job_grain_ = 1;
  std::atomic<uint64_t> generation_{0};  // bumped (release) once the job's fields are written
  std::atomic<int> pending_{0};          // workers still running the current job
  bool stop_ = false;
};

}  // namespace vireo
