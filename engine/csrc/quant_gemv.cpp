// Weight-only quantised matmuls for a few activation rows (decode at small batch), on the weights' own layouts.
//
// At batch 1 a decode step is a stream of weight bytes: 94 MB per token for the default model. torch's int4 and
// int8 CPU kernels reach about half of this machine's read bandwidth there in a real step, and their cost grows
// with the row count as if each row were a separate pass. These kernels read each weight byte once for all
// rows (up to kMaxRows), dequantise in registers and accumulate in float32.
//
//   int4_gemv: x [rows, K] (float32 or bfloat16) times W [N, K] in 4 bits, in the layout that torch's CPU int4
//              packing has at its AVX-512 capability (engine.linear.pack_int4_blocks writes it whatever torch's
//              capability, N a multiple of 64), with scales_and_zeros [K / group, N, 2]:
//              w = (q - 8) * scale + zero, as aten._weight_int4pack_mm_for_cpu reads it.
//   int8_gemv: x [rows, K] times W [N, K] int8 with one scale per output row, as aten._weight_int8pack_mm.
//
// Both return [rows, N] in x's dtype. The sums are float32 in another order than torch's kernels, so results
// agree with them to rounding, not bit for bit. Each has an AVX-512 and an AVX2 + FMA form (the build decides,
// engine/native.py); the scalar build calls torch's kernels.
//
// The layout (torch's int4 CPU packing at its AVX-512 capability; at AVX2 and below torch packs otherwise):
// output rows come in blocks of 64; a block stores, for each k, 32 bytes whose byte j holds row j in its low
// nibble and row j + 32 in its high nibble.

#include <ATen/Parallel.h>
#include <torch/types.h>

#include "ops.h"
#include "scalar.h"
#include "vector_lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace BATCHSERVE_OPS {
namespace {

using batchserve::widen;

constexpr int64_t kBlockN = 64;  // output rows per int4 block
constexpr int64_t kMaxRows = 8;  // activation rows per pass over the weights (int8)
constexpr int64_t kPrefetchRows = 8;  // int8 weight rows requested ahead of use
constexpr int64_t kInt8Tile = 128;  // int8 weight rows per tile (72 KB at K = 576: stays in L2 across passes)
constexpr int64_t kPrefetchBytes = 1024;  // int4 bytes requested ahead of use (the next groups)
// Independent FMA chains per activation row in int8_row: with one sum per row, each FMA waits for the previous
// one's latency (4-5 cycles), which at one or two rows left the int8 LM head latency-bound, not load-bound.
constexpr int kInt8Chains = 4;
constexpr int int8_chains(int rows) { return rows >= kInt8Chains ? 1 : kInt8Chains / rows; }

// Calls f(std::integral_constant<int, R>{}) for R = count in 1..Max: the kernels unroll over a compile-time
// row count, and every caller picks it the same way.
template <int Max, typename F>
inline void with_row_count(int64_t count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (Max >= 2) f(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (Max >= 3) f(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (Max >= 4) f(std::integral_constant<int, 4>{}); break;
    case 5: if constexpr (Max >= 5) f(std::integral_constant<int, 5>{}); break;
    case 6: if constexpr (Max >= 6) f(std::integral_constant<int, 6>{}); break;
    case 7: if constexpr (Max >= 7) f(std::integral_constant<int, 7>{}); break;
    case 8: if constexpr (Max >= 8) f(std::integral_constant<int, 8>{}); break;
    default: break;  // callers pass 1..Max
  }
}

// The (scale, zero) pairs of `count` output rows, split into s and z (the AVX2 kernels' epilogues; once a group).
template <typename S>
inline void split_pairs(const S* pairs, int64_t count, float* s, float* z) {
  for (int64_t i = 0; i < count; ++i) {
    s[i] = widen(pairs[2 * i]);
    z[i] = widen(pairs[2 * i + 1]);
  }
}

// Per row and group: two int8 digits per value, the scale that maps them back, and the exact float sum (for the
// zero term); the integer dot product kernels below read this layout (see int4_dot_block).
[[maybe_unused]] void quantise_activations(const float* x, int64_t rows, int64_t K, int64_t group, int8_t* xq, float* x_scales,
                          float* x_sums) {
  const int64_t groups = K / group;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = x + r * K + g * group;
      float top = 0, sum = 0;
      for (int64_t i = 0; i < group; ++i) {
        top = std::max(top, std::fabs(v[i]));
        sum += v[i];
      }
      const float scale = top / 127.0f;
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      int8_t* digits = xq + 2 * (r * K + g * group);
      for (int64_t i = 0; i < group; i += 8) {
        for (int64_t j = 0; j < 8; ++j) {
          const float units = v[i + j] * inverse;  // in [-127, 127]
          const float leading = std::nearbyint(units);
          digits[2 * i + j] = static_cast<int8_t>(leading);
          // The rounding error, |units - leading| <= 0.5, in 127ths: within [-64, 64].
          digits[2 * i + 8 + j] = static_cast<int8_t>(std::nearbyint((units - leading) * 127.0f));
        }
      }
      x_scales[r * groups + g] = scale / 127.0f;  // per unit of the combined 127 * leading + residual
      x_sums[r * groups + g] = sum;
    }
  }
}

#if defined(__AVX512F__)

constexpr int kInt4Rows = 8;  // activation rows per pass over the int4 weights

// Whole vectors from and to float32 or bfloat16 (a bfloat16 store rounds as c10::BFloat16 does).
using batchserve::lanes::load;
using batchserve::lanes::store;

// 16 float32 results to 16 values of T (the int4_dot driver's epilogue).
template <typename T>
inline void store_row16(T* y, const float* out) { store(y, _mm512_loadu_ps(out)); }

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

template <int R>
inline void int8_row(const int8_t* w, const float* x, int64_t K, float* dots /* [R] */) {
  // C independent sums per row (see kInt8Chains).
  constexpr int C = int8_chains(R);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * C <= K; k += 16 * C) {
    for (int c = 0; c < C; ++c) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16 * c));
      const __m512 wk = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wk, _mm512_loadu_ps(x + r * K + k + 16 * c), acc[r][c]);
    }
  }
  for (; k + 16 <= K; k += 16) {
    const __m512 wk = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k))));
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(wk, _mm512_loadu_ps(x + r * K + k), acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 1; c < C; ++c) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][c]);
    float sum = batchserve::lanes::sum(acc[r][0]);
    for (int64_t t = k; t < K; ++t) sum += static_cast<float>(w[t]) * x[r * K + t];
    dots[r] = sum;
  }
}



#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int4_dot: the int4 weights in the project's own layout, for VNNI integer dot products. Rows come in blocks of
// 16; a block stores, for each run of 8 inputs k..k+7, 64 bytes: 4 bytes per row, byte j holding input k+j in its
// low nibble and k+4+j in its high one. So one 64-byte load and two masks give, per row, the 4-input groups that
// `vpdpbusd` multiplies with 4 int8 activations and sums into that row's int32 lane: 32 products per instruction,
// against 16 per float FMA after converting each weight. The activations are quantised per group of the
// weights (scale = max |x| / 127), as llama.cpp's Q8 activations are, and then once more: the rounding error
// of each value as a second int8 digit in 127ths of a unit. Two dot products instead of one make the
// activations good to about 1/32000 of the group's largest value (a single int8 digit cost +1.6 % perplexity on
// the default model; two: see docs/quantization.md).
constexpr int64_t kDotBlock = 16;

template <int R>
inline void int4_dot_block(const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                           const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                           float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R], residual[R];
    for (int r = 0; r < R; ++r) acc[r] = residual[r] = _mm512_setzero_si512();
    const uint8_t* bytes = packed + g * group * 8;  // 64 bytes per 8 inputs
    for (int64_t k = 0; k < group; k += 8, bytes += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(bytes);
      const __m512i first = _mm512_and_si512(v, low);
      const __m512i second = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = xq + 2 * (r * K + g * group + k);  // 8 leading digits, then 8 residual digits
        int32_t a, b, c, d;
        std::memcpy(&a, xs, 4);
        std::memcpy(&b, xs + 4, 4);
        std::memcpy(&c, xs + 8, 4);
        std::memcpy(&d, xs + 12, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], first, _mm512_set1_epi32(a));
        acc[r] = _mm512_dpbusd_epi32(acc[r], second, _mm512_set1_epi32(b));
        residual[r] = _mm512_dpbusd_epi32(residual[r], first, _mm512_set1_epi32(c));
        residual[r] = _mm512_dpbusd_epi32(residual[r], second, _mm512_set1_epi32(d));
      }
    }
    const __m512 s = load(scales + g * kDotBlock);
    // sum_k ((q - 8) s + z) x = s sum_k q x + (z - 8 s) sum_k x
    const __m512 z = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, load(zeros + g * kDotBlock));
    for (int r = 0; r < R; ++r) {
      // x = scale * (leading + residual / 127): 127 * the leading dot plus the residual one, in int32 (at most
      // 32 * 15 * 127 * 128, far from overflow).
      const __m512i digits = _mm512_add_epi32(_mm512_mullo_epi32(acc[r], _mm512_set1_epi32(127)), residual[r]);
      const __m512 dots = _mm512_mul_ps(_mm512_cvtepi32_ps(digits), _mm512_set1_ps(x_scales[r * groups + g]));
      total[r] = _mm512_fmadd_ps(s, dots, total[r]);
      total[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(x_sums[r * groups + g]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kDotBlock, total[r]);
}

#endif  // VNNI

#elif defined(__AVX2__)
// AVX2 + FMA: 8 float lanes and 16 registers. Each kernel keeps the AVX-512 one's data layout and order of
// work, on half the lanes and fewer activation rows per pass, so that its accumulators stay in registers.

constexpr int kInt4Rows = 4;

using batchserve::lanes::load;
using batchserve::lanes::store;

// 16 float32 results to 16 values of T (the int4_dot driver's epilogue).
template <typename T>
inline void store_row16(T* y, const float* out) {
  store(y, _mm256_loadu_ps(out));
  store(y + 8, _mm256_loadu_ps(out + 8));
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

template <int R>
inline void int8_row(const int8_t* w, const float* x, int64_t K, float* dots /* [R] */) {
  // C independent sums per row (see kInt8Chains).
  constexpr int C = int8_chains(R);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * C <= K; k += 8 * C) {
    for (int c = 0; c < C; ++c) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k + 8 * c));
      const __m256 wk = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + r * K + k + 8 * c), acc[r][c]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 wk = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k))));
    for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + r * K + k), acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 1; c < C; ++c) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][c]);
    float sum = batchserve::lanes::sum(acc[r][0]);
    for (int64_t t = k; t < K; ++t) sum += static_cast<float>(w[t]) * x[r * K + t];
    dots[r] = sum;
  }
}


// int4_dot on AVX2: the same layout and two-digit activations as the AVX-512 VNNI kernel above. Without VNNI,
// `vpmaddubsw` multiplies the unsigned 4-bit weights by the int8 digits and adds neighbouring pairs into int16
// (at most 2 * 15 * 127: no saturation), and `vpmaddwd` adds those pairs into the row's int32 lane, scaling the
// leading digits' sums by 127 on the way. Where the CPU has AVX-VNNI (Intel from Alder Lake, AMD from Zen 5)
// `vpdpbusd` does the same in one instruction; this build does not assume it.
constexpr int64_t kDotBlock = 16;

template <int R>
inline void int4_dot_block(const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                           const int8_t* xq, const float* x_scales, const float* x_sums, int64_t K, int64_t group,
                           float* out /* [R, 16] */) {
  const int64_t groups = K / group;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1), leading_weight = _mm256_set1_epi16(127);
  __m256 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const uint8_t* bytes = packed + g * group * 8;  // 64 bytes per 8 inputs: rows 0-7, then rows 8-15
    for (int64_t k = 0; k < group; k += 8, bytes += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
      __m256i first[2], second[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * h));
        first[h] = _mm256_and_si256(v, low);
        second[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = xq + 2 * (r * K + g * group + k);  // 8 leading digits, then 8 residual digits
        int32_t a, b, c, d;
        std::memcpy(&a, xs, 4);
        std::memcpy(&b, xs + 4, 4);
        std::memcpy(&c, xs + 8, 4);
        std::memcpy(&d, xs + 12, 4);
        const __m256i va = _mm256_set1_epi32(a), vb = _mm256_set1_epi32(b);
        const __m256i vc = _mm256_set1_epi32(c), vd = _mm256_set1_epi32(d);
        for (int h = 0; h < 2; ++h) {
          const __m256i leading =
              _mm256_add_epi16(_mm256_maddubs_epi16(first[h], va), _mm256_maddubs_epi16(second[h], vb));
          const __m256i residual =
              _mm256_add_epi16(_mm256_maddubs_epi16(first[h], vc), _mm256_maddubs_epi16(second[h], vd));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_add_epi32(_mm256_madd_epi16(leading, leading_weight),
                                                                    _mm256_madd_epi16(residual, ones)));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load(scales + g * kDotBlock + 8 * h);
      // sum_k ((q - 8) s + z) x = s sum_k q x + (z - 8 s) sum_k x
      const __m256 z = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, load(zeros + g * kDotBlock + 8 * h));
      for (int r = 0; r < R; ++r) {
        const __m256 dots = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_set1_ps(x_scales[r * groups + g]));
        total[r][h] = _mm256_fmadd_ps(s, dots, total[r][h]);
        total[r][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(x_sums[r * groups + g]), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * kDotBlock + 8 * h, total[r][h]);
}


#else
// The scalar build: plain loops over the same layouts (the compiler vectorises what SSE2 allows). torch's own
// kernels are no fallback here: their int4 packing depends on torch's capability, and their int8 kernel has
// crashed on widths that are not a multiple of 16 (torch 2.13).

constexpr int kInt4Rows = 1;

template <typename T, typename S>
void int4_rows(const float* x, const float* group_sums, const uint8_t* packed, const S* scales_and_zeros, T* y,
               int64_t rows, int64_t K, int64_t N, int64_t group) {
  const int64_t groups = K / group;
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    float acc[kBlockN], total[kBlockN];
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t r = 0; r < rows; ++r) {
        std::fill(total, total + kBlockN, 0.0f);
        for (int64_t g = 0; g < groups; ++g) {
          std::fill(acc, acc + kBlockN, 0.0f);
          const uint8_t* bytes = packed + (block * K + g * group) * (kBlockN / 2);
          for (int64_t k = 0; k < group; ++k, bytes += kBlockN / 2) {
            const float xk = x[r * K + g * group + k];
            for (int64_t j = 0; j < kBlockN / 2; ++j) {
              acc[j] += static_cast<float>((bytes[j] & 0x0F) - 8) * xk;
              acc[j + kBlockN / 2] += static_cast<float>((bytes[j] >> 4) - 8) * xk;
            }
          }
          const S* pairs = scales_and_zeros + (g * N + block * kBlockN) * 2;
          const float sum = group_sums[r * groups + g];
          for (int64_t j = 0; j < kBlockN; ++j) total[j] += widen(pairs[2 * j]) * acc[j] + widen(pairs[2 * j + 1]) * sum;
        }
        for (int64_t j = 0; j < kBlockN; ++j) y[r * N + block * kBlockN + j] = batchserve::narrow<T>(total[j]);
      }
    }
  });
}

template <typename S>
void int8_rows(const float* x, const int8_t* values, const S* scales, float* y, int64_t rows, int64_t K, int64_t N) {
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* w = values + n * K;
      const float scale = widen(scales[n]);
      for (int64_t r = 0; r < rows; ++r) {
        float sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += static_cast<float>(w[k]) * x[r * K + k];
        y[r * N + n] = sum * scale;
      }
    }
  });
}

#endif  // __AVX512F__ / __AVX2__ / scalar

// The AVX-512 build has the kernel only with VNNI; the AVX2 build always has it.
#if (defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)) || \
    (defined(__AVX2__) && !defined(__AVX512F__))
#define BATCHSERVE_INT4_DOT 1
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// The drivers both vector builds share: each calls its build's int8_row, int4_dot_block and store_row16.

template <typename S>
void int8_rows(const float* x, const int8_t* values, const S* scales, float* y, int64_t rows, int64_t K, int64_t N) {
  at::parallel_for(0, N, kInt8Tile, [&](int64_t begin, int64_t end) {
    float dots[kMaxRows];
    // Tiles of weight rows, each read from memory once and then from L2 by every pass of kMaxRows activation rows.
    // Passes outside the tile would re-read all activation rows (73 KB at 32 rows: past L1) for every weight row.
    for (int64_t tile = begin; tile < end; tile += kInt8Tile) {
      const int64_t tile_end = std::min(tile + kInt8Tile, end);
      for (int64_t first = 0; first < rows; first += kMaxRows) {
        const int64_t count = std::min(kMaxRows, rows - first);
        const float* xs = x + first * K;
        for (int64_t n = tile; n < tile_end; ++n) {
          if (first == 0) {
            // One core alone does not keep enough loads in flight to use its share of the memory bandwidth.
            const char* ahead = reinterpret_cast<const char*>(values + std::min(n + kPrefetchRows, N - 1) * K);
            for (int64_t line = 0; line < K; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
          }
          with_row_count<kMaxRows>(count, [&](auto R) { int8_row<decltype(R)::value>(values + n * K, xs, K, dots); });
          const float scale = widen(scales[n]);
          for (int64_t r = 0; r < count; ++r) y[(first + r) * N + n] = dots[r] * scale;
        }
      }
    }
  });
}

#if defined(BATCHSERVE_INT4_DOT)
template <typename T>
void int4_dot_rows(const float* x, const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                   T* y, int64_t rows, int64_t K, int64_t N, int64_t group) {
  const int64_t groups = K / group;
  std::vector<int8_t> xq(2 * rows * K);
  std::vector<float> x_scales(rows * groups), x_sums(rows * groups);
  quantise_activations(x, rows, K, group, xq.data(), x_scales.data(), x_sums.data());
  at::parallel_for(0, N / kDotBlock, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kInt4Rows * kDotBlock];
    for (int64_t block = begin; block < end; ++block) {
      const uint8_t* block_bytes = packed + block * K * 8;
      const c10::BFloat16* block_scales = scales + block * groups * kDotBlock;
      const c10::BFloat16* block_zeros = zeros + block * groups * kDotBlock;
      for (int64_t first = 0; first < rows; first += kInt4Rows) {
        const int64_t count = std::min<int64_t>(kInt4Rows, rows - first);
        const int8_t* xs = xq.data() + 2 * first * K;
        const float* sc = x_scales.data() + first * groups;
        const float* sm = x_sums.data() + first * groups;
        with_row_count<kInt4Rows>(count, [&](auto R) {
          int4_dot_block<decltype(R)::value>(block_bytes, block_scales, block_zeros, xs, sc, sm, K, group, out);
        });
        for (int64_t r = 0; r < count; ++r) store_row16(y + (first + r) * N + block * kDotBlock, out + r * kDotBlock);
      }
    }
  });
}
#endif
#endif

bool float_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

}  // namespace

torch::Tensor int4_gemv(const torch::Tensor& x, const torch::Tensor& packed, int64_t group,
                        const torch::Tensor& scales_and_zeros) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && float_or_bf16(x), "x must be [rows, K] float32 or bfloat16");
  TORCH_CHECK(scales_and_zeros.scalar_type() == x.scalar_type() && scales_and_zeros.dim() == 3 &&
                  scales_and_zeros.size(2) == 2,
              "scales_and_zeros must be [K / group, N, 2] in x's dtype");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 2, "packed must be [N, K / 2] uint8");
  const int64_t rows = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(group >= 1 && K % group == 0 && packed.size(1) * 2 == K, "K must match the packing and the group");
  TORCH_CHECK(scales_and_zeros.size(0) == K / group && scales_and_zeros.size(1) == N, "scales do not match W");
  TORCH_CHECK(N % kBlockN == 0 && group % 16 == 0, "int4_gemv packs output rows in blocks of 64, groups of 16k");
  {
    const auto xf = x.to(torch::kFloat).contiguous();
    const auto sums = xf.view({rows, K / group, group}).sum(-1).contiguous();
    const auto w = packed.contiguous();
    const auto sz = scales_and_zeros.contiguous();
    auto y = torch::empty({rows, N}, x.options());
    if (x.scalar_type() == torch::kBFloat16) {
      int4_rows<c10::BFloat16, c10::BFloat16>(xf.data_ptr<float>(), sums.data_ptr<float>(), w.data_ptr<uint8_t>(),
                                              sz.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, K, N,
                                              group);
    } else {
      int4_rows<float, float>(xf.data_ptr<float>(), sums.data_ptr<float>(), w.data_ptr<uint8_t>(),
                              sz.data_ptr<float>(), y.data_ptr<float>(), rows, K, N, group);
    }
    return y;
  }
}

torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && float_or_bf16(x), "x must be [rows, K] float32 or bfloat16");
  TORCH_CHECK(values.scalar_type() == torch::kChar && values.dim() == 2 && values.size(1) == x.size(1),
              "values must be [N, K] int8");
  TORCH_CHECK(scales.scalar_type() == x.scalar_type() && scales.dim() == 1 && scales.size(0) == values.size(0),
              "scales must be [N] in x's dtype");
  const int64_t rows = x.size(0), K = x.size(1), N = values.size(0);
  const auto xf = x.to(torch::kFloat).contiguous();
  const auto w = values.contiguous();
  const auto s = scales.contiguous();
  // The outputs are float32, rounded to bfloat16 once at the end where x is bfloat16: the bits of rounding each
  // output in the kernel, and faster than storing them one by one (a [32, 576] x [49152, 576] head: 10.6 against
  // 9.7 ms, AVX2).
  auto y = torch::empty({rows, N}, x.options().dtype(torch::kFloat));
  if (x.scalar_type() == torch::kBFloat16) {
    int8_rows(xf.data_ptr<float>(), w.data_ptr<int8_t>(), s.data_ptr<c10::BFloat16>(), y.data_ptr<float>(), rows, K, N);
    return y.to(torch::kBFloat16);
  }
  int8_rows(xf.data_ptr<float>(), w.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr<float>(), rows, K, N);
  return y;
}

bool int4_dot_available() {
#if defined(BATCHSERVE_INT4_DOT)
  return true;
#else
  return false;
#endif
}

torch::Tensor int4_dot(const torch::Tensor& x, const torch::Tensor& packed, int64_t group, const torch::Tensor& scales,
                       const torch::Tensor& zeros) {
  TORCH_CHECK(int4_dot_available(), "int4_dot needs AVX2, or AVX-512 with VNNI");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && float_or_bf16(x), "x must be [rows, K] float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 2, "packed must be [N, K / 2] uint8");
  const int64_t rows = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(group >= 8 && group % 8 == 0 && K % group == 0 && packed.size(1) * 2 == K,
              "K must match the packing and the group (a multiple of 8)");
  TORCH_CHECK(N % 16 == 0, "int4_dot packs output rows in blocks of 16");
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && zeros.scalar_type() == torch::kBFloat16 &&
                  scales.numel() == N * (K / group) && zeros.numel() == N * (K / group),
              "scales and zeros must be [N / 16, K / group, 16] bfloat16");
  auto y = torch::empty({rows, N}, x.options());
#if defined(BATCHSERVE_INT4_DOT)
  const auto xf = x.to(torch::kFloat).contiguous();
  const auto w = packed.contiguous();
  const auto s = scales.contiguous();
  const auto z = zeros.contiguous();
  if (x.scalar_type() == torch::kBFloat16) {
    int4_dot_rows<c10::BFloat16>(xf.data_ptr<float>(), w.data_ptr<uint8_t>(), s.data_ptr<c10::BFloat16>(),
                                 z.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, K, N, group);
  } else {
    int4_dot_rows<float>(xf.data_ptr<float>(), w.data_ptr<uint8_t>(), s.data_ptr<c10::BFloat16>(),
                         z.data_ptr<c10::BFloat16>(), y.data_ptr<float>(), rows, K, N, group);
  }
#endif
  return y;
}

}  // namespace BATCHSERVE_OPS
