// int4_dot's kernel in the avx2 build: the same layout and two-digit activations as the VNNI kernel
// (int4_dot_avx512_vnni.h), 8 rows a register. Without VNNI, `vpmaddubsw` multiplies the unsigned 4-bit weights by
// the int8 digits and adds neighbouring pairs into int16 (at most 2 * 15 * 127: no saturation); the pair sums of 32
// inputs are added in int16, and `vpmaddwd` adds those pairs into the row's int32 lane, scaling the leading digits'
// sums by 127 on the way. The int32 sums are the VNNI kernel's exactly. Where the CPU has AVX-VNNI (Intel from Alder
// Lake, AMD from Zen 5) `vpdpbusd` does the same in one instruction; this build does not assume it.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "int4_dot_ymm.h"
#include "quant.h"

namespace BATCHSERVE_OPS {
namespace {

// Activation rows per pass over the weights. A pass's int16 sums take two registers per row and digit, so two rows
// (8 sums, 4 weight registers, the broadcasts) are what AVX2's 16 registers hold without spilling; four rows a
// pass, with 8-input runs to fit, took 1.37x the time of two at 4 to 32 rows on a Xeon core (a one-off standalone
// loop, interleaved best of 7; the same bits).
constexpr int kDotRows = 2;
constexpr int64_t kInt16Inputs = 32;  // inputs whose pair sums int16 holds: 4 runs of 8

template <int R>
inline void int4_dot_block(const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                           const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                           const NextBlock& /* next */, float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  const __m256i ones = _mm256_set1_epi16(1), leading_weight = _mm256_set1_epi16(127);
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const uint8_t* bytes = packed + g * group * 8;  // 64 bytes per 8 inputs: rows 0-7, then rows 8-15
    // The int16 pair sums of a run of inputs are added as int16 (at most 8 * 2 * 15 * 127 = 30480 for the leading
    // digits over 32 inputs) and only then widened by `vpmaddwd`: a quarter of the widening multiplies of 8-input
    // runs.
    for (int64_t k0 = 0; k0 < group; k0 += kInt16Inputs) {
      __m256i leading[R][2], residual[R][2];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) leading[r][h] = residual[r][h] = _mm256_setzero_si256();
      for (int64_t k = k0; k < std::min<int64_t>(group, k0 + kInt16Inputs); k += 8, bytes += 64) {
        __m256i first[2], second[2];
        load_int4_weights_ymm(bytes, first, second);
        for (int r = 0; r < R; ++r) {
          const DigitsYmm x = broadcast_digits_ymm(xq + 2 * (r * K + g * group + k));
          for (int h = 0; h < 2; ++h) {
            const __m256i lead = _mm256_add_epi16(_mm256_maddubs_epi16(first[h], x.leading_first),
                                                  _mm256_maddubs_epi16(second[h], x.leading_second));
            const __m256i rest = _mm256_add_epi16(_mm256_maddubs_epi16(first[h], x.residual_first),
                                                  _mm256_maddubs_epi16(second[h], x.residual_second));
            leading[r][h] = _mm256_add_epi16(leading[r][h], lead);
            residual[r][h] = _mm256_add_epi16(residual[r][h], rest);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_add_epi32(_mm256_madd_epi16(leading[r][h], leading_weight),
                                                                  _mm256_madd_epi16(residual[r][h], ones)));
    }
    add_group_ymm<R>(acc, scales, zeros, x_scales, x_sums, g, groups, total);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kDotBlock + 8 * h, total[r][h]);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
