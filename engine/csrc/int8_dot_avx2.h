// int8_dot's kernel in the avx2 build: the VNNI kernel's layout and digits (int8_dot_avx512_vnni.h), 8 output rows
// a register. Without `vpdpbusd`, `vpmaddubsw` multiplies unsigned bytes by signed ones, so each weight byte
// (w + 128) is turned back into w, and the sign moves onto the activation digit (`vpsignb`): |w| * (sign(w) * x),
// at most 2 * 128 * 127 a pair of int16, no saturation; `vpmaddwd` adds the pairs into the row's int32 lane. The
// products are the true w * x, so no +128 comes back off (biases are not read), and the int32 dot products are
// the VNNI kernel's exactly.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <immintrin.h>

#include <cstdint>

#include "quant.h"

namespace BATCHSERVE_OPS {
namespace {

constexpr int kInt8DotRows = 2;  // activation rows per pass over a block

// One block of 16 output rows for R activation rows: out[r, 0..15] = sum over groups of x_scale[r, g] times (127 *
// leading dot + residual dot), before the weights' own scales; without kResidual the leading dot alone (its 127 in
// x_scale, as int8_dot_rows passes it). biases is the VNNI kernel's correction for its +128, unused here. The running
// sums stay in `out` (L1) and each 4 inputs' weights are turned into magnitudes and signs just before use: holding the
// sums and all of a step's weights in registers took more than AVX2's 16 and spilled the int32 sums to the stack at
// every step.
template <int R, bool kResidual>
inline void int8_dot_block(const uint8_t* block, const int8_t* xq, const float* x_scales,
                           const int32_t* /* biases */, int64_t K, int64_t group, const NextBlock& /* next */,
                           float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * 16 + 8 * h, _mm256_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m256i leading[R][2], residual[R][2];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) leading[r][h] = residual[r][h] = _mm256_setzero_si256();
    for (int64_t k = 0; k < group; k += 8) {
      const uint8_t* bytes = block + (g * group + k) * 16;  // 64 bytes per 4 inputs: rows 0-7, then rows 8-15
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes + 64, _MM_HINT_T0);
      for (int q = 0; q < 2; ++q) {  // inputs k..k+3, then k+4..k+7
        __m256i weights[2], magnitude[2];  // rows 0-7, 8-15
        for (int h = 0; h < 2; ++h) {
          weights[h] = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 64 * q + 32 * h)), flip);
          magnitude[h] = _mm256_abs_epi8(weights[h]);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xs = xq + 2 * (r * K + g * group + k);  // 8 leading digits, then 8 residual digits
          const __m256i lead = broadcast4_ymm(xs + 4 * q);
          for (int h = 0; h < 2; ++h) {
            const __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(lead, weights[h]));
            leading[r][h] = _mm256_add_epi32(leading[r][h], _mm256_madd_epi16(pairs, ones));
          }
          if constexpr (kResidual) {
            const __m256i rest = broadcast4_ymm(xs + 8 + 4 * q);
            for (int h = 0; h < 2; ++h) {
              const __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(rest, weights[h]));
              residual[r][h] = _mm256_add_epi32(residual[r][h], _mm256_madd_epi16(pairs, ones));
            }
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 x_scale = _mm256_set1_ps(x_scales[r * groups + g]);
      for (int h = 0; h < 2; ++h) {
        // 127 * leading + residual in int32 (one digit: leading), as the VNNI kernel folds it: the same integers,
        // the same floats.
        const __m256i digits = kResidual ? _mm256_add_epi32(_mm256_mullo_epi32(leading[r][h], _mm256_set1_epi32(127)),
                                                            residual[r][h])
                                         : leading[r][h];
        float* total = out + r * 16 + 8 * h;
        _mm256_storeu_ps(total, _mm256_fmadd_ps(_mm256_cvtepi32_ps(digits), x_scale, _mm256_loadu_ps(total)));
      }
    }
  }
}

}  // namespace
}  // namespace BATCHSERVE_OPS
