// Every kernel's (and copy's and memset's) start and end on the GPU, recorded kernels (CUDA graphs) included, for a
// program that knows nothing of it: a CUPTI injection library. The CUDA driver loads it at its first call where
// CUDA_INJECTION64_PATH names it; it asks CUPTI for one record a kernel (the GPU's own timestamps) and writes them as
// CSV when the program exits. What ncu cannot show (it runs a kernel alone): where inside the recorded decode step each
// kernel starts and ends, the overlaps PDL and the graph's branches give, and the time no kernel runs.
// tools/kernel_trace.py reads the CSV.
//
//   (CUDA builds where the toolkit has CUPTI: build-cuda/libvireo_kernel_trace.so; or by hand:
//    g++ -O2 -shared -fPIC -I$CUDA/include tools/kernel_trace.cpp -L$CUDA/lib64 -lcupti -o libkernel_trace.so)
//   CUDA_INJECTION64_PATH=$PWD/build-cuda/libvireo_kernel_trace.so VIREO_KERNEL_TRACE=trace.csv vireo bench ...
//   python3 tools/kernel_trace.py trace.csv
//
// Columns: start_ns,end_ns,graph_id,graph_node_id,correlation_id,stream_id,grid,block,name. A
// recorded graph's kernels share the correlation id of the cudaGraphLaunch that ran them.
// Not part of vireo: the engine has no CUPTI dependency.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Row {
  uint64_t start, end, graph_node;
  uint32_t graph, correlation, stream;
  int grid[3], block[3];
  std::string name;
};

std::mutex g_mu;
std::vector<Row>* g_rows = nullptr;  // leaked on purpose: written from atexit
constexpr size_t kBufferBytes = 8u << 20;

#define TRACE_CHECK(call)                                                          \
  do {                                                                             \
    CUptiResult r_ = (call);                                                       \
    if (r_ != CUPTI_SUCCESS) {                                                     \
      const char* s_ = nullptr;                                                    \
      cuptiGetResultString(r_, &s_);                                               \
      std::fprintf(stderr, "kernel_trace: %s failed: %s\n", #call, s_ ? s_ : "?"); \
    }                                                                              \
  } while (0)

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

// The fields every activity record kind here shares (kernels, copies, memsets); grid and block 0.
template <class R>
Row row_of(const R* r, std::string name) {
  Row row{};
  row.start = r->start, row.end = r->end, row.graph_node = r->graphNodeId;
  row.graph = r->graphId, row.correlation = r->correlationId, row.stream = r->streamId;
  row.name = std::move(name);
  return row;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      g_rows->push_back(
          row_of(m, "memcpy " + std::to_string(m->bytes) + " B kind " + std::to_string(int(m->copyKind))));
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      g_rows->push_back(row_of(m, "memset " + std::to_string(m->bytes) + " B"));
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      Row row = row_of(k, k->name ? k->name : "?");
      row.grid[0] = k->gridX, row.grid[1] = k->gridY, row.grid[2] = k->gridZ;
      row.block[0] = k->blockX, row.block[1] = k->blockY, row.block[2] = k->blockZ;
      g_rows->push_back(std::move(row));
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "kernel_trace: CUPTI dropped %zu records\n", dropped);
  std::free(buffer);
}

void write_trace() {
  TRACE_CHECK(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
  const char* path = std::getenv("VIREO_KERNEL_TRACE");
  if (!path || !*path) path = "kernel_trace.csv";
  FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", path);
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(f, "start_ns,end_ns,graph_id,graph_node_id,correlation_id,stream_id,grid,block,name\n");
  for (const Row& r : *g_rows)
    std::fprintf(f, "%llu,%llu,%u,%llu,%u,%u,%dx%dx%d,%dx%dx%d,\"%s\"\n", (unsigned long long)r.start,
                 (unsigned long long)r.end, r.graph, (unsigned long long)r.graph_node, r.correlation, r.stream,
                 r.grid[0], r.grid[1], r.grid[2], r.block[0], r.block[1], r.block[2], r.name.c_str());
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu kernels -> %s\n", g_rows->size(), path);
}

}  // namespace

extern "C" int InitializeInjection() {
  g_rows = new std::vector<Row>();
  g_rows->reserve(1 << 20);
  TRACE_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  // CONCURRENT_KERNEL keeps kernels overlapping as they run (KERNEL would serialize them).
  TRACE_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  TRACE_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));  // a graph's copy and memset nodes too
  TRACE_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
  std::atexit(write_trace);
  return 1;
}
