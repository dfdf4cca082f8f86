// CHECK(x) for the standalone CUDA probes (tools/*_probe.cu, no vireo code): a failed CUDA call
// prints "<kProbeName>: <call>: <error>" and exits 1. Each probe defines kProbeName first.
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
