// int6_dot: x [rows, K] (float32 or bfloat16) times 6-bit weights W [N, K], GGUF Q6_K's values as the file holds them:
// w = d * s * (q - 32), a code q in 0..63 per weight, a signed 8-bit scale s per 16 weights of a row and a float d per
// 256. What llama.cpp keeps a 4-bit file's LM head in: the 1B's 128256 x 2048 head reads 216 MB a token this way and
// 263 MB as int8, at memory's pace either way (docs/kernels.md).
//
// The layout (engine.model.head_linear.Int6DotLinear packs it at load): blocks of 16 output rows; a block stores, for
// each run of 16 inputs k..k+15, 192 bytes. Bytes 0-63: byte b holds row b / 4's input k + b % 4 in its low nibble and
// k + 4 + b % 4 in its high one; bytes 64-127 the same for k + 8.. and k + 12..; bytes 128-191: byte b holds the top
// two bits of those four codes, k + b % 4's in bits 0-1, k + 4's in 2-3, k + 8's in 4-5, k + 12's in 6-7. Unpacked,
// each register holds 4 inputs' codes per row in a 32-bit lane, as `vpdpbusd` multiplies them with 4 activation
// digits. Scales: sub_scales [N / 16, K / 16, 16] int8, super_scales [N / 16, K / 256, 16] float32.
//
// Activations are two int8 digits per value per run of 16 (activation_digits.h), so each run's int32 dot product
// turns float once with the run's weight scale; the codes' +32 comes back off as 32 times the digits' sum. One digit
// (`one_digit`) halves the integer work for many rows, as int8_dot's. Builds: AVX-512 VNNI (int6_dot_avx512_vnni.h)
// and AVX2 (int6_dot_avx2.h), the same int32 sums and float steps; the others have none (int6_dot_available()), and
// the engine runs such a head's values dense. Past 3 rows the engine runs an int8 copy instead (head_linear.py).

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
#include "int6_dot_avx512_vnni.h"
#define BATCHSERVE_INT6_DOT 1
#endif
#elif defined(__AVX2__)
#include "int6_dot_avx2.h"
#define BATCHSERVE_INT6_DOT 1
#endif

namespace BATCHSERVE_OPS {
namespace {

#if defined(BATCHSERVE_INT6_DOT)
template <typename T>
void int6_dot_rows(const T* x, const uint8_t* packed, const int8_t* sub_scales, const float* super_scales, T* y,
                   int64_t rows, int64_t K, int64_t N, bool one_digit) {
  const int64_t runs = K / kInt6Run;
  const DigitActivations xq = digit_activations(x, rows, K, kInt6Run, 32, one_digit);  // the codes' +32 comes off
  const int64_t block_bytes = runs * kInt6RunBytes;
  at::parallel_for(0, N / kDotBlock, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kInt6DotRows * kDotBlock];
    for (int64_t block = begin; block < end; ++block) {
      const uint8_t* bytes = packed + block * block_bytes;
      const int8_t* subs = sub_scales + block * runs * kDotBlock;
      const float* supers = super_scales + block * (runs / kInt6RunsPerSuper) * kDotBlock;
      NextBlock next;  // past one row, as int8_dot's
      if (rows > 1 && block + 1 < end) next = {bytes + block_bytes, 0, (rows + kInt6DotRows - 1) / kInt6DotRows};
      for (int64_t first = 0; first < rows; first += kInt6DotRows, ++next.pass) {
        const int64_t count = std::min<int64_t>(kInt6DotRows, rows - first);
        with_row_count<kInt6DotRows>(count, [&](auto R) {
          const int8_t* xs = xq.digits.get() + 2 * first * K;
          const float* sc = xq.scales.data() + first * runs;
          const int32_t* bias = xq.biases.data() + first * runs;
          if (one_digit)
            int6_dot_block<decltype(R)::value, false>(bytes, subs, supers, xs, sc, bias, K, next, out);
          else
            int6_dot_block<decltype(R)::value, true>(bytes, subs, supers, xs, sc, bias, K, next, out);
        });
        for (int64_t r = 0; r < count; ++r)
          for (int64_t i = 0; i < kDotBlock; i += batchserve::lanes::kWidth)
            batchserve::lanes::store(y + (first + r) * N + block * kDotBlock + i,
                                     batchserve::lanes::load(out + r * kDotBlock + i));
      }
    }
  });
}
#endif

}  // namespace

bool int6_dot_available() {
#if defined(BATCHSERVE_INT6_DOT)
  return true;
#else
  return false;
#endif
}

torch::Tensor int6_dot(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sub_scales,
                       const torch::Tensor& super_scales, bool one_digit) {
  TORCH_CHECK(int6_dot_available(), "int6_dot needs AVX2, or AVX-512 with VNNI");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && float_or_bf16(x), "int6_dot: x must be [rows, K] float32 or bfloat16");
  const int64_t rows = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(K % (kInt6Run * kInt6RunsPerSuper) == 0, "int6_dot: K must be a multiple of 256");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.dim() == 2 && packed.size(1) * 4 == K * 3 &&
                  N % kDotBlock == 0,
              "int6_dot: packed must be [N, K * 3 / 4] uint8, N a multiple of 16");
  TORCH_CHECK(sub_scales.scalar_type() == torch::kChar && sub_scales.numel() == N * (K / kInt6Run),
              "int6_dot: sub_scales must be [N / 16, K / 16, 16] int8");
  TORCH_CHECK(super_scales.scalar_type() == torch::kFloat &&
                  super_scales.numel() == N * (K / (kInt6Run * kInt6RunsPerSuper)),
              "int6_dot: super_scales must be [N / 16, K / 256, 16] float32");
  auto y = torch::empty({rows, N}, x.options());
#if defined(BATCHSERVE_INT6_DOT)
  const auto xc = x.contiguous();
  const auto w = packed.contiguous();
  const auto subs = sub_scales.contiguous();
  const auto supers = super_scales.contiguous();
  if (x.scalar_type() == torch::kBFloat16) {
    int6_dot_rows<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), w.data_ptr<uint8_t>(), subs.data_ptr<int8_t>(),
                                 supers.data_ptr<float>(), y.data_ptr<c10::BFloat16>(), rows, K, N, one_digit);
  } else {
    int6_dot_rows<float>(xc.data_ptr<float>(), w.data_ptr<uint8_t>(), subs.data_ptr<int8_t>(), supers.data_ptr<float>(),
                         y.data_ptr<float>(), rows, K, N, one_digit);
  }
#endif
  return y;
}

}  // namespace BATCHSERVE_OPS
