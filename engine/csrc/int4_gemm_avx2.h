// int4_gemm's kernel in the avx2 build: `vpmaddubsw` multiplies the 4-bit weights (unsigned, at most 15) by int8
// activations into int16 pairs (at most 2 * 15 * 127, no saturation) and `vpmaddwd` by ones widens them into
// each output row's int32 lane; the same integer sums as the VNNI build's `vpdpbusd`.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

constexpr int kGemmRows = 4;  // activation rows per pass (16 registers: 8 int32 and 8 float accumulators)

template <int R>
inline void int4_gemm_block(const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                            const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                            float* out /* [R, 16] */) {
  using batchserve::lanes::load;
  const int64_t groups = K / group;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const uint8_t* bytes = packed + g * group * 8;  // 64 bytes per 8 inputs: rows 0-7, then rows 8-15
    for (int64_t k = 0; k < group; k += 8, bytes += 64) {
      __m256i first[2], second[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * h));
        first[h] = _mm256_and_si256(v, low);
        second[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = xq + r * K + g * group + k;
        int32_t a, b;
        std::memcpy(&a, xs, 4);
        std::memcpy(&b, xs + 4, 4);
        const __m256i va = _mm256_set1_epi32(a), vb = _mm256_set1_epi32(b);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs =
              _mm256_add_epi16(_mm256_maddubs_epi16(first[h], va), _mm256_maddubs_epi16(second[h], vb));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load(scales + g * kDotBlock + 8 * h);
      const __m256 z = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, load(zeros + g * kDotBlock + 8 * h));
      for (int r = 0; r < R; ++r) {
        const __m256 dots = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_set1_ps(x_scales[r * groups + g]));
        total[r][h] = _mm256_fmadd_ps(s, dots, total[r][h]);
        total[r][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(x_sums[r * groups + g]), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kDotBlock + 8 * h, total[r][h]);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
