// int4_gemm's kernel in the avx2 build, on the same unpacked block as the VNNI build's (unpack_block): `vpmaddubsw`
// multiplies the 4-bit weights (unsigned, at most 15) by int8 activations into int16 pairs (at most 2 * 15 * 127 =
// 3810, no saturation), eight of them (32 inputs) sum in int16 (at most 30480, no overflow), and `vpmaddwd` by ones
// widens them into each output row's int32 lane: the same integer sums as the VNNI build's `vpdpbusd`. A step of at
// most kPackedRows rows reads the packed bytes as they are (`Packed`, int4_dot's loads), as the VNNI build does.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "int4_dot_ymm.h"
#include "quant.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

constexpr int kGemmRows = 4;  // activation rows per pass (8 int16 accumulators, their broadcasts, 16 registers)
constexpr int kPackedRows = 2;  // steps of at most this many rows read the packed bytes (4 spill: 1.0-1.1x)
constexpr int64_t kUnpackedBytesPerInput = 16;  // one byte per weight of the block's 16 rows
constexpr int64_t kInt16Inputs = 32;  // inputs summed in int16 before widening (8 x 3810 < 32768)

// The block's packed bytes (K * 8) to K * 16: per run of 8 inputs, the low nibbles' 64 bytes, then the high ones'
// (in each, rows 0-7's 4-input groups, then rows 8-15's).
inline void unpack_block(const uint8_t* packed, int64_t K, uint8_t* unpacked) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t run = 0; run < K / 8; ++run) {
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + run * 64 + 32 * h));
      _mm256_store_si256(reinterpret_cast<__m256i*>(unpacked + run * 128 + 32 * h), _mm256_and_si256(v, low));
      _mm256_store_si256(reinterpret_cast<__m256i*>(unpacked + run * 128 + 64 + 32 * h),
                         _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    }
  }
}

inline __m256i load32(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

// The int16 pair sums of R rows' digits at inputs [from, to) (at most kInt16Inputs) against the block's 16 rows,
// from its unpacked bytes or (`Packed`) its packed ones.
template <int R, bool Packed>
inline void int16_pairs(const uint8_t* weights, const int8_t* xq, int64_t K, int64_t from, int64_t to,
                        __m256i (&pairs)[R][2]) {
  for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
  for (int64_t k = from; k < to; k += 8) {
    // Inputs k..k+3 (`first`) and k+4..k+7 (`second`) of rows 0-7 (h = 0) and 8-15 (h = 1). Packed: split once
    // into registers; unpacked: read where each row uses them (as memory operands, no registers held: at 4 rows
    // a pass, 4 held weight registers spill).
    __m256i first[2], second[2];
    if constexpr (Packed) load_int4_weights_ymm(weights + k * 8, first, second);
    const uint8_t* bytes = weights + k * kUnpackedBytesPerInput;
    for (int r = 0; r < R; ++r) {
      const int8_t* xs = xq + r * K + k;
      int32_t a, b;
      std::memcpy(&a, xs, 4);
      std::memcpy(&b, xs + 4, 4);
      const __m256i va = _mm256_set1_epi32(a), vb = _mm256_set1_epi32(b);
      for (int h = 0; h < 2; ++h) {
        const __m256i low = Packed ? first[h] : load32(bytes + 32 * h);
        const __m256i high = Packed ? second[h] : load32(bytes + 64 + 32 * h);
        pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_maddubs_epi16(low, va));
        pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_maddubs_epi16(high, vb));
      }
    }
  }
}

// out[r] = sum_g s[g] x_scale[r, g] dot(q[g], digits[r, g]) + (z - 8 s)[g] x_sum[r, g] for R rows of one block;
// the running sums stay in `out` (L1): AVX2's 16 registers hold the int16 sums and the broadcasts. A group of
// kInt16Inputs (every GGUF's 32) goes from its int16 sums straight to floats: no int32 sums held across a loop,
// whose 8 more registers spilled 7 others to the stack at every group.
template <int R, bool Packed>
inline void int4_gemm_block(const uint8_t* weights, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                            const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                            const NextBlock& next, float* out /* [R, 16] */) {
  using batchserve::lanes::load;
  const int64_t groups = K / group;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) std::memset(out + r * kDotBlock, 0, kDotBlock * sizeof(float));
  for (int64_t g = 0; g < groups; ++g) {
    next.request(g * group * 8, (g + 1) * group * 8, K * 8);  // 8 packed bytes per input
    __m256i acc[R][2];
    if (group == kInt16Inputs) {
      int16_pairs<R, Packed>(weights, xq, K, g * group, g * group + group, acc);
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_madd_epi16(acc[r][h], ones);
    } else {
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int64_t start = 0; start < group; start += kInt16Inputs) {
        __m256i pairs[R][2];
        const int64_t from = g * group + start, to = g * group + std::min(group, start + kInt16Inputs);
        int16_pairs<R, Packed>(weights, xq, K, from, to, pairs);
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs[r][h], ones));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load(scales + g * kDotBlock + 8 * h);
      const __m256 z = zero_term8(s, offset_or_null(zeros, g * kDotBlock + 8 * h));
      for (int r = 0; r < R; ++r) {
        float* total = out + r * kDotBlock + 8 * h;
        const __m256 dots = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_set1_ps(x_scales[r * groups + g]));
        const __m256 sum = _mm256_fmadd_ps(s, dots, _mm256_loadu_ps(total));
        _mm256_storeu_ps(total, _mm256_fmadd_ps(z, _mm256_set1_ps(x_sums[r * groups + g]), sum));
      }
    }
  }
}

}  // namespace
}  // namespace BATCHSERVE_OPS
