// int4_dot's kernel in the avx2_vnni build (AVX2 with AVX-VNNI: Intel's cores from Alder Lake, AMD's from Zen 5):
// the avx2 kernel's layout and passes (int4_dot_avx2.h), with `vpdpbusd` on 256-bit registers doing in one
// instruction what `vpmaddubsw`, the int16 add and the widening `vpmaddwd` do there. The leading digits' and the
// residual ones' sums stay apart in int32 until a group ends, then combine as 127 * leading + residual: the same
// int32 sums as the other two kernels, so the same bits.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#include "int4_dot_ymm.h"
#include "quant.h"

namespace BATCHSERVE_OPS {
namespace {

// Activation rows per pass: two rows' 8 int32 sums, the 4 weight registers and the broadcasts fill AVX2's 16 (four
// rows, spilling, measured the same on a Xeon core; eight, 1.6x the time).
constexpr int kDotRows = 2;

template <int R>
inline void int4_dot_block(const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                           const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                           const NextBlock& /* next */, float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  const uint8_t* bytes = packed;  // 64 bytes per 8 inputs: rows 0-7, then rows 8-15
  for (int64_t g = 0; g < groups; ++g) {
    __m256i leading[R][2], residual[R][2];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) leading[r][h] = residual[r][h] = _mm256_setzero_si256();
    for (int64_t k = 0; k < group; k += 8, bytes += 64) {
      __m256i first[2], second[2];
      load_int4_weights_ymm(bytes, first, second);
      for (int r = 0; r < R; ++r) {
        const DigitsYmm x = broadcast_digits_ymm(xq + 2 * (r * K + g * group + k));
        for (int h = 0; h < 2; ++h) {
          leading[r][h] = _mm256_dpbusd_avx_epi32(leading[r][h], first[h], x.leading_first);
          leading[r][h] = _mm256_dpbusd_avx_epi32(leading[r][h], second[h], x.leading_second);
          residual[r][h] = _mm256_dpbusd_avx_epi32(residual[r][h], first[h], x.residual_first);
          residual[r][h] = _mm256_dpbusd_avx_epi32(residual[r][h], second[h], x.residual_second);
        }
      }
    }
    // 127 * leading + residual in int32 (at most 32 * 15 * 127 * 128 for a group of 32: far from overflow).
    __m256i dots[R][2];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        dots[r][h] = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(leading[r][h], 7), leading[r][h]),
                                      residual[r][h]);
    add_group_ymm<R>(dots, scales, zeros, x_scales, x_sums, g, groups, total);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kDotBlock + 8 * h, total[r][h]);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
