#pragma once
// GPU tests skip, saying why, where no CUDA device is present or vireo was built without CUDA.
#include <gtest/gtest.h>

#include <string>

#include "backend/cuda/cuda_backend.h"

#ifdef VIREO_HAVE_CUDA
#define REQUIRE_CUDA()                                                             \
  do {                                                                             \
    std::string why_;                                                              \
    if (!vireo::cuda_device_present(&why_)) GTEST_SKIP() << "no CUDA device: " << why_; \
  } while (0)
#else
#define REQUIRE_CUDA() GTEST_SKIP() << "no CUDA device: vireo was built without CUDA"
#endif
