// What the weight-only quantised matmuls share (int4_gemv.cpp, int8_gemv.cpp, int4_dot.cpp): each reads every weight
// byte once for all the activation rows of a pass, unrolled over a compile-time row count.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own): the builds for different
// instruction sets, loaded into one process, must never call each other's copies.

#pragma once

#include <torch/types.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ops.h"  // BATCHSERVE_OPS
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

// Weight bytes requested ahead of use, by every int4 kernel and the LM head's (int8_dot, int6_dot). At one row a
// kernel streams its weights at memory's pace, and 1 KB ahead was too close to cover the wait: 8 KB took 0.69-0.74x
// the time of 1 KB at one row on the 3B's shapes capped to AVX2, 0.85-0.86x natively; the 1B's Q6_K head on
// int6_dot 0.90x the time of 4 KB at one row (kernel-ab, streamed; docs/kernels.md).
constexpr int64_t kPrefetchBytes = 8192;
constexpr int64_t kBlockN = 64;  // output rows per block of int4_gemv's layout (int4_gemv.cpp)
constexpr int64_t kDotBlock = 16;  // output rows per block of int4_dot's layout (int4_dot.cpp)
constexpr int64_t kInt6Run = 16;  // int6_dot.cpp: inputs per sub-scale, per activation scale, per 192 bytes of a block
constexpr int64_t kInt6RunBytes = 192;  // a run of 16 inputs for a block's 16 output rows
constexpr int64_t kInt6RunsPerSuper = 16;  // runs per super-scale (Q6_K's 256 weights)

#if defined(__AVX512F__)
// 64 packed bytes of int4_dot's layout (a block's 16 rows, 8 inputs), requested kPrefetchBytes ahead, split into the
// low nibbles (`first`: inputs k..k+3 of each row) and the high ones (`second`: k+4..k+7).
inline void load_int4_weights_zmm(const uint8_t* bytes, __m512i& first, __m512i& second) {
  _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
  const __m512i v = _mm512_loadu_si512(bytes), low = _mm512_set1_epi8(0x0F);
  first = _mm512_and_si512(v, low);
  second = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}
#endif

#if defined(__AVX2__)
// Four int8 activation digits, repeated across a 256-bit register: one 32-bit lane per output row (the AVX2
// integer-dot kernels, int4_dot_avx2.h and int8_dot_avx2.h).
inline __m256i broadcast4_ymm(const int8_t* digits) {
  int32_t four;
  std::memcpy(&four, digits, 4);
  return _mm256_set1_epi32(four);
}
#endif

// A thread's next block of weights, of which each pass over the current block requests its share as it goes (the
// integer-dot kernels past one row): memory streams the next block while this one's arithmetic runs, where the
// requests a few lines ahead in the block itself left each pass waiting on memory and then computing.
struct NextBlock {
  const uint8_t* bytes = nullptr;  // null: no next block, or one row (memory's pace; the requests ahead suffice)
  int64_t pass = 0, passes = 1;

  // The line to request at `offset` of the current block's `block_bytes` bytes, or null.
  const char* line(int64_t offset, int64_t block_bytes) const {
    if (bytes == nullptr) return nullptr;
    return reinterpret_cast<const char*>(bytes) + (pass * block_bytes + offset) / passes / 64 * 64;
  }

#if defined(__AVX2__)
  // Requests into L2 this pass's share of the lines that offsets [from, to) of the current block stand for, each
  // line once (int4_gemm, a group of inputs at a time: its unpacked block is in L1 and must stay there). Passes
  // past `passes` have no share: the next block was requested whole by then.
  void request(int64_t from, int64_t to, int64_t block_bytes) const {
    if (bytes == nullptr || pass >= passes) return;
    for (int64_t offset = from; offset < to; offset += 64 * passes)
      _mm_prefetch(line(offset, block_bytes), _MM_HINT_T1);
  }
#endif
};

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

inline bool float_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

// The zero term's per-output factor of group g, z - 8 s: zeros null means symmetric weights (GGUF Q4_0, w = (q - 8)
// s), whose zero term is -8 s without reading a zero per group (a tenth of the weights' bytes).
#if defined(__AVX512F__)
inline __m512 zero_term16(__m512 s, const c10::BFloat16* zeros) {
  return zeros == nullptr ? _mm512_mul_ps(_mm512_set1_ps(-8.0f), s)
                          : _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, batchserve::lanes::load(zeros));
}
#endif
#if defined(__AVX2__)
inline __m256 zero_term8(__m256 s, const c10::BFloat16* zeros) {
  return zeros == nullptr ? _mm256_mul_ps(_mm256_set1_ps(-8.0f), s)
                          : _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, batchserve::lanes::load8(zeros));
}
#endif

// p + n, or null where p is null (a symmetric weight's absent zeros, at any offset).
template <typename T>
inline const T* offset_or_null(const T* p, int64_t n) {
  return p == nullptr ? nullptr : p + n;
}

// A zeros operand's data, or null where it is empty (symmetric weights).
inline const c10::BFloat16* zeros_or_null(const torch::Tensor& zeros) {
  return zeros.numel() == 0 ? nullptr : zeros.data_ptr<c10::BFloat16>();
}

// The operands int4_dot and int4_gemm share (int4_dot's layout): x [rows, K] float32 or bf16, packed [N, K / 2]
// uint8 in blocks of 16 output rows, bf16 scales and zeros per block, group and 16 outputs. `op` names the caller.
inline void check_int4_operands(const char* op, const torch::Tensor& x, const torch::Tensor& packed, int64_t group,
                                const torch::Tensor& scales, const torch::Tensor& zeros) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && float_or_bf16(x), op, ": x must be [rows, K] float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 2, op, ": packed must be [N, K / 2] uint8");
  const int64_t K = x.size(1), N = packed.size(0);
  TORCH_CHECK(group >= 8 && group % 8 == 0 && K % group == 0 && packed.size(1) * 2 == K, op,
              ": K must match the packing and the group (a multiple of 8)");
  TORCH_CHECK(N % 16 == 0, op, " packs output rows in blocks of 16");
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && zeros.scalar_type() == torch::kBFloat16 &&
                  scales.numel() == N * (K / group) && (zeros.numel() == N * (K / group) || zeros.numel() == 0),
              op, ": scales and zeros must be [N / 16, K / group, 16] bfloat16 (zeros empty: symmetric weights)");
}

}  // namespace
}  // namespace BATCHSERVE_OPS
