// int4_dot's kernel in the avx512_vnni build: `vpdpbusd` multiplies 4 unsigned 4-bit weights by 4 int8
// activation digits and sums them into a row's int32 lane, 16 rows a register (int4_dot.cpp has the layout).
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#include "digit_dot_avx512_vnni.h"
#include "quant.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

using batchserve::lanes::load;

constexpr int kDotRows = 8;  // activation rows per pass over the weights

template <int R>
inline void int4_dot_block(const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                           const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                           const NextBlock& next, float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  auto load_weights = [&](int64_t input, __m512i& first, __m512i& second) {
    if (const char* ahead = next.line(input * 8, K * 8)) _mm_prefetch(ahead, _MM_HINT_T1);
    load_int4_weights_zmm(packed + input * 8, first, second);  // 64 bytes per 8 inputs
  };
  auto finish = [&](int64_t g, const __m512i(&leading)[R], const __m512i(&residual)[R], __m512(&total)[R]) {
    const __m512 s = load(scales + g * kDotBlock);
    // sum_k ((q - 8) s + z) x = s sum_k q x + (z - 8 s) sum_k x
    const __m512 z = zero_term16(s, offset_or_null(zeros, g * kDotBlock));
    for (int r = 0; r < R; ++r) {
      // x = scale * (leading + residual / 127): 127 * the leading dot plus the residual one, in int32 (at most
      // 32 * 15 * 127 * 128, far from overflow).
      const __m512i digits = _mm512_add_epi32(_mm512_mullo_epi32(leading[r], _mm512_set1_epi32(127)), residual[r]);
      const __m512 dots = _mm512_mul_ps(_mm512_cvtepi32_ps(digits), _mm512_set1_ps(x_scales[r * groups + g]));
      total[r] = _mm512_fmadd_ps(s, dots, total[r]);
      total[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(x_sums[r * groups + g]), total[r]);
    }
  };
  digit_dot_block<R, true>(K, group, xq, load_weights, finish, out);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
