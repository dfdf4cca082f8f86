#include "experts/streaming_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "core/clock.h"

namespace vireo {

namespace {

char* map_arena(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail("cannot allocate the expert pool (", bytes, " bytes): ", std::strerror(errno));
  return static_cast<char*>(p);
}

}  // namespace

StreamingExpertStore::StreamingExpertStore(const Checkpoint& ck, const ExpertStoreParams& p,
                                           const ExpertStoreOptions& o)
    : opts_(o),
      layout_(ck, p),
      pool_(o.slots, p.n_layers, int(p.moe_layers.size()), p.n_experts,
            o.layer_floor >= 0 ? o.layer_floor : SlotPool::auto_floor(o.slots, int(p.moe_layers.size()), p.top_k)),
      predictions_(p.n_layers) {
  if (o.slots < 1) fail("the expert pool needs at least one slot");
  if (pool_.max_per_prepare() < 1)
    fail("expert pool: ", o.slots, " slots cannot keep a floor of ", pool_.floor(), " slots for each of ",
         p.moe_layers.size(), " MoE layers");
  if (o.io_threads < 1 || o.io_threads > 256) fail("--io-threads must be in [1, 256], got ", o.io_threads);
  // Whatever the page cache holds of the checkpoint from earlier runs is not ours to use: drop it
  // so memory use and read speed are what the budget says.
  for (const std::string& f : layout_.files()) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
  // Everything that can throw before the arena's mapping comes first: a constructor that throws
  // never runs the destructor, so only the try below unmaps it.
  weights_.resize(size_t(o.slots));
  errors_.resize(size_t(o.slots));
  arena_bytes_ = size_t(o.slots) * size_t(layout_.slot_bytes());
  arena_ = map_arena(arena_bytes_);
  try {
    reader_ = std::make_unique<ExpertReader>(layout_.files(), o.direct, o.io_threads, o.read_chunk);
  } catch (...) {
    ::munmap(arena_, arena_bytes_);
    throw;
  }
}

StreamingExpertStore::~StreamingExpertStore() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !pool_.any_busy(); });
  }
  reader_.reset();
  if (arena_) ::munmap(arena_, arena_bytes_);
}

int64_t StreamingExpertStore::slot_of(int layer, int expert) const {
  std::lock_guard<std::mutex> lock(mu_);
  return pool_.find(layer, expert);
}

ExpertStoreStats StreamingExpertStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void StreamingExpertStore::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = {};
}

int64_t StreamingExpertStore::claim(int layer, int expert, std::unique_lock<std::mutex>& lock) {
  bool evicted = false;
  // Every slot pinned, protected or still being read: wait for a read to finish.
  const int64_t slot = pool_.claim_waiting(layer, expert, &evicted, [&] {
    const auto t0 = Clock::now();
    cv_.wait(lock);
    stats_.stall_seconds += seconds_since(t0);
  }, "expert pool");
  stats_.evictions += evicted;
  return slot;
}

void StreamingExpertStore::start_read(int64_t slot, int layer, int expert, bool urgent) {
  char* base = arena_ + size_t(slot) * size_t(layout_.slot_bytes());
  const ExpertRecord& r = layout_.record(layer, expert);
  weights_[size_t(slot)] = layout_.bind(layer, expert, base);
  errors_[size_t(slot)].clear();
  pool_.set_busy(slot, true);
  stats_.bytes_read += r.payload_bytes;
  reader_->read(r.extents, base, urgent, [this, slot](const std::string& err, uint64_t bytes, double secs) {
    std::lock_guard<std::mutex> lock(mu_);
    pool_.set_busy(slot, false);
    errors_[size_t(slot)] = err;
    stats_.bytes_transferred += bytes;
    stats_.read_seconds += secs;
    cv_.notify_all();
  });
}

std::vector<const ExpertWeights*> StreamingExpertStore::prepare_async(int layer, const std::vector<int>& experts) {
  std::unique_lock<std::mutex> lock(mu_);
  predictions_.score(layer, experts, stats_);
  stats_.requests += experts.size();
  stats_.hits += uint64_t(pool_.pin_hits(layer, experts, current_, stats_.prefetch_used));
  for (size_t i = 0; i < experts.size(); ++i) {
    if (current_[i] >= 0) continue;
    ++stats_.misses;
    const int64_t slot = claim(layer, experts[i], lock);
    pool_.pin(slot);
    start_read(slot, layer, experts[i], true);
    current_[i] = slot;
  }
  std::vector<const ExpertWeights*> out;
  for (int64_t slot : current_) out.push_back(&weights_[size_t(slot)]);
  return out;
}

void StreamingExpertStore::await(size_t i) {
  std::unique_lock<std::mutex> lock(mu_);
  VIREO_ASSERT(i < current_.size());
  const int64_t slot = current_[i];
  if (pool_.busy(slot)) {
    const auto t0 = Clock::now();
    cv_.wait(lock, [&] { return !pool_.busy(slot); });
    stats_.stall_seconds += seconds_since(t0);
  }
  if (!errors_[size_t(slot)].empty()) {
    const std::string err = errors_[size_t(slot)];
    const int layer = pool_.layer_of(slot), expert = pool_.expert_of(slot);
    const std::string& file = layout_.files()[size_t(layout_.record(layer, expert).extents[0].file)];
    pool_.release(slot);  // a later prepare reads it again
    fail(file, ": expert ", expert, " of layer ", layer, ": ", err);
  }
}

bool StreamingExpertStore::ready(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  VIREO_ASSERT(i < current_.size());
  return !pool_.busy(current_[i]);
}

std::vector<const ExpertWeights*> StreamingExpertStore::prepare(int layer, const std::vector<int>& experts) {
  auto out = prepare_async(layer, experts);
  for (size_t i = 0; i < out.size(); ++i) await(i);
  return out;
}

void StreamingExpertStore::prefetch(int layer, const std::vector<int>& experts) {
  if (!opts_.prefetch) return;
  std::unique_lock<std::mutex> lock(mu_);
  for (int e : predictions_.guess(layer, experts, stats_)) {
    if (pool_.find(layer, e) >= 0) continue;
    bool evicted = false;
    const int64_t slot = pool_.claim_guess(layer, e, &evicted);
    if (slot < 0) break;
    stats_.evictions += evicted;
    ++stats_.prefetch_reads;
    start_read(slot, layer, e, false);
  }
}

double StreamingExpertStore::measure_read_gbs(int n, int batch, uint64_t seed) {
  const ExpertStoreParams& p = layout_.params();
  std::vector<std::pair<int, int>> all;
  for (int l : p.moe_layers)
    for (int e = 0; e < p.n_experts; ++e) all.emplace_back(l, e);
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(std::min(all.size(), size_t(std::max(n, 1))));
  batch = std::max(1, std::min(batch, int(all.size())));
  const size_t sb = size_t(layout_.slot_bytes());
  char* buf = map_arena(sb * size_t(batch));
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;
  uint64_t moved = 0;
  std::string error;
  const auto t0 = Clock::now();
  for (size_t i = 0; i < all.size(); i += size_t(batch)) {
    const size_t m = std::min(all.size() - i, size_t(batch));
    pending = int(m);
    for (size_t k = 0; k < m; ++k) {
      const ExpertRecord& r = layout_.record(all[i + k].first, all[i + k].second);
      reader_->read(r.extents, buf + k * sb, true, [&](const std::string& err, uint64_t bytes, double) {
        std::lock_guard<std::mutex> lock(mu);
        moved += bytes;
        if (!err.empty()) error = err;
        if (--pending == 0) cv.notify_all();
      });
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return pending == 0; });
  }
  const double secs = seconds_since(t0);
  ::munmap(buf, sb * size_t(batch));
  if (!error.empty()) fail("read bandwidth probe: ", error);
  return double(moved) / secs / 1e9;
}

}  // namespace vireo
