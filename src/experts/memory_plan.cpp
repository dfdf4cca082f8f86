#include "experts/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace vireo {

namespace {
// Code, libraries, thread stacks and allocator slack: a fixed floor plus a share of the budget.
uint64_t reserve_for(uint64_t budget) { return (uint64_t(48) << 20) + budget / 50; }
}  // namespace

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
  p.minimum = fixed + uint64_t(std::max(in.top_k, 1)) * slot;
  // The reserve grows with the budget: solve budget >= fixed(budget) + top_k slots.
  p.minimum = uint64_t(double(p.minimum) / (1.0 - 1.0 / 50)) + 1;
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
  return p;
}

std::string MemoryPlan::table() const {
  std::string t;
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
  row("scratch", in.scratch_bytes, "activations of one step");
  row("reserve", reserve, "code, stacks, allocator slack (48 MiB + 2% of budget)");
  row("total", total, streaming ? str(format_bytes(in.budget > total ? in.budget - total : 0), " of the budget unused") : "");
  if (streaming) row("minimum budget", minimum, str("a pool of top_k = ", in.top_k, " slots"));
  if (in.gpu_budget) row("GPU budget", in.gpu_budget, "not planned yet: the CPU backend holds everything in RAM");
  return t;
}

}  // namespace vireo
