// What the two 256-bit int4_dot kernels share (int4_dot_avx2.h, int4_dot_avx_vnni.h): a block's unsigned weights of
// 8 inputs, a row's digits of 8 inputs broadcast 4 at a time, and a group's float sums from its int32 dot products.
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

// The unsigned weights of 8 inputs (64 bytes) for the block's rows 0-7 (h = 0) and 8-15 (h = 1): `first` holds
// inputs k..k+3 of each row (low nibbles), `second` inputs k+4..k+7 (high ones).
inline void load_int4_weights_ymm(const uint8_t* bytes, __m256i (&first)[2], __m256i (&second)[2]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * h));
    first[h] = _mm256_and_si256(v, low);
    second[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
}

// One row's 16 digits of 8 inputs (8 leading, then 8 residual), each 4 repeated across a register: what `first`
// and `second` multiply.
struct DigitsYmm {
  __m256i leading_first, leading_second, residual_first, residual_second;
};

inline DigitsYmm broadcast_digits_ymm(const int8_t* digits) {
  return {broadcast4_ymm(digits), broadcast4_ymm(digits + 4), broadcast4_ymm(digits + 8), broadcast4_ymm(digits + 12)};
}

// Group g's term of R rows' running sums, from its int32 dot products (127 * leading + residual):
// sum_k ((q - 8) s + z) x = s sum_k q x + (z - 8 s) sum_k x, with x = x_scale * digits.
template <int R>
inline void add_group_ymm(const __m256i (&dots)[R][2], const c10::BFloat16* scales, const c10::BFloat16* zeros,
                          const float* x_scales, const float* x_sums, int64_t g, int64_t groups,
                          __m256 (&total)[R][2]) {
  using batchserve::lanes::load;
  for (int h = 0; h < 2; ++h) {
    const __m256 s = load(scales + g * kDotBlock + 8 * h);
    const __m256 z = zero_term8(s, offset_or_null(zeros, g * kDotBlock + 8 * h));
    for (int r = 0; r < R; ++r) {
      const __m256 x_dots = _mm256_mul_ps(_mm256_cvtepi32_ps(dots[r][h]), _mm256_set1_ps(x_scales[r * groups + g]));
      total[r][h] = _mm256_fmadd_ps(s, x_dots, total[r][h]);
      total[r][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(x_sums[r * groups + g]), total[r][h]);
    }
  }
}

}  // namespace
}  // namespace BATCHSERVE_OPS
