// int8_dot: x [rows, K] (float32 or bfloat16) times int8 weights W [N, K] with one scale per output row, by integer
// dot products: the int8 LM head's kernel where the build has `vpdpbusd`, or AVX2's `vpmaddubsw` (int8_gemv, float
// FMAs over the widened weights, in the avx512 and scalar builds). The weights are packed once at load
// (engine.model.linear.Int8DotLinear): blocks of 16 output rows, each storing for every 4 inputs k..k+3 64 bytes, 4
// per output row, each byte w + 128 (unsigned, as `vpdpbusd` takes it). The activations are two int8 digits per
// value per group of inputs, as int4_dot's (activation_digits.h); the +128 comes back off exactly, as 128 times the
// digits' integer sum. Per row, 2 integer dot products cover 64 weights where float FMAs cover 16 per instruction: a
// verify step's 5 rows or a batch's 16 cost the LM head far fewer instructions, and one row reads the same bytes.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "activation_digits.h"
#include "ops.h"
#include "quant.h"
#include "vector_lanes.h"

#if defined(__AVX512F__)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "int8_dot_avx512_vnni.h"
#define BATCHSERVE_INT8_DOT 1
#endif
#elif defined(__AVX2__)
#include "int8_dot_avx2.h"
#define BATCHSERVE_INT8_DOT 1
#endif

namespace BATCHSERVE_OPS {
namespace {

#if defined(BATCHSERVE_INT8_DOT)
namespace lanes = batchserve::lanes;

template <typename T>
void int8_dot_rows(const T* x, const uint8_t* packed, const float* scales, T* y, int64_t rows, int64_t K, int64_t N,
                   int64_t group, bool one_digit) {
  const int64_t groups = K / group;
  // The weights' +128 comes back off as 128 times the digits' sum. One digit is the leading digit alone, its 127
  // moved into the scale: its dot product needs no multiply before it turns float (two integer operations fewer per
  // row and group of the LM head).
  const DigitActivations xq = digit_activations(x, rows, K, group, 128, one_digit);
  at::parallel_for(0, N / kDotBlock, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kInt8DotRows * kDotBlock];
    for (int64_t block = begin; block < end; ++block) {
      const uint8_t* block_bytes = packed + block * K * kDotBlock;
      const float* row_scales = scales + block * kDotBlock;  // a block's 16 rows: one vector, or two of AVX2's 8
      NextBlock next;  // past one row (the 1B's 16-row LM head: 0.73x the time)
      if (rows > 1 && block + 1 < end)
        next = {packed + (block + 1) * K * kDotBlock, 0, (rows + kInt8DotRows - 1) / kInt8DotRows};
      for (int64_t first = 0; first < rows; first += kInt8DotRows, ++next.pass) {
        const int64_t count = std::min<int64_t>(kInt8DotRows, rows - first);
        with_row_count<kInt8DotRows>(count, [&](auto R) {
          const int8_t* xs = xq.digits.get() + 2 * first * K;
          const float* sc = xq.scales.data() + first * groups;
          const int32_t* bias = xq.biases.data() + first * groups;
          if (one_digit)
            int8_dot_block<decltype(R)::value, false>(block_bytes, xs, sc, bias, K, group, next, out);
          else
            int8_dot_block<decltype(R)::value, true>(block_bytes, xs, sc, bias, K, group, next, out);
        });
        for (int64_t r = 0; r < count; ++r)
          for (int64_t i = 0; i < kDotBlock; i += lanes::kWidth)
            lanes::store(y + (first + r) * N + block * kDotBlock + i,
                         lanes::mul(lanes::load(out + r * kDotBlock + i), lanes::load(row_scales + i)));
      }
    }
  });
}
#endif

}  // namespace

bool int8_dot_available() {
#if defined(BATCHSERVE_INT8_DOT)
  return true;
#else
  return false;
#endif
}

torch::Tensor int8_dot(const torch::Tensor& x, const torch::Tensor& packed, int64_t group, const torch::Tensor& scales,
                       bool one_digit) {
  TORCH_CHECK(int8_dot_available(), "int8_dot needs AVX2, or AVX-512 with VNNI");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && float_or_bf16(x), "int8_dot: x must be [rows, K] float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 2 && packed.size(1) == x.size(1),
              "int8_dot: packed must be [N, K] uint8");
  const int64_t rows = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(group >= 8 && group % 8 == 0 && K % group == 0, "int8_dot: K must be a multiple of the group (of 8)");
  TORCH_CHECK(N % kDotBlock == 0, "int8_dot packs output rows in blocks of 16");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.dim() == 1 && scales.size(0) == N,
              "int8_dot: scales must be [N] float32");
  auto y = torch::empty({rows, N}, x.options());
#if defined(BATCHSERVE_INT8_DOT)
  const auto xc = x.contiguous();
  const auto w = packed.contiguous();
  const auto s = scales.contiguous();
  if (x.scalar_type() == torch::kBFloat16) {
    int8_dot_rows<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), w.data_ptr<uint8_t>(), s.data_ptr<float>(),
                                 y.data_ptr<c10::BFloat16>(), rows, K, N, group, one_digit);
  } else {
    int8_dot_rows<float>(xc.data_ptr<float>(), w.data_ptr<uint8_t>(), s.data_ptr<float>(), y.data_ptr<float>(), rows,
                         K, N, group, one_digit);
  }
#endif
  return y;
}

}  // namespace BATCHSERVE_OPS
