// paged_prefill_attention's kernel in the avx512_bf16 build: one block of 16 query positions of one row against its
// keys, for a pass of HP query heads that share one KV head. `vdpbf16ps` multiplies pairs of bfloat16 and adds them
// into float32 lanes (32 multiply-adds an instruction, twice a float32 FMA's).
//
// The lanes are the block's 16 query positions, so the online softmax is all vertical: a lane's running maximum,
// sum and rescale are plain vector ops, with no horizontal reduction per query. Scores: the query block is held
// as pairs of dimensions ([HP][dim / 2][16 positions] of bf16 pairs), and each key's pair of dimensions is read in
// place from the paged cache and broadcast (one key feeds all HP heads' accumulators). Values: the weights of two
// consecutive keys are rounded to bf16 and interleaved per lane, and the values were laid out beforehand as pairs
// of keys per dimension ([key pairs][dim] of bf16 pairs, paged_prefill_attention.cpp), so one broadcast value pair
// feeds the HP heads' accumulators. Exponentials are base 2 (the scale folds in log2 e and is applied inside the
// exponent's subtraction, one FMA). Scores above a lane's diagonal are set to -FLT_MAX, not -inf, so the exponential
// needs no clamp or mask: 2^(very negative) is 0.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace batchserve::prefill {

constexpr int kLanes = 16;  // query positions a block

// HP heads per pass -> keys per score tile (HP x kKeys accumulators) and dimensions per value pass (HP x kDims).
template <int HP>
constexpr int kKeys = HP == 1 ? 16 : HP == 2 ? 12 : HP == 3 ? 8 : 6;
template <int HP>
constexpr int kDims = HP == 1 ? 16 : HP == 2 ? 8 : HP == 3 ? 8 : 4;
template <int HP>
constexpr int kChunk = kKeys<HP> * 8;  // keys between two softmax updates (even: whole key pairs)

// 2^x for finite x <= 0 (a score far below its row's maximum gives 0: n then lies under -149). Degree 4 on the
// rounded-off fraction, fitted for relative error with the constant term held at 1 (so 2^0 is exactly 1): 2.9e-6 at
// most, far below the bf16 rounding of the weights it feeds.
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(0.00958285201f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0559064262f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240240991f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693124175f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Two float32 vectors (keys k and k + 1) as one vector of bf16 pairs, lane i = (a[i], b[i]).
inline __m512i interleave_bf16(__m512 a, __m512 b) {
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // low 16: a, high 16: b
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, halves);
}

// Per-block scratch, allocated once a thread.
template <int D, int HP>
struct Scratch {
  alignas(64) float scores[HP][kChunk<HP>][kLanes];
  alignas(64) uint32_t weights[HP][kChunk<HP> / 2][kLanes];
  alignas(64) float out[HP][D][kLanes];
};

// One block: queries `qp` ([HP][D / 2][16] bf16 pairs), lane i at position positions[i] (all >= first, the
// smallest; every lane's keys start at 0). keys: the KV head's cache ([slots, D] bf16, as 32-bit pairs); slots[k]:
// key k's slot; values: the row's value pairs ([key pairs][D] 32-bit). `c` = scale * log2 e. Leaves out[hp][d][i]
// = the attention output, normalised.
template <int D, int HP>
void attend_block(const uint32_t* qp, __m512i positions, int64_t first, int64_t keys_needed, const uint32_t* keys,
                  const int32_t* slots, const uint32_t* values, float c, Scratch<D, HP>& s) {
  constexpr int NK = kKeys<HP>, DS = kDims<HP>, KC = kChunk<HP>, P = D / 2;
  const __m512 scale = _mm512_set1_ps(c), hidden = _mm512_set1_ps(-std::numeric_limits<float>::max());
  __m512 top[HP], total[HP];
  for (int h = 0; h < HP; ++h) {
    top[h] = hidden;
    total[h] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) _mm512_store_ps(s.out[h][d], _mm512_setzero_ps());
  }
  for (int64_t c0 = 0; c0 < keys_needed; c0 += KC) {
    const int64_t chunk_end = std::min<int64_t>(c0 + KC, keys_needed);
    // Scores of the chunk's keys, NK at a time; keys past keys_needed (the last tile's overhang) read the last
    // needed key's slot and are masked like any key above a lane's diagonal.
    for (int64_t k0 = c0; k0 < chunk_end; k0 += NK) {
      const uint32_t* key[NK];
      for (int j = 0; j < NK; ++j) key[j] = keys + int64_t{slots[std::min<int64_t>(k0 + j, keys_needed - 1)]} * P;
      __m512 acc[HP][NK];
      for (int h = 0; h < HP; ++h)
        for (int j = 0; j < NK; ++j) acc[h][j] = _mm512_setzero_ps();
      for (int p = 0; p < P; ++p) {
        __m512i q[HP];
        for (int h = 0; h < HP; ++h) q[h] = _mm512_load_si512(qp + (h * P + p) * kLanes);
        for (int j = 0; j < NK; ++j) {
          const __m512i k = _mm512_set1_epi32(static_cast<int>(key[j][p]));
          for (int h = 0; h < HP; ++h) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], as_bh(q[h]), as_bh(k));
        }
      }
      if (k0 + NK - 1 <= first) {
        for (int j = 0; j < NK; ++j)
          for (int h = 0; h < HP; ++h) _mm512_store_ps(s.scores[h][k0 + j - c0], acc[h][j]);
      } else {
        for (int j = 0; j < NK; ++j) {
          const __mmask16 visible = _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int>(k0 + j)), positions);
          for (int h = 0; h < HP; ++h)
            _mm512_store_ps(s.scores[h][k0 + j - c0], _mm512_mask_mov_ps(hidden, visible, acc[h][j]));
        }
      }
    }
    // The online softmax: new maxima, the old sums and outputs rescaled, this chunk's weights as bf16 pairs.
    const int pairs = static_cast<int>((chunk_end - c0 + 1) / 2);
    const __m512bh ones = as_bh(_mm512_set1_epi16(0x3F80));  // bf16 1.0: a pair's dot with it is the pair's sum
    __m512 rescale[HP];
    bool rescaled = false;
    for (int h = 0; h < HP; ++h) {
      __m512 chunk_top = top[h];
      for (int k = 0; k < 2 * pairs; ++k) chunk_top = _mm512_max_ps(chunk_top, _mm512_load_ps(s.scores[h][k]));
      rescaled = rescaled || _mm512_cmp_ps_mask(chunk_top, top[h], _CMP_NEQ_OQ) != 0;
      const __m512 top_c = _mm512_mul_ps(chunk_top, scale);
      rescale[h] = exp2_nonpositive(_mm512_fmsub_ps(top[h], scale, top_c));
      top[h] = chunk_top;
      // The sum is taken of the rounded weights, the ones the values are multiplied by.
      __m512 sum = _mm512_setzero_ps();
      for (int pair = 0; pair < pairs; ++pair) {
        const __m512 a = exp2_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(s.scores[h][2 * pair]), scale, top_c));
        const __m512 b = exp2_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(s.scores[h][2 * pair + 1]), scale, top_c));
        const __m512i w = interleave_bf16(a, b);
        sum = _mm512_dpbf16_ps(sum, as_bh(w), ones);
        _mm512_store_si512(s.weights[h][pair], w);
      }
      total[h] = _mm512_fmadd_ps(total[h], rescale[h], sum);
    }
    // out = out * rescale + weights x values, DS dimensions of the HP heads at a time; no rescale where no lane's
    // maximum moved (most chunks once the first keys are seen).
    const uint32_t* chunk_values = values + (c0 / 2) * D;
    for (int d0 = 0; d0 < D; d0 += DS) {
      __m512 acc[HP][DS];
      for (int h = 0; h < HP; ++h)
        for (int j = 0; j < DS; ++j) {
          acc[h][j] = _mm512_load_ps(s.out[h][d0 + j]);
          if (rescaled) acc[h][j] = _mm512_mul_ps(acc[h][j], rescale[h]);
        }
      for (int pair = 0; pair < pairs; ++pair) {
        __m512i w[HP];
        for (int h = 0; h < HP; ++h) w[h] = _mm512_load_si512(s.weights[h][pair]);
        const uint32_t* v = chunk_values + pair * D + d0;
        for (int j = 0; j < DS; ++j) {
          const __m512i x = _mm512_set1_epi32(static_cast<int>(v[j]));
          for (int h = 0; h < HP; ++h) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], as_bh(w[h]), as_bh(x));
        }
      }
      for (int h = 0; h < HP; ++h)
        for (int j = 0; j < DS; ++j) _mm512_store_ps(s.out[h][d0 + j], acc[h][j]);
    }
  }
  for (int h = 0; h < HP; ++h) {
    const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), total[h]);
    for (int d = 0; d < D; ++d) _mm512_store_ps(s.out[h][d], _mm512_mul_ps(_mm512_load_ps(s.out[h][d]), inverse));
  }
}

}  // namespace batchserve::prefill
