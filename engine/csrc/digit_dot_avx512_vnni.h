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
        leading[r] = _mm512_dpbusd_epi32(leading[r], first, broadcast4(xs));
        leading[r] = _mm512_dpbusd_epi32(leading[r], second, broadcast4(xs + 4));
        if constexpr (kResidual) {
          residual[r] = _mm512_dpbusd_epi32(residual[r], first, broadcast4(xs + 8));
          residual[r] = _mm512_dpbusd_epi32(residual[r], second, broadcast4(xs + 12));
        }
      }
    }
    finish(g, leading, residual, total);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 16, total[r]);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
