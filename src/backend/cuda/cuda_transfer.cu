// The CUDA TransferLink: device slot memory, pinned host memory, and host-to-device copies on a
// stream of their own. Each copy records an event; the compute stream waits on that event only
// (cudaStreamWaitEvent), so kernels that do not need the bytes run while they are in flight.
#include <cuda_runtime.h>

#include <algorithm>
#include <deque>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_internal.h"
#include "backend/transfer_link.h"

namespace vireo {

using namespace vireo::cuda;

namespace {

class CudaTransferLink final : public TransferLink {
 public:
  explicit CudaTransferLink(Backend& compute) : compute_(compute_stream_of(compute)) {
    VIREO_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
    VIREO_CUDA_CHECK(cudaEventCreateWithFlags(&compute_mark_, cudaEventDisableTiming));
  }
  ~CudaTransferLink() override {
    cudaStreamSynchronize(copy_);
    cudaStreamSynchronize(compute_);
    for (auto& p : pending_) cudaEventDestroy(p.event);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    for (auto& s : stalls_) {
      cudaEventDestroy(s.begin);
      cudaEventDestroy(s.end);
    }
    for (auto& s : free_stalls_) {
      cudaEventDestroy(s.begin);
      cudaEventDestroy(s.end);
    }
    cudaEventDestroy(compute_mark_);
    cudaStreamDestroy(copy_);
  }

  Device device() const override { return Device::CUDA; }

  std::shared_ptr<char> alloc_device(size_t bytes) override {
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));
    if (e != cudaSuccess)
      fail("cuda: out of device memory allocating the expert pool (", bytes, " bytes: ", cudaGetErrorString(e), ")");
    return std::shared_ptr<char>(static_cast<char*>(p), [](char* q) { cudaFree(q); });
  }

  std::shared_ptr<char> alloc_pinned(size_t bytes) override {
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable);
    if (e != cudaSuccess)
      fail("cuda: cannot allocate ", bytes, " bytes of pinned host memory (", cudaGetErrorString(e), ")");
    return std::shared_ptr<char>(static_cast<char*>(p), [](char* q) { cudaFreeHost(q); });
  }

  Ticket copy_to_device(void* dst, const void* src, size_t bytes) override {
    VIREO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, copy_));
    cudaEvent_t ev = take_event();
    VIREO_CUDA_CHECK(cudaEventRecord(ev, copy_));
    pending_.push_back({++issued_, ev});
    return issued_;
  }

  void order_after_compute() override {
    VIREO_CUDA_CHECK(cudaEventRecord(compute_mark_, compute_));
    VIREO_CUDA_CHECK(cudaStreamWaitEvent(copy_, compute_mark_, 0));
  }

  void compute_wait(Ticket t) override {
    if (done(t)) return;
    // Timed: how long the compute stream really idles here (read back once both have passed).
    Stall s = take_stall();
    VIREO_CUDA_CHECK(cudaEventRecord(s.begin, compute_));
    VIREO_CUDA_CHECK(cudaStreamWaitEvent(compute_, event_of(t), 0));
    VIREO_CUDA_CHECK(cudaEventRecord(s.end, compute_));
    stalls_.push_back(s);
  }

  bool done(Ticket t) override {
    while (!pending_.empty()) {
      const cudaError_t e = cudaEventQuery(pending_.front().event);
      if (e == cudaErrorNotReady) break;
      VIREO_CUDA_CHECK(e);
      completed_ = pending_.front().ticket;
      free_events_.push_back(pending_.front().event);
      pending_.pop_front();
    }
    return t <= completed_;
  }

  void host_wait(Ticket t) override {
    if (done(t)) return;
    VIREO_CUDA_CHECK(cudaEventSynchronize(event_of(t)));
    done(t);
  }

  double compute_stall_seconds() override {
    while (!stalls_.empty()) {
      const cudaError_t e = cudaEventQuery(stalls_.front().end);
      if (e == cudaErrorNotReady) break;
      VIREO_CUDA_CHECK(e);
      float ms = 0;
      VIREO_CUDA_CHECK(cudaEventElapsedTime(&ms, stalls_.front().begin, stalls_.front().end));
      stall_seconds_ += double(ms) * 1e-3;
      free_stalls_.push_back(stalls_.front());
      stalls_.pop_front();
    }
    return stall_seconds_;
  }

  double measure_gbs(size_t bytes) override {
    auto host = alloc_pinned(bytes);
    auto dev = alloc_device(bytes);
    std::fill(host.get(), host.get() + bytes, char(1));
    const double ms = median_copy_ms(dev.get(), host.get(), bytes, cudaMemcpyHostToDevice, copy_, 2, 5);
    return double(bytes) / (ms * 1e-3) / 1e9;
  }

 private:
  struct Pending {
    Ticket ticket;
    cudaEvent_t event;
  };
  struct Stall {
    cudaEvent_t begin, end;
  };
  cudaEvent_t take_event() {
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e;
    VIREO_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  Stall take_stall() {
    compute_stall_seconds();  // recycles the finished ones
    if (!free_stalls_.empty()) {
      Stall s = free_stalls_.back();
      free_stalls_.pop_back();
      return s;
    }
    Stall s;
    VIREO_CUDA_CHECK(cudaEventCreate(&s.begin));
    VIREO_CUDA_CHECK(cudaEventCreate(&s.end));
    return s;
  }
  // The event of a ticket not known to be complete (tickets are consecutive in pending_).
  cudaEvent_t event_of(Ticket t) {
    VIREO_ASSERT(!pending_.empty() && t >= pending_.front().ticket && t <= issued_);
    return pending_[size_t(t - pending_.front().ticket)].event;
  }

  cudaStream_t compute_ = nullptr, copy_ = nullptr;
  cudaEvent_t compute_mark_ = nullptr;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::deque<Stall> stalls_;
  std::vector<Stall> free_stalls_;
  Ticket issued_ = 0, completed_ = 0;
  double stall_seconds_ = 0;
};

}  // namespace

std::unique_ptr<TransferLink> make_cuda_transfer_link(Backend& compute) {
  return std::make_unique<CudaTransferLink>(compute);
}

uint64_t cuda_device_memory_used() {
  size_t free_b = 0, total = 0;
  VIREO_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
  return uint64_t(total - free_b);
}

}  // namespace vireo
