// AVX2 + FMA + F16C kernels for cpu_matmul (see matmul_kernels.h): the fallback for x86 CPUs
// without AVX-512. The file is compiled for that ISA via `#pragma GCC target`; the dispatcher
// only calls in after __builtin_cpu_supports.
//
// One direct kernel serves every T: it streams R weight rows, converts 16 weights per step in
// registers and multiplies them with up to two x rows; for larger T it runs again per pair of x
// rows (the R weight rows are then re-read from L1/L2, not from memory). Column tails are copied
// into a zero-padded 16-element buffer so every element goes through the same vector code.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "backend/cpu/matmul_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")

namespace vireo::kernels {
namespace {

// Loops over register-block indices must be unrolled completely so the accumulator arrays live
// in registers; GCC's -O2 does not do that by itself.
#define VIREO_UNROLL _Pragma("GCC unroll 16")

constexpr float kFp8Fold = 256.0f;  // e4m3 bits moved into f16 give value * 2^-8

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

constexpr int64_t elem_size(DType d) {
  return d == DType::F32 ? 4 : d == DType::F8_E4M3 ? 1 : 2;
}

// 16 consecutive weights at p as f32: lo = elements 0..7, hi = 8..15. FP8: see matmul_avx512.cpp.
template <DType D>
inline void load16(const void* p, __m256& lo, __m256& hi) {
  if constexpr (D == DType::F32) {
    const float* f = static_cast<const float*>(p);
    lo = _mm256_loadu_ps(f);
    hi = _mm256_loadu_ps(f + 8);
  } else if constexpr (D == DType::BF16) {
    const __m128i* h = static_cast<const __m128i*>(p);
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h)), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h + 1)), 16));
  } else if constexpr (D == DType::F16) {
    const __m128i* h = static_cast<const __m128i*>(p);
    lo = _mm256_cvtph_ps(_mm_loadu_si128(h));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
  } else {
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
    v = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16(short(0xBF80)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [r0, r0 + R) x x-rows [t0, t0 + NT): per element two 8-lane accumulators (halves of each
// 16-column step), restarted per 128-column block for FP8 and folded in with the block scale.
template <DType D, int R, int NT>
void direct(const MatmulArgs& a, int64_t r0, int64_t t0) {
  constexpr int64_t es = elem_size(D);
  const int64_t in = a.in;
  const char* wr[R];
  VIREO_UNROLL
  for (int r = 0; r < R; ++r) wr[r] = static_cast<const char*>(a.w) + (r0 + r) * in * es;
  const float* xr[NT];
  VIREO_UNROLL
  for (int t = 0; t < NT; ++t) xr[t] = a.x + (t0 + t) * in;

  __m256 lo[R][NT], hi[R][NT];
  auto zero_acc = [&] {
    VIREO_UNROLL
    for (int r = 0; r < R; ++r)
      VIREO_UNROLL
      for (int t = 0; t < NT; ++t) lo[r][t] = hi[r][t] = _mm256_setzero_ps();
  };
  // One 16-column step from explicit pointers (the tail passes padded copies).
  auto step_ptr = [&](const char* const* wp, const float* const* xp) {
    __m256 xl[NT], xh[NT];
    VIREO_UNROLL
    for (int t = 0; t < NT; ++t) {
      xl[t] = _mm256_loadu_ps(xp[t]);
      xh[t] = _mm256_loadu_ps(xp[t] + 8);
    }
    VIREO_UNROLL
    for (int r = 0; r < R; ++r) {
      __m256 wl, wh;
      load16<D>(wp[r], wl, wh);
      VIREO_UNROLL
      for (int t = 0; t < NT; ++t) {
        lo[r][t] = _mm256_fmadd_ps(wl, xl[t], lo[r][t]);
        hi[r][t] = _mm256_fmadd_ps(wh, xh[t], hi[r][t]);
      }
    }
  };
  auto step = [&](int64_t i) {
    const char* wp[R];
    const float* xp[NT];
    VIREO_UNROLL
    for (int r = 0; r < R; ++r) wp[r] = wr[r] + i * es;
    VIREO_UNROLL
    for (int t = 0; t < NT; ++t) xp[t] = xr[t] + i;
    step_ptr(wp, xp);
  };
  auto step_tail = [&](int64_t i, int64_t n) {
    alignas(32) char wbuf[R][64];
    alignas(32) float xbuf[NT][16];
    const char* wp[R];
    const float* xp[NT];
    VIREO_UNROLL
    for (int r = 0; r < R; ++r) {
      std::memset(wbuf[r], 0, sizeof(wbuf[r]));
      std::memcpy(wbuf[r], wr[r] + i * es, size_t(n * es));
      wp[r] = wbuf[r];
    }
    VIREO_UNROLL
    for (int t = 0; t < NT; ++t) {
      std::memset(xbuf[t], 0, sizeof(xbuf[t]));
      std::memcpy(xbuf[t], xr[t] + i, size_t(n) * sizeof(float));
      xp[t] = xbuf[t];
    }
    step_ptr(wp, xp);
  };

  float result[R][NT];
  if constexpr (D != DType::F8_E4M3) {
    zero_acc();
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) step(i);
    if (i < in) step_tail(i, in - i);
    VIREO_UNROLL
    for (int r = 0; r < R; ++r)
      VIREO_UNROLL
      for (int t = 0; t < NT; ++t) result[r][t] = hsum(_mm256_add_ps(lo[r][t], hi[r][t]));
  } else {
    const float* srow[R];
    VIREO_UNROLL
    for (int r = 0; r < R; ++r) srow[r] = a.scale + ((r0 + r) / 128) * a.scale_cols;
    __m256 tot[R][NT];
    VIREO_UNROLL
    for (int r = 0; r < R; ++r)
      VIREO_UNROLL
      for (int t = 0; t < NT; ++t) tot[r][t] = _mm256_setzero_ps();
    for (int64_t b0 = 0, blk = 0; b0 < in; b0 += 128, ++blk) {
      const int64_t bend = imin(b0 + 128, in);
      zero_acc();
      int64_t i = b0;
      for (; i + 16 <= bend; i += 16) step(i);
      if (i < bend) step_tail(i, bend - i);
      VIREO_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_set1_ps(srow[r][blk] * kFp8Fold);
        VIREO_UNROLL
        for (int t = 0; t < NT; ++t)
          tot[r][t] = _mm256_fmadd_ps(_mm256_add_ps(lo[r][t], hi[r][t]), s, tot[r][t]);
      }
    }
    VIREO_UNROLL
    for (int r = 0; r < R; ++r)
      VIREO_UNROLL
      for (int t = 0; t < NT; ++t) result[r][t] = hsum(tot[r][t]);
  }
  VIREO_UNROLL
  for (int r = 0; r < R; ++r)
    VIREO_UNROLL
    for (int t = 0; t < NT; ++t) a.y[(t0 + t) * a.out + r0 + r] = result[r][t];
}

template <DType D, int NT>
void direct_rows(const MatmulArgs& a, int64_t r0, int64_t r1, int64_t t0) {
  // 16 ymm registers: four rows for one x row, two (FP8: one) for two x rows.
  constexpr int R = NT == 1 ? 4 : D == DType::F8_E4M3 ? 1 : 2;
  int64_t r = r0;
  for (; r + R <= r1; r += R) direct<D, R, NT>(a, r, t0);
  for (; r < r1; ++r) direct<D, 1, NT>(a, r, t0);
}

template <DType D>
void rows(const MatmulArgs& a, int64_t r0, int64_t r1) {
  if (a.T == 1) {
    direct_rows<D, 1>(a, r0, r1, 0);
    return;
  }
  // Row blocks of 16 keep the re-read weights cache-resident across the x-row pairs.
  for (int64_t rb = r0; rb < r1; rb += 16) {
    const int64_t re = imin(rb + 16, r1);
    int64_t t = 0;
    for (; t + 2 <= a.T; t += 2) direct_rows<D, 2>(a, rb, re, t);
    if (t < a.T) direct_rows<D, 1>(a, rb, re, t);
  }
}

#undef VIREO_UNROLL

}  // namespace

size_t scratch_floats_avx2(const MatmulArgs&) { return 0; }

void matmul_rows_avx2(const MatmulArgs& a, int64_t r0, int64_t r1, float*) {
  switch (a.dtype) {
    case DType::F32: rows<DType::F32>(a, r0, r1); break;
    case DType::BF16: rows<DType::BF16>(a, r0, r1); break;
    case DType::F16: rows<DType::F16>(a, r0, r1); break;
    case DType::F8_E4M3: rows<DType::F8_E4M3>(a, r0, r1); break;
    default: break;  // rejected by the dispatcher
  }
}

}  // namespace vireo::kernels

#pragma GCC pop_options
