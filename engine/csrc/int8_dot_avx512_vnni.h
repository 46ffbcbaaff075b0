// int8_dot's kernel in the avx512_vnni build: `vpdpbusd` multiplies 4 weight bytes (int8 + 128, unsigned) by 4 int8
// activation digits and sums them into an output row's int32 lane, 16 output rows a register (int8_dot.cpp has the
// layout).
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <immintrin.h>

#include <cstdint>

#include "digit_dot_avx512_vnni.h"
#include "quant.h"

namespace BATCHSERVE_OPS {
namespace {

constexpr int kInt8DotRows = 8;  // activation rows per pass over a block of weights

// One block of 16 output rows for R activation rows: out[r, 0..15] = sum over groups of x_scale[r, g] times
// (127 * leading dot + residual dot - biases[r, g]), before the weights' own scales; without kResidual the leading
// dot alone, less its bias (int8_dot_rows moves the 127 into x_scale and leaves the residual out of the bias).
template <int R, bool kResidual>
inline void int8_dot_block(const uint8_t* block, const int8_t* xq, const float* x_scales, const int32_t* biases,
                           int64_t K, int64_t group, const NextBlock& next, float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  auto load_weights = [&](int64_t input, __m512i& first, __m512i& second) {
    const uint8_t* bytes = block + input * 16;  // 64 bytes per 4 inputs
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes + 64, _MM_HINT_T0);
    if (const char* ahead = next.line(input * 16, K * 16)) {  // 128 bytes of this block: 128 / passes of the next
      _mm_prefetch(ahead, _MM_HINT_T1);
      if (next.passes == 1) _mm_prefetch(ahead + 64, _MM_HINT_T1);
    }
    first = _mm512_loadu_si512(bytes);
    second = _mm512_loadu_si512(bytes + 64);
  };
  auto finish = [&](int64_t g, const __m512i(&leading)[R], const __m512i(&residual)[R], __m512(&total)[R]) {
    for (int r = 0; r < R; ++r) {
      // In int32: 127 * leading + residual is at most 127 * 64 * 255 * 127 + 64 * 255 * 64 for a group of 64, far
      // from overflow; the weights' +128 added the bias, taken off exactly.
      const __m512i dots = kResidual
                               ? _mm512_add_epi32(_mm512_mullo_epi32(leading[r], _mm512_set1_epi32(127)), residual[r])
                               : leading[r];
      const __m512i digits = _mm512_sub_epi32(dots, _mm512_set1_epi32(biases[r * groups + g]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(digits), _mm512_set1_ps(x_scales[r * groups + g]), total[r]);
    }
  };
  digit_dot_block<R, kResidual>(K, group, xq, load_weights, finish, out);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
