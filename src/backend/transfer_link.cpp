#include "backend/transfer_link.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <vector>

#include "core/error.h"

namespace vireo {

namespace {

class HostTransferLink final : public TransferLink {
 public:
  Device device() const override { return Device::CPU; }
  std::shared_ptr<char> alloc_device(size_t bytes) override { return alloc(bytes); }
  std::shared_ptr<char> alloc_pinned(size_t bytes) override { return alloc(bytes); }

  Ticket copy_to_device(void* dst, const void* src, size_t bytes) override {
    queue_.push_back({dst, src, bytes});
    return ++issued_;
  }
  void order_after_compute() override {}  // CPU compute is synchronous: nothing is queued
  void compute_wait(Ticket t) override { complete(t); }
  bool done(Ticket t) override { return t <= completed_; }
  void host_wait(Ticket t) override { complete(t); }
  double compute_stall_seconds() override { return 0; }
  double measure_gbs(size_t bytes) override {
    auto a = alloc(bytes), b = alloc(bytes);
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.get(), a.get(), bytes);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return double(bytes) / std::max(s, 1e-9) / 1e9;
  }

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  static std::shared_ptr<char> alloc(size_t bytes) {
    void* p = std::aligned_alloc(4096, (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096);
    if (!p) fail("cannot allocate ", bytes, " bytes");
    return std::shared_ptr<char>(static_cast<char*>(p), [](char* q) { std::free(q); });
  }
  void complete(Ticket t) {
    VIREO_ASSERT(t <= issued_);
    while (completed_ < t) {
      const Copy& c = queue_.front();
      std::memcpy(c.dst, c.src, c.bytes);
      queue_.pop_front();
      ++completed_;
    }
  }
  std::deque<Copy> queue_;  // issued, not performed yet (tickets completed_ + 1 ...)
  Ticket issued_ = 0, completed_ = 0;
};

}  // namespace

std::unique_ptr<TransferLink> make_host_transfer_link() { return std::make_unique<HostTransferLink>(); }

}  // namespace vireo
