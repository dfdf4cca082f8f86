#include "core/dtype.h"

#include <cmath>

namespace vireo {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::F8_E4M3: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::F64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::F64: return "F64";
  }
  return "?";
}

bool parse_dtype(std::string_view s, DType* out) {
  static const struct { const char* name; DType t; } table[] = {
      {"F32", DType::F32}, {"BF16", DType::BF16}, {"F16", DType::F16},
      {"F8_E4M3", DType::F8_E4M3}, {"I32", DType::I32}, {"I64", DType::I64},
      {"U8", DType::U8}, {"F64", DType::F64}};
  for (const auto& e : table)
    if (s == e.name) { *out = e.t; return true; }
  return false;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    float v = std::ldexp(float(mant), -24);  // subnormal (or zero)
    return sign ? -v : v;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  return f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t f32_to_f16(float f) {
  uint32_t u = bits_from_f32(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;
  if (a < 6.103515625e-05f) {  // subnormal: multiples of 2^-24, round half even
    float q = std::nearbyint(a * 16777216.0f);
    return sign | uint16_t(q);
  }
  uint32_t au = bits_from_f32(a);
  uint32_t mant = au & 0x7fffffu;
  uint32_t exp = (au >> 23) - 112;
  uint32_t r = (exp << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) r++;
  return sign | uint16_t(r);
}

float fp8_e4m3_to_f32(uint8_t b) {
  uint32_t sign = b & 0x80u;
  uint32_t exp = (b >> 3) & 0xfu;
  uint32_t mant = b & 0x7u;
  float v;
  if (exp == 15 && mant == 7) return NAN;
  if (exp == 0) v = std::ldexp(float(mant), -9);  // subnormal: m/8 * 2^-6
  else v = std::ldexp(1.0f + float(mant) / 8.0f, int(exp) - 7);
  return sign ? -v : v;
}

uint8_t f32_to_fp8_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  // Below 2^-6 (the smallest normal): multiples of 2^-9, codes 0..7, and 8 (= 2^-6, code 0x08)
  // where the rounding carries; nearbyint rounds half to even, the scaling by 512 is exact.
  if (a < 0.015625f) return sign | uint8_t(std::nearbyint(a * 512.0f));
  // Normal: the exponent rebiased (127 -> 7), the top 3 of f32's 23 mantissa bits, the other 20
  // rounding to nearest, ties to even (a carry moves into the exponent; below 448 it never
  // reaches the NaN code). (Was an exhaustive search over the codes, ~1 us a value: the tests'
  // FP8 weights at GLM-5 shapes took minutes. DType.Fp8E4M3RoundingEqualsNearestSearch keeps it
  // as the reference.)
  const uint32_t au = bits_from_f32(a);
  const uint32_t mant = au & 0x7fffffu;
  uint32_t r = (((au >> 23) - 120u) << 3) | (mant >> 20);
  const uint32_t rest = mant & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (r & 1u))) r++;
  return sign | uint8_t(r);
}

}  // namespace vireo
