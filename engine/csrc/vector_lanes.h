// float32 vectors at the build's width (16 lanes with AVX-512, 8 with AVX2), loaded from float32, bfloat16 or int8
// and stored to float32 or bfloat16, for the kernels that work a whole vector at a time: one kernel written on these
// compiles to each vector build's instructions (decode attention, SiLU * up, int8_gemv). A bfloat16 load is a shift
// of the raw bits; a bfloat16 store rounds to nearest-even as batchserve::narrow does (NaN to 0x7FC0), so a kernel
// that rounds here where torch rounds gives torch's bits. The scalar build has none of this and keeps its plain
// loops.

#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace batchserve::lanes {

// 8 values as float32 in every vector build, for code written on 256-bit vectors (int4_gemm's activation
// quantiser); the AVX2 build's `load` is this.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kWidth = 16;

inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// Each lane's bfloat16 bits, rounded, in the low half of its 32 bits.
inline __m512i bf16_bits(Vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
}
inline Vec from_bf16_bits(__m512i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
// table[bits of each of kWidth bfloat16 keys]: one gather.
inline Vec lookup(const float* table, const c10::BFloat16* keys) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys));
  return _mm512_i32gather_ps(_mm512_cvtepu16_epi32(raw), table, 4);
}
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec zero() { return _mm512_setzero_ps(); }
// kWidth int8 values, converted to float32 (exactly).
inline Vec load_int8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float max_lane(Vec v) { return _mm512_reduce_max_ps(v); }
#else
using Vec = __m256;
constexpr int64_t kWidth = 8;

inline Vec load(const float* p) { return load8(p); }
inline Vec load(const c10::BFloat16* p) { return load8(p); }
inline __m256i bf16_bits(Vec v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}
inline Vec from_bf16_bits(__m256i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, Vec v) {
  const __m256i bits = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
inline Vec lookup(const float* table, const c10::BFloat16* keys) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys));
  return _mm256_i32gather_ps(table, _mm256_cvtepu16_epi32(raw), 4);
}
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load_int8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float sum(Vec v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
inline float max_lane(Vec v) {
  const __m128 pair = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}
#endif

// The value a bfloat16 store would keep, back in float32 (float32: the value itself).
inline Vec round_as(Vec v, float) { return v; }
inline Vec round_as(Vec v, c10::BFloat16) { return from_bf16_bits(bf16_bits(v)); }

}  // namespace batchserve::lanes

#endif  // __AVX512F__ || __AVX2__
