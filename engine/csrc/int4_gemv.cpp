// int4_gemv: x [rows, K] (float32 or bfloat16) times W [N, K] in 4 bits, for a few activation rows (decode at small
// batch); [rows, N] in x's dtype. W is in the layout that torch's CPU int4 packing has at its AVX-512 capability
// (engine.linear.pack_int4_blocks writes it whatever torch's capability, N a multiple of 64), with
// scales_and_zeros [K / group, N, 2]: w = (q - 8) * scale + zero, as aten._weight_int4pack_mm_for_cpu reads it.
//
// At batch 1 a decode step is a stream of weight bytes: 94 MB per token for the default model. torch's int4 and
// int8 CPU kernels reach about half of this machine's read bandwidth there in a real step, and their cost grows
// with the row count as if each row were a separate pass. This kernel reads each weight byte once for all rows of
// a pass, dequantises in registers and accumulates in float32, in another order than torch's kernel (so results
// agree with it to rounding, not bit for bit).
//
// The layout (torch's int4 CPU packing at its AVX-512 capability; at AVX2 and below torch packs otherwise):
// output rows come in blocks of 64 (kBlockN); a block stores, for each k, 32 bytes whose byte j holds row j in its
// low nibble and row j + 32 in its high nibble.
//
// One kernel per instruction set, each in its own header: int4_gemv_avx512.h, int4_gemv_avx2.h, int4_gemv_scalar.h.

#include <torch/types.h>

#include <cstdint>

#include "ops.h"
#include "quant.h"

#if defined(__AVX512F__)
#include "int4_gemv_avx512.h"
#elif defined(__AVX2__)
#include "int4_gemv_avx2.h"
#else
#include "int4_gemv_scalar.h"
#endif

namespace BATCHSERVE_OPS {

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

}  // namespace BATCHSERVE_OPS
