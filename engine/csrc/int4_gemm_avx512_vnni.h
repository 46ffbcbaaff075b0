// int4_gemm's kernel in the avx512_vnni build. Each block of 16 output rows' 4-bit weights (int4_dot.cpp's layout)
// is unpacked once into bytes (unpack_block: per run of 8 inputs, two 64-byte vectors of 4-input groups, 4 bits
// more a weight but only while the block is worked, in L1), so the inner loop is two loads and, per activation
// row, two `vpdpbusd` of 4 weights times 4 int8 activations into that row's int32 lanes. One digit per activation,
// so half int4_dot's dot products; kGemmRows activation rows share each loaded weight vector. A step of at most
// kPackedRows rows passes over each block once, so it reads the packed bytes as they are (`Packed`) and splits the
// nibbles in registers: nothing to store and load again, and the same vectors, so the same bits.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#include "digit_dot_avx512_vnni.h"  // dot4_accumulate
#include "quant.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

constexpr int kGemmRows = 8;  // activation rows per pass over a block's weights (8 int32 + 8 float accumulators)
constexpr int kPackedRows = kGemmRows;  // steps of at most this many rows read the packed bytes (one pass)
constexpr int64_t kUnpackedBytesPerInput = 16;  // one byte per weight of the block's 16 rows

// The block's packed bytes (K * 8) to K * 16: per run of 8 inputs, the low nibbles' 64 bytes, then the high ones'.
inline void unpack_block(const uint8_t* packed, int64_t K, uint8_t* unpacked) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t run = 0; run < K / 8; ++run) {
    const __m512i v = _mm512_loadu_si512(packed + run * 64);
    _mm512_store_si512(unpacked + run * 128, _mm512_and_si512(v, low));
    _mm512_store_si512(unpacked + run * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

template <int R, bool Packed>
inline void int4_gemm_block(const uint8_t* weights, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                            const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                            const NextBlock& next, float* out /* [R, 16] */) {
  using batchserve::lanes::load;
  const int64_t groups = K / group;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    next.request(g * group * 8, (g + 1) * group * 8, K * 8);  // 8 packed bytes per input
    for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
      __m512i first, second;
      if constexpr (Packed) {
        load_int4_weights_zmm(weights + k * 8, first, second);  // 64 bytes per 8 inputs
      } else {
        const uint8_t* bytes = weights + k * kUnpackedBytesPerInput;  // 128 bytes per 8 inputs
        first = _mm512_load_si512(bytes);
        second = _mm512_load_si512(bytes + 64);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = xq + r * K + k;
        acc[r] = dot4_accumulate(acc[r], first, xs);
        acc[r] = dot4_accumulate(acc[r], second, xs + 4);
      }
    }
    const __m512 s = load(scales + g * kDotBlock);
    // sum_k ((q - 8) s + z) x = s sum_k q x + (z - 8 s) sum_k x
    const __m512 z = zero_term16(s, offset_or_null(zeros, g * kDotBlock));
    for (int r = 0; r < R; ++r) {
      const __m512 dots = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(x_scales[r * groups + g]));
      total[r] = _mm512_fmadd_ps(s, dots, total[r]);
      total[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(x_sums[r * groups + g]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kDotBlock, total[r]);
}

}  // namespace
}  // namespace BATCHSERVE_OPS
