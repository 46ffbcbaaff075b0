// paged_decode_attention's (row, kv_head) pair in the avx512_bf16 build, for a bfloat16 query and cache, a head
// size of whole 32-value vectors and blocks of whole 16-key tiles. `vdpbf16ps` multiplies pairs of bfloat16 and
// adds them into float32 lanes: 32 multiply-adds an instruction, reading the cache as it is stored.
//
// Scores, 16 keys a tile: each key's dot product with a query head leaves 16 partial sums in one register; the
// tile's 16 registers are then summed across lanes together (a transposing tree of unpacks and shuffles, 45
// instructions for 16 scores), where the float32 path sums each score's lanes on its own (~8 instructions a score,
// a third of that kernel). A lane of the result depends on its own key only, so the keys a tile reads past the
// context (the rest of its last block, whatever they hold) are computed and never stored.
// Values, 2 keys a step: the two keys' value rows are interleaved into bfloat16 pairs per dimension, and each head's
// two softmax weights, rounded to bfloat16 (as the prefill kernel's are), weigh both in one `vdpbf16ps`. The
// weights are not normalised until the end: the output is the weighted sum over the sum of the rounded weights.
// On AMD EPYC Zen 4 (ns a key and KV head, against the float32 path): 0.7x the time for rows whose keys are in cache
// (one row, or five verifying drafts, of 300 keys), 0.8x at 32 rows of 160-1,000 keys, where the blocks come from
// memory and the bandwidth bounds both (docs/peers.md).

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vector_exp.h"
#include "vector_lanes.h"

namespace batchserve::decode_bf16 {

constexpr int64_t kTile = 16;  // keys a score tile: one register of scores

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Whether a pair of this shape runs here: head size in whole 32-value vectors (up to 256), blocks in whole tiles.
inline bool fits(int64_t dim, int64_t block_size) {
  return dim % 32 == 0 && dim <= 256 && block_size % kTile == 0;
}

// out lane i = the sum of a[i]'s 16 lanes.
inline __m512 sum_across(const __m512 (&a)[kTile]) {
  __m512 b[8], c[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit chunk: (a0 lanes 0+2, a1 0+2, a0 1+3, a1 1+3)
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per chunk: that chunk's sum of a[4j], a[4j+1], a[4j+2], a[4j+3]
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * j]), _mm512_castps_pd(b[2 * j + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * j]), _mm512_castps_pd(b[2 * j + 1]));
    c[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // Chunk j of the result is c[j]'s four chunks summed.
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

// scores[g * context + t] = scale * q_g . key_t; NW = head size / 32.
template <int NW>
inline void tile_scores(const c10::BFloat16* query, const c10::BFloat16* keys, const int64_t* blocks, int64_t context,
                        int64_t block_size, int64_t group, float scale, float* scores) {
  constexpr int64_t dim = NW * 32;
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    __m512i q[NW];
    for (int w = 0; w < NW; ++w) q[w] = _mm512_loadu_si512(query + g * dim + w * 32);
    for (int64_t start = 0; start < context; start += kTile) {
      const c10::BFloat16* key = keys + (blocks[start / block_size] * block_size + start % block_size) * dim;
      __m512 a[kTile];
      for (int i = 0; i < kTile; ++i) {
        a[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(q[0]), as_bh(_mm512_loadu_si512(key + i * dim)));
        for (int w = 1; w < NW; ++w)
          a[i] = _mm512_dpbf16_ps(a[i], as_bh(q[w]), as_bh(_mm512_loadu_si512(key + i * dim + w * 32)));
      }
      const int64_t n = std::min(kTile, context - start);
      const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
      _mm512_mask_storeu_ps(scores + g * context + start, live, _mm512_mul_ps(sum_across(a), scale_v));
    }
  }
}

// Each head's scores to unnormalised weights exp(s - max), rounded to bfloat16 into weights[g * stride + t]
// (stride: context rounded up to even, the odd tail's partner 0), and each head's sum of them into sums[g].
inline void tile_weights(const float* scores, int64_t context, int64_t group, int64_t stride, uint16_t* weights,
                         float* sums) {
  namespace lanes = batchserve::lanes;
  for (int64_t g = 0; g < group; ++g) {
    const float* s = scores + g * context;
    __m512 running = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + kTile <= context; t += kTile) running = _mm512_max_ps(running, _mm512_loadu_ps(s + t));
    const __mmask16 tail = static_cast<__mmask16>((1u << (context - t)) - 1);
    running = _mm512_mask_max_ps(running, tail, running, _mm512_maskz_loadu_ps(tail, s + t));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(running));
    __m512 total = _mm512_setzero_ps();
    uint16_t* out = weights + g * stride;
    for (t = 0; t < context; t += kTile) {
      const __mmask16 live = static_cast<__mmask16>(context - t >= kTile ? 0xFFFF : (1u << (context - t)) - 1);
      const __m512 e = lanes::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), top));
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
      // The sum of what the values are weighed with: the rounded weights.
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, lanes::from_bf16_bits(_mm512_cvtepu16_epi32(rounded))));
      _mm256_mask_storeu_epi16(out + t, live, rounded);
    }
    if (context % 2 == 1) out[context] = 0;
    sums[g] = _mm512_reduce_add_ps(total);
  }
}

// acc[g * dim + d] = sum_t weight[g][t] * value_t[d] / sums[g], written to out (bfloat16, [group, dim]).
template <int NW>
inline void pair_values(const uint16_t* weights, int64_t stride, const float* sums, const c10::BFloat16* values,
                        const int64_t* blocks, int64_t context, int64_t block_size, int64_t group,
                        c10::BFloat16* out) {
  constexpr int64_t dim = NW * 32;
  constexpr int kHeads = NW == 1 ? 8 : NW == 2 ? 4 : NW == 4 ? 2 : 1;  // heads a pass: 2 * NW * kHeads <= 16 sums
  // The unpacks pair dimensions within 128-bit chunks: low takes each chunk's first 4, high its last 4.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t head0 = 0; head0 < group; head0 += kHeads) {
    const int heads = static_cast<int>(std::min<int64_t>(kHeads, group - head0));
    __m512 acc[kHeads][2 * NW];
    for (int g = 0; g < kHeads; ++g)
      for (int v = 0; v < 2 * NW; ++v) acc[g][v] = _mm512_setzero_ps();
    for (int64_t t = 0; t < context; t += 2) {
      const c10::BFloat16* a = values + (blocks[t / block_size] * block_size + t % block_size) * dim;
      const bool both = t + 1 < context;  // the odd tail's partner is a zero row (the slot past it may hold anything)
      __m512i lo[NW], hi[NW];
      for (int w = 0; w < NW; ++w) {
        const __m512i x = _mm512_loadu_si512(a + w * 32);
        const __m512i y = both ? _mm512_loadu_si512(a + dim + w * 32) : _mm512_setzero_si512();
        lo[w] = _mm512_unpacklo_epi16(x, y);
        hi[w] = _mm512_unpackhi_epi16(x, y);
      }
      for (int g = 0; g < kHeads; ++g) {
        if (g >= heads) break;
        uint32_t pair;
        std::memcpy(&pair, weights + (head0 + g) * stride + t, sizeof(pair));
        const __m512bh w_pair = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
        for (int w = 0; w < NW; ++w) {
          acc[g][2 * w] = _mm512_dpbf16_ps(acc[g][2 * w], as_bh(lo[w]), w_pair);
          acc[g][2 * w + 1] = _mm512_dpbf16_ps(acc[g][2 * w + 1], as_bh(hi[w]), w_pair);
        }
      }
    }
    for (int g = 0; g < heads; ++g) {
      const __m512 inverse = _mm512_set1_ps(1.0f / sums[head0 + g]);
      c10::BFloat16* o = out + (head0 + g) * dim;
      for (int w = 0; w < NW; ++w) {
        batchserve::lanes::store(o + w * 32,
                                 _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][2 * w], first, acc[g][2 * w + 1]), inverse));
        batchserve::lanes::store(
            o + w * 32 + 16, _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][2 * w], second, acc[g][2 * w + 1]), inverse));
      }
    }
  }
}

// Scratch a thread reuses across its pairs.
struct Scratch {
  std::vector<float> scores;
  std::vector<uint16_t> weights;
  std::vector<float> sums;
};

// One (row, kv_head) pair: query [group, dim] and out [group, dim] in place in the step's tensors.
template <int NW>
inline void attend_pair(const c10::BFloat16* query, const c10::BFloat16* keys, const c10::BFloat16* values,
                        const int64_t* blocks, int64_t context, int64_t block_size, int64_t group, float scale,
                        Scratch& scratch, c10::BFloat16* out) {
  const int64_t stride = context + context % 2;
  scratch.scores.resize(group * context);
  scratch.weights.resize(group * stride);
  scratch.sums.resize(group);
  tile_scores<NW>(query, keys, blocks, context, block_size, group, scale, scratch.scores.data());
  tile_weights(scratch.scores.data(), context, group, stride, scratch.weights.data(), scratch.sums.data());
  pair_values<NW>(scratch.weights.data(), stride, scratch.sums.data(), values, blocks, context, block_size, group, out);
}

// Calls f(std::integral_constant<int, NW>{}) for a head of NW 32-value vectors (fits() holds).
template <typename F>
inline void with_head_words(int64_t dim, F&& f) {
  if (dim == 64) return f(std::integral_constant<int, 2>{});
  if (dim == 128) return f(std::integral_constant<int, 4>{});
  if (dim == 32) return f(std::integral_constant<int, 1>{});
  if (dim == 256) return f(std::integral_constant<int, 8>{});
  if (dim == 96) return f(std::integral_constant<int, 3>{});
  if (dim == 160) return f(std::integral_constant<int, 5>{});
  if (dim == 192) return f(std::integral_constant<int, 6>{});
  return f(std::integral_constant<int, 7>{});
}

}  // namespace batchserve::decode_bf16
