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

#include "quant.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

using batchserve::lanes::load;

// Activation rows per pass: two rows' 8 int32 sums, the 4 weight registers and the broadcasts fill AVX2's 16 (four
// rows, spilling, measured the same on a Xeon core; eight, 1.6x the time).
constexpr int kDotRows = 2;

template <int R>
inline void int4_dot_block(const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                           const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                           float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  const uint8_t* bytes = packed;  // 64 bytes per 8 inputs: rows 0-7, then rows 8-15
  for (int64_t g = 0; g < groups; ++g) {
    __m256i leading[R][2], residual[R][2];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) leading[r][h] = residual[r][h] = _mm256_setzero_si256();
    for (int64_t k = 0; k < group; k += 8, bytes += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
      __m256i first[2], second[2];  // the unsigned weights of rows 0-7 and 8-15: low nibbles, then high
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * h));
        first[h] = _mm256_and_si256(v, low);
        second[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = xq + 2 * (r * K + g * group + k);  // 8 leading digits, then 8 residual digits
        const __m256i va = broadcast4_ymm(xs), vb = broadcast4_ymm(xs + 4), vc = broadcast4_ymm(xs + 8),
                      vd = broadcast4_ymm(xs + 12);
        for (int h = 0; h < 2; ++h) {
          leading[r][h] = _mm256_dpbusd_avx_epi32(leading[r][h], first[h], va);
          leading[r][h] = _mm256_dpbusd_avx_epi32(leading[r][h], second[h], vb);
          residual[r][h] = _mm256_dpbusd_avx_epi32(residual[r][h], first[h], vc);
          residual[r][h] = _mm256_dpbusd_avx_epi32(residual[r][h], second[h], vd);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load(scales + g * kDotBlock + 8 * h);
      // sum_k ((q - 8) s + z) x = s sum_k q x + (z - 8 s) sum_k x
      const __m256 z = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, load(zeros + g * kDotBlock + 8 * h));
      for (int r = 0; r < R; ++r) {
        // 127 * leading + residual in int32 (at most 32 * 15 * 127 * 128 for a group of 32: far from overflow).
        const __m256i lead = leading[r][h];
        const __m256i digits = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(lead, 7), lead), residual[r][h]);
        const __m256 dots = _mm256_mul_ps(_mm256_cvtepi32_ps(digits), _mm256_set1_ps(x_scales[r * groups + g]));
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
