#pragma once
// SlotPool: which (layer, expert) occupies which of a fixed number of slots, and which slot to
// give up for a new one. Pure bookkeeping, no memory and no I/O, so a host pool and a GPU pool
// share it.
//
// Policy: least recently used over one global pool, with a per-layer floor: a slot may be taken
// from another layer only while that layer holds more than `floor` slots, so one layer's burst
// cannot strip every other layer bare. A slot is never taken while pinned (handed out by the
// current prepare) or busy (its bytes are still arriving).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/error.h"

namespace vireo {

class SlotPool {
 public:
  // layers: index range of layer ids (0 .. n_layers-1); n_moe_layers: how many of them can hold
  // slots (for the capacity arithmetic).
  SlotPool(int64_t n_slots, int n_layers, int n_moe_layers, int n_experts, int floor);
  // The floor when none is asked for (-1): min(top_k, (n_slots - top_k) / n_moe_layers), so one
  // prepare can always hold top_k experts while every layer keeps as much as the pool allows.
  static int auto_floor(int64_t n_slots, int n_moe_layers, int top_k);

  int64_t size() const { return int64_t(slots_.size()); }
  int floor() const { return floor_; }
  // Slots one prepare for any layer can hold at once: every other MoE layer may keep its floor.
  int64_t max_per_prepare() const;

  // The slot holding (layer, expert), or -1.
  int64_t find(int layer, int expert) const;
  // Assigns a slot to (layer, expert), which must not be resident: a free slot if any, else the
  // least recently used evictable one. Returns -1 if every slot is pinned, busy or protected by
  // a floor. *evicted is set when a resident expert lost its slot. own_layer_only: take only a
  // free slot or one of `layer`'s own (prefetch: a guess must not push out other layers).
  int64_t claim(int layer, int expert, bool* evicted = nullptr, bool own_layer_only = false);
  // As claim(), but while every slot is pinned or busy calls `wait()` (which must let a busy
  // slot finish) and tries again. Fails (an internal error naming `what`) when no slot is busy:
  // then nothing could ever free one.
  template <typename Wait>
  int64_t claim_waiting(int layer, int expert, bool* evicted, Wait&& wait, const char* what) {
    for (;;) {
      const int64_t slot = claim(layer, expert, evicted);
      if (slot >= 0) return slot;
      if (!any_busy())
        fail("internal error: ", what, " of ", size(), " slots exhausted by one prepare of layer ", layer);
      wait();
    }
  }
  void touch(int64_t slot);             // most recently used
  void pin(int64_t slot);               // until unpin_all()
  void unpin_all();
  void set_busy(int64_t slot, bool busy);
  bool busy(int64_t slot) const { return slots_[size_t(slot)].busy; }
  bool any_busy() const;
  // Drops the slot's expert (e.g. a failed read); the slot becomes free.
  void release(int64_t slot);

  int layer_of(int64_t slot) const { return slots_[size_t(slot)].layer; }
  int expert_of(int64_t slot) const { return slots_[size_t(slot)].expert; }
  int resident(int layer) const { return per_layer_[size_t(layer)]; }
  // Per-slot user flag: the stores mark prefetched-not-yet-used slots kPrefetched.
  static constexpr uint8_t kPrefetched = 1;
  uint8_t& tag(int64_t slot) { return slots_[size_t(slot)].tag; }
  // A slot for a prefetch guess, tagged kPrefetched: a free one or one of `layer`'s own least
  // recently used (exactly what that layer's misses would evict anyway; a guess must not push
  // out other layers' experts). -1 when there is none: the guess is dropped, never waited for.
  int64_t claim_guess(int layer, int expert, bool* evicted) {
    const int64_t slot = claim(layer, expert, evicted, true);
    if (slot >= 0) tag(slot) = kPrefetched;
    return slot;
  }
  // The start of a prepare of `experts` of `layer`: unpins the previous prepare's slots, then
  // finds and pins the experts already in slots, all before any miss picks a victim, so a miss
  // never evicts an expert this same prepare is about to use. slots[i] = experts[i]'s slot, or
  // -1 for a miss. Returns the hits; counts a prefetched slot as used on its first request.
  int64_t pin_hits(int layer, const std::vector<int>& experts, std::vector<int64_t>& slots, uint64_t& prefetch_used);

 private:
  struct Slot {
    int layer = -1, expert = -1;
    uint64_t last_use = 0;
    bool pinned = false, busy = false;
    uint8_t tag = 0;
  };
  std::vector<Slot> slots_;
  std::vector<int64_t> where_;   // [layer * n_experts + expert] -> slot or -1
  std::vector<int> per_layer_;   // slots held per layer
  std::vector<int64_t> pinned_;
  int n_experts_, n_moe_layers_, floor_;
  uint64_t clock_ = 0;
};

}  // namespace vireo
