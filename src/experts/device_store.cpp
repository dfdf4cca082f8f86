#include "experts/device_store.h"

#include <algorithm>
#include <cstring>

#include "core/clock.h"
#include "core/thread_pool.h"

namespace vireo {

namespace {

void on_device(Tensor& t, Device d) {
  if (t.ndim) t.device = d;
}

}  // namespace

DeviceExpertStore::DeviceExpertStore(const Checkpoint& ck, const ExpertStoreParams& p, const ExpertStoreOptions& o,
                                     std::shared_ptr<TransferLink> link)
    : opts_(o),
      link_holder_(std::move(link)),
      link_(*link_holder_),
      layout_(ck, p, ck.files().empty()),
      dev_layout_(ck, p, true),
      pool_(o.slots, p.n_layers, int(p.moe_layers.size()), p.n_experts,
            o.layer_floor >= 0 ? o.layer_floor : SlotPool::auto_floor(o.slots, int(p.moe_layers.size()), p.top_k)),
      predictions_(p.n_layers) {
  if (o.slots < 1) fail("the device expert pool needs at least one slot");
  if (pool_.max_per_prepare() < 1)
    fail("device expert pool: ", o.slots, " slots cannot keep a floor of ", pool_.floor(), " slots for each of ",
         p.moe_layers.size(), " MoE layers");
  if (o.staging < 0) fail("staging buffers must be >= 0, got ", o.staging);
  if (o.staging > 0 && layout_.packed()) fail(ck.dir(), ": a staging ring reads from disk; this checkpoint is in memory");
  if (o.io_threads < 1 || o.io_threads > 256) fail("--io-threads must be in [1, 256], got ", o.io_threads);
  moe_index_.assign(size_t(p.n_layers), -1);
  for (size_t i = 0; i < p.moe_layers.size(); ++i) moe_index_[size_t(p.moe_layers[i])] = int(i);
  const uint64_t sb = layout_.slot_bytes();
  arena_bytes_ = size_t(o.slots) * size_t(dev_layout_.slot_bytes());
  arena_ = link_.alloc_device(arena_bytes_);
  weights_.resize(size_t(o.slots));
  ticket_.assign(size_t(o.slots), 0);
  staging_of_.assign(size_t(o.slots), -1);
  errors_.resize(size_t(o.slots));
  if (!layout_.packed())
    reader_ = std::make_unique<ExpertReader>(layout_.files(), o.direct, o.io_threads, o.read_chunk);
  if (o.staging == 0) {
    pinned_bytes_ = uint64_t(p.moe_layers.size()) * uint64_t(p.n_experts) * sb;
    pinned_ = link_.alloc_pinned(pinned_bytes_);
    fill_host_copy(ck);
    reader_.reset();  // the host copy is complete: no more disk reads
  } else {
    pinned_bytes_ = uint64_t(o.staging) * sb;
    pinned_ = link_.alloc_pinned(pinned_bytes_);
    staging_.resize(size_t(o.staging));
    host_slot_of_.assign(p.moe_layers.size() * size_t(p.n_experts), -1);
  }
}

DeviceExpertStore::~DeviceExpertStore() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      return std::none_of(staging_.begin(), staging_.end(), [](const Staging& s) { return s.reading && !s.read_done; });
    });
  }
  reader_.reset();
  // Copies still in flight read the pinned buffers and write the slots: let them land first.
  TransferLink::Ticket last = *std::max_element(ticket_.begin(), ticket_.end());
  for (const Staging& s : staging_) last = std::max(last, s.ticket);
  if (last) link_.host_wait(last);
}

char* DeviceExpertStore::host_image(int layer, int expert) const {
  const size_t i = size_t(moe_index_[size_t(layer)]) * size_t(layout_.params().n_experts) + size_t(expert);
  return pinned_.get() + i * size_t(layout_.slot_bytes());
}

void DeviceExpertStore::fill_host_copy(const Checkpoint& ck) {
  const ExpertStoreParams& p = layout_.params();
  if (layout_.packed()) {
    std::vector<std::pair<int, int>> all;
    for (int l : p.moe_layers)
      for (int e = 0; e < p.n_experts; ++e) all.emplace_back(l, e);
    ThreadPool::global().parallel_for(int64_t(all.size()), [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        const ExpertRecord& r = layout_.record(all[size_t(i)].first, all[size_t(i)].second);
        char* dst = host_image(all[size_t(i)].first, all[size_t(i)].second);
        for (const ExpertPiece& pc : r.pieces)
          if (pc.src) std::memcpy(dst + pc.slot_offset, pc.src, pc.view.nbytes());
      }
    }, 1);
    return;
  }
  // From disk with the store's reader: every expert queued at once, the reader keeps
  // io_threads reads in flight.
  std::mutex mu;
  std::condition_variable cv;
  int64_t pending = 0;
  std::string error;
  for (int l : p.moe_layers)
    for (int e = 0; e < p.n_experts; ++e) {
      {
        std::lock_guard<std::mutex> lock(mu);
        ++pending;
      }
      const ExpertRecord& r = layout_.record(l, e);
      reader_->read(r.extents, host_image(l, e), true, [&, l, e](const std::string& err, uint64_t, double) {
        std::lock_guard<std::mutex> lock(mu);
        if (!err.empty() && error.empty())
          error = layout_.files()[size_t(layout_.record(l, e).extents[0].file)] + ": expert " + std::to_string(e) +
                  " of layer " + std::to_string(l) + ": " + err;
        if (--pending == 0) cv.notify_all();
      });
    }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return pending == 0; });
  if (!error.empty()) fail(error);
}

ExpertStoreStats DeviceExpertStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ExpertStoreStats s = stats_;
  s.bytes_transferred = disk_bytes_;
  s.read_seconds = disk_seconds_;
  s.stall_seconds += link_.compute_stall_seconds() - link_stall_base_;
  return s;
}

void DeviceExpertStore::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = {};
  disk_bytes_ = 0;
  disk_seconds_ = 0;
  link_stall_base_ = link_.compute_stall_seconds();
}

size_t DeviceExpertStore::host_key(int layer, int expert) const {
  return size_t(moe_index_[size_t(layer)]) * size_t(layout_.params().n_experts) + size_t(expert);
}

void DeviceExpertStore::forget_host_slot(int64_t b) {
  Staging& s = staging_[size_t(b)];
  if (s.layer >= 0 && host_slot_of_[host_key(s.layer, s.expert)] == b) host_slot_of_[host_key(s.layer, s.expert)] = -1;
  s.layer = s.expert = -1;
  s.valid = false;
}

int64_t DeviceExpertStore::free_staging() {
  // A host slot not being read into and with its last copy landed: an empty one first, else the
  // least recently used.
  int64_t best = -1;
  for (size_t b = 0; b < staging_.size(); ++b) {
    const Staging& s = staging_[b];
    if (s.reading || (s.ticket != 0 && !link_.done(s.ticket))) continue;
    if (!s.valid) return int64_t(b);
    if (best < 0 || s.last_use < staging_[size_t(best)].last_use) best = int64_t(b);
  }
  return best;
}

int64_t DeviceExpertStore::take_staging() {
  for (;;) {
    if (const int64_t b = free_staging(); b >= 0) return b;
    // The oldest copy still reading a buffer: wait for it (it is already queued).
    TransferLink::Ticket oldest = 0;
    for (const Staging& s : staging_)
      if (!s.reading && s.ticket && (!oldest || s.ticket < oldest)) oldest = s.ticket;
    const auto t0 = Clock::now();
    if (oldest) link_.host_wait(oldest);
    else wait_for_a_read();  // every buffer is being read into
    stats_.stall_seconds += seconds_since(t0);
  }
}

void DeviceExpertStore::wait_for_a_read() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      return std::any_of(staging_.begin(), staging_.end(), [](const Staging& s) { return s.reading && s.read_done; });
    });
  }
  pump();
}

void DeviceExpertStore::pump() {
  std::vector<int64_t> landed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t b = 0; b < staging_.size(); ++b)
      if (staging_[b].reading && staging_[b].read_done) landed.push_back(int64_t(b));
  }
  for (int64_t b : landed) {
    Staging& s = staging_[size_t(b)];
    const int64_t slot = s.slot;
    s.reading = s.read_done = false;
    s.slot = -1;
    staging_of_[size_t(slot)] = -1;
    pool_.set_busy(slot, false);
    if (!s.error.empty()) {
      errors_[size_t(slot)] = s.error;
      s.error.clear();
      forget_host_slot(b);
      continue;
    }
    s.valid = true;
    s.ticket = ticket_[size_t(slot)] = copy_expert(slot, pinned_.get() + size_t(b) * size_t(layout_.slot_bytes()));
  }
}

TransferLink::Ticket DeviceExpertStore::copy_expert(int64_t slot, const char* src) {
  const int layer = pool_.layer_of(slot), expert = pool_.expert_of(slot);
  const ExpertRecord& from = layout_.record(layer, expert);
  const ExpertRecord& to = dev_layout_.record(layer, expert);
  char* dst = arena_.get() + size_t(slot) * size_t(dev_layout_.slot_bytes());
  TransferLink::Ticket t = 0;
  for (int k = 0; k < 6; ++k) {
    if (!to.pieces[k].view.ndim) continue;
    const size_t n = to.pieces[k].view.nbytes();
    t = link_.copy_to_device(dst + to.pieces[k].slot_offset, src + from.pieces[k].slot_offset, n);
    stats_.bytes_to_device += n;
  }
  return t;
}

int64_t DeviceExpertStore::claim(int layer, int expert) {
  bool evicted = false;
  // Every slot pinned or still being read from disk: let a read finish.
  const int64_t slot = pool_.claim_waiting(layer, expert, &evicted, [&] {
    const auto t0 = Clock::now();
    wait_for_a_read();
    stats_.stall_seconds += seconds_since(t0);
  }, "device expert pool");
  stats_.evictions += evicted;
  return slot;
}

void DeviceExpertStore::start_miss(int64_t slot, int layer, int expert) {
  char* dst = arena_.get() + size_t(slot) * size_t(dev_layout_.slot_bytes());
  ExpertWeights w = dev_layout_.bind(layer, expert, dst);
  for (Tensor* t : {&w.gate.w, &w.gate.scale_inv, &w.up.w, &w.up.scale_inv, &w.down.w, &w.down.scale_inv})
    on_device(*t, link_.device());
  weights_[size_t(slot)] = w;
  errors_[size_t(slot)].clear();
  const ExpertRecord& r = layout_.record(layer, expert);
  stats_.bytes_read += r.payload_bytes;
  if (host_copy()) {
    ticket_[size_t(slot)] = copy_expert(slot, host_image(layer, expert));
    return;
  }
  char* const host = pinned_.get();
  const size_t hb = size_t(layout_.slot_bytes());
  if (const int64_t kept = host_slot_of_[host_key(layer, expert)]; kept >= 0 && staging_[size_t(kept)].valid) {
    // Still in the host tier: copy it again, no disk read. The slot stays taken until this copy
    // lands (its ticket is the newest on the link's one stream).
    Staging& s = staging_[size_t(kept)];
    s.last_use = ++host_clock_;
    ++stats_.host_hits;
    s.ticket = ticket_[size_t(slot)] = copy_expert(slot, host + size_t(kept) * hb);
    return;
  }
  const int64_t b = take_staging();
  Staging& s = staging_[size_t(b)];
  forget_host_slot(b);
  s.layer = layer;
  s.expert = expert;
  s.last_use = ++host_clock_;
  host_slot_of_[host_key(layer, expert)] = b;
  s.slot = slot;
  s.reading = true;
  s.read_done = false;
  s.ticket = 0;
  staging_of_[size_t(slot)] = b;
  ticket_[size_t(slot)] = 0;
  pool_.set_busy(slot, true);
  char* buf = host + size_t(b) * hb;
  reader_->read(r.extents, buf, true, [this, b](const std::string& err, uint64_t bytes, double secs) {
    std::lock_guard<std::mutex> lock(mu_);
    staging_[size_t(b)].read_done = true;
    staging_[size_t(b)].error = err;
    disk_bytes_ += bytes;
    disk_seconds_ += secs;
    cv_.notify_all();
  });
}

std::vector<const ExpertWeights*> DeviceExpertStore::prepare_async(int layer, const std::vector<int>& experts) {
  pump();
  predictions_.score(layer, experts, stats_);
  stats_.requests += experts.size();
  stats_.hits += uint64_t(pool_.pin_hits(layer, experts, current_, stats_.prefetch_used));
  // Misses. A slot that held an expert may still be read by kernels queued before now: the
  // first copy into such a slot (and every later one: one stream) waits for them.
  bool ordered = false;
  for (size_t i = 0; i < experts.size(); ++i) {
    if (current_[i] >= 0) continue;
    ++stats_.misses;
    const int64_t slot = claim(layer, experts[i]);
    order_reuse(slot, ordered);
    pool_.pin(slot);
    start_miss(slot, layer, experts[i]);
    current_[i] = slot;
  }
  std::vector<const ExpertWeights*> out;
  out.reserve(current_.size());
  for (int64_t slot : current_) out.push_back(&weights_[size_t(slot)]);
  return out;
}

void DeviceExpertStore::order_reuse(int64_t slot, bool& ordered) {
  if (ordered || weights_[size_t(slot)].gate.w.empty()) return;
  link_.order_after_compute();
  ordered = true;
}

void DeviceExpertStore::prefetch(int layer, const std::vector<int>& experts) {
  if (!opts_.prefetch) return;
  pump();
  bool ordered = false;
  for (int e : predictions_.guess(layer, experts, stats_)) {
    if (pool_.find(layer, e) >= 0) continue;
    if (!host_copy() && free_staging() < 0) break;  // a guess never waits for a staging buffer
    bool evicted = false;
    const int64_t slot = pool_.claim_guess(layer, e, &evicted);
    if (slot < 0) break;
    stats_.evictions += evicted;
    ++stats_.prefetch_reads;
    order_reuse(slot, ordered);
    start_miss(slot, layer, e);
  }
}

bool DeviceExpertStore::ready(size_t i) {
  VIREO_ASSERT(i < current_.size());
  pump();
  const int64_t slot = current_[size_t(i)];
  return !pool_.busy(slot) && (ticket_[size_t(slot)] == 0 || link_.done(ticket_[size_t(slot)]));
}

void DeviceExpertStore::await(size_t i) {
  VIREO_ASSERT(i < current_.size());
  const int64_t slot = current_[i];
  pump();
  if (pool_.busy(slot)) {  // still being read from disk
    const auto t0 = Clock::now();
    while (pool_.busy(slot)) wait_for_a_read();
    stats_.stall_seconds += seconds_since(t0);
  }
  if (!errors_[size_t(slot)].empty()) {
    const std::string err = errors_[size_t(slot)];
    const int layer = pool_.layer_of(slot), expert = pool_.expert_of(slot);
    const std::string& file = layout_.files()[size_t(layout_.record(layer, expert).extents[0].file)];
    errors_[size_t(slot)].clear();
    pool_.release(slot);  // a later prepare reads it again
    weights_[size_t(slot)] = {};
    fail(file, ": expert ", expert, " of layer ", layer, ": ", err);
  }
  if (ticket_[size_t(slot)]) link_.compute_wait(ticket_[size_t(slot)]);
}

std::vector<const ExpertWeights*> DeviceExpertStore::prepare(int layer, const std::vector<int>& experts) {
  auto out = prepare_async(layer, experts);
  for (size_t i = 0; i < out.size(); ++i) await(i);
  return out;
}

}  // namespace vireo
