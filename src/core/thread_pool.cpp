#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace vireo {

namespace {
std::unique_ptr<ThreadPool> g_pool;
int g_threads = 0;

void chunk(int64_t n, int64_t grain, int parts, int index, int64_t* b, int64_t* e) {
  int64_t blocks = (n + grain - 1) / grain;
  int64_t per = blocks / parts, extra = blocks % parts;
  int64_t start = index * per + std::min<int64_t>(index, extra);
  int64_t count = per + (index < extra ? 1 : 0);
  *b = std::min(n, start * grain);
  *e = std::min(n, (start + count) * grain);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins until done() or kSpinMicros have passed; returns done(). Every 64 tries it also yields,
// so that where threads outnumber cores the thread being waited for gets one.
template <class Done>
bool spin_until(Done done) {
  using clock = std::chrono::steady_clock;
  const auto until = clock::now() + std::chrono::microseconds(ThreadPool::kSpinMicros);
  for (int i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if (i % 64 == 0) {
      if (clock::now() > until) return done();
      std::this_thread::yield();
    }
  }
}
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_start_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    const std::function<void(int64_t, int64_t, int)>* job;
    int64_t n, grain;
    {
      std::lock_guard<std::mutex> lock(mu_);  // the fields of the generation just seen (or stop_)
      if (stop_) return;
      job = job_;
      n = job_n_;
      grain = job_grain_;
    }
    int64_t b, e;
    chunk(n, grain, n_threads_, index, &b, &e);
    if (b < e) (*job)(b, e, index);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);  // the caller may be between its check and its sleep
      cv_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                              int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    pending_.store(n_threads_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_start_.notify_all();
  int64_t b, e;
  chunk(n, grain, n_threads_, 0, &b, &e);
  if (b < e) fn(b, e, 0);
  if (spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
}

ThreadPool& ThreadPool::global() {
  if (!g_pool) {
    int n = g_threads;
    if (n <= 0) {
      if (const char* env = std::getenv("VIREO_THREADS")) n = std::atoi(env);
      if (n <= 0) n = int(std::thread::hardware_concurrency());
    }
    g_pool = std::make_unique<ThreadPool>(n);
  }
  return *g_pool;
}

void ThreadPool::set_global_threads(int n) {
  g_threads = n;
  g_pool.reset();
}

}  // namespace vireo
