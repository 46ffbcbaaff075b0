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
#include <cstring>

#include "quant.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

using batchserve::lanes::load;

// Activation rows per pass over the weights. A pass's int16 sums take two registers per row and digit, so two rows
// (8 sums, 4 weight registers, the broadcasts) are what AVX2's 16 registers hold without spilling; four rows a
// pass, with 8-input runs to fit, took 1.37x the time of two at 4 to 32 rows on a Xeon core (a one-off standalone
// loop, interleaved best of 7; the same bits).
constexpr int kDotRows = 2;
constexpr int64_t kInt16Inputs = 32;  // inputs whose pair sums int16 holds: 4 runs of 8

template <int R>
inline void int4_dot_block(const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                           const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                           float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  const __m256i low = _mm256_set1_epi8(0x0F);
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
            leading[r][h] = _mm256_add_epi16(
                leading[r][h],
                _mm256_add_epi16(_mm256_maddubs_epi16(first[h], va), _mm256_maddubs_epi16(second[h], vb)));
            residual[r][h] = _mm256_add_epi16(
                residual[r][h],
                _mm256_add_epi16(_mm256_maddubs_epi16(first[h], vc), _mm256_maddubs_epi16(second[h], vd)));
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_add_epi32(_mm256_madd_epi16(leading[r][h], leading_weight),
                                                                  _mm256_madd_epi16(residual[r][h], ones)));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load(scales + g * kDotBlock + 8 * h);
      // sum_k ((q - 8) s + z) x = s sum_k q x + (z - 8 s) sum_k x
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
