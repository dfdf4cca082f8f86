#pragma once
// Measured main-memory read bandwidth: the bound that decode (a GEMV over every weight) runs
// against. `vireo bench` and BENCHMARKS.md report achieved GB/s as a fraction of this number.
#include <cstddef>

#include "core/thread_pool.h"

namespace vireo {

// Reads a `bytes`-sized buffer (allocated and touched here, far larger than the caches) with all
// pool threads, each summing its contiguous share with vector loads; returns the best of a few
// runs in GB/s (1e9 bytes per second).
double measure_memory_bandwidth_gbs(ThreadPool& pool, size_t bytes = size_t(1) << 30);

}  // namespace vireo
