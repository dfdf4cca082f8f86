#include "experts/expert_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>

namespace vireo {

namespace {

// Opens every file; returns false (nothing left open) if O_DIRECT was asked for and refused.
bool open_all(const std::vector<std::string>& files, bool direct, bool may_refuse, std::vector<int>& fds) {
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fd < 0) {
      const int err = errno;
      for (int g : fds) ::close(g);
      fds.clear();
      if (direct && err == EINVAL && may_refuse) return false;
      fail(f, ": cannot open", direct ? " for O_DIRECT reads" : "", ": ", std::strerror(err),
           direct ? " (try --direct-io off)" : "");
    }
    // Buffered reads are random: no readahead into the page cache.
    if (!direct) ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    fds.push_back(fd);
  }
  return true;
}

}  // namespace

ExpertReader::ExpertReader(const std::vector<std::string>& files, DirectIo mode, int threads, size_t chunk)
    : chunk_(std::max<size_t>(chunk / kIoAlign * kIoAlign, kIoAlign)) {
  // Auto: the file system may refuse O_DIRECT (tmpfs, some overlays); then buffered reads, each
  // followed by DONTNEED.
  direct_ = mode != DirectIo::Off && open_all(files, true, mode == DirectIo::Auto, fds_);
  if (!direct_) open_all(files, false, false, fds_);
  // A constructor that throws never runs the destructor: if a thread cannot start, stop the ones
  // that did (a joinable std::thread destroyed unjoined ends the process) and close the files.
  try {
    for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { worker(); });
  } catch (const std::system_error& e) {
    stop_all();
    fail("cannot start ", std::max(threads, 1), " expert I/O threads (--io-threads): ", e.what());
  }
}

void ExpertReader::stop_all() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  for (int fd : fds_) ::close(fd);
  fds_.clear();
}

ExpertReader::~ExpertReader() { stop_all(); }

void ExpertReader::read(const std::vector<ExpertExtent>& extents, char* base, bool urgent, Done done) {
  auto req = std::make_shared<Request>();
  req->done = std::move(done);
  std::vector<Chunk> chunks;
  for (const ExpertExtent& e : extents)
    for (uint64_t off = 0; off < e.length; off += chunk_)
      chunks.push_back({fds_[size_t(e.file)], e.file_offset + off, std::min<uint64_t>(chunk_, e.length - off),
                        base + e.slot_offset + off, req});
  req->remaining = int(chunks.size());
  if (chunks.empty()) {
    req->done("", 0, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = urgent ? urgent_ : background_;
    for (Chunk& c : chunks) q.push_back(std::move(c));
  }
  cv_.notify_all();
}

void ExpertReader::worker() {
  for (;;) {
    Chunk c;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !urgent_.empty() || !background_.empty(); });
      if (stop_) return;
      auto& q = !urgent_.empty() ? urgent_ : background_;
      c = std::move(q.front());
      q.pop_front();
    }
    run(c);
  }
}

void ExpertReader::run(Chunk& c) {
  auto t0 = std::chrono::steady_clock::now();
  uint64_t got = 0;
  std::string err;
  while (got < c.length) {
    const ssize_t n = ::pread(c.fd, c.dst + got, c.length - got, off_t(c.offset + got));
    if (n < 0) {
      if (errno == EINTR) continue;
      err = str("read of ", c.length, " bytes at offset ", c.offset, " failed: ", std::strerror(errno));
      break;
    }
    if (n == 0) break;  // end of file: extents are widened past it to a block boundary
    got += uint64_t(n);
  }
  if (!direct_) ::posix_fadvise(c.fd, off_t(c.offset), off_t(c.length), POSIX_FADV_DONTNEED);
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  Request& r = *c.req;
  r.bytes += got;
  r.nanos += ns;
  if (!err.empty()) {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.error.empty()) r.error = err;
  }
  if (--r.remaining == 0) {
    std::string e;
    {
      std::lock_guard<std::mutex> lock(r.mu);
      e = r.error;
    }
    r.done(e, r.bytes.load(), double(r.nanos.load()) * 1e-9);
  }
}

}  // namespace vireo
