// A pure decode step's decoder layers in one call, for models whose projections are all int4 integer-dot weights.
//
// At batch 1 a step makes about ten calls a layer (norms, four projections, RoPE and the cache write, attention,
// SiLU * up), each a few microseconds of Python and dispatcher around a kernel of tens. This runs the same
// kernels, with the same arguments in the same order, straight from C++: the result is the per-op path's, bit
// for bit (tests/engine/model/test_decode_layers.py), and the runner keeps the per-op path for every other step.
//
//   decode_layers: for each layer i, with its kLayerTensors tensors in `layers` (at the offsets below) and its
//                  keys and values in cache[i] ([layers, 2, kv_heads, slots, dim]):
//                    h = add_rms_norm(x, mlp_out, input_norm); q = rope_write_cache(int4_dot(h, qkv));
//                    h = add_rms_norm(x, int4_dot(attention(q), o), post_norm);
//                    mlp_out = int4_dot(silu_mul(int4_dot(h, gate_up)), down)
//                  and finally x += mlp_out. x, the residual stream [rows, hidden], is updated in place.
//                  Without `fused_silu`, SiLU * up is ATen's silu and mul, as torch's modules compute it (the
//                  compiled one gives torch's bits only where torch runs the same instruction set). With
//                  `one_digit`, every projection is int4_gemm (one int8 digit per activation) where int4_dot is
//                  named above, as the per-op path runs a step past the quantised weights' row switch.

#include <ATen/ATen.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>

#include "ops.h"

namespace BATCHSERVE_OPS {
namespace {

// Where each of a layer's tensors lies among its kLayerTensors: a norm is one tensor, a projection three (packed,
// scales, zeros). The order is LAYER_TENSORS in engine/model/fused_decode.py, which builds the list; the names are its
// fields', and tests/engine/model/test_decode_layers.py checks that the two agree.
enum LayerTensor : int64_t {
  kInputNorm = 0,
  kQkvProj = 1,
  kOProj = 4,
  kPostNorm = 7,
  kGateUpProj = 8,
  kDownProj = 11,
  kLayerTensors = 14,
};

torch::Tensor project(const torch::Tensor& x, const torch::Tensor* weight /* packed, scales, zeros */,
                      bool one_digit) {
  // The group size follows from the shapes: packed is [N, K / 2], scales [N / 16, K / group, 16].
  const int64_t group = weight[0].size(1) * 2 / weight[1].size(1);
  return one_digit ? int4_gemm(x, weight[0], group, weight[1], weight[2])
                   : int4_dot(x, weight[0], group, weight[1], weight[2]);
}

}  // namespace

void decode_layers(torch::Tensor x, const torch::Tensor& cache, at::TensorList layers, const torch::Tensor& cos,
                   const torch::Tensor& sin, const torch::Tensor& slot_mapping, const torch::Tensor& block_table,
                   const torch::Tensor& context_lens, int64_t heads, int64_t kv_heads, int64_t block_size,
                   double scale, double eps, bool fused_silu, bool one_digit) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, hidden] tensor");
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.is_contiguous(),
              "cache must be a contiguous [layers, 2, kv_heads, slots, dim] tensor");
  const int64_t num_layers = cache.size(0);
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == num_layers * kLayerTensors,
              "layers must hold ", static_cast<int64_t>(kLayerTensors), " tensors for each of the cache's layers");
  for (const auto& tensor : layers) TORCH_CHECK(tensor.is_contiguous(), "layer tensors must be contiguous");
  const int64_t rows = x.size(0);
  std::optional<torch::Tensor> mlp_out;
  for (int64_t i = 0; i < num_layers; ++i) {
    const torch::Tensor* w = layers.data() + i * kLayerTensors;
    const torch::Tensor key_cache = cache.select(0, i).select(0, 0);
    const torch::Tensor value_cache = cache.select(0, i).select(0, 1);
    torch::Tensor h = add_rms_norm(x, mlp_out, w[kInputNorm], eps);
    const torch::Tensor qkv = project(h, w + kQkvProj, one_digit);
    const torch::Tensor query =
        rope_write_cache(qkv, cos, sin, key_cache, value_cache, slot_mapping, heads, kv_heads);
    const torch::Tensor attended =
        paged_decode_attention(query, key_cache, value_cache, block_table, context_lens, block_size, scale);
    h = add_rms_norm(x, project(attended.view({rows, -1}), w + kOProj, one_digit), w[kPostNorm], eps);
    const torch::Tensor gate_up = project(h, w + kGateUpProj, one_digit);
    torch::Tensor gated;
    if (fused_silu) {
      gated = silu_mul(gate_up);
    } else {
      const auto halves = gate_up.chunk(2, -1);
      gated = at::silu(halves[0]) * halves[1];
    }
    mlp_out = project(gated, w + kDownProj, one_digit);
  }
  if (mlp_out.has_value()) x.add_(*mlp_out);
}

}  // namespace BATCHSERVE_OPS
