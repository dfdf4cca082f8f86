#pragma once
// TransferLink: what a store of streamed weights needs from a device, and nothing more: device
// memory for a slot arena, pinned host memory, and asynchronous host-to-device copies on a stream
// of their own, ordered against the backend's compute stream by events.
//
//   copy_to_device   queues a copy on the transfer stream; returns a ticket (tickets complete in
//                    the order they were issued: one stream).
//   compute_wait     the compute stream waits for a ticket before the kernels queued after it:
//                    the host does not block, and only the kernels that need the bytes wait.
//   order_after_compute
//                    later copies wait for every kernel queued on the compute stream so far (a
//                    slot must not be overwritten while queued kernels still read its old bytes).
//
// The CUDA backend implements it (make_cuda_transfer_link, cuda_backend.h). The host link below
// implements it with host memory and memcpy, deferring each copy until it is waited for, so the
// store's logic runs on the CPU backend and its tests fail if a wait is ever missing.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/tensor.h"

namespace vireo {

class TransferLink {
 public:
  using Ticket = uint64_t;  // 0: nothing to wait for
  virtual ~TransferLink() = default;

  // Where alloc_device memory lives (tensors viewing it carry this device).
  virtual Device device() const = 0;
  virtual std::shared_ptr<char> alloc_device(size_t bytes) = 0;
  // Page-locked host memory (host-to-device copies from it run at the link's full speed).
  virtual std::shared_ptr<char> alloc_pinned(size_t bytes) = 0;

  virtual Ticket copy_to_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void order_after_compute() = 0;
  virtual void compute_wait(Ticket t) = 0;
  // True when the copy has landed (no wait needed by anyone).
  virtual bool done(Ticket t) = 0;
  // The host blocks until the copy has landed (before reusing its pinned source).
  virtual void host_wait(Ticket t) = 0;
  // Seconds the compute stream sat waiting in compute_wait (collected for waits that completed).
  virtual double compute_stall_seconds() = 0;
  // Pinned host-to-device copy bandwidth in GB/s, measured now with copies of `bytes`.
  virtual double measure_gbs(size_t bytes) = 0;
};

// Host memory, memcpy on demand: a copy is performed when its ticket (or a later one) is waited
// for, in issue order, as a real transfer stream would complete them.
std::unique_ptr<TransferLink> make_host_transfer_link();

}  // namespace vireo
