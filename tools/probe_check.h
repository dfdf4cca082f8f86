// What the standalone CUDA probes (tools/*_probe.cu: no vireo library, but vireo_stream_probe takes
// the backend's header-only device helpers and vireo_topk_probe calls the library's top-k) share:
// CHECK(x), with which a failed CUDA call prints "<kProbeName>: <call>: <error>" and exits 1 (each
// probe defines kProbeName first), the 16-byte streaming load they read with, and the copy line
// they print.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                    \
  do {                                                                              \
    const cudaError_t e_ = (x);                                                     \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s: %s: %s\n", kProbeName, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

// As vireo's ldg_stream: 16 bytes, not kept in L1.
__device__ __forceinline__ uint4 ld16(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
__device__ __forceinline__ unsigned fold(const uint4& w) { return w.x ^ w.y ^ w.z ^ w.w; }

// The copy line (vireo bench copies 2 GiB each way): pool's first half copied onto its second 5
// times after one warm-up copy; *gbs = bytes read + written over the time. Returns the first error.
inline cudaError_t copy_gbs(char* pool, size_t pool_bytes, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1,
                            double* gbs) {
  const size_t half = pool_bytes / 2;
  cudaError_t e = cudaMemcpyAsync(pool + half, pool, half, cudaMemcpyDeviceToDevice, st);
  if (e == cudaSuccess) e = cudaEventRecord(e0, st);
  for (int i = 0; i < 5 && e == cudaSuccess; ++i)
    e = cudaMemcpyAsync(pool + half, pool, half, cudaMemcpyDeviceToDevice, st);
  if (e == cudaSuccess) e = cudaEventRecord(e1, st);
  if (e == cudaSuccess) e = cudaEventSynchronize(e1);
  float ms = 0;
  if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
  *gbs = 2.0 * double(half) * 5 / 1e6 / ms;
  return e;
}

// The median over 9 timed replays of `reps` calls of run(i) (i = 0 .. reps - 1, queued on st), in
// us a call, into *us (after one untimed replay that warms the clocks). Returns the first error.
template <class Run>
cudaError_t median_replay_us(cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, int reps, Run&& run, float* us) {
  for (int i = 0; i < reps; ++i) run(i);
  std::vector<float> t(9);
  for (float& v : t) {
    cudaError_t e = cudaEventRecord(e0, st);
    for (int i = 0; i < reps && e == cudaSuccess; ++i) run(i);
    if (e == cudaSuccess) e = cudaEventRecord(e1, st);
    if (e == cudaSuccess) e = cudaEventSynchronize(e1);
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
    if (e != cudaSuccess) return e;
    v = ms * 1e3f / float(reps);
  }
  std::sort(t.begin(), t.end());
  *us = t[t.size() / 2];
  return cudaGetLastError();
}
