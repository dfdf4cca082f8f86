// AVX-512 kernels for cpu_matmul (see matmul_kernels.h). The whole file is compiled for
// AVX-512 via `#pragma GCC target`; the dispatcher only calls in after __builtin_cpu_supports.
//
// Decode (T <= 3): a direct kernel streams R weight rows at a time, converts 32 weights per step
// in registers and multiplies them with NT x rows; memory bandwidth is the bound. Prefill
// (T > 3): each thread converts a tile of 64 rows x 512 columns once into an f32 buffer and
// runs a 4(t) x 4(o) register-blocked micro-kernel over all T rows, so the conversion is
// amortised over T. Both vectorise along `in` and reduce horizontally at the end of each kKc
// columns, so neither needs a transposed weight copy, and both do an element's arithmetic in the
// same order (direct's comment), so a row of y has the same bits at any T.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "backend/cpu/matmul_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
// GCC 12 reports its own intrinsic headers (_mm512_undefined_*) as using uninitialized values.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace vireo::kernels {
namespace {

// Loops over register-block indices must be unrolled completely so the accumulator arrays live
// in registers; GCC's -O2 does not do that by itself.
#define VIREO_UNROLL _Pragma("GCC unroll 16")

constexpr int64_t kDirectMaxT = 3;  // T above this uses the packed prefill kernel (measured: T=4 is faster there)
constexpr int64_t kKc = 512;        // prefill: columns per packed tile (multiple of 128)
constexpr int64_t kRowTile = 64;    // prefill: rows per packed tile
constexpr float kFp8Fold = 256.0f;  // e4m3 bits moved into f16 give value * 2^-8

// Local helper: std templates are not instantiated under the target pragma (see matmul_kernels.h).
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

constexpr int64_t elem_size(DType d) {
  return d == DType::F32 ? 4 : d == DType::F8_E4M3 ? 1 : 2;
}

// 32 consecutive weights starting at p, converted to f32: lo = elements 0..15, hi = 16..31.
// With Masked, elements whose bit in m is clear read as zero (and are not touched in memory).
// FP8 e4m3: sign-extend each byte to 16 bits, shift left 7 and keep sign | exponent | mantissa
// (mask 0xBF80): this is the f16 with the same bits, worth value * 2^-8 for every finite code,
// subnormals included; the 2^8 is folded into the block scale.
template <DType D, bool Masked>
inline void load32(const void* p, __mmask32 m, __m512& lo, __m512& hi) {
  if constexpr (D == DType::F32) {
    const float* f = static_cast<const float*>(p);
    if constexpr (Masked) {
      lo = _mm512_maskz_loadu_ps(__mmask16(m), f);
      hi = _mm512_maskz_loadu_ps(__mmask16(m >> 16), f + 16);
    } else {
      lo = _mm512_loadu_ps(f);
      hi = _mm512_loadu_ps(f + 16);
    }
  } else if constexpr (D == DType::BF16 || D == DType::F16) {
    const uint16_t* h = static_cast<const uint16_t*>(p);
    __m256i a, b;
    if constexpr (Masked) {
      a = _mm256_maskz_loadu_epi16(__mmask16(m), h);
      b = _mm256_maskz_loadu_epi16(__mmask16(m >> 16), h + 16);
    } else {
      a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
      b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16));
    }
    if constexpr (D == DType::BF16) {
      lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(a), 16));
      hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    } else {
      lo = _mm512_cvtph_ps(a);
      hi = _mm512_cvtph_ps(b);
    }
  } else {
    const uint8_t* q = static_cast<const uint8_t*>(p);
    __m256i bytes = Masked ? _mm256_maskz_loadu_epi8(m, q)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    __m512i v = _mm512_cvtepi8_epi16(bytes);
    v = _mm512_and_si512(_mm512_slli_epi16(v, 7), _mm512_set1_epi16(short(0xBF80)));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
  }
}

template <bool Masked>
inline void load32_x(const float* p, __mmask32 m, __m512& lo, __m512& hi) {
  if constexpr (Masked) {
    lo = _mm512_maskz_loadu_ps(__mmask16(m), p);
    hi = _mm512_maskz_loadu_ps(__mmask16(m >> 16), p + 16);
  } else {
    lo = _mm512_loadu_ps(p);
    hi = _mm512_loadu_ps(p + 16);
  }
}

inline __mmask32 low_mask32(int64_t n) { return n >= 32 ? ~__mmask32(0) : __mmask32((1u << n) - 1); }

// ---- decode: direct kernel ------------------------------------------------------------------

// Rows [r0, r0 + R) x x-rows [t0, t0 + NT). Per output element the packed prefill kernel's
// arithmetic exactly, so a row of y has the same bits whatever T is (a batch of sequences, a
// verification step, a prompt): one 16-lane accumulator over 16 columns at a time (two per
// 32-column step, in column order), FP8 weights multiplied by their block scale first (as
// pack_row stores them), restarted every kKc columns, whose fixed horizontal reduction is added
// to the element's running sum (from 0). The arithmetic does not depend on R or NT.
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
  const float* srow[R] = {};
  if constexpr (D == DType::F8_E4M3) {
    VIREO_UNROLL
    for (int r = 0; r < R; ++r) srow[r] = a.scale + ((r0 + r) / 128) * a.scale_cols;
  }

  __m512 acc[R][NT];
  // 32 columns from i (n of them valid, the rest read as zeros; the upper 16 skipped when none
  // is valid, as the packed kernel's 16-column steps end there).
  auto step = [&]<bool Masked>(int64_t i, int64_t n) {
    const __mmask32 m = Masked ? low_mask32(n) : 0;
    __m512 xl[NT], xh[NT];
    VIREO_UNROLL
    for (int t = 0; t < NT; ++t) load32_x<Masked>(xr[t] + i, m, xl[t], xh[t]);
    VIREO_UNROLL
    for (int r = 0; r < R; ++r) {
      __m512 wl, wh;
      load32<D, Masked>(wr[r] + i * es, m, wl, wh);
      if constexpr (D == DType::F8_E4M3) {
        const __m512 sc = _mm512_set1_ps(srow[r][i / 128] * kFp8Fold);
        wl = _mm512_mul_ps(wl, sc);
        wh = _mm512_mul_ps(wh, sc);
      }
      VIREO_UNROLL
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(wl, xl[t], acc[r][t]);
      if (!Masked || n > 16) {
        VIREO_UNROLL
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(wh, xh[t], acc[r][t]);
      }
    }
  };

  float result[R][NT];
  VIREO_UNROLL
  for (int r = 0; r < R; ++r)
    VIREO_UNROLL
    for (int t = 0; t < NT; ++t) result[r][t] = 0.0f;
  for (int64_t c0 = 0; c0 < in; c0 += kKc) {
    const int64_t cend = imin(c0 + kKc, in);
    VIREO_UNROLL
    for (int r = 0; r < R; ++r)
      VIREO_UNROLL
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    int64_t i = c0;
    for (; i + 32 <= cend; i += 32) step.template operator()<false>(i, 32);
    if (i < cend) step.template operator()<true>(i, cend - i);
    VIREO_UNROLL
    for (int r = 0; r < R; ++r)
      VIREO_UNROLL
      for (int t = 0; t < NT; ++t) result[r][t] += _mm512_reduce_add_ps(acc[r][t]);
  }
  VIREO_UNROLL
  for (int r = 0; r < R; ++r)
    VIREO_UNROLL
    for (int t = 0; t < NT; ++t) a.y[(t0 + t) * a.out + r0 + r] = result[r][t];
}

template <DType D, int NT>
void direct_rows(const MatmulArgs& a, int64_t r0, int64_t r1) {
  // Rows per pass: enough to reuse each x load, few enough to keep accumulators in 32 zmm.
  constexpr int R = NT == 1 ? 4 : NT <= 3 ? 2 : 1;
  int64_t r = r0;
  for (; r + R <= r1; r += R) direct<D, R, NT>(a, r, 0);
  for (; r < r1; ++r) direct<D, 1, NT>(a, r, 0);
}

// ---- prefill: packed tile + micro-kernel ----------------------------------------------------

// Converts columns [k0, k0 + klen) of weight row `row` into dst (f32, block scale applied),
// zero-padded to a multiple of 32.
template <DType D>
void pack_row(const MatmulArgs& a, int64_t row, int64_t k0, int64_t klen, float* dst) {
  constexpr int64_t es = elem_size(D);
  const char* w = static_cast<const char*>(a.w) + (row * a.in + k0) * es;
  const float* srow = D == DType::F8_E4M3 ? a.scale + (row / 128) * a.scale_cols : nullptr;
  for (int64_t i = 0; i < klen; i += 32) {
    __m512 lo, hi;
    if (i + 32 <= klen) load32<D, false>(w + i * es, 0, lo, hi);
    else load32<D, true>(w + i * es, low_mask32(klen - i), lo, hi);
    if constexpr (D == DType::F8_E4M3) {
      // k0 and i are multiples of 32 and kKc of 128, so the 32 columns share one block.
      const __m512 s = _mm512_set1_ps(srow[(k0 + i) / 128] * kFp8Fold);
      lo = _mm512_mul_ps(lo, s);
      hi = _mm512_mul_ps(hi, s);
    }
    _mm512_storeu_ps(dst + i, lo);
    _mm512_storeu_ps(dst + i + 16, hi);
  }
}

// Sums each of 16 accumulators acc[4r + t] horizontally; returns lane 4t + r = sum of
// acc[4r + t]. A fixed shuffle tree: 30 shuffles and 15 adds instead of 16 full reductions.
inline __m512 reduce16(const __m512* acc) {
  __m512 b[8], c[4], d[2];
  VIREO_UNROLL
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: acc[2i], 8-15: acc[2i+1]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  }
  VIREO_UNROLL
  for (int i = 0; i < 4; ++i) {  // 128-bit quarter k: acc[4i + k]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  VIREO_UNROLL
  for (int i = 0; i < 2; ++i) {  // quarter k: (acc[8i + k] x2, acc[8i + 4 + k] x2)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  }
  // quarter k: (acc[k], acc[4 + k], acc[8 + k], acc[12 + k])
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

// y[t, r] += sum_k x[t, k] * w[r, k] for t < MT, r < nr (<= 4), k < klen (a multiple of 16;
// both operands are zero-padded). x rows have stride ldx, w rows ldw.
template <int MT>
void micro(const float* x, int64_t ldx, int64_t klen, const float* w, int64_t ldw, float* y,
           int64_t ldy, int nr) {
  __m512 acc[16];
  VIREO_UNROLL
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t k = 0; k < klen; k += 16) {
    const __m512 a0 = _mm512_loadu_ps(w + k), a1 = _mm512_loadu_ps(w + ldw + k);
    const __m512 a2 = _mm512_loadu_ps(w + 2 * ldw + k), a3 = _mm512_loadu_ps(w + 3 * ldw + k);
    VIREO_UNROLL
    for (int t = 0; t < MT; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * ldx + k);
      acc[0 + t] = _mm512_fmadd_ps(a0, xv, acc[0 + t]);
      acc[4 + t] = _mm512_fmadd_ps(a1, xv, acc[4 + t]);
      acc[8 + t] = _mm512_fmadd_ps(a2, xv, acc[8 + t]);
      acc[12 + t] = _mm512_fmadd_ps(a3, xv, acc[12 + t]);
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, reduce16(acc));
  VIREO_UNROLL
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < nr; ++r) y[t * ldy + r] += s[4 * t + r];
}

template <DType D>
void prefill_rows(const MatmulArgs& a, int64_t r0, int64_t r1, float* scratch) {
  const int64_t in = a.in, out = a.out, T = a.T;
  float* wbuf = scratch;                 // [kRowTile, kKc]
  float* xbuf = scratch + kRowTile * kKc;  // [T, kKc]
  for (int64_t t = 0; t < T; ++t) std::memset(a.y + t * out + r0, 0, (r1 - r0) * sizeof(float));
  for (int64_t k0 = 0; k0 < in; k0 += kKc) {
    const int64_t klen = imin(kKc, in - k0);
    const int64_t kpad = (klen + 15) / 16 * 16;
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(xbuf + t * kKc, a.x + t * in + k0, klen * sizeof(float));
      std::memset(xbuf + t * kKc + klen, 0, (kpad - klen) * sizeof(float));
    }
    for (int64_t rt = r0; rt < r1; rt += kRowTile) {
      const int64_t nrows = imin(kRowTile, r1 - rt);
      const int64_t npad = (nrows + 3) / 4 * 4;
      for (int64_t r = 0; r < nrows; ++r) pack_row<D>(a, rt + r, k0, klen, wbuf + r * kKc);
      for (int64_t r = nrows; r < npad; ++r) std::memset(wbuf + r * kKc, 0, kKc * sizeof(float));
      for (int64_t r = 0; r < npad; r += 4) {
        const int nr = int(imin(4, nrows - r));
        const float* w = wbuf + r * kKc;
        float* yb = a.y + rt + r;
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) micro<4>(xbuf + t * kKc, kKc, kpad, w, kKc, yb + t * out, out, nr);
        switch (T - t) {
          case 3: micro<3>(xbuf + t * kKc, kKc, kpad, w, kKc, yb + t * out, out, nr); break;
          case 2: micro<2>(xbuf + t * kKc, kKc, kpad, w, kKc, yb + t * out, out, nr); break;
          case 1: micro<1>(xbuf + t * kKc, kKc, kpad, w, kKc, yb + t * out, out, nr); break;
          default: break;
        }
      }
    }
  }
}

template <DType D>
void rows(const MatmulArgs& a, int64_t r0, int64_t r1, float* scratch) {
  switch (a.T) {
    case 1: direct_rows<D, 1>(a, r0, r1); return;
    case 2: direct_rows<D, 2>(a, r0, r1); return;
    case 3: direct_rows<D, 3>(a, r0, r1); return;
    default: prefill_rows<D>(a, r0, r1, scratch); return;
  }
}

#undef VIREO_UNROLL

}  // namespace

size_t scratch_floats_avx512(const MatmulArgs& a) {
  return a.T > kDirectMaxT ? size_t((kRowTile + a.T) * kKc) : 0;
}

void matmul_rows_avx512(const MatmulArgs& a, int64_t r0, int64_t r1, float* scratch) {
  switch (a.dtype) {
    case DType::F32: rows<DType::F32>(a, r0, r1, scratch); break;
    case DType::BF16: rows<DType::BF16>(a, r0, r1, scratch); break;
    case DType::F16: rows<DType::F16>(a, r0, r1, scratch); break;
    case DType::F8_E4M3: rows<DType::F8_E4M3>(a, r0, r1, scratch); break;
    default: break;  // rejected by the dispatcher
  }
}

}  // namespace vireo::kernels

#pragma GCC pop_options
