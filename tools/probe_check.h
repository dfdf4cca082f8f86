// What the standalone CUDA probes (tools/*_probe.cu, no vireo code) share: CHECK(x), with which a
// failed CUDA call prints "<kProbeName>: <call>: <error>" and exits 1 (each probe defines
// kProbeName first), and the 16-byte streaming load they read with.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

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
