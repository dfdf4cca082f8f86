#pragma once
// Arithmetic that rounds identically on the host (g++) and on a CUDA device (nvcc), so that a
// computation written once with these helpers gives bit-identical results on both: every step is
// one IEEE round-to-nearest operation, with fused multiply-adds only where written (fma).
//
// The functions have internal linkage (static): each translation unit keeps the copy compiled with
// its own flags, so the linker cannot pick a copy from a unit that contracts.
//
// Why helpers rather than operators: nvcc contracts a * b + c into an fma by default, and a host
// compiler may too (-ffp-contract=fast with FMA instructions enabled). On the device the __*_rn
// intrinsics are never contracted; on the host the translation units that run these computations
// are compiled with -ffp-contract=off (CMakeLists.txt), and x86-64 SSE arithmetic has no excess
// precision. Denormals are kept on both sides (nvcc's default -ftz=false; no -ffast-math here).
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define VIREO_HD __host__ __device__
#else
#define VIREO_HD
#endif

namespace vireo::pm {

static VIREO_HD inline float add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
static VIREO_HD inline float sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
static VIREO_HD inline float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
static VIREO_HD inline float div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
static VIREO_HD inline float fma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
static VIREO_HD inline double add(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
static VIREO_HD inline double mul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
static VIREO_HD inline double div(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
static VIREO_HD inline float to_float(double x) {
#ifdef __CUDA_ARCH__
  return __double2float_rn(x);
#else
  return float(x);
#endif
}

static VIREO_HD inline uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return uint32_t(__float_as_uint(x));
#else
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
#endif
}
static VIREO_HD inline float bits_float(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, 4);
  return x;
#endif
}

// e^x in float, the same bits on host and device, within ~1 ulp of the true value (checked
// against std::exp in tests/test_sampling.cpp). Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2,
// then the degree-7 Taylor polynomial of e^r (truncation error < 6e-9, below an ulp) by Horner
// with fmas, then the exact scaling by 2^k (a subnormal result rounds once, in the last multiply).
static VIREO_HD inline float exp(float x) {
  if (x != x) return x;                      // NaN
  if (x < -104.0f) return 0.0f;              // below half the smallest subnormal (e^-103.97)
  if (x > 88.8f) return INFINITY;            // above the largest float (e^88.72)
  // round(x log2 e) with round-half-even: adding 1.5 * 2^23 leaves no fraction bits.
  const float shifter = 0x1.8p23f;
  const float kf = sub(fma(x, 0x1.715476p+0f, shifter), shifter);
  // ln2 = hi + lo, hi with 16 significant bits; each fma rounds once.
  float r = fma(-kf, 0x1.62e4p-1f, x);
  r = fma(-kf, 0x1.7f7d1cp-20f, r);
  float p = 0x1.a01a02p-13f;  // 1/7!, then 1/6! .. 1/2!, 1, 1 (float-rounded)
  p = fma(p, r, 0x1.6c16c2p-10f);
  p = fma(p, r, 0x1.111112p-7f);
  p = fma(p, r, 0x1.555556p-5f);
  p = fma(p, r, 0x1.555556p-3f);
  p = fma(p, r, 0.5f);
  p = fma(p, r, 1.0f);
  p = fma(p, r, 1.0f);
  const int k = int(kf);  // in [-150, 128]
  if (k > 127) return mul(mul(p, 2.0f), bits_float(uint32_t(k - 1 + 127) << 23));
  if (k >= -126) return mul(p, bits_float(uint32_t(k + 127) << 23));
  // 2^k is not a normal float: scale by 2^(k + 64) (exact), then by 2^-64 (the one rounding).
  return mul(mul(p, bits_float(uint32_t(k + 64 + 127) << 23)), 0x1p-64f);
}

}  // namespace vireo::pm
