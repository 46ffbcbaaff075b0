// What the integer-dot kernels of the avx512_vnni build share (int4_dot_avx512_vnni.h, int8_dot_avx512_vnni.h):
// R activation rows' two-digit dot products (activation_digits.h) with a block of 16 output rows' weights, 8 inputs
// at a time by `vpdpbusd`, one int32 lane per output row, folded into float totals once per group of inputs.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "ops.h"  // BATCHSERVE_OPS

namespace BATCHSERVE_OPS {
namespace {

inline __m512i broadcast4(const int8_t* digits) {
  int32_t four;
  std::memcpy(&four, digits, 4);
  return _mm512_set1_epi32(four);
}

struct FourDigits {
  int8_t digits[4];
};

// acc += weights' unsigned bytes times the 4 signed digits at `digits` (broadcast to every lane), 4 products a
// lane: one `vpdpbusd` in place, the digits its broadcast memory operand. GCC 12 compiles the intrinsic on a
// loop-carried accumulator as a copy, the instruction and a copy back (more register moves than dot products in
// these kernels, each a slot of the front end's), with the broadcast an instruction of its own.
inline __m512i dot4_accumulate(__m512i acc, __m512i weights, const int8_t* digits) {
#if defined(__GNUC__)
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(weights), "m"(*reinterpret_cast<const FourDigits*>(digits)));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, weights, broadcast4(digits));
#endif
}

// out[r, 0..15] = the totals `finish` builds, group by group, from each row's leading and residual dot products
// (with kResidual false the residual digits are not read and their dot products stay zero: one digit, half the work).
// `load_weights(input, first, second)`: the block's unsigned weight bytes for inputs input..input+3 (first) and
// input+4..input+7 (second), 4 bytes per output row. `finish(g, leading, residual, total)`: folds group g's
// int32 dot products into the R float totals. The digits of row r, input i are at xq[2 * (r * K + i)] on, 8
// leading then 8 residual per 8 inputs.
template <int R, bool kResidual, typename LoadWeights, typename Finish>
inline void digit_dot_block(int64_t K, int64_t group, const int8_t* xq, LoadWeights&& load_weights, Finish&& finish,
                            float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i leading[R], residual[R];
    for (int r = 0; r < R; ++r) leading[r] = residual[r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < group; k += 8) {
      __m512i first, second;
      load_weights(g * group + k, first, second);
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = xq + 2 * (r * K + g * group + k);
        leading[r] = dot4_accumulate(leading[r], first, xs);
        leading[r] = dot4_accumulate(leading[r], second, xs + 4);
        if constexpr (kResidual) {
          residual[r] = dot4_accumulate(residual[r], first, xs + 8);
          residual[r] = dot4_accumulate(residual[r], second, xs + 12);
        }
      }
    }
    finish(g, leading, residual, total);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 16, total[r]);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
