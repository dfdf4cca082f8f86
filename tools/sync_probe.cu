// vireo_sync_probe: what one dependency between two steps of work costs on the GPU, three ways:
//  1. a kernel boundary in a recorded graph with programmatic dependent launch (as the decode step
//     runs: every kernel begins with griddepcontrol.wait, then launch_dependents);
//  2. the same boundary without PDL (the graph's plain edges);
//  3. a grid barrier inside one persistent kernel (a block an SM, co-resident by a cooperative
//     launch; arrival by atomicAdd with release order, waiting by acquire loads of a generation).
// Each of N dependent steps does the least a step of the decode layer does: every block reads one
// word that the previous step wrote (a different block's) and writes its own. Grids of 132 blocks
// x 1024 threads (a block an SM, as the wide GEMVs), of 528 x 256 (4 an SM) and 132 x 256; the last
// column asks 120 KB of shared memory a block, so that a step's blocks cannot share an SM with the
// step before. Printed: us a step, the median of 7 timed runs (CUDA events). No vireo code.
//
//   build-cuda/vireo_sync_probe        (built with the CUDA backend; needs an sm_90 GPU)
//
// Why: docs/notes/cuda-decode-gemv.md sketches a persistent decode step that would replace the
// ~15 kernel boundaries of a layer with barriers or counters inside one kernel. That gains only
// where a barrier costs less than a boundary; this measures both before the rewrite.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

namespace {

constexpr const char* kProbeName = "vireo_sync_probe";

constexpr int kSteps = 200, kTimed = 7;

// One step as its own kernel: wait for the step before, let the next be dispatched, read the word
// a neighbouring block wrote in the step before, write this block's.
__global__ void step_kernel(const int* __restrict__ in, int* __restrict__ out, int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (threadIdx.x == 0) {
    const int b = int(blockIdx.x);
    out[b] = in[(b + 1) % int(gridDim.x)] + 1;
  }
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// All steps in one kernel, a grid barrier between them. bar[0]: arrivals, bar[1]: generation.
__global__ void persistent_kernel(int* __restrict__ a, int* __restrict__ b, unsigned* bar, int steps) {
  const int blk = int(blockIdx.x), nb = int(gridDim.x);
  for (int s = 0; s < steps; ++s) {
    const int* in = s % 2 ? b : a;
    int* out = s % 2 ? a : b;
    if (threadIdx.x == 0) {
      out[blk] = in[(blk + 1) % nb] + 1;
      const unsigned gen = ld_acquire(bar + 1);
      __threadfence();  // this block's write before its arrival
      if (atomicAdd(bar, 1u) == unsigned(nb) - 1) {
        bar[0] = 0;
        __threadfence();
        atomicAdd(bar + 1, 1u);  // release the next generation
      } else {
        while (ld_acquire(bar + 1) == gen) {
        }
      }
    }
    __syncthreads();
  }
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// us a step of a graph of kSteps step kernels.
// smem: dynamic shared memory a block asks for (120 KB: no two blocks of two steps share an SM, so
// PDL cannot dispatch a step's blocks before the step before has left the SM).
float graph_chain(int blocks, int threads, bool pdl, int* a, int* b, size_t smem = 0) {
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int s = 0; s < kSteps; ++s) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(unsigned(blocks));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const int* in = s % 2 ? b : a;
    int* out = s % 2 ? a : b;
    CHECK(cudaLaunchKernelEx(&cfg, step_kernel, in, out, pdl ? 1 : 0));
  }
  CHECK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphLaunch(exec, st));  // warm-up
  CHECK(cudaStreamSynchronize(st));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int i = 0; i < kTimed; ++i) {
    CHECK(cudaEventRecord(e0, st));
    CHECK(cudaGraphLaunch(exec, st));
    CHECK(cudaEventRecord(e1, st));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms * 1000.0f / kSteps);
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(st));
  return median(t);
}

// us a step of one cooperative kernel of kSteps barriers (0 where the grid cannot be resident).
float persistent(int blocks, int threads, int* a, int* b, unsigned* bar) {
  int per_sm = 0, sms = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel, threads, 0));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (per_sm * sms < blocks) return 0.0f;
  int steps = kSteps;
  void* args[] = {&a, &b, &bar, &steps};
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int i = 0; i <= kTimed; ++i) {
    CHECK(cudaMemset(bar, 0, 2 * sizeof(unsigned)));
    CHECK(cudaEventRecord(e0));
    CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persistent_kernel), dim3(unsigned(blocks)),
                                      dim3(unsigned(threads)), args, 0, nullptr));
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) t.push_back(ms * 1000.0f / kSteps);  // the first launch warms up
  }
  return median(t);
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int *a = nullptr, *b = nullptr;
  unsigned* bar = nullptr;
  CHECK(cudaMalloc(&a, 4096 * sizeof(int)));
  CHECK(cudaMalloc(&b, 4096 * sizeof(int)));
  CHECK(cudaMalloc(&bar, 2 * sizeof(unsigned)));
  CHECK(cudaMemset(a, 0, 4096 * sizeof(int)));
  CHECK(cudaMemset(b, 0, 4096 * sizeof(int)));
  std::printf("us a dependent step (median of %d runs of %d steps), %d SMs\n", kTimed, kSteps, sms);
  CHECK(cudaFuncSetAttribute(step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
  std::printf("%-26s %12s %12s %12s %16s\n", "grid", "graph+PDL", "graph", "persistent", "PDL, 120KB smem");
  const int shapes[][2] = {{sms, 1024}, {4 * sms, 256}, {sms, 256}};
  for (const auto& s : shapes) {
    const float pdl = graph_chain(s[0], s[1], true, a, b);
    const float plain = graph_chain(s[0], s[1], false, a, b);
    const float pers = persistent(s[0], s[1], a, b, bar);
    const float alone = s[0] <= sms ? graph_chain(s[0], s[1], true, a, b, 120 * 1024) : 0.0f;
    std::printf("%4d blocks x %4d threads %12.2f %12.2f %12.2f %16.2f\n", s[0], s[1], pdl, plain, pers, alone);
  }
  return 0;
}
