// int4_gemv's kernel in the AVX2 build: 8 float lanes and 16 registers. It keeps the AVX-512 kernel's data layout
// and order of work (int4_gemv_avx512.h), on a quarter of a 64-row block at a time and fewer activation rows per
// pass, so that its accumulators stay in registers; each weight is masked, centred and converted to float.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "quant.h"
#include "scalar.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

constexpr int kInt4Rows = 4;  // activation rows per pass over the int4 weights

using batchserve::lanes::store;
using batchserve::widen;

// The (scale, zero) pairs of `count` output rows, split into s and z (the AVX2 kernels' epilogues; once a group).
template <typename S>
inline void split_pairs(const S* pairs, int64_t count, float* s, float* z) {
  for (int64_t i = 0; i < count; ++i) {
    s[i] = widen(pairs[2 * i]);
    z[i] = widen(pairs[2 * i + 1]);
  }
}

// 16 output rows (a quarter of a 64-row block of torch's packing) for R activation rows. Quarter q reads bytes
// 16 (q % 2) .. + 15 of each k's 32, in their low nibble for q < 2 and their high one after.
template <int R, int Quarter, typename S>
inline void int4_quarter(const uint8_t* packed, const S* scales_and_zeros, const float* x, const float* group_sums,
                         int64_t K, int64_t N, int64_t group, int64_t block, float* out /* [R, 16] */) {
  constexpr int kShift = (Quarter / 2) * 4;
  const __m256i nibble = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
  const int64_t groups = K / group;
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t* bytes = packed + (block * K + g * group) * (kBlockN / 2) + (Quarter % 2) * 16;
    for (int64_t k = 0; k < group; ++k, bytes += kBlockN / 2) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
      const __m256i lo = _mm256_srli_epi32(_mm256_cvtepu8_epi32(raw), kShift);
      const __m256i hi = _mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8)), kShift);
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(lo, nibble), eight));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(hi, nibble), eight));
      for (int r = 0; r < R; ++r) {
        const __m256 xk = _mm256_set1_ps(x[r * K + g * group + k]);
        acc[r][0] = _mm256_fmadd_ps(w0, xk, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, xk, acc[r][1]);
      }
    }
    alignas(32) float s[16], z[16];
    split_pairs(scales_and_zeros + (g * N + block * kBlockN + Quarter * 16) * 2, 16, s, z);
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = _mm256_load_ps(s + 8 * h), zv = _mm256_load_ps(z + 8 * h);
      for (int r = 0; r < R; ++r) {
        total[r][h] = _mm256_fmadd_ps(sv, acc[r][h], total[r][h]);
        total[r][h] = _mm256_fmadd_ps(zv, _mm256_set1_ps(group_sums[r * groups + g]), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * 16 + h * 8, total[r][h]);
}

template <typename T, typename S>
void int4_rows(const float* x, const float* group_sums, const uint8_t* packed, const S* scales_and_zeros, T* y,
               int64_t rows, int64_t K, int64_t N, int64_t group) {
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float out[kInt4Rows * 16];
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t first = 0; first < rows; first += kInt4Rows) {
        const int64_t count = std::min<int64_t>(kInt4Rows, rows - first);
        const float* xs = x + first * K;
        const float* sums = group_sums + first * (K / group);
        auto quarter = [&](auto Q) {
          with_row_count<kInt4Rows>(count, [&](auto R) {
            int4_quarter<decltype(R)::value, decltype(Q)::value, S>(packed, scales_and_zeros, xs, sums, K, N, group,
                                                                    block, out);
          });
          for (int64_t r = 0; r < count; ++r)
            for (int h = 0; h < 2; ++h)
              store(y + (first + r) * N + block * kBlockN + decltype(Q)::value * 16 + h * 8,
                     _mm256_load_ps(out + r * 16 + h * 8));
        };
        quarter(std::integral_constant<int, 0>{});
        quarter(std::integral_constant<int, 1>{});
        quarter(std::integral_constant<int, 2>{});
        quarter(std::integral_constant<int, 3>{});
      }
    }
  });
}

}  // namespace
}  // namespace BATCHSERVE_OPS
