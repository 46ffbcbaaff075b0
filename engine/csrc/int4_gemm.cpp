// int4_gemm: x [rows, K] (float32 or bfloat16) times int4 weights W [N, K] for many rows (a prefill chunk); [rows, N]
// in x's dtype. The weights are int4_dot's (int4_dot.cpp has the layout), so one copy serves both. The activations
// are quantised once per row and group of the weights to one int8 digit (scale = max |x| / 127, llama.cpp's Q8
// activations), where int4_dot writes two: half the integer work, at a quality docs/quantization.md states. Each
// block of 16 output rows' weights is unpacked to bytes once (K * 16 bytes, a per-thread buffer in L1 or L2) and
// read by every kGemmRows activation rows; a step of a few rows (kPackedRows) reads the packed bytes instead.
//
// One kernel per instruction set, each in its own header: int4_gemm_avx512_vnni.h (`vpdpbusd`) and
// int4_gemm_avx2.h (`vpmaddubsw` + `vpmaddwd`); their integer sums are exact and quantise_rows rounds the same way
// in both, so both give the same int32 dot products. Builds without int4_dot have no int4_gemm either
// (int4_dot_available() says so).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "quant.h"
#include "vector_lanes.h"

#if defined(__AVX512F__)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "int4_gemm_avx512_vnni.h"
#define BATCHSERVE_INT4_GEMM 1
#endif
#elif defined(__AVX2__)
#include "int4_gemm_avx2.h"
#define BATCHSERVE_INT4_GEMM 1
#endif

namespace BATCHSERVE_OPS {
namespace {

#if defined(BATCHSERVE_INT4_GEMM)
namespace lanes = batchserve::lanes;

constexpr int64_t kPrefetchPasses = 2;  // passes over a block that request the next one (the rest request nothing)

// The 8 values at v times `inverse`, rounded to nearest-even (nearbyint's default) into 8 int8 digits; returns them
// as int32 lanes. bf16 values are widened in registers (exact): a bf16 step needs no float32 copy of x.
template <typename T>
inline __m256i round_eight(const T* v, __m256 inverse, int8_t* digits) {
  const __m256i units = _mm256_cvtps_epi32(_mm256_mul_ps(lanes::load8(v), inverse));  // in [-127, 127]
  const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(units), _mm256_extracti128_si256(units, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(digits), _mm_packs_epi16(halves, halves));
  return units;
}

// Per row and group: one int8 digit per value, the scale that maps it back, and the sum of the values the digits
// stand for (scale times the digits' exact sum) for the zero term. That sum, not the float one: the weights are
// (q - 8) s + z with q in [0, 15], so the dot product splits into s sum q x + (z - 8 s) sum x, and only with both
// halves on the same rounded x does the rounding error come out as sum w (x' - x). With the float sum it is
// s sum q (x' - x): the error weighted by q, all positive, not by the weights (docs/quantization.md has the cost).
template <typename T>
void quantise_rows(const T* x, int64_t rows, int64_t K, int64_t group, int8_t* xq, float* x_scales, float* x_sums) {
  const int64_t groups = K / group;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const T* v = x + r * K + g * group;
        __m256 top = _mm256_setzero_ps();
        for (int64_t i = 0; i < group; i += 8)
          top = _mm256_max_ps(top, _mm256_andnot_ps(sign, lanes::load8(v + i)));
        alignas(32) float tops[8];
        _mm256_store_ps(tops, top);
        const float scale = *std::max_element(tops, tops + 8) / 127.0f;
        const __m256 inverse = _mm256_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
        __m256i digit_sum = _mm256_setzero_si256();
        for (int64_t i = 0; i < group; i += 8)
          digit_sum = _mm256_add_epi32(digit_sum, round_eight(v + i, inverse, xq + r * K + g * group + i));
        alignas(32) int32_t sums[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums), digit_sum);
        int32_t total = 0;  // exact: at most 127 per value
        for (const int32_t part : sums) total += part;
        x_scales[r * groups + g] = scale;
        x_sums[r * groups + g] = scale * static_cast<float>(total);
      }
    }
  });
}

template <typename T>
void int4_gemm_rows(const T* x, const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros,
                    T* y, int64_t rows, int64_t K, int64_t N, int64_t group) {
  const int64_t groups = K / group;
  std::vector<int8_t> xq(rows * K);
  std::vector<float> x_scales(rows * groups), x_sums(rows * groups);
  quantise_rows(x, rows, K, group, xq.data(), x_scales.data(), x_sums.data());
  // Rows [first, first + count) of one block's 16 outputs, from its weights as `Packed` says.
  auto pass = [&](auto packed_weights, const uint8_t* weights, int64_t block, int64_t first, int64_t count,
                  const NextBlock& next, float* out) {
    constexpr bool kPacked = decltype(packed_weights)::value;
    const c10::BFloat16* block_scales = scales + block * groups * kDotBlock;
    const c10::BFloat16* block_zeros = offset_or_null(zeros, block * groups * kDotBlock);
    const int8_t* xs = xq.data() + first * K;
    const float* sc = x_scales.data() + first * groups;
    const float* sm = x_sums.data() + first * groups;
    with_row_count<kGemmRows>(count, [&](auto R) {
      int4_gemm_block<decltype(R)::value, kPacked>(weights, block_scales, block_zeros, xs, sc, sm, K, group, next, out);
    });
    for (int64_t r = 0; r < count; ++r) {
      T* row = y + (first + r) * N + block * kDotBlock;
      const float* sums = out + r * kDotBlock;
      for (int64_t i = 0; i < kDotBlock; i += lanes::kWidth) lanes::store(row + i, lanes::load(sums + i));
    }
  };
  if (rows <= kPackedRows) {
    // One pass over each block (a decode step's few rows): its packed bytes are read as they are, with nothing
    // unpacked to store and read again (docs/kernels.md has the times).
    at::parallel_for(0, N / kDotBlock, 4, [&](int64_t begin, int64_t end) {
      alignas(64) float out[kGemmRows * kDotBlock];
      for (int64_t block = begin; block < end; ++block)
        pass(std::true_type{}, packed + block * K * 8, block, 0, rows, NextBlock{}, out);
    });
    return;
  }
  at::parallel_for(0, N / kDotBlock, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kGemmRows * kDotBlock];
    std::vector<uint8_t> buffer(K * kUnpackedBytesPerInput + 64);
    uint8_t* block_bytes = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
    for (int64_t block = begin; block < end; ++block) {
      unpack_block(packed + block * K * 8, K, block_bytes);
      // The next block streams in over the first kPrefetchPasses passes over this one: read cold when unpacked, it
      // held each 16-row step of the 3B's weights at 0.72-0.83x the speed of the same call on weights in cache.
      NextBlock next;
      const int64_t passes = std::min<int64_t>((rows + kGemmRows - 1) / kGemmRows, kPrefetchPasses);
      if (block + 1 < end) next = {packed + (block + 1) * K * 8, 0, passes};
      for (int64_t first = 0; first < rows; first += kGemmRows, ++next.pass)
        pass(std::false_type{}, block_bytes, block, first, std::min<int64_t>(kGemmRows, rows - first), next, out);
    }
  });
}
#endif

}  // namespace

torch::Tensor int4_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t group,
                        const torch::Tensor& scales, const torch::Tensor& zeros) {
  TORCH_CHECK(int4_dot_available(), "int4_gemm needs AVX2, or AVX-512 with VNNI");
  check_int4_operands("int4_gemm", x, packed, group, scales, zeros);
  const int64_t rows = x.size(0), N = packed.size(0);
  auto y = torch::empty({rows, N}, x.options());
#if defined(BATCHSERVE_INT4_GEMM)
  const int64_t K = x.size(1);
  const auto xc = x.contiguous();  // float32 or bfloat16, read as it is (quantise_rows widens bf16 in registers)
  const auto w = packed.contiguous();
  const auto s = scales.contiguous();
  const auto z = zeros.contiguous();
  if (x.scalar_type() == torch::kBFloat16) {
    int4_gemm_rows<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), w.data_ptr<uint8_t>(), s.data_ptr<c10::BFloat16>(),
                                  zeros_or_null(z), y.data_ptr<c10::BFloat16>(), rows, K, N, group);
  } else {
    int4_gemm_rows<float>(xc.data_ptr<float>(), w.data_ptr<uint8_t>(), s.data_ptr<c10::BFloat16>(),
                          zeros_or_null(z), y.data_ptr<float>(), rows, K, N, group);
  }
#endif
  return y;
}

}  // namespace BATCHSERVE_OPS
