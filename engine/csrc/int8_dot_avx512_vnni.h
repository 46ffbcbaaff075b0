// int8_dot's kernel in the avx512_vnni build: `vpdpbusd` multiplies 4 weight bytes (int8 + 128, unsigned) by 4 int8
// activation digits and sums them into an output row's int32 lane, 16 output rows a register (int8_dot.cpp has the
// layout).
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant.h"

namespace BATCHSERVE_OPS {
namespace {

constexpr int kInt8DotRows = 8;  // activation rows per pass over a block of weights

inline __m512i broadcast4(const int8_t* digits) {
  int32_t four;
  std::memcpy(&four, digits, 4);
  return _mm512_set1_epi32(four);
}

// One block of 16 output rows for R activation rows: out[r, 0..15] = sum over groups of x_scale[r, g] times
// (127 * leading dot + residual dot - 128 * the digits' sum), before the weights' own scales.
template <int R>
inline void int8_dot_block(const uint8_t* block, const int8_t* xq, const float* x_scales, const int32_t* digit_sums,
                           int64_t K, int64_t group, float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i leading[R], residual[R];
    for (int r = 0; r < R; ++r) leading[r] = residual[r] = _mm512_setzero_si512();
    const uint8_t* bytes = block + g * group * 16;  // 64 bytes per 4 inputs
    for (int64_t k = 0; k < group; k += 8, bytes += 128) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes + 64, _MM_HINT_T0);
      const __m512i first = _mm512_loadu_si512(bytes);  // inputs k..k+3
      const __m512i second = _mm512_loadu_si512(bytes + 64);  // inputs k+4..k+7
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = xq + 2 * (r * K + g * group + k);  // 8 leading digits, then 8 residual digits
        leading[r] = _mm512_dpbusd_epi32(leading[r], first, broadcast4(xs));
        leading[r] = _mm512_dpbusd_epi32(leading[r], second, broadcast4(xs + 4));
        residual[r] = _mm512_dpbusd_epi32(residual[r], first, broadcast4(xs + 8));
        residual[r] = _mm512_dpbusd_epi32(residual[r], second, broadcast4(xs + 12));
      }
    }
    for (int r = 0; r < R; ++r) {
      // In int32: 127 * leading + residual is at most 127 * 64 * 255 * 127 + ... for a group of 64, far from overflow;
      // the weights' +128 adds 128 * (the digits' sum), taken off exactly.
      const __m512i digits = _mm512_sub_epi32(
          _mm512_add_epi32(_mm512_mullo_epi32(leading[r], _mm512_set1_epi32(127)), residual[r]),
          _mm512_set1_epi32(128 * digit_sums[r * groups + g]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(digits), _mm512_set1_ps(x_scales[r * groups + g]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 16, total[r]);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
