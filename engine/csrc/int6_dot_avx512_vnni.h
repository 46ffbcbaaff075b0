// int6_dot's kernel in the avx512_vnni build: each 16-input run of a block's 16 output rows is unpacked from its 192
// bytes (int6_dot.cpp has the layout) into four registers of unsigned 6-bit codes, 4 inputs of each row per 32-bit
// lane, which `vpdpbusd` multiplies by 4 int8 activation digits into the row's int32 lane.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <immintrin.h>

#include <cstdint>

#include "digit_dot_avx512_vnni.h"
#include "quant.h"

namespace BATCHSERVE_OPS {
namespace {

constexpr int kInt6DotRows = 8;  // activation rows per pass over a block of weights

// The 16 rows' codes for inputs k..k+15 (w[0]: k..k+3, w[1]: k+4..k+7, ...): low nibbles from two 64-byte loads,
// each register's top two bits from its 2-bit field of the third, shifted to bits 4-5. The 16-bit shifts carry bits
// across bytes only into places the masks clear.
inline void unpack_int6(const uint8_t* bytes, __m512i (&w)[4]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i low = _mm512_loadu_si512(bytes), more = _mm512_loadu_si512(bytes + 64);
  const __m512i high = _mm512_loadu_si512(bytes + 128);
  // (a & nibble) | b, b already masked: ternary-logic table 0xEC is (A & C) | B, C the nibble mask.
  w[0] = _mm512_ternarylogic_epi32(low, _mm512_and_si512(_mm512_slli_epi16(high, 4), top), nibble, 0xEC);
  w[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(low, 4), _mm512_and_si512(_mm512_slli_epi16(high, 2), top),
                                   nibble, 0xEC);
  w[2] = _mm512_ternarylogic_epi32(more, _mm512_and_si512(high, top), nibble, 0xEC);
  w[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(more, 4), _mm512_and_si512(_mm512_srli_epi16(high, 2), top),
                                   nibble, 0xEC);
}

// One block of 16 output rows for R activation rows: out[r, 0..15] = sum over 16-input runs j of x_scale[r, j] times
// the weights' scale (d * sub-scale, per row) times (127 * leading dot + residual dot - biases[r, j]); without
// kResidual the leading dot alone, less its bias (int6_dot_rows moves the 127 into x_scale).
template <int R, bool kResidual>
inline void int6_dot_block(const uint8_t* block, const int8_t* sub_scales, const float* super_scales, const int8_t* xq,
                           const float* x_scales, const int32_t* biases, int64_t K, const NextBlock& next,
                           float* out /* [R, 16] */) {
  const int64_t runs = K / kInt6Run;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  __m512 d = _mm512_setzero_ps();
  for (int64_t j = 0; j < runs; ++j) {
    const uint8_t* bytes = block + j * kInt6RunBytes;
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes + 128, _MM_HINT_T0);
    if (const char* ahead = next.line(j * kInt6RunBytes, runs * kInt6RunBytes)) {
      _mm_prefetch(ahead, _MM_HINT_T1);
      if (next.passes == 1) _mm_prefetch(ahead + 64, _MM_HINT_T1);
    }
    if (j % kInt6RunsPerSuper == 0) d = _mm512_loadu_ps(super_scales + j / kInt6RunsPerSuper * 16);
    const __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub_scales + j * 16));
    const __m512 weight_scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub)), d);
    __m512i w[4];
    unpack_int6(bytes, w);
    for (int r = 0; r < R; ++r) {
      const int8_t* xs = xq + 2 * (r * K + j * kInt6Run);  // 8 leading, 8 residual, 8 leading, 8 residual
      __m512i leading = dot4_accumulate(_mm512_setzero_si512(), w[0], xs);
      leading = dot4_accumulate(leading, w[1], xs + 4);
      leading = dot4_accumulate(leading, w[2], xs + 16);
      leading = dot4_accumulate(leading, w[3], xs + 20);
      __m512i dots = leading;
      if constexpr (kResidual) {
        __m512i residual = dot4_accumulate(_mm512_setzero_si512(), w[0], xs + 8);
        residual = dot4_accumulate(residual, w[1], xs + 12);
        residual = dot4_accumulate(residual, w[2], xs + 24);
        residual = dot4_accumulate(residual, w[3], xs + 28);
        // At most 16 * 63 * (127 * 127 + 127) before the bias: far from int32's limit.
        dots = _mm512_add_epi32(_mm512_mullo_epi32(leading, _mm512_set1_epi32(127)), residual);
      }
      const __m512i exact = _mm512_sub_epi32(dots, _mm512_set1_epi32(biases[r * runs + j]));
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(x_scales[r * runs + j]));
      total[r] = _mm512_fmadd_ps(scaled, weight_scale, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 16, total[r]);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
