// Activations as two int8 digits per value, per group of inputs: what the integer-dot kernels (int4_dot.cpp,
// int8_dot.cpp) multiply their weights with. The leading digit is the value in 127ths of its group's largest, the
// second the leading digit's rounding error in 127ths of a unit, so the pair is good to about 1/32000 of the group's
// largest value (one digit cost +1.6 % perplexity on the default model through int4_dot).
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops.h"  // BATCHSERVE_OPS
#include "vector_lanes.h"

#if defined(__AVX2__)
#include <immintrin.h>

namespace BATCHSERVE_OPS {
namespace {

// Values are read 8 at a time in every build, with one running sum per position mod 8 added up in a fixed tree at
// the end of the group, so the AVX2 and AVX-512 builds give the same bits. Only builds with integer dot products
// (AVX2 and up) quantise activations.
constexpr int64_t kDigitLanes = 8;

inline float sum_of_eight(const float* part) {
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

using batchserve::lanes::load8;  // bf16 widens exactly

// 8 integral floats in [-127, 127] to 8 int8s.
inline void store_digits8(int8_t* out, __m256 integral) {
  const __m256i i32 = _mm256_cvtps_epi32(integral);
  const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(i16, i16));
}

// One row's group: its largest magnitude and its sum (8 running sums), then its digits (the layout below).
template <typename T>
inline void quantise_group(const T* v, int64_t group, int8_t* digits, float* x_scale, float* x_sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps(), parts = _mm256_setzero_ps();
  for (int64_t i = 0; i < group; i += kDigitLanes) {
    const __m256 x = load8(v + i);
    top = _mm256_max_ps(top, _mm256_and_ps(x, magnitude));
    parts = _mm256_add_ps(parts, x);
  }
  alignas(32) float lanes[kDigitLanes];
  _mm256_store_ps(lanes, top);
  const float largest = *std::max_element(lanes, lanes + kDigitLanes);
  _mm256_store_ps(lanes, parts);
  const float scale = largest / 127.0f;
  const __m256 inverse = _mm256_set1_ps(scale > 0 ? 1.0f / scale : 0.0f), hundred27 = _mm256_set1_ps(127.0f);
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // std::nearbyint's default rounding
  for (int64_t i = 0; i < group; i += kDigitLanes) {
    const __m256 units = _mm256_mul_ps(load8(v + i), inverse);  // in [-127, 127]
    const __m256 leading = _mm256_round_ps(units, nearest);
    store_digits8(digits + 2 * i, leading);
    // The rounding error, |units - leading| <= 0.5, in 127ths: within [-64, 64].
    const __m256 error = _mm256_mul_ps(_mm256_sub_ps(units, leading), hundred27);
    store_digits8(digits + 2 * i + 8, _mm256_round_ps(error, nearest));
  }
  *x_scale = scale / 127.0f;  // per unit of the combined 127 * leading + residual
  *x_sum = sum_of_eight(lanes);
}

// Per row and group: two int8 digits per value (per 8 inputs, 8 leading digits then 8 residual ones), the scale that
// maps them back, and the float sum (for int4_dot's zero term); int4_dot_block and int8_dot_block read this layout.
// x is read in its own dtype (bfloat16 widens exactly), so a decode step makes no float32 copy of each projection's
// input. Rows go to torch's threads: on one thread as plain loops, this was 7 % of a 32-row projection's time.
template <typename T>
[[maybe_unused]] void quantise_activations(const T* x, int64_t rows, int64_t K, int64_t group, int8_t* xq,
                                           float* x_scales, float* x_sums) {
  const int64_t groups = K / group;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g)
        quantise_group(x + r * K + g * group, group, xq + 2 * (r * K + g * group), x_scales + r * groups + g,
                       x_sums + r * groups + g);
  });
}

// What unsigned weight codes stored `offset` above their value add to each row's and group's integer dot product:
// offset times the digits' sum, with the leading digit counted 127 times (one_digit: the leading digit alone, its 127
// moved into the scale, so once). The kernels subtract it and get the signed weights' dot product exactly.
[[maybe_unused]] std::vector<int32_t> digit_biases(const int8_t* xq, int64_t rows, int64_t K, int64_t group,
                                                   int32_t offset, bool one_digit) {
  const int64_t groups = K / group;
  const int32_t leading_weight = one_digit ? 1 : 127, residual_weight = one_digit ? 0 : 1;
  std::vector<int32_t> biases(rows * groups, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* digits = xq + 2 * (r * K + g * group);
      int32_t sum = 0;
      for (int64_t i = 0; i < 2 * group; i += 16)
        for (int64_t j = 0; j < 8; ++j) sum += leading_weight * digits[i + j] + residual_weight * digits[i + 8 + j];
      biases[r * groups + g] = offset * sum;
    }
  return biases;
}

// A step's activations as int8_dot and int6_dot read them: the digits, each group's scale (with one digit, the
// leading digit's 127 moved into it) and each group's bias for weights stored `offset` above their value.
struct DigitActivations {
  std::unique_ptr<int8_t[]> digits;
  std::vector<float> scales;
  std::vector<int32_t> biases;
};

template <typename T>
[[maybe_unused]] DigitActivations digit_activations(const T* x, int64_t rows, int64_t K, int64_t group, int32_t offset,
                                                    bool one_digit) {
  DigitActivations out{std::unique_ptr<int8_t[]>(new int8_t[2 * rows * K]), std::vector<float>(rows * (K / group)),
                       {}};  // every digit is written: no zeroing
  std::vector<float> sums(rows * (K / group));
  quantise_activations(x, rows, K, group, out.digits.get(), out.scales.data(), sums.data());
  out.biases = digit_biases(out.digits.get(), rows, K, group, offset, one_digit);
  if (one_digit)
    for (float& scale : out.scales) scale *= 127.0f;
  return out;
}

}  // namespace
}  // namespace BATCHSERVE_OPS
#endif  // __AVX2__
