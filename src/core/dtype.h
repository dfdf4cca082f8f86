#pragma once
// Storage dtypes of checkpoint tensors and their conversion to f32.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace vireo {

enum class DType : uint8_t { F32, BF16, F16, F8_E4M3, I32, I64, U8, F64 };

// Bytes per element.
size_t dtype_size(DType t);
// Safetensors spelling ("F32", "BF16", "F16", "F8_E4M3", ...).
const char* dtype_name(DType t);
// Parses the safetensors spelling; returns false for dtypes vireo does not read.
bool parse_dtype(std::string_view s, DType* out);

inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t bits_from_f32(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }
// Round to nearest even, as torch does (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_from_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// OCP FP8 E4M3 (the "fn" variant used by torch.float8_e4m3fn): bias 7, no infinities,
// S.1111.111 is NaN, max finite 448.
float fp8_e4m3_to_f32(uint8_t b);
uint8_t f32_to_fp8_e4m3(float f);  // round to nearest even, saturating to +-448

}  // namespace vireo
