// int4_gemv's kernel in the AVX-512 builds (avx512 and avx512_vnni): a block of 64 output rows at once, 16 float
// lanes a quarter, up to kInt4Rows activation rows a pass. A packed byte's nibble picks its centred value (q - 8)
// from a 16-entry table with one permute, so no mask, subtract or conversion is needed per weight.
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

constexpr int kInt4Rows = 8;  // activation rows per pass over the int4 weights

// Whole vectors from and to float32 or bfloat16 (a bfloat16 store rounds as c10::BFloat16 does).
using batchserve::lanes::load;
using batchserve::lanes::store;

// The (scale, zero) pairs of 16 output rows, split into s and z.
template <typename S>
inline void scales16(const S* pairs, __m512& s, __m512& z) {
  const __m512 lo = load(pairs), hi = load(pairs + 16);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  s = _mm512_permutex2var_ps(lo, even, hi);
  z = _mm512_permutex2var_ps(lo, odd, hi);
}

// One block of 64 output rows for R activation rows (x already float32, with per-group sums).
template <int R, typename S>
inline void int4_block(const uint8_t* packed, const S* scales_and_zeros, const float* x, const float* group_sums,
                       int64_t K, int64_t N, int64_t group, int64_t block, float* out /* [R, 64] */) {
  __m512 total[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) total[r][c] = _mm512_setzero_ps();
  // q - 8 for every 4-bit q.
  const __m512 centred = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t groups = K / group;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    const uint8_t* bytes = packed + (block * K + g * group) * (kBlockN / 2);
    for (int64_t k = 0; k < group; ++k, bytes += kBlockN / 2) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
      // Each 32-bit lane holds one packed byte; the table lookup reads only its low 4 bits, so the low nibble
      // needs no mask and the high one only a shift.
      const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
      __m512 w[4];
      w[0] = _mm512_permutexvar_ps(first, centred);  // rows 0-15
      w[1] = _mm512_permutexvar_ps(second, centred);  // rows 16-31
      w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(first, 4), centred);  // rows 32-47
      w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(second, 4), centred);  // rows 48-63
      for (int r = 0; r < R; ++r) {
        const __m512 xk = _mm512_set1_ps(x[r * K + g * group + k]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(w[c], xk, acc[r][c]);
      }
    }
    const S* pairs = scales_and_zeros + (g * N + block * kBlockN) * 2;
    for (int c = 0; c < 4; ++c) {
      __m512 s, z;
      scales16(pairs + c * 32, s, z);
      for (int r = 0; r < R; ++r) {
        total[r][c] = _mm512_fmadd_ps(s, acc[r][c], total[r][c]);
        total[r][c] = _mm512_fmadd_ps(z, _mm512_set1_ps(group_sums[r * groups + g]), total[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + r * kBlockN + c * 16, total[r][c]);
}

template <typename T, typename S>
void int4_rows(const float* x, const float* group_sums, const uint8_t* packed, const S* scales_and_zeros, T* y,
               int64_t rows, int64_t K, int64_t N, int64_t group) {
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kInt4Rows * kBlockN];
    for (int64_t block = begin; block < end; ++block) {
      // Every row chunk of this block reuses its weight bytes from cache: they are read from memory once.
      for (int64_t first = 0; first < rows; first += kInt4Rows) {
        const int64_t count = std::min<int64_t>(kInt4Rows, rows - first);
        const float* xs = x + first * K;
        const float* sums = group_sums + first * (K / group);
        with_row_count<kInt4Rows>(count, [&](auto R) {
          int4_block<decltype(R)::value, S>(packed, scales_and_zeros, xs, sums, K, N, group, block, out);
        });
        for (int64_t r = 0; r < count; ++r)
          for (int c = 0; c < 4; ++c)
            store(y + (first + r) * N + block * kBlockN + c * 16, _mm512_loadu_ps(out + r * kBlockN + c * 16));
      }
    }
  });
}

}  // namespace
}  // namespace BATCHSERVE_OPS
