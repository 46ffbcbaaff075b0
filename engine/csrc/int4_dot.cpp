// int4_dot: x [rows, K] (float32 or bfloat16) times int4 weights W [N, K] with integer dot products, for a few
// activation rows; [rows, N] in x's dtype. The weights are in the project's own layout (engine.linear.Int4DotLinear
// writes it), with scales and zeros [N / 16, K / group, 16] bfloat16: w = (q - 8) * scale + zero (zeros empty for
// symmetric weights: every zero 0, as GGUF Q4_0's). Rows come in blocks of 16 (kDotBlock); a block stores, for each run
// of 8 inputs k..k+7, 64 bytes: 4 bytes per row, byte j holding input k+j in its low nibble and k+4+j in its high one.
// So one 64-byte load and two masks give, per row, the 4-input groups that `vpdpbusd` multiplies with 4 int8
// activations and sums into that row's int32 lane: 32 products per instruction, against 16 per float FMA after
// converting each weight. The activations are quantised per group of the weights (scale = max |x| / 127), as
// llama.cpp's Q8 activations are, and then once more: the rounding error of each value as a second int8 digit in 127ths
// of a unit. Two dot products instead of one make the activations good to about 1/32000 of the group's largest value (a
// single int8 digit cost +1.6 % perplexity on the default model; two: see docs/quantization.md).
//
// One kernel per instruction set, each in its own header: int4_dot_avx512_vnni.h (`vpdpbusd`), int4_dot_avx_vnni.h
// (`vpdpbusd` on 256 bits) and int4_dot_avx2.h (`vpmaddubsw` + `vpmaddwd`); their integer sums are exact, so all
// give the same int32 dot products. The avx512 build (no VNNI) and the scalar build have no kernel:
// int4_dot_available() says so, and the engine keeps those weights on int4_gemv.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "activation_digits.h"
#include "ops.h"
#include "quant.h"
#include "vector_lanes.h"

#if defined(__AVX512F__)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "int4_dot_avx512_vnni.h"
#define BATCHSERVE_INT4_DOT 1
#endif
#elif defined(__AVX2__)
#if defined(__AVXVNNI__)
#include "int4_dot_avx_vnni.h"
#else
#include "int4_dot_avx2.h"
#endif
#define BATCHSERVE_INT4_DOT 1
#endif

namespace BATCHSERVE_OPS {
namespace {

#if defined(BATCHSERVE_INT4_DOT)
namespace lanes = batchserve::lanes;

// 16 float32 results to 16 values of T.
template <typename T>
inline void store_row16(T* y, const float* out) {
  for (int64_t i = 0; i < kDotBlock; i += lanes::kWidth) lanes::store(y + i, lanes::load(out + i));
}

template <typename T>
void int4_dot_rows(const T* x, const uint8_t* packed, const c10::BFloat16* scales, const c10::BFloat16* zeros, T* y,
                   int64_t rows, int64_t K, int64_t N, int64_t group) {
  const int64_t groups = K / group;
  const std::unique_ptr<int8_t[]> xq(new int8_t[2 * rows * K]);  // every digit is written: no zeroing
  std::vector<float> x_scales(rows * groups), x_sums(rows * groups);
  quantise_activations(x, rows, K, group, xq.get(), x_scales.data(), x_sums.data());
  at::parallel_for(0, N / kDotBlock, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kDotRows * kDotBlock];
    for (int64_t block = begin; block < end; ++block) {
      const uint8_t* block_bytes = packed + block * K * 8;
      const c10::BFloat16* block_scales = scales + block * groups * kDotBlock;
      const c10::BFloat16* block_zeros = offset_or_null(zeros, block * groups * kDotBlock);
      NextBlock next;  // past one row (the 1B's 4-row projections: 0.76-0.97x the time)
      if (rows > 1 && block + 1 < end) next = {packed + (block + 1) * K * 8, 0, (rows + kDotRows - 1) / kDotRows};
      for (int64_t first = 0; first < rows; first += kDotRows, ++next.pass) {
        const int64_t count = std::min<int64_t>(kDotRows, rows - first);
        const int8_t* xs = xq.get() + 2 * first * K;
        const float* sc = x_scales.data() + first * groups;
        const float* sm = x_sums.data() + first * groups;
        with_row_count<kDotRows>(count, [&](auto R) {
          int4_dot_block<decltype(R)::value>(block_bytes, block_scales, block_zeros, xs, sc, sm, K, group, next, out);
        });
        for (int64_t r = 0; r < count; ++r) store_row16(y + (first + r) * N + block * kDotBlock, out + r * kDotBlock);
      }
    }
  });
}
#endif

}  // namespace

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
  check_int4_operands("int4_dot", x, packed, group, scales, zeros);
  const int64_t rows = x.size(0), N = packed.size(0);
  auto y = torch::empty({rows, N}, x.options());
#if defined(BATCHSERVE_INT4_DOT)
  const int64_t K = x.size(1);
  const auto xc = x.contiguous();
  const auto w = packed.contiguous();
  const auto s = scales.contiguous();
  const auto z = zeros.contiguous();
  if (x.scalar_type() == torch::kBFloat16) {
    int4_dot_rows<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), w.data_ptr<uint8_t>(), s.data_ptr<c10::BFloat16>(),
                                 zeros_or_null(z), y.data_ptr<c10::BFloat16>(), rows, K, N, group);
  } else {
    int4_dot_rows<float>(xc.data_ptr<float>(), w.data_ptr<uint8_t>(), s.data_ptr<c10::BFloat16>(),
                         zeros_or_null(z), y.data_ptr<float>(), rows, K, N, group);
  }
#endif
  return y;
}

}  // namespace BATCHSERVE_OPS
