// int6_dot's kernel in the avx2 build: the VNNI kernel's layout and digits (int6_dot_avx512_vnni.h), 8 output rows a
// register, each half of a block (rows 0-7, then 8-15) in turn. The codes are unsigned (0..63), as `vpmaddubsw` takes
// its first operand: a code times a digit pair sums to at most 2 * 63 * 127, two such pairs to 32004, inside int16;
// `vpmaddwd` adds them into the row's int32 lane. The int32 dot products, the biases and the float steps are the VNNI
// kernel's, so both builds give the same results.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <immintrin.h>

#include <cstdint>

#include "quant.h"

namespace BATCHSERVE_OPS {
namespace {

constexpr int kInt6DotRows = 2;  // activation rows per pass over a block

// Half h's codes for inputs k..k+15 (int6_dot_avx512_vnni.h's unpack_int6, 32 bytes of each 64).
inline void unpack_int6_half(const uint8_t* bytes, int h, __m256i (&w)[4]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const auto load = [&](int offset) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + offset + 32 * h));
  };
  const __m256i low = load(0), more = load(64), high = load(128);
  w[0] = _mm256_or_si256(_mm256_and_si256(low, nibble), _mm256_and_si256(_mm256_slli_epi16(high, 4), top));
  w[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low, 4), nibble),
                         _mm256_and_si256(_mm256_slli_epi16(high, 2), top));
  w[2] = _mm256_or_si256(_mm256_and_si256(more, nibble), _mm256_and_si256(high, top));
  w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(more, 4), nibble),
                         _mm256_and_si256(_mm256_srli_epi16(high, 2), top));
}

// The codes of w[0], w[1] (or w[2], w[3]) times the 4 + 4 digits at xs and xs + 4, summed per row: int32 lanes.
inline __m256i dot8(const __m256i& first, const __m256i& second, const int8_t* xs) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, broadcast4_ymm(xs)),
                                         _mm256_maddubs_epi16(second, broadcast4_ymm(xs + 4)));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// One block of 16 output rows for R activation rows, as the VNNI kernel's int6_dot_block computes it.
template <int R, bool kResidual>
inline void int6_dot_block(const uint8_t* block, const int8_t* sub_scales, const float* super_scales, const int8_t* xq,
                           const float* x_scales, const int32_t* biases, int64_t K, const NextBlock& /* next */,
                           float* out /* [R, 16] */) {
  const int64_t runs = K / kInt6Run;
  __m256 total[R][2], d[2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < runs; ++j) {
    const uint8_t* bytes = block + j * kInt6RunBytes;
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes + 128, _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      if (j % kInt6RunsPerSuper == 0) d[h] = _mm256_loadu_ps(super_scales + j / kInt6RunsPerSuper * 16 + 8 * h);
      const __m128i sub = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub_scales + j * 16 + 8 * h));
      const __m256 weight_scale = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)), d[h]);
      __m256i w[4];
      unpack_int6_half(bytes, h, w);
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = xq + 2 * (r * K + j * kInt6Run);  // 8 leading, 8 residual, 8 leading, 8 residual
        const __m256i leading = _mm256_add_epi32(dot8(w[0], w[1], xs), dot8(w[2], w[3], xs + 16));
        __m256i dots = leading;
        if constexpr (kResidual) {
          const __m256i residual = _mm256_add_epi32(dot8(w[0], w[1], xs + 8), dot8(w[2], w[3], xs + 24));
          dots = _mm256_add_epi32(_mm256_mullo_epi32(leading, _mm256_set1_epi32(127)), residual);
        }
        const __m256i exact = _mm256_sub_epi32(dots, _mm256_set1_epi32(biases[r * runs + j]));
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(x_scales[r * runs + j]));
        total[r][h] = _mm256_fmadd_ps(scaled, weight_scale, total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * 16 + 8 * h, total[r][h]);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
