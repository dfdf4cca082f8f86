#include "experts/slot_pool.h"

#include <algorithm>

#include "core/error.h"

namespace vireo {

SlotPool::SlotPool(int64_t n_slots, int n_layers, int n_moe_layers, int n_experts, int floor)
    : slots_(size_t(std::max<int64_t>(n_slots, 0))),
      where_(size_t(n_layers) * size_t(n_experts), -1),
      per_layer_(size_t(n_layers), 0),
      n_experts_(n_experts),
      n_moe_layers_(n_moe_layers),
      floor_(std::max(floor, 0)) {}

int SlotPool::auto_floor(int64_t n_slots, int n_moe_layers, int top_k) {
  return int(std::clamp<int64_t>((n_slots - top_k) / std::max(n_moe_layers, 1), 0, top_k));
}

int64_t SlotPool::max_per_prepare() const {
  return std::max<int64_t>(0, size() - int64_t(std::max(n_moe_layers_ - 1, 0)) * floor_);
}

int64_t SlotPool::find(int layer, int expert) const {
  return where_[size_t(layer) * size_t(n_experts_) + size_t(expert)];
}

int64_t SlotPool::claim(int layer, int expert, bool* evicted, bool own_layer_only) {
  VIREO_ASSERT(find(layer, expert) < 0);
  if (evicted) *evicted = false;
  int64_t best = -1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.layer < 0) {  // free slots first
      best = int64_t(i);
      break;
    }
    if (s.pinned || s.busy) continue;
    if (s.layer != layer && (own_layer_only || per_layer_[size_t(s.layer)] <= floor_)) continue;
    if (best < 0 || s.last_use < slots_[size_t(best)].last_use) best = int64_t(i);
  }
  if (best < 0) return -1;
  Slot& s = slots_[size_t(best)];
  if (s.layer >= 0) {
    where_[size_t(s.layer) * size_t(n_experts_) + size_t(s.expert)] = -1;
    --per_layer_[size_t(s.layer)];
    if (evicted) *evicted = true;
  }
  s.layer = layer;
  s.expert = expert;
  s.tag = 0;
  s.last_use = ++clock_;
  where_[size_t(layer) * size_t(n_experts_) + size_t(expert)] = best;
  ++per_layer_[size_t(layer)];
  return best;
}

void SlotPool::touch(int64_t slot) { slots_[size_t(slot)].last_use = ++clock_; }

void SlotPool::pin(int64_t slot) {
  if (!slots_[size_t(slot)].pinned) pinned_.push_back(slot);
  slots_[size_t(slot)].pinned = true;
}

int64_t SlotPool::pin_hits(int layer, const std::vector<int>& experts, std::vector<int64_t>& slots,
                           uint64_t& prefetch_used) {
  if (int64_t(experts.size()) > max_per_prepare())
    fail("internal error: prepare of ", experts.size(), " experts exceeds the ", max_per_prepare(),
         " one prepare can hold");
  unpin_all();
  slots.assign(experts.size(), -1);
  int64_t hits = 0;
  for (size_t i = 0; i < experts.size(); ++i) {
    const int64_t slot = find(layer, experts[i]);
    if (slot < 0) continue;
    ++hits;
    if (tag(slot) == kPrefetched) {
      ++prefetch_used;
      tag(slot) = 0;
    }
    touch(slot);
    pin(slot);
    slots[i] = slot;
  }
  return hits;
}

void SlotPool::unpin_all() {
  for (int64_t s : pinned_) slots_[size_t(s)].pinned = false;
  pinned_.clear();
}

void SlotPool::set_busy(int64_t slot, bool busy) { slots_[size_t(slot)].busy = busy; }

bool SlotPool::any_busy() const {
  return std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.busy; });
}

void SlotPool::release(int64_t slot) {
  Slot& s = slots_[size_t(slot)];
  if (s.layer < 0) return;
  where_[size_t(s.layer) * size_t(n_experts_) + size_t(s.expert)] = -1;
  --per_layer_[size_t(s.layer)];
  s = Slot{};
  pinned_.erase(std::remove(pinned_.begin(), pinned_.end(), slot), pinned_.end());
}

}  // namespace vireo
