// Decode attention straight from the paged KV cache: one query token per row, grouped-query heads.
//
// The torch fallback gathers every row's blocks into a contiguous buffer and then runs batched matmuls over
// tiny (group x head_dim) x (head_dim x context) problems; on the CPU both the copy and the per-matrix
// overhead cost more than the arithmetic. Here each (row, kv_head) pair reads its keys and values once, in
// place, through the block table, and the pairs run in parallel. Query and cache are each float32 or bfloat16;
// a bfloat16 cache halves the bytes read, and all arithmetic is float32 (the output is rounded to the query's
// dtype once, at the end).

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "scalar.h"
#if defined(__AVX512BF16__)
#include "paged_decode_attention_avx512_bf16.h"
#endif
#include "vector_exp.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

using batchserve::narrow;
using batchserve::widen;

constexpr int64_t kLanes = 16;  // independent partial sums, so the compiler can keep them in vector lanes

template <typename C>
inline float dot(const float* a, const C* b, int64_t n) {
  float partial[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += a[i + l] * widen(b[i + l]);
  }
  float sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
  for (; i < n; ++i) sum += a[i] * widen(b[i]);
  return sum;
}

template <typename C>
inline void axpy(float weight, const C* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += weight * widen(x[i]);
}

#if defined(__AVX512F__) || defined(__AVX2__)
// The vector builds: one (row, kv_head) pair with a head size of NV whole vectors. Each cached key and value is
// loaded and widened once and used by every query head of the group; a score is one chain of NV multiply-adds and
// one horizontal sum. The portable loops below widened each key once per query head and summed 16 partial sums
// one after another, which left the kernel at a fifth of the multiply-adds the int4 matmuls reach.
namespace lanes = batchserve::lanes;
using lanes::Vec;
constexpr int64_t kVec = lanes::kWidth;

// scores[g * context + t] = scale * q_g . key_t for the pair's group of query heads (query: float32, [group, NV
// vectors]).
template <int NV, typename C>
inline void vector_scores(const float* query, const C* keys, const int64_t* blocks, int64_t context,
                          int64_t block_size, int64_t group, float scale, float* scores) {
  constexpr int64_t dim = NV * kVec;
  for (int64_t start = 0; start < context; start += block_size) {
    const C* key = keys + blocks[start / block_size] * block_size * dim;
    for (int64_t t = start; t < std::min(start + block_size, context); ++t, key += dim) {
      Vec k[NV];
      for (int v = 0; v < NV; ++v) k[v] = lanes::load(key + v * kVec);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = query + g * dim;
        Vec acc = lanes::mul(lanes::load(q), k[0]);
        for (int v = 1; v < NV; ++v) acc = lanes::fma(lanes::load(q + v * kVec), k[v], acc);
        scores[g * context + t] = lanes::sum(acc) * scale;
      }
    }
  }
}

// acc[g] = sum_t probs[g * context + t] * value_t (acc: float32, [group, NV vectors]). Each pass keeps a slice of
// up to kHeads heads' sums in registers across all tokens (a running sum in memory waited on its own store every
// token); the slices re-read the values from L1.
constexpr int kHeads = 4;
constexpr int kSlice = kVec == 16 ? 4 : 2;  // vectors a head per pass: kHeads * kSlice accumulators

template <int NV, typename C>
inline void vector_values(const float* probs, const C* values, const int64_t* blocks, int64_t context,
                          int64_t block_size, int64_t group, float* acc) {
  constexpr int64_t dim = NV * kVec;
  static_assert(NV % kSlice == 0, "head sizes are whole slices");
  for (int64_t first_head = 0; first_head < group; first_head += kHeads) {
    const int64_t heads = std::min<int64_t>(kHeads, group - first_head);
    const float* p = probs + first_head * context;
    for (int slice = 0; slice < NV; slice += kSlice) {
      Vec sums[kHeads][kSlice];
      for (int g = 0; g < kHeads; ++g)
        for (int v = 0; v < kSlice; ++v) sums[g][v] = lanes::set1(0.0f);
      for (int64_t start = 0; start < context; start += block_size) {
        const C* value = values + blocks[start / block_size] * block_size * dim + slice * kVec;
        for (int64_t t = start; t < std::min(start + block_size, context); ++t, value += dim) {
          Vec x[kSlice];
          for (int v = 0; v < kSlice; ++v) x[v] = lanes::load(value + v * kVec);
          for (int g = 0; g < kHeads; ++g) {
            if (g >= heads) break;
            const Vec weight = lanes::set1(p[g * context + t]);
            for (int v = 0; v < kSlice; ++v) sums[g][v] = lanes::fma(weight, x[v], sums[g][v]);
          }
        }
      }
      for (int g = 0; g < heads; ++g)
        for (int v = 0; v < kSlice; ++v) lanes::store(acc + (first_head + g) * dim + (slice + v) * kVec, sums[g][v]);
    }
  }
}

#endif

// The largest of s[0..n), and their sum: the vector builds go kVec lanes at a time, where a scalar loop was one
// chain of dependent compares or adds per score; the scalar build sums in order.
inline float max_of(const float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  if (n >= kVec) {
    Vec running = lanes::load(s);
    for (t = kVec; t + kVec <= n; t += kVec) running = lanes::max(running, lanes::load(s + t));
    top = lanes::max_lane(running);
  }
#endif
  for (; t < n; ++t) top = std::max(top, s[t]);
  return top;
}

inline float sum_of(const float* s, int64_t n) {
  float total = 0;
  int64_t t = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  Vec running = lanes::set1(0.0f);
  for (; t + kVec <= n; t += kVec) running = lanes::add(running, lanes::load(s + t));
  total = lanes::sum(running);
#endif
  for (; t < n; ++t) total += s[t];
  return total;
}

inline void softmax_in_place(float* s, int64_t n) {
  const float top = max_of(s, n);
  for (int64_t t = 0; t < n; ++t) s[t] -= top;
  batchserve::exp_in_place(s, n);  // vectorised: a scalar exp per score was ~15 % of the kernel
  const float inverse = 1.0f / sum_of(s, n);
  for (int64_t t = 0; t < n; ++t) s[t] *= inverse;
}

// One (row, kv_head) pair: its group's scores over the context, their softmax, and the weighted sum of the values
// into acc [group, dim]. NV > 0: the head is NV whole vectors and the vector builds' loops run; NV == 0: the
// portable loops, which go block by block (the slot of token t without a division per token). Forced inline: as a
// call, the AVX2 build's kernel took 1.3x its time (32 rows of 130 tokens, interleaved runs).
template <int NV, typename C>
__attribute__((always_inline)) inline void attend_pair(const float* query, const C* keys, const C* values,
                                                       const int64_t* blocks, int64_t context, int64_t block_size,
                                                       int64_t group, int64_t dim, float scale, float* scores,
                                                       float* acc) {
  if constexpr (NV == 0) {
    for (int64_t start = 0; start < context; start += block_size) {
      const C* key = keys + blocks[start / block_size] * block_size * dim;
      for (int64_t t = start; t < std::min(start + block_size, context); ++t, key += dim) {
        for (int64_t g = 0; g < group; ++g) scores[g * context + t] = dot(query + g * dim, key, dim) * scale;
      }
    }
  } else {
#if defined(__AVX512F__) || defined(__AVX2__)
    vector_scores<NV>(query, keys, blocks, context, block_size, group, scale, scores);
#endif
  }
  for (int64_t g = 0; g < group; ++g) softmax_in_place(scores + g * context, context);
  if constexpr (NV == 0) {
    std::fill(acc, acc + group * dim, 0.0f);
    for (int64_t start = 0; start < context; start += block_size) {
      const C* value = values + blocks[start / block_size] * block_size * dim;
      for (int64_t t = start; t < std::min(start + block_size, context); ++t, value += dim) {
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * context + t], value, acc + g * dim, dim);
      }
    }
  } else {
#if defined(__AVX512F__) || defined(__AVX2__)
    vector_values<NV>(scores, values, blocks, context, block_size, group, acc);
#endif
  }
}

// Calls f(std::integral_constant<int, NV>{}) with NV the head size in whole vectors where the vector builds unroll
// it (4, 8 or 16 vectors: 64 and 128 in the AVX2 build, also 256 in the AVX-512 ones), and with NV = 0 elsewhere.
template <typename F>
inline void with_head_vectors(int64_t dim, F&& f) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if (dim == 4 * kVec) return f(std::integral_constant<int, 4>{});
  if (dim == 8 * kVec) return f(std::integral_constant<int, 8>{});
  if (dim == 16 * kVec) return f(std::integral_constant<int, 16>{});
#endif
  f(std::integral_constant<int, 0>{});
}

// A (row, kv_head) pair's keys and values, requested into L2 while the pair before it is computed. A sequence's
// blocks lie wherever the pool had room (rows decoding together take turns at it), so each block is a short stream
// the hardware prefetcher meets cold: on AMD EPYC Zen 4, 32 rows of 160 keys in interleaved blocks took 1.5x and in
// shuffled ones 2x their time in consecutive blocks. Prefetching blocks ahead inside the pass did not help; the next
// pair a pass ahead takes 20-30 % off interleaved blocks and 35-40 % off shuffled ones (8 to 32 rows, 160 to 1,000
// keys), and needs inlining as `attend_pair` does. At most kPrefetchBytes, so a long context cannot evict the pair
// in use.
constexpr int64_t kPrefetchBytes = 256 * 1024;

template <typename C>
__attribute__((always_inline)) inline void prefetch_pair(const C* k_ptr, const C* v_ptr, const int64_t* table_ptr,
                                                         const int64_t* lens_ptr, int64_t pair, int64_t kv_heads,
                                                         int64_t slots, int64_t dim, int64_t max_blocks,
                                                         int64_t block_size) {
  const int64_t r = pair / kv_heads, h = pair % kv_heads;
  const int64_t block_bytes = block_size * dim * static_cast<int64_t>(sizeof(C));
  const int64_t count = std::min((lens_ptr[r] + block_size - 1) / block_size, kPrefetchBytes / (2 * block_bytes));
  const int64_t* blocks = table_ptr + r * max_blocks;
  for (int64_t b = 0; b < count; ++b) {
    const int64_t offset = (h * slots + blocks[b] * block_size) * dim;
    const char* key = reinterpret_cast<const char*>(k_ptr + offset);
    const char* value = reinterpret_cast<const char*>(v_ptr + offset);
    for (int64_t byte = 0; byte < block_bytes; byte += 64) {
      __builtin_prefetch(key + byte, 0, 2);
      __builtin_prefetch(value + byte, 0, 2);
    }
  }
}

// Q: the query's (and output's) element type; C: the cache's.
template <typename Q, typename C>
void decode_pairs(const Q* q_ptr, const C* k_ptr, const C* v_ptr, Q* out_ptr, const int64_t* table_ptr,
                  const int64_t* lens_ptr, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t slots,
                  int64_t max_blocks, int64_t block_size, float scale) {
  const int64_t group = heads / kv_heads;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
    if (batchserve::decode_bf16::fits(dim, block_size)) {
      namespace bf16 = batchserve::decode_bf16;
      at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
        bf16::Scratch scratch;
        for (int64_t pair = begin; pair < end; ++pair) {
          const int64_t r = pair / kv_heads, h = pair % kv_heads;
          const int64_t first = (r * heads + h * group) * dim;
          if (pair + 1 < end) prefetch_pair(k_ptr, v_ptr, table_ptr, lens_ptr, pair + 1, kv_heads, slots, dim,
                                            max_blocks, block_size);
          bf16::with_head_words(dim, [&](auto NW) {
            bf16::attend_pair<decltype(NW)::value>(q_ptr + first, k_ptr + h * slots * dim, v_ptr + h * slots * dim,
                                                   table_ptr + r * max_blocks, lens_ptr[r], block_size, group, scale,
                                                   scratch, out_ptr + first);
          });
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, query(group * dim), acc(group * dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t r = pair / kv_heads, h = pair % kv_heads;
      const int64_t context = lens_ptr[r];
      const int64_t* blocks = table_ptr + r * max_blocks;
      const C* keys = k_ptr + h * slots * dim;
      const C* values = v_ptr + h * slots * dim;
      const int64_t first = (r * heads + h * group) * dim;  // this pair's query heads are adjacent
      for (int64_t i = 0; i < group * dim; ++i) query[i] = widen(q_ptr[first + i]);
      if (pair + 1 < end) prefetch_pair(k_ptr, v_ptr, table_ptr, lens_ptr, pair + 1, kv_heads, slots, dim, max_blocks,
                                        block_size);
      scores.resize(group * context);
      with_head_vectors(dim, [&](auto NV) {
        attend_pair<decltype(NV)::value>(query.data(), keys, values, blocks, context, block_size, group, dim, scale,
                                         scores.data(), acc.data());
      });
      for (int64_t i = 0; i < group * dim; ++i) out_ptr[first + i] = narrow<Q>(acc[i]);
    }
  });
}

bool float_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

}  // namespace

torch::Tensor paged_decode_attention(
    const torch::Tensor& query,         // [rows, heads, dim]
    const torch::Tensor& key_cache,     // [kv_heads, slots, dim]
    const torch::Tensor& value_cache,   // [kv_heads, slots, dim]
    const torch::Tensor& block_table,   // [rows, max_blocks] int64
    const torch::Tensor& context_lens,  // [rows] int64: keys each row attends to, its new token included
    int64_t block_size,
    double scale) {
  TORCH_CHECK(query.device().is_cpu() && float_or_bf16(query), "query must be float32 or bfloat16 on the CPU");
  TORCH_CHECK(key_cache.device().is_cpu() && float_or_bf16(key_cache) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "the cache must be float32 or bfloat16 on the CPU");
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block_table and context_lens must be int64");
  TORCH_CHECK(block_size >= 1, "block_size must be positive");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 3 && value_cache.sizes() == key_cache.sizes(),
              "query [rows, heads, dim] and caches [kv_heads, slots, dim] expected");
  TORCH_CHECK(block_table.dim() == 2 && context_lens.dim() == 1, "block_table [rows, blocks], context_lens [rows]");
  const auto q = query.contiguous();
  const auto k = key_cache.contiguous();
  const auto v = value_cache.contiguous();
  const auto table = block_table.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k.size(0), slots = k.size(1);
  TORCH_CHECK(kv_heads >= 1 && k.size(2) == dim && heads % kv_heads == 0, "head sizes do not match");
  TORCH_CHECK(slots % block_size == 0, "the cache must hold whole blocks");
  TORCH_CHECK(table.size(0) == rows && lens.size(0) == rows, "one block table row and length per query row");
  const int64_t max_blocks = table.size(1);
  const int64_t* lens_ptr = lens.data_ptr<int64_t>();
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t num_blocks = slots / block_size;
  // Validate everything the parallel loop will read, so that it needs no checks (and throws nothing).
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens_ptr[r] >= 1 && lens_ptr[r] <= max_blocks * block_size, "context length out of range");
    for (int64_t b = 0; b < (lens_ptr[r] + block_size - 1) / block_size; ++b) {
      const int64_t block = table_ptr[r * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block table points outside the cache");
    }
  }

  auto out = torch::empty_like(q);
  const float scale_f = static_cast<float>(scale);
  const bool q_bf16 = q.scalar_type() == torch::kBFloat16, c_bf16 = k.scalar_type() == torch::kBFloat16;
#define BATCHSERVE_DECODE(Q, C)                                                                                  \
  decode_pairs<Q, C>(q.data_ptr<Q>(), k.data_ptr<C>(), v.data_ptr<C>(), out.data_ptr<Q>(), table_ptr, lens_ptr, \
                     rows, heads, kv_heads, dim, slots, max_blocks, block_size, scale_f)
  if (q_bf16 && c_bf16) {
    BATCHSERVE_DECODE(c10::BFloat16, c10::BFloat16);
  } else if (q_bf16) {
    BATCHSERVE_DECODE(c10::BFloat16, float);
  } else if (c_bf16) {
    BATCHSERVE_DECODE(float, c10::BFloat16);
  } else {
    BATCHSERVE_DECODE(float, float);
  }
#undef BATCHSERVE_DECODE
  return out;
}

}  // namespace BATCHSERVE_OPS
