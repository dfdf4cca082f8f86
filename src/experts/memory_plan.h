#pragma once
// The memory plan: arithmetic over what a run will hold in RAM (dense spine resident, a pool of
// expert slots, the MLA cache, activation scratch and a reserve), from which the expert pool is
// sized to fit a budget. Tests check it against the bytes really allocated.
//
// With a GPU budget (--gpu-budget, --device cuda) the plan has a second column: on the device
// the dense spine, a pool of expert slots, the MLA cache, scratch and a reserve (CUDA context,
// cuBLASLt workspace); in RAM a pinned copy of every routed expert, or, where that does not fit
// the RAM budget (or the memory available), a host tier: as many pinned expert slots as fit,
// fed by disk reads and kept LRU, so a device miss on an expert still there is only a copy.
#include <cstdint>
#include <string>

namespace vireo {

struct MemoryPlanInputs {
  uint64_t budget = 0;         // bytes; 0: no budget (every expert resident)
  uint64_t dense_bytes = 0;    // resident weights: everything but routed experts
  uint64_t expert_bytes = 0;   // one routed expert's weights
  uint64_t slot_bytes = 0;     // one pool slot (expert_bytes plus block alignment)
  uint64_t device_slot_bytes = 0;  // one device slot (tensors packed, 256-byte aligned); 0: slot_bytes
  int n_moe_layers = 0, n_experts = 0, top_k = 0;
  uint64_t cache_bytes = 0;    // MLA cache for context x batch
  uint64_t scratch_bytes = 0;  // activations of one step
  uint64_t backend_bytes = 0;  // GPU plans: the backend's op buffers (conversions, side lanes)
  int64_t context = 0, batch = 1;
  int64_t step_tokens = 0;     // tokens of the largest step scratch_bytes is sized for (the table's note)
  uint64_t gpu_budget = 0;     // bytes of device memory; 0: no GPU column
  uint64_t host_available = 0; // GPU plans without a RAM budget: RAM free for a pinned copy (0: assume it fits)
  bool in_memory = false;      // the checkpoint is in memory (no disk to stream from)
};

// The device column of a plan with a GPU budget.
struct GpuPlan {
  int64_t slots = 0;         // device expert slots
  uint64_t pool_bytes = 0;
  uint64_t reserve = 0;      // CUDA context, cuBLASLt workspace, op scratch, allocator slack
  uint64_t total = 0;
  uint64_t minimum = 0;      // smallest GPU budget that runs: top_k slots
  bool fits = true;
  // Host side: a pinned copy of every expert, or a host tier of `staging` pinned slots fed from
  // disk (LRU; also the staging buffers of the copies to the device).
  bool host_copy = true;
  int64_t staging = 0;
  uint64_t pinned_bytes = 0;
  uint64_t host_total = 0;   // RAM: resident weights + pinned + reserve
};

struct MemoryPlan {
  MemoryPlanInputs in;
  bool streaming = false;    // a budget is set: experts stream through the pool
  int64_t slots = 0;         // pool slots (streaming), else every expert
  uint64_t pool_bytes = 0;
  uint64_t reserve = 0;      // code, thread stacks, allocator slack
  uint64_t total = 0;        // sum of the rows
  uint64_t minimum = 0;      // smallest budget that runs: a pool of top_k slots
  bool fits = true;          // budget >= minimum
  bool gpu = false;          // in.gpu_budget > 0: `g` holds the device column
  GpuPlan g;
  int64_t total_experts() const { return int64_t(in.n_moe_layers) * in.n_experts; }
  // The table, one row per line.
  std::string table() const;
};

MemoryPlan make_memory_plan(const MemoryPlanInputs& in);
// The GPU reserve for a device budget: 640 MiB + 2% of it.
uint64_t gpu_reserve_for(uint64_t gpu_budget);

// "8G", "512M", "1.5GiB", "64k", "123" (binary units: K = 1024) -> bytes; `flag` names the
// option in errors.
uint64_t parse_byte_size(const std::string& s, const std::string& flag);
// 1536 -> "1.50 KiB".
std::string format_bytes(uint64_t bytes);

}  // namespace vireo
