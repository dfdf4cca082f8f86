#pragma once
// ExpertReader: worker threads that read extents of the checkpoint files into memory with
// pread, several requests in flight. Files are opened with O_DIRECT where allowed; otherwise
// every buffered read is followed by posix_fadvise(DONTNEED) so the page cache does not quietly
// keep the model in RAM. Two queues: urgent reads (a prepare is waiting) go before background
// ones (prefetch).
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "experts/expert_layout.h"

namespace vireo {

class ExpertReader {
 public:
  // done(error, bytes_moved, seconds_in_read_calls): once per read(), on a worker thread; error
  // is empty on success.
  using Done = std::function<void(const std::string&, uint64_t, double)>;

  ExpertReader(const std::vector<std::string>& files, DirectIo mode, int threads, size_t chunk);
  ~ExpertReader();
  ExpertReader(const ExpertReader&) = delete;
  ExpertReader& operator=(const ExpertReader&) = delete;

  bool direct() const { return direct_; }
  // Reads every extent into base + extent.slot_offset (base kIoAlign-aligned).
  void read(const std::vector<ExpertExtent>& extents, char* base, bool urgent, Done done);

 private:
  struct Request {
    std::atomic<int> remaining{0};
    std::atomic<uint64_t> bytes{0};
    std::atomic<int64_t> nanos{0};
    std::mutex mu;
    std::string error;
    Done done;
  };
  struct Chunk {
    int fd;
    uint64_t offset, length;
    char* dst;
    std::shared_ptr<Request> req;
  };
  void worker();
  void stop_all();  // stops and joins the threads, closes the files (the destructor's work)
  void run(Chunk& c);

  std::vector<int> fds_;
  bool direct_ = false;
  size_t chunk_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk> urgent_, background_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace vireo
