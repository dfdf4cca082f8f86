#include "experts/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace vireo {

namespace {
// Code, libraries, thread stacks and allocator slack: a fixed floor plus a share of the budget.
uint64_t reserve_for(uint64_t budget) { return (uint64_t(48) << 20) + budget / 50; }

// The scratch row's note: the step it is sized for (scratch grows with the step's tokens and
// with the keys attended, up to the context).
std::string scratch_note(const MemoryPlanInputs& in) {
  if (in.step_tokens <= 0) return "activations of one step";
  return str("activations of one step of ", in.step_tokens, " tokens over up to ", in.context, " keys");
}

void plan_gpu(MemoryPlan& p) {
  const MemoryPlanInputs& in = p.in;
  GpuPlan& g = p.g;
  p.gpu = true;
  g.reserve = gpu_reserve_for(in.gpu_budget);
  const uint64_t fixed = in.dense_bytes + in.cache_bytes + in.scratch_bytes + in.backend_bytes + g.reserve;
  const uint64_t dev_slot = in.device_slot_bytes ? in.device_slot_bytes : in.slot_bytes;
  const uint64_t slot = std::max<uint64_t>(dev_slot, 1);
  // The reserve grows with the budget: solve B >= fixed_without_the_2% + B / 50 + top_k slots.
  const uint64_t base = fixed - in.gpu_budget / 50 + uint64_t(std::max(in.top_k, 1)) * slot;
  g.minimum = uint64_t(double(base) / (1.0 - 1.0 / 50)) + 1;
  g.slots = in.gpu_budget > fixed ? int64_t((in.gpu_budget - fixed) / slot) : 0;
  g.slots = std::min<int64_t>(g.slots, p.total_experts());
  g.pool_bytes = uint64_t(g.slots) * dev_slot;
  g.total = fixed + g.pool_bytes;
  g.fits = in.gpu_budget >= g.minimum && g.slots >= std::max(in.top_k, 1);
  // Host side. Every expert pinned in RAM when it fits (the RAM budget, else 90% of what is
  // available); else as many pinned host slots as that RAM holds: a tier between disk and GPU
  // that keeps the experts read last (LRU), so a device miss whose expert is still there is a
  // copy, not a disk read. With nothing known about RAM, 2 x top_k slots (a staging ring).
  const uint64_t all = uint64_t(p.total_experts()) * in.slot_bytes;
  const uint64_t ram_reserve = reserve_for(in.budget);
  if (in.in_memory) g.host_copy = true;
  else if (in.budget) g.host_copy = in.dense_bytes + all + ram_reserve <= in.budget;
  else if (in.host_available) g.host_copy = in.dense_bytes + all <= in.host_available / 10 * 9;
  else g.host_copy = true;
  if (g.host_copy) {
    g.staging = 0;
    g.pinned_bytes = all;
  } else {
    g.staging = std::max(2 * in.top_k, 2);
    const uint64_t ram = in.budget ? in.budget : in.host_available / 10 * 9;
    if (ram) {
      const uint64_t fixed_ram = in.dense_bytes + ram_reserve;
      const int64_t room = ram > fixed_ram ? int64_t((ram - fixed_ram) / std::max<uint64_t>(in.slot_bytes, 1)) : 0;
      g.staging = std::min<int64_t>(room, p.total_experts());
      if (g.staging < 1) g.fits = false;  // not even one host slot fits the RAM budget
    }
    g.staging = std::max<int64_t>(g.staging, 0);
    g.pinned_bytes = uint64_t(g.staging) * in.slot_bytes;
  }
  g.host_total = in.dense_bytes + g.pinned_bytes + ram_reserve;
}

}  // namespace

uint64_t gpu_reserve_for(uint64_t gpu_budget) { return (uint64_t(640) << 20) + gpu_budget / 50; }

std::string format_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", v, units[u]);
  return buf;
}

uint64_t parse_byte_size(const std::string& s, const std::string& flag) {
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(s, &used);
  } catch (...) {
    used = 0;
  }
  std::string unit = s.substr(used);
  for (char& ch : unit) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  if (unit.size() > 1 && unit.back() == 'B') unit.pop_back();
  if (unit.size() > 1 && unit.back() == 'I') unit.pop_back();
  double mult = 0;
  if (unit.empty()) mult = 1;
  else if (unit == "K") mult = 1024.0;
  else if (unit == "M") mult = 1024.0 * 1024;
  else if (unit == "G") mult = 1024.0 * 1024 * 1024;
  else if (unit == "T") mult = 1024.0 * 1024 * 1024 * 1024;
  if (used == 0 || mult == 0 || !(v >= 0) || v * mult > 1.8e19)
    fail(flag, ": '", s, "' is not a size (expected bytes or a number with K, M, G or T, e.g. 8G)");
  return uint64_t(std::llround(v * mult));
}

MemoryPlan make_memory_plan(const MemoryPlanInputs& in) {
  MemoryPlan p;
  p.in = in;
  p.streaming = in.budget > 0;
  p.reserve = reserve_for(in.budget);
  const uint64_t fixed = in.dense_bytes + in.cache_bytes + in.scratch_bytes + p.reserve;
  const uint64_t slot = std::max<uint64_t>(in.slot_bytes, 1);
  // The reserve grows with the budget: solve B >= fixed_without_the_2% + B / 50 + top_k slots
  // (fixed holds this budget's 2% already: take it out before solving, or it counts twice).
  const uint64_t base = fixed - in.budget / 50 + uint64_t(std::max(in.top_k, 1)) * slot;
  p.minimum = uint64_t(double(base) / (1.0 - 1.0 / 50)) + 1;
  if (p.streaming) {
    p.slots = in.budget > fixed ? int64_t((in.budget - fixed) / slot) : 0;
    p.slots = std::min<int64_t>(p.slots, p.total_experts());
    p.pool_bytes = uint64_t(p.slots) * in.slot_bytes;
    p.fits = in.budget >= p.minimum && p.slots >= std::max(in.top_k, 1);
  } else {
    p.slots = p.total_experts();
    p.pool_bytes = uint64_t(p.slots) * in.expert_bytes;
  }
  p.total = fixed + p.pool_bytes;
  if (in.gpu_budget) plan_gpu(p);
  return p;
}

std::string MemoryPlan::table() const {
  std::string t;
  if (gpu) {
    auto row = [&](const char* name, const std::string& ram, const std::string& dev, const std::string& note) {
      char buf[320];
      std::snprintf(buf, sizeof buf, "  %-26s %12s %12s  %s\n", name, ram.c_str(), dev.c_str(), note.c_str());
      t += buf;
    };
    const std::string none = "-";
    t += str("memory plan: GPU budget ", format_bytes(in.gpu_budget), ", RAM budget ",
             in.budget ? format_bytes(in.budget) : std::string("none"), ", context ", in.context, " x batch ", in.batch,
             "\n");
    row("", "RAM", "GPU", "");
    row("resident weights", format_bytes(in.dense_bytes), format_bytes(in.dense_bytes),
        "dense spine: embeddings, attention, norms, routers, shared experts, dense layers, lm_head");
    char note[200];
    std::snprintf(note, sizeof note, "GPU: %lld slots x %s (%.1f%% of %lld routed experts); RAM: %s",
                  (long long)g.slots, format_bytes(in.device_slot_bytes ? in.device_slot_bytes : in.slot_bytes).c_str(),
                  total_experts() ? 100.0 * double(g.slots) / double(total_experts()) : 0.0,
                  (long long)total_experts(),
                  g.host_copy ? "pinned copy of every expert"
                              : str("host tier of ", g.staging, " pinned slots (",
                                    int(100.0 * double(g.staging) / double(std::max<int64_t>(total_experts(), 1))),
                                    "% of experts, LRU) fed from disk").c_str());
    row("expert pool", format_bytes(g.pinned_bytes), format_bytes(g.pool_bytes), note);
    row("MLA cache", none, format_bytes(in.cache_bytes), str(in.context, " tokens x ", in.batch, " sequences"));
    row("scratch", none, format_bytes(in.scratch_bytes), scratch_note(in));
    row("op buffers", none, format_bytes(in.backend_bytes),
        "backend: input conversions, FP8 weight copies, 4 expert lanes (workspace + rows), at most");
    row("reserve", format_bytes(reserve_for(in.budget)), format_bytes(g.reserve),
        "RAM: 48 MiB + 2% of budget; GPU: CUDA context, cuBLASLt workspace (640 MiB) + 2% of budget");
    row("total", format_bytes(g.host_total), format_bytes(g.total),
        str(format_bytes(in.gpu_budget > g.total ? in.gpu_budget - g.total : 0), " of the GPU budget unused"));
    row("minimum budget", none, format_bytes(g.minimum), str("a device pool of top_k = ", in.top_k, " slots"));
    return t;
  }
  auto row = [&](const char* name, uint64_t bytes, const std::string& note) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "  %-26s %12s  %s\n", name, format_bytes(bytes).c_str(), note.c_str());
    t += buf;
  };
  t += str("memory plan: ", streaming ? "budget " + format_bytes(in.budget) : std::string("no budget (all experts resident)"),
           ", context ", in.context, " x batch ", in.batch, "\n");
  row("resident weights", in.dense_bytes, "dense spine: embeddings, attention, norms, routers, shared experts, dense layers, lm_head");
  char note[160];
  std::snprintf(note, sizeof note, "%lld slots x %s (%.1f%% of %lld routed experts)", (long long)slots,
                format_bytes(streaming ? in.slot_bytes : in.expert_bytes).c_str(),
                total_experts() ? 100.0 * double(slots) / double(total_experts()) : 0.0, (long long)total_experts());
  row("expert pool", pool_bytes, note);
  row("MLA cache", in.cache_bytes, str(in.context, " tokens x ", in.batch, " sequences"));
  row("scratch", in.scratch_bytes, scratch_note(in));
  row("reserve", reserve, "code, stacks, allocator slack (48 MiB + 2% of budget)");
  row("total", total, streaming ? str(format_bytes(in.budget > total ? in.budget - total : 0), " of the budget unused") : "");
  if (streaming) row("minimum budget", minimum, str("a pool of top_k = ", in.top_k, " slots"));
  return t;
}

}  // namespace vireo
