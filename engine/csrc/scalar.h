// float32 and bfloat16 element access for the CPU kernels, written so that the compiler vectorises the loops.
//
// bfloat16 is handled as its raw 16 bits: widening is a shift, and narrowing rounds to nearest-even exactly as
// c10::BFloat16 does (so a kernel that rounds where torch rounds gives torch's bits). c10's own conversion
// carries a NaN branch and a type the vectoriser does not see through.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace batchserve {

inline float widen(float value) { return value; }

inline float widen(c10::BFloat16 value) {
  const uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Rounds a float to T: the identity for float, round-to-nearest-even for bfloat16 (NaN stays NaN).
template <typename T>
inline T narrow(float value);

template <>
inline float narrow<float>(float value) {
  return value;
}

template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = value != value ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
  return out;
}

// The value float arithmetic in T gives: exact for float, rounded to bfloat16 (and widened back) for bfloat16.
template <typename T>
inline float round_as(float value) {
  return widen(narrow<T>(value));
}

}  // namespace batchserve
